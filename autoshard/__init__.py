"""autoshard: auto-parallel FSDP+TP planning for PyTorch."""

from autoshard.driver.api import AutoShard, auto_shard
from autoshard.driver.config import PlanConfig
from autoshard.driver.pipeline import PipelinePlan, plan_pipeline
from autoshard.driver.stages import PipelineRun, StageSpec, apply_pipeline, pipeline_run
from autoshard.layout import Layout
from autoshard.problem.plan import Plan
from autoshard.runtime.module import ParallelModule, parallelize

__all__ = [
    "AutoShard",
    "apply_pipeline",
    "auto_shard",
    "Layout",
    "ParallelModule",
    "PipelinePlan",
    "PipelineRun",
    "Plan",
    "PlanConfig",
    "parallelize",
    "pipeline_run",
    "plan_pipeline",
    "StageSpec",
]
