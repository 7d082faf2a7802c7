"""autoshard: auto-parallel FSDP+TP planning for PyTorch."""

from .api import AutoShard, auto_shard
from .apply import ParallelModule, parallelize
from .layout import Layout
from .plan import Plan

__all__ = ["AutoShard", "auto_shard", "Layout", "ParallelModule", "Plan", "parallelize"]
