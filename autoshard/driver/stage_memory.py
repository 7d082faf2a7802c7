"""Dry runs of a planned pipeline's stages: what the search's linear memory model leaves out (an
op's working set, collective buffers, the exact live set at the peak), measured as for a plan
without pp.

Each distinct chunk of the pipeline (its blocks, layout family, and whether it holds the
embedding or the head) is planned as `apply_pipeline` plans it and its rank-0 program runs one
micro-batch on fake tensors. A pp rank holds the state of each of its chunks and, per chunk,
what the forward hands to the backward for every micro-batch its schedule keeps in flight; the
working set of one op at a time comes on top, the largest of its chunks':

    rank peak = sum over its chunks (dry-run peak - working set + (in flight - 1) x saved)
                + the largest chunk's working set
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from autoshard.driver.api import AutoShard
from autoshard.driver.pipeline import PipelinePlan
from autoshard.driver.stages import plan_stage, stage_specs
from autoshard.pipeline.search import Pipeline
from autoshard.problem.plan import Plan
from autoshard.runtime.dryrun import MemoryEstimate, dry_run


@dataclass(frozen=True)
class StageDryRun:
    """One chunk's dry run and what its rank's schedule keeps of it."""

    chunk: int
    rank: int  # the pp rank that runs it
    in_flight: int  # micro-batches whose saved values its rank holds at its peak
    estimate: MemoryEstimate  # rank 0 of its stage mesh, one micro-batch

    @property
    def held_bytes(self) -> int:
        """At its rank's peak, all but one op's working set."""
        e = self.estimate
        return e.peak_bytes - e.transient + (self.in_flight - 1) * e.saved_bytes


@dataclass(frozen=True)
class StageMemory:
    """The dry runs of a pipeline's chunks and each pp rank's peak from them."""

    stages: list[StageDryRun]
    seconds: float
    plans: int  # distinct chunks planned and dry-run (twins share one)

    def rank_bytes(self, rank: int) -> int:
        mine = [s for s in self.stages if s.rank == rank]
        return sum(s.held_bytes for s in mine) + max(s.estimate.transient for s in mine)

    @property
    def peak_bytes(self) -> int:
        return max(self.rank_bytes(r) for r in {s.rank for s in self.stages})


class ChosenStages:
    """The chunks of a pipeline of `model` (one that splits itself), each planned on demand as
    `apply_pipeline` plans it, and once: the dry runs and `--explain` share the solves."""

    def __init__(self, model: nn.Module, result: PipelinePlan, input_fn: Callable[[int], Any], pipeline: Pipeline):
        self.pipeline = pipeline
        self.specs = stage_specs(model, result, input_fn, pipeline)
        self.stage = result.config.stage_config()
        self._planned: dict[int, tuple[AutoShard, Plan]] = {}

    def planned(self, chunk: int) -> tuple[AutoShard, Plan]:
        if chunk not in self._planned:
            assert self.stage.mesh is not None
            p = self.pipeline
            self._planned[chunk] = plan_stage(
                self.specs[chunk], self.stage, self.stage.mesh, micro_batches=p.micro_batches, stages=p.ranks
            )
        return self._planned[chunk]


def dry_run_stages(stages: ChosenStages) -> StageMemory:
    """Dry-run the distinct chunks of `stages` (twins: the same number of blocks, layout family
    and ends), each one's rank-0 program. Runs where planning does (no process group, or a fake
    one of the stage mesh's size)."""
    start = time.perf_counter()
    found: dict[tuple, MemoryEstimate] = {}
    runs = []
    for chunk in stages.pipeline.stages:
        key = (chunk.n_blocks, chunk.family, chunk.before, chunk.after)
        if key not in found:
            _, plan = stages.planned(chunk.chunk)
            found[key] = dry_run(plan, mesh_dim_names=stages.stage.mesh_names).ranks[0]
        runs.append(StageDryRun(chunk.chunk, chunk.rank, chunk.in_flight, found[key]))
    return StageMemory(runs, time.perf_counter() - start, len(found))
