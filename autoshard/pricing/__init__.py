"""What things cost: the redistribute planner, ring collective formulas, the compute roofline."""
