"""Pipeline parallelism as a search above the ILP: segments of a solved plan, torch's schedules
as a cost model, and the dynamic program over stage cuts."""
