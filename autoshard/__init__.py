"""autoshard: auto-parallel FSDP+TP planning for PyTorch."""

from autoshard.driver.api import AutoShard, auto_shard
from autoshard.driver.config import PlanConfig
from autoshard.layout import Layout
from autoshard.problem.plan import Plan
from autoshard.runtime.module import ParallelModule, parallelize

__all__ = ["AutoShard", "auto_shard", "Layout", "ParallelModule", "Plan", "PlanConfig", "parallelize"]
