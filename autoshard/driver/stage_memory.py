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

Distinct chunks are planned and dry-run side by side in worker processes, one per core (a
forkserver's, started by `start_workers` before any solve: HiGHS's threads do not survive a
fork), each in a fake process group of the stage mesh's size.
"""

from __future__ import annotations

import gc
import logging
import math
import multiprocessing
import os
import pickle
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from autoshard import _torch_compat as tc
from autoshard.driver.api import AutoShard
from autoshard.driver.config import PlanConfig
from autoshard.driver.pipeline import PipelinePlan
from autoshard.driver.stages import StageSpec, plan_stage, stage_specs
from autoshard.pipeline.search import Pipeline, Stage
from autoshard.problem.plan import Plan
from autoshard.runtime.dryrun import MemoryEstimate, dry_run

log = logging.getLogger("autoshard")


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


def start_workers() -> None:
    """Start the forkserver that `dry_run_stages` forks its workers from, importing autoshard
    while the caller plans (where there is more than one core)."""
    if _cores() > 1:
        from multiprocessing import forkserver

        multiprocessing.set_forkserver_preload([__name__])
        forkserver.ensure_running()


def dry_run_stages(stages: ChosenStages) -> StageMemory:
    """Dry-run the distinct chunks of `stages` (twins: the same number of blocks, layout family
    and ends), each one's rank-0 program: side by side in worker processes where there are
    cores for them and the stages can be sent there, else here, where planning runs (no process
    group, or a fake one of the stage mesh's size)."""
    start = time.perf_counter()
    first: dict[tuple, int] = {}  # twin key -> the chunk dry-run for all its twins
    for chunk in stages.pipeline.stages:
        first.setdefault(_twin(chunk), chunk.chunk)
    chunks = list(first.values())
    workers = min(_cores(), len(chunks))
    tasks = [(stages.specs[k], stages.stage, stages.pipeline.micro_batches, stages.pipeline.ranks) for k in chunks]
    if workers > 1 and _sendable(tasks):
        log.info("dry run: %d distinct stages, %d at a time in worker processes", len(chunks), workers)
        context = multiprocessing.get_context("forkserver")
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            estimates = list(pool.map(_dry_run_alone, *zip(*tasks)))
    else:
        estimates = [dry_run(stages.planned(k)[1], mesh_dim_names=stages.stage.mesh_names).ranks[0] for k in chunks]
    found = dict(zip(first, estimates))
    runs = [StageDryRun(c.chunk, c.rank, c.in_flight, found[_twin(c)]) for c in stages.pipeline.stages]
    return StageMemory(runs, time.perf_counter() - start, len(found))


def _twin(chunk: Stage) -> tuple:
    return (chunk.n_blocks, chunk.family, chunk.before, chunk.after)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _sendable(tasks: list) -> bool:
    """Whether the stages pickle (a model's own module may hold what does not)."""
    try:
        pickle.dumps(tasks)
    except (pickle.PicklingError, TypeError, AttributeError):
        return False
    return True


def _dry_run_alone(spec: StageSpec, stage: PlanConfig, micro_batches: int, ranks: int) -> MemoryEstimate:
    """In a worker process: one chunk planned as `ChosenStages.planned` plans it, then dry-run."""
    assert stage.mesh is not None
    gc.disable()  # as `plan` runs: what planning allocates lives until the worker ends
    with tc.fake_process_group(math.prod(stage.mesh)):
        _, plan = plan_stage(spec, stage, stage.mesh, micro_batches=micro_batches, stages=ranks)
        return dry_run(plan, mesh_dim_names=stage.mesh_names).ranks[0]
