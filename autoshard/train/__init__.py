"""The training run: the step loop, checkpoints, metrics, signals and export (a driver above the stages)."""
