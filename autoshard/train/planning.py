"""Planning a run: trace, solve (rank 0 for all), fit the memory limit, apply; and, unless
`--grad-accum` says, how many micro-batches a step runs as.

A batch that fits the memory limit (as it is, or by resharding after the forward or recomputing)
runs as one. One that does not fit at all is planned again as 2, 4, ... micro-batches while a
micro-batch still splits over the data-parallel dims, until one fits as it is; of the plans that
fit, the lowest modeled step wins (`Plan.step_time_s`: K micro-batches, the held all-reduces and
the optimizer once). A plan file (a resumed run's own, or `--plan-file`) that records its count is
planned with that count alone. Every rank makes the same choice: the fits are decided on rank 0 and
broadcast (`driver.ranks`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from autoshard.driver.api import AutoShard
from autoshard.driver.fit import MemoryLimitError
from autoshard.driver.ranks import RankZeroPlanning, SavedSolution
from autoshard.fileio import read_json
from autoshard.options import UsageError
from autoshard.problem.plan import Plan
from autoshard.report.files import write_report
from autoshard.report.text import summary_lines
from autoshard.runtime.dryrun import DryRunResult
from autoshard.runtime.module import ParallelModule
from autoshard.train.loggers import Throughput
from autoshard.train.planfile import PlanFile
from autoshard.train.settings import Settings
from autoshard.train.steps import StepSchedule, step_schedule
from autoshard.workloads import Workload

log = logging.getLogger("autoshard")


@dataclass
class PlannedRun:
    """What planning gave a run: the plan, its parallel module, the AutoShard that made it, the
    fingerprint of the problem it solves, and its dry run. What the trainer reads of it, a
    pipelined run's `train.pipelined.PlannedPipeline` gives too."""

    plan: Plan
    pmodel: ParallelModule
    auto: AutoShard
    fingerprint: str
    memory: DryRunResult
    stages = None  # no pp process group: clipping needs no sum over stages

    @property
    def micro_batches(self) -> int:
        return self.plan.micro_batches

    @property
    def feed_micro_batches(self) -> int:
        return self.plan.micro_batches

    @property
    def schedule(self) -> StepSchedule:
        return step_schedule(self.plan.micro_batches)

    @property
    def modeled_step_s(self) -> float:
        return self.plan.step_time_s

    @property
    def modeled_overlapped_s(self) -> float:
        return self.pmodel.program.step_s(self.plan.micro_batches)

    @property
    def profiles(self) -> str:
        return f"{self.auto.config.network}/{self.auto.config.device_profile}"

    def throughput(self, tokens: int, dtype: torch.dtype | None) -> Throughput:
        return Throughput.of_plan(tokens, self.plan, self.auto.device, dtype)

    def write_report(self, extra: dict, out: Path) -> None:
        """Rank 0: sharding.log, plan.json (`extra` beside the plan and its solution) and report.html."""
        paths = write_report(
            self.plan,
            out,
            program=self.pmodel.program,
            dry_run=self.memory,
            memory_fit=self.auto.fit,
            device=self.auto.device,
            timings=self.auto.timings,
            mesh_names=self.auto.config.mesh_names,
            extra=extra | {"solution": self.plan.solution.to_json()},
        )
        for line in summary_lines(read_json(paths[1])):
            log.info("  %s", line)
        log.info("autoshard train: sharding log %s", paths[0])


@dataclass
class _Solved:
    micro_batches: int
    auto: AutoShard
    plan: Plan
    planning: RankZeroPlanning

    @property
    def as_is(self) -> bool:
        """Whether it fits without resharding or recomputing (or there is no limit to fit)."""
        return self.auto.fit is None or self.auto.fit.mode == "keep"


def micro_batch_counts(settings: Settings) -> list[int]:
    """The micro-batch counts to plan for: `--grad-accum`'s, else 1, 2, 4, ... while a micro-batch
    splits over the data-parallel dims."""
    if settings.grad_accum is not None:
        return [settings.grad_accum]
    counts, k = [], 1
    while settings.batch % k == 0:
        try:
            settings.check_batch(settings.batch // k)
        except ValueError:
            break
        counts.append(k)
        k *= 2
    return counts


def plan_run(settings: Settings, workload: Workload, mesh, plan_file: PlanFile | None) -> PlannedRun:
    """Plan on every rank (rank 0 solving and dry-running for all), choose the micro-batch count,
    apply. UsageError when no count fits the memory limit (the first one's message)."""
    own = plan_file.micro_batches if plan_file is not None else None
    counts = [own] if own is not None and settings.grad_accum is None else micro_batch_counts(settings)
    best: _Solved | None = None
    failure: MemoryLimitError | None = None
    tried: list[str] = []
    for k in counts:
        try:
            solved = _solve(settings.replace(grad_accum=k), workload, mesh, plan_file)
        except MemoryLimitError as err:  # every rank reached it alike
            failure = failure or err
            tried.append(f"{k}: none fits")
            continue
        how = "" if solved.as_is or solved.auto.fit is None else f" ({solved.auto.fit.mode})"
        tried.append(f"{k}: {solved.plan.step_time_s * 1e3:.1f} ms{how}")
        if best is None or solved.plan.step_time_s < best.plan.step_time_s:
            best = solved
        if solved.as_is or k == counts[0]:  # the batch fits, resharding or recomputing if need be: no more counts
            break
    if best is None:
        assert failure is not None
        raise UsageError(str(failure))
    if len(tried) > 1:
        runs = (
            "as one batch"
            if best.micro_batches == 1
            else f"as {best.micro_batches} micro-batches of {settings.batch // best.micro_batches} rows"
        )
        log.info(
            "autoshard train: --batch %d runs %s, the fastest plan that fits the memory limit "
            "(modeled step by micro-batch count: %s)",
            settings.batch,
            runs,
            "; ".join(tried),
        )
    auto, plan = best.auto, best.plan
    pmodel = auto.apply(
        plan, prefetch=settings.prefetch, bucket_bytes=settings.bucket_cap_mb * 2**20, seed=settings.seed
    )
    memory = auto.fit_dry_run  # fitting the memory limit dry-ran this very plan, or:
    if memory is None:
        memory = best.planning.dry_run(pmodel.program, plan)
        auto.timings["dry_run"] = memory.seconds
    log.info("autoshard train: dry run estimate: %s", memory.summary())
    return PlannedRun(plan, pmodel, auto, auto.sharding.fingerprint(), memory)


def _solve(settings: Settings, workload: Workload, mesh, plan_file: PlanFile | None) -> _Solved:
    """The plan of `settings.grad_accum` micro-batches of `settings.micro_batch` rows."""
    example = lambda: workload.example_inputs(settings.micro_batch, settings.seq, "meta")  # noqa: E731
    model = workload.build("meta")
    # a plan file whose plan recomputes or reshards the blocks (the fit chose it) solves that problem
    config = settings.replace(
        recompute=settings.recompute or (plan_file is not None and plan_file.recompute),
        reshard_after_forward=settings.reshard_after_forward or (plan_file is not None and plan_file.reshard),
    )
    planning = RankZeroPlanning(
        mesh,
        backend=config.backend,
        time_limit=config.time_limit,
        saved=None
        if plan_file is None
        else SavedSolution(plan_file.fingerprint, plan_file.solution, plan_file.source, plan_file.required),
    )
    auto = AutoShard(
        model,
        example,
        mesh,
        config=config,
        loss_fn=workload.loss_fn,
        n_model_inputs=workload.n_model_inputs,
        compile=settings.compile,
    )
    assert settings.grad_accum is not None
    auto.accumulate(settings.grad_accum)
    if settings.recipe is not None:
        from autoshard.problem.recipes import param_bytes_per_rank, recipe_layouts, recipe_pins

        mesh_ndim = len(settings.mesh)
        auto.pin(recipe_pins(settings.recipe, mesh_ndim))
        if settings.memory_budget is None:
            layouts = recipe_layouts(model, settings.recipe, mesh_ndim)
            auto.memory_budget(param_bytes_per_rank(model, layouts, settings.mesh))
    plan = auto.optimize(planning=planning)
    return _Solved(settings.grad_accum, auto, plan, planning)
