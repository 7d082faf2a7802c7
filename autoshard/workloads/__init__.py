"""Workloads: a model and its training step, one module per model family (llama.py, hf.py) found
by the registry; `checkpoints` reads safetensors weights for any of them, whole or by slices."""

from autoshard.workloads.base import DataSource, Workload
from autoshard.workloads.checkpoints import (
    CheckpointSlices,
    Start,
    check_checkpoint,
    checkpoint_values,
    read_safetensors,
)
from autoshard.workloads.registry import get_workload, known_names

__all__ = [
    "CheckpointSlices",
    "DataSource",
    "Start",
    "Workload",
    "check_checkpoint",
    "checkpoint_values",
    "get_workload",
    "known_names",
    "read_safetensors",
]
