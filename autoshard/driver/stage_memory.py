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

from autoshard.driver.pipeline import PipelinePlan
from autoshard.driver.stages import plan_stage, stage_specs
from autoshard.pipeline.search import Pipeline
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


def dry_run_stages(
    model: nn.Module, result: PipelinePlan, input_fn: Callable[[int], Any], *, pipeline: Pipeline | None = None
) -> StageMemory:
    """Plan and dry-run the chunks of `result.best` (or `pipeline`) of `model`, one that splits
    itself (`pipeline_stage(start, stop)`); `input_fn(rows)` as `plan_pipeline` takes it. Runs
    where planning does (no process group, or a fake one of the stage mesh's size)."""
    start = time.perf_counter()
    best = pipeline if pipeline is not None else result.best
    tokens, targets = input_fn(best.rows)
    dtype = result.config.precision.param_dtype or next(model.parameters()).dtype
    specs = stage_specs(model, best, tokens, targets, dtype)
    stage = result.config.stage_config()
    assert stage.mesh is not None
    found: dict[tuple, MemoryEstimate] = {}
    stages = []
    for chunk, spec in zip(best.stages, specs):
        key = (chunk.n_blocks, chunk.family, chunk.before, chunk.after)
        if key not in found:
            _, plan = plan_stage(spec, stage, stage.mesh, micro_batches=best.micro_batches, stages=best.ranks)
            found[key] = dry_run(plan, mesh_dim_names=stage.mesh_names).ranks[0]
        stages.append(StageDryRun(chunk.chunk, chunk.rank, chunk.in_flight, found[key]))
    return StageMemory(stages, time.perf_counter() - start, len(found))
