"""What the lowered program's executor costs the host: the Python and copies around each
redistribution, and the ops rank 0's program dispatches in a step."""
