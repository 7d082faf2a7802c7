"""Run a pipeline: every rank plans and lowers its own stages, and torch's pipelining schedule
drives them.

    run = pipeline_run([StageSpec(stage_module, example_inputs), ...], config, mesh,
                       schedule="1F1B", micro_batches=4)
    run.load_each(model.initial_values(seed))             # or run.load_full(state_dict)
    loss = run.step(tokens, targets)                      # this rank's rows; the loss on the last stage
    optimizer = torch.optim.AdamW(run.parameters())       # this rank's stages' DTensor parameters

Each stage is planned as its own model on the stage mesh (the mesh without pp) by the same ILP
(`AutoShard.pipeline_stage`): its inputs, its output and their gradients cross the stage
boundary in one layout, the rows split over the data-parallel dims and whole on the others, so a
stage sends its local shard to the same coordinate of the next stage's mesh. Every rank plans
every stage in the same order (rank 0 solves each for all, as `AutoShard.optimize` does in a
process group) and keeps the programs of the stages it runs: stage `k` runs on pp rank
`k % pp`, as torch's looped schedules place them. Torch's `PipelineStage` sends the activations
and gradients and its schedule (GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble) orders the
micro-batches; under the zero-bubble one each stage's backward runs in halves (`program.weights`),
the weights' where the schedule fills a bubble with it. The loss of each micro-batch is its mean,
so gradients are averaged over the micro-batches as the schedule scales them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from autoshard.driver.api import AutoShard
from autoshard.driver.config import PlanConfig
from autoshard.driver.pipeline import FAMILIES, PipelinePlan
from autoshard.driver.ranks import broadcast, in_process_group
from autoshard.layout import Layout, R, S
from autoshard.pipeline.search import Pipeline
from autoshard.problem.plan import Plan
from autoshard.runtime.module import ParallelModule

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble")


@dataclass
class StageSpec:
    """One stage (chunk) of the model, in pipeline order: the module, and example inputs of
    one micro-batch in global shapes (the first stage's tokens; a later stage's activations,
    requiring a gradient; the last stage's also the targets). Its layout family, as the
    pipeline planner chose it (`PipelinePlan.best.stages[k].family`): `sharded`, every
    parameter split over the whole stage mesh (a parameter budget of its even share);
    `recompute`, its blocks' activations recomputed in the backward."""

    module: nn.Module
    inputs: tuple[Any, ...]
    sharded: bool = False
    recompute: bool = False


@dataclass
class PipelineRun:
    """This rank's stages of a pipeline and the torch schedule that drives them."""

    modules: dict[int, ParallelModule]  # stage index -> its parallel module (those this rank runs)
    plans: list[Plan] = field(repr=False)  # every stage's plan, in stage order
    schedule: Any = field(repr=False)  # torch.distributed.pipelining's schedule object
    micro_batches: int = 1
    last_stage: int = 0
    stages: list[_Stage] = field(default_factory=list, repr=False)  # what torch's stages call, this rank's

    def parameters(self) -> Iterable[nn.Parameter]:
        for module in self.modules.values():
            yield from module.parameters()

    def named_parameters(self) -> Iterable[tuple[str, nn.Parameter]]:
        for module in self.modules.values():
            yield from module.named_parameters()

    def named_buffers(self) -> Iterable[tuple[str, torch.Tensor]]:
        for module in self.modules.values():
            yield from module.named_buffers()

    def load_each(self, values: Iterable[tuple[str, torch.Tensor]], *, exclude: Collection[str] = ()) -> None:
        """Each of this rank's stages takes its shard of the whole model's values, one full tensor
        at a time (an init that yields each, `model.initial_values(seed)`): names no stage here
        holds are skipped; KeyError when a parameter or buffer not in `exclude` never comes."""
        left = {n for n, _ in (*self.named_parameters(), *self.named_buffers()) if n not in exclude}
        for fqn, full in values:
            if fqn not in exclude and any([module.take(fqn, full) for module in self.modules.values()]):
                left.discard(fqn)
            del full  # before the next one is made
        if left:
            raise KeyError(f"the values lack {len(left)} parameters or buffers, e.g. {sorted(left)[:3]}")

    def load_slices(self, read: Any, names: Collection[str] | None = None) -> None:
        """Every parameter of this rank's stages (those in `names`, None: all) read by slices,
        each rank reading only its shards (`ParallelModule.load_slices`)."""
        for module in self.modules.values():
            module.load_slices(read, names)

    def load_full(self, values: Mapping[str, torch.Tensor]) -> None:
        for module in self.modules.values():
            module.load_full(values, strict=False)

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """One training step's forward and backward over this rank's rows (split into the
        micro-batches); gradients land in `.grad`. The mean loss on the rank that runs the last
        stage, None on the others."""
        losses = self.micro_losses(tokens, targets)
        return torch.stack(losses).mean() if losses else None

    def micro_losses(self, tokens: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        """`step`, returning each micro-batch's loss (detached) on the rank that runs the last
        stage, none on the others."""
        losses: list[torch.Tensor] = []
        for stage in self.stages:  # a step starts at micro-batch 0, whatever the last one did
            stage.calls = 0
        args = (tokens,) if 0 in self.modules else ()
        self.schedule.step(*args, target=targets, losses=losses, return_outputs=False, targets=targets)
        return [loss.detach() for loss in losses] if self.last_stage in self.modules else []


class _Stage(nn.Module):
    """What torch's `PipelineStage` calls: the parallel module of one stage, given the targets
    (a keyword every stage gets from `step`) only when it is the last. Every schedule runs a
    stage's micro-batches in order, forward and backward alike, so the forwards of all but the
    last of each step run inside `no_sync()`: their backwards hold the gradient all-reduces,
    and the last backward reduces the sums once a step, as DDP under torch's pipelining does."""

    def __init__(self, module: ParallelModule, last: bool, micro_batches: int):
        super().__init__()
        self.module, self.last, self.micro_batches = module, last, micro_batches
        self.calls = 0

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        inputs = (x, targets) if self.last else (x,)
        if not torch.is_grad_enabled():  # evaluation: no backward to hold
            return self.module(*inputs)
        held = self.calls % self.micro_batches < self.micro_batches - 1
        self.calls += 1
        with self.module.no_sync() if held else contextlib.nullcontext():
            return self.module(*inputs)


def stage_specs(
    model: nn.Module, result: PipelinePlan, input_fn: Callable[[int], tuple], pipeline: Pipeline
) -> list[StageSpec]:
    """The stages of `pipeline` (one of `result`'s: its cuts and each chunk's layout family) for
    a model that splits itself (`model.pipeline_stage(start, stop)`, our llama's); each takes one
    micro-batch of `input_fn(rows)` (tokens, targets: the planning's), the hidden states between
    stages in the planned compute dtype."""
    tokens, targets = input_fn(pipeline.rows)
    dtype = result.config.precision.param_dtype or next(model.parameters()).dtype
    split = getattr(model, "pipeline_stage", None)
    if split is None:
        raise TypeError(f"{type(model).__name__} has no pipeline_stage(start, stop): build its StageSpecs by hand")
    families = {f.name: f for f in FAMILIES} | {f.name: f for f in (replace(f, gathered_once=True) for f in FAMILIES)}
    specs = []
    for chunk in pipeline.stages:
        module = split(chunk.first_block, chunk.first_block + chunk.n_blocks)
        family = families[chunk.family]
        inputs = module.example_inputs(tokens, targets, dtype)
        specs.append(StageSpec(module, inputs, sharded=family.sharded, recompute=family.recompute))
    return specs


def boundary_layout(stage: PlanConfig) -> Layout:
    """Where activations cross a stage boundary: rows split over the data-parallel dims, whole
    on the others."""
    assert stage.mesh is not None
    dp = set(stage.data_parallel_dims)
    return Layout(tuple(S(0) if d in dp else R for d in range(len(stage.mesh))))


def plan_stage(
    spec: StageSpec, stage: PlanConfig, mesh: Any, *, micro_batches: int = 1, stages: int = 1
) -> tuple[AutoShard, Plan]:
    """One stage planned on the stage mesh `mesh` (its shape when no process group) of one of
    `stages` pp ranks, its boundary in `boundary_layout`, for `micro_batches` per step."""
    config = stage.replace(recompute=spec.recompute)
    auto = AutoShard(spec.module, lambda: spec.inputs, mesh, config=config, stages=stages)
    layout = boundary_layout(stage)
    auto.pipeline_stage(layout)
    auto.constrain_inputs(*(layout for _ in spec.inputs))
    auto.accumulate(micro_batches)
    if spec.sharded:
        assert stage.mesh is not None
        held = sum(p.numel() * p.element_size() for p in spec.module.parameters())
        auto.memory_budget(held / math.prod(stage.mesh))
    return auto, auto.optimize()


def pipeline_run(
    stages: Sequence[StageSpec],
    config: PlanConfig,
    mesh: Any,
    *,
    schedule: str = "1F1B",
    micro_batches: int,
    seed: int = 0,
) -> PipelineRun:
    """Plan every stage, lower this rank's and build torch's schedule over them. `config` has
    the whole mesh, pp first; `mesh` is the DeviceMesh of it, with its dims' names."""
    from torch.distributed.pipelining import PipelineStage, schedules

    ranks = config.pipeline_ranks
    if ranks is None:
        raise ValueError("a pipeline needs a mesh whose first dim is named pp")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    looped, zero_bubble = schedule.startswith("Interleaved"), schedule == "InterleavedZeroBubble"
    one_each = len(stages) == ranks
    if len(stages) % ranks or (not one_each and not looped) or (one_each and looped and not zero_bubble):
        runs = "one or more stages" if zero_bubble else "several stages" if looped else "one stage"
        raise ValueError(f"{schedule} runs {runs} per pp rank: {len(stages)} stages on {ranks} pp ranks")
    names = mesh.mesh_dim_names
    pp_rank = mesh.get_local_rank(0)
    stage_mesh = mesh[names[1:]] if len(names) > 2 else mesh[names[1]]
    stage_config = config.stage_config()
    layout = boundary_layout(stage_config)
    plans: list[Plan] = []
    modules: dict[int, ParallelModule] = {}
    pipes: list[Any] = []
    calls: list[_Stage] = []
    for k, spec in enumerate(stages):
        auto, plan = plan_stage(spec, stage_config, stage_mesh, micro_batches=micro_batches, stages=ranks)
        plans.append(plan)
        if k % ranks != pp_rank:
            continue
        module = auto.apply(plan, seed=seed, apart=zero_bubble)
        modules[k] = module
        local = tuple(_local_example(x, layout, stage_config) for x in spec.inputs)
        last = k == len(stages) - 1
        out = _output_example(plan, layout, stage_config)
        calls.append(_Stage(module, last, micro_batches))
        pipes.append(
            PipelineStage(
                calls[-1],
                k,
                len(stages),
                _device(mesh.device_type),
                input_args=local[:1],
                output_args=out,
                group=mesh.get_group(0),
                dw_builder=module.deferred_weights if zero_bubble else None,
            )
        )
    cls: Any = getattr(schedules, f"Schedule{schedule}")  # a looped one takes every stage of this rank
    runner = cls(pipes if looped else pipes[0], micro_batches, loss_fn=_stage_loss)
    return PipelineRun(modules, plans, runner, micro_batches, len(stages) - 1, calls)


def apply_pipeline(
    model: nn.Module,
    result: PipelinePlan,
    mesh: Any,
    input_fn: Callable[[int], tuple],
    *,
    pipeline: Pipeline | None = None,
    seed: int = 0,
) -> PipelineRun:
    """Run the pipeline `plan_pipeline` chose (`result.best`: cuts, layout families, schedule,
    micro-batches; or another of its `pipeline`s, `result.even` say) for `model` (one with
    `pipeline_stage(start, stop)`) on the DeviceMesh `mesh`; `input_fn(rows)` is the planning's,
    returning (tokens, targets). Inside a process group every rank runs rank 0's choice."""
    best = pipeline if pipeline is not None else result.best
    if in_process_group():
        best = broadcast(best)
    specs = stage_specs(model, result, input_fn, best)
    return pipeline_run(
        specs, result.config, mesh, schedule=best.schedule.name, micro_batches=best.micro_batches, seed=seed
    )


def _stage_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The last stage returns its micro-batch's loss already (computed in its program)."""
    return output


def _device(device_type: str) -> torch.device:
    """This rank's device: on a GPU mesh the current CUDA device (torchrun's local rank)."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _local_example(x: Any, layout: Layout, stage: PlanConfig) -> Any:
    """An empty tensor of `x`'s local shape in `layout` (what torch's stage checks inputs against)."""
    assert stage.mesh is not None
    shape = layout.local_shape(tuple(x.shape), stage.mesh)
    return torch.empty(shape, dtype=x.dtype, device="meta").requires_grad_(x.requires_grad)


def _output_example(plan: Plan, layout: Layout, stage: PlanConfig) -> torch.Tensor:
    """The stage output's local shape: the boundary layout's shard, or the scalar loss; it
    requires a gradient (torch's stage sends one back only for an output that does)."""
    assert stage.mesh is not None
    value = plan.graph.loss.meta["val"]
    shape = () if value.dim() == 0 else layout.local_shape(tuple(value.shape), stage.mesh)
    return torch.empty(shape, dtype=value.dtype, device="meta", requires_grad=True)
