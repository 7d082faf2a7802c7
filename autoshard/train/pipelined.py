"""Training on a mesh whose first dim is pp: the pipeline search chooses the stage cuts, the
schedule and the micro-batches (`driver.pipeline.plan_pipeline`), every rank plans and lowers its
own stages (`driver.stages.apply_pipeline`), and the trainer's loop drives them through its two
seams:

- the model, `StagedModel`: this rank's stages' parameters and buffers under the whole model's
  names, which is what the optimizer, clipping, the finite check and DCP's state dicts take (a
  checkpoint holds the names a run without pp holds, so `export` and a resume on another mesh
  read it alike), and what the feed asks for this rank's rows (those of its data-parallel
  coordinate: the first stage takes the tokens, the last the targets);
- the step, `PipelineStep`: one step of torch's schedule over those rows, its micro-batches'
  losses read from a rank of the last stage.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoshard import _torch_compat as tc
from autoshard.driver.config import PlanConfig
from autoshard.driver.pipeline import PipelinePlan, plan_pipeline
from autoshard.driver.stages import PipelineRun, apply_pipeline, boundary_layout
from autoshard.options import UsageError
from autoshard.pricing.compute import graph_work
from autoshard.report.build import plan_report
from autoshard.report.files import write_report_files
from autoshard.report.pipeline import pipeline_entry
from autoshard.report.text import summary_lines
from autoshard.runtime.module import owner_of
from autoshard.train.loggers import Throughput
from autoshard.train.planfile import PlanFile
from autoshard.train.settings import Settings
from autoshard.workloads import Workload
from autoshard.workloads.hf_stages import splittable

log = logging.getLogger("autoshard")


class _RandomSteps:
    """The forward count every stage's random ops draw from, set on all of them at once."""

    def __init__(self, run: PipelineRun):
        self.run = run

    @property
    def step(self) -> int:
        return next(iter(self.run.modules.values())).random.step

    @step.setter
    def step(self, value: int) -> None:
        for module in self.run.modules.values():
            module.random.step = value


class StagedModel(nn.Module):
    """This rank's stages as one module for the trainer: their parameters and buffers (the same
    tensors) registered under the whole model's names, and this rank's rows of a step's batch,
    `rows` of the global `batch` (the boundary layout's split over the data-parallel dims)."""

    def __init__(self, run: PipelineRun, stage_mesh: Any, stage: PlanConfig, batch: int):
        super().__init__()
        object.__setattr__(self, "run", run)  # kept out of the module tree: its modules are ours
        self.compile_stats: dict = {}  # the stages run uncompiled
        for module in run.modules.values():
            persistent = set(module.state_dict())
            for fqn, param in module.named_parameters():
                owner, leaf = owner_of(self, fqn)
                owner.register_parameter(leaf, param)
            for fqn, buffer in module.named_buffers():
                owner, leaf = owner_of(self, fqn)
                if leaf in dict(owner.named_buffers(recurse=False)):  # a constant every stage computes (rotary)
                    if fqn in persistent:
                        raise ValueError(f"buffer {fqn} is state of two stages: a pipeline cannot checkpoint it")
                    continue
                owner.register_buffer(leaf, buffer, persistent=fqn in persistent)
        placements = boundary_layout(stage).to_torch_placements(stage_mesh)
        index = torch.arange(batch, device=stage_mesh.device_type)
        self.batch, self.device = batch, stage_mesh.device_type
        self.rows = tc.distribute_local(index, stage_mesh, placements).cpu()

    @property
    def random(self) -> _RandomSteps:
        return _RandomSteps(self.run)

    def load_each(self, values: Iterable[tuple[str, torch.Tensor]], *, exclude: Collection[str] = ()) -> None:
        self.run.load_each(values, exclude=exclude)

    def load_slices(self, read: Any, names: Collection[str] | None = None) -> None:
        self.run.load_slices(read, names)

    # what the feed reads: this rank's rows of every input, whole along the other dims
    def input_rows(self, i: int) -> torch.Tensor:
        return self.rows

    def shard_inputs(self, *full: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for i, x in enumerate(full):
            if x.shape[0] != self.batch:
                raise ValueError(f"input {i}: {x.shape[0]} rows, a step has {self.batch}")
        return tuple(x[self.rows.to(x.device)].to(self.device) for x in full)

    def local_inputs(self, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for i, x in enumerate(rows):
            if x.shape[0] != len(self.rows):
                raise ValueError(f"input {i}: {x.shape[0]} rows, this rank holds {len(self.rows)}")
        return tuple(x.to(self.device).contiguous() for x in rows)


@dataclass(frozen=True)
class PipelineStep:
    """A step schedule (`train.steps.StepSchedule`) of torch's pipeline schedule: the step's rows
    of this rank through its stages, every micro-batch's loss on the ranks of the last stage
    (zeros on the others: the loop reads the losses of `loss_rank`, a rank of the last stage)."""

    pipeline: PipelineRun
    loss_rank: int

    @property
    def micro_batches(self) -> int:
        return self.pipeline.micro_batches

    def run(self, pmodel: Any, feed: Any, step: int) -> list[torch.Tensor]:
        tokens, targets = feed.inputs(step, 0)
        losses = self.pipeline.micro_losses(tokens, targets)
        return losses or [torch.zeros((), device=tokens.device)] * self.micro_batches


@dataclass
class PlannedPipeline:
    """What planning gave a pipelined run (`train.planning.PlannedRun`'s counterpart): the search's
    result, this rank's stages, the trainer's model of them and its step."""

    result: PipelinePlan
    run: PipelineRun
    pmodel: StagedModel
    schedule: PipelineStep
    stages: Any  # the pp dim's process group: clipping sums the stages' squared norms over it
    tokens_per_step: int
    memory: Any = None  # no stage is dry-run: the search's modeled memory is reported

    @property
    def micro_batches(self) -> int:
        return self.run.micro_batches

    feed_micro_batches = 1  # the feed serves a step's rows at once; the schedule splits them

    @property
    def modeled_step_s(self) -> float:
        return self.result.best.step_time_s

    modeled_overlapped_s = None  # the search prices the schedule, not each stage program's overlap

    @property
    def profiles(self) -> str:
        config = self.result.config
        return f"{config.network.name}/{config.device_profile.name}"

    def throughput(self, tokens: int, dtype: torch.dtype | None) -> Throughput:
        """Tokens/s and MFU: the flops of every stage's traced micro-batch, times the micro-batches."""
        flops = sum(graph_work(plan.graph.gm.graph).flops for plan in self.run.plans) * self.micro_batches
        world = math.prod(self.result.config.mesh)
        return Throughput(tokens, flops, world, self.result.config.device_profile.peak_for(dtype) * world)

    @property
    def fingerprint(self) -> str:
        """What the pipeline is (plan.json's fingerprint: a plan file of one stage mesh never
        matches it): the mesh, the schedule and micro-batches, the cut and each stage's family."""
        best, config = self.result.best, self.result.config
        chosen = [config.mesh, config.mesh_names, best.schedule.name, best.micro_batches, best.rows]
        chosen += [(s.first_block, s.n_blocks, s.family) for s in best.stages]
        return "pipeline-" + hashlib.sha256(json.dumps(chosen).encode()).hexdigest()[:16]

    def write_report(self, extra: dict, out: Path) -> None:
        """Rank 0: sharding.log, plan.json and report.html of the pipeline and its first stage."""
        entry = pipeline_entry(self.result, self.tokens_per_step)
        stage = self.result.config.stage_config()
        first = self.run.plans[0]
        report = plan_report(
            first,
            device=stage.device_profile,
            timings=self.result.timings,
            mesh_names=stage.mesh_names,
            extra=extra | {"pipeline": entry, "solution": first.solution.to_json()},
        )
        paths = write_report_files(report, out)
        for line in summary_lines(report):  # the pipeline's lines among them
            log.info("  %s", line)
        log.info("autoshard train: sharding log %s", paths[0])


def plan_pipelined(settings: Settings, workload: Workload, mesh: Any, plan_file: PlanFile | None) -> PlannedPipeline:
    """Search the pipeline (every rank; rank 0's choice for all), then plan and lower this rank's
    stages. A resumed run keeps its own micro-batch count, `--grad-accum` names one."""
    own = plan_file.micro_batches if plan_file is not None else None
    count = settings.grad_accum if settings.grad_accum is not None else own
    model = workload.build("meta")
    inputs = lambda rows: workload.example_inputs(rows, settings.seq, "meta")  # noqa: E731
    try:
        splits = splittable(model)  # before the search: a model that cannot split fails at once
    except ValueError as err:
        raise UsageError(f"a pp mesh dim: {err}") from None
    try:
        result = plan_pipeline(
            model,
            inputs,
            settings,
            batch=settings.batch,
            loss_fn=workload.loss_fn,
            n_model_inputs=workload.n_model_inputs,
            micro_batches=None if count is None else [count],
        )
    except ValueError as err:
        raise UsageError(f"planning the pipeline failed: {err}") from None
    best = result.best
    log.info(
        "autoshard train: pipeline %s, %d micro-batches of %d rows, blocks per stage %s (modeled step %.1f ms)",
        best.schedule.name,
        best.micro_batches,
        best.rows,
        best.blocks,
        best.step_time_s * 1e3,
    )
    run = apply_pipeline(splits, result, mesh, inputs, seed=settings.seed)
    names = mesh.mesh_dim_names
    stage_mesh = mesh[names[1:]] if len(names) > 2 else mesh[names[1]]
    pmodel = StagedModel(run, stage_mesh, result.config.stage_config(), settings.batch)
    last = mesh.mesh[run.last_stage % mesh.shape[0]].flatten()[0].item()  # pp rank of the last stage
    step = PipelineStep(run, int(last))
    return PlannedPipeline(result, run, pmodel, step, mesh.get_group(0), settings.batch * settings.seq)
