"""What drives the stages: the `AutoShard` API, the `PlanConfig` it plans with, the memory-fit loop
and planning beside the other ranks of a process group (rank 0 solves for all)."""
