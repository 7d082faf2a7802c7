"""Graph + strategies + prices + constraints -> solver.Problem; the solution read back as a Plan."""
