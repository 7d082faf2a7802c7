"""autoshard: auto-parallel FSDP+TP planning for PyTorch."""

from autoshard.api import AutoShard, auto_shard
from autoshard.runtime.module import ParallelModule, parallelize
from autoshard.layout import Layout
from autoshard.problem.plan import Plan

__all__ = ["AutoShard", "auto_shard", "Layout", "ParallelModule", "Plan", "parallelize"]
