"""The optimizer side of a step: torch's fused AdamW with weight decay on matrices only, its lr
schedule built from torch's own lr_scheduler classes, and gradient clipping by the global norm.

Each is a function of the settings and the step alone, so a resumed run rebuilds them: the
schedule is replayed to the resumed step (its lrs are those of an uninterrupted run), and the
norm is torch's `get_total_norm` and `clip_grad_norm_`'s scaling, run on the DTensor gradients'
local shards (sharded, replicated or uneven) with the shards' squares summed over the mesh, each
replicated shard counted by one of its replicas.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim import lr_scheduler as sched

from autoshard import _torch_compat as tc

LR_SCHEDULES = ("constant", "cosine", "linear", "wsd")


def decays(p: torch.Tensor) -> bool:
    """Whether weight decay applies to `p`: matrices (embeddings, projections) do, norms' scales and
    biases (vectors) do not, as in most recipes: decaying a norm's scale towards 0 only fights it."""
    return p.ndim >= 2


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW's settings (`train`'s flags of the same names); a bad value raises ValueError naming
    its flag when the config is made."""

    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.lr < math.inf:
            raise ValueError(f"--lr must be positive, got {self.lr:g}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"--betas must be two numbers in [0, 1), got {self.betas}")
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"--weight-decay must be >= 0, got {self.weight_decay:g}")

    @classmethod
    def from_settings(cls, settings: Any) -> OptimizerConfig:
        return cls(settings.lr, settings.betas, settings.weight_decay)

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.AdamW:
        """torch's fused AdamW (as `autoshard_models.train_single.make_optimizer`: element by
        element, so a shard updates as the same elements of the whole tensor do; stepped on the
        local shards, `tc.ShardwiseAdamW`) over two param
        groups: the matrices with `weight_decay`, the rest without (empty groups left out). Each
        group holds the `initial_lr` its schedule starts from, so a checkpoint carries the peak lr,
        not only the scheduled one of its step."""
        params = [p for p in params if p.requires_grad]
        groups = [
            {"params": [p for p in params if decays(p)], "weight_decay": self.weight_decay},
            {"params": [p for p in params if not decays(p)], "weight_decay": 0.0},
        ]
        for group in groups:
            group["initial_lr"] = self.lr
        return tc.ShardwiseAdamW([g for g in groups if g["params"]], lr=self.lr, betas=self.betas, fused=True)


@dataclass(frozen=True)
class ScheduleConfig:
    """The lr schedule's settings (`--lr-schedule` and the flags it reads)."""

    steps: int
    lr: float = 3e-3
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    decay_fraction: float = 0.2

    def __post_init__(self) -> None:
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"--min-lr must be between 0 and --lr {self.lr:g}, got {self.min_lr:g}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"--warmup-steps must be >= 0 and below --steps {self.steps}, got {self.warmup_steps}")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(f"--decay-fraction must be in (0, 1], got {self.decay_fraction}")
        if self.lr_schedule == "wsd" and self.warmup_steps + self.decay_steps > self.steps:
            raise ValueError(
                f"--lr-schedule wsd: --warmup-steps {self.warmup_steps} and the decay's {self.decay_steps} steps "
                f"(--decay-fraction {self.decay_fraction:g} of {self.steps}) exceed --steps {self.steps}"
            )

    @classmethod
    def from_settings(cls, settings: Any) -> ScheduleConfig:
        return cls(
            settings.steps,
            settings.lr,
            settings.lr_schedule,
            settings.warmup_steps,
            settings.min_lr,
            settings.decay_fraction,
        )

    @property
    def decay_steps(self) -> int:
        """How many of the last steps the lr decays over: all after the warm-up, or for wsd the
        last `decay_fraction` of the steps (at least one)."""
        if self.lr_schedule == "wsd":
            return max(1, round(self.decay_fraction * self.steps))
        return self.steps - self.warmup_steps

    def build(self, optim: torch.optim.Optimizer) -> sched.LRScheduler:
        """The lr schedule over steps 1..steps (scheduler index = step - 1), from torch's classes:
        a linear warm-up from lr/(W+1) at step 1 to the peak at step W+1 (LinearLR), then constant;
        cosine or linear from the peak down to `min_lr` at the last step (CosineAnnealingLR,
        LinearLR); or wsd: the peak held (ConstantLR) until a linear decay over the last
        `decay_steps` reaches `min_lr` at the last step. Built at index 0: `at_step` moves it on."""
        warmup, steps, decay = self.warmup_steps, self.steps, self.decay_steps
        phases: list[sched.LRScheduler] = []
        if warmup:
            phases.append(sched.LinearLR(optim, start_factor=1 / (warmup + 1), end_factor=1.0, total_iters=warmup))
        if self.lr_schedule == "constant":
            phases.append(sched.ConstantLR(optim, factor=1.0, total_iters=0))
        elif self.lr_schedule == "cosine":
            phases.append(sched.CosineAnnealingLR(optim, T_max=max(decay - 1, 1), eta_min=self.min_lr))
        else:  # linear, wsd: linear from the peak (first decay step) to min_lr (the last)
            if self.lr_schedule == "wsd" and steps - warmup - decay > 0:
                phases.append(sched.ConstantLR(optim, factor=1.0, total_iters=0))
            floor = self.min_lr / self.lr
            phases.append(sched.LinearLR(optim, start_factor=1.0, end_factor=floor, total_iters=max(decay - 1, 1)))
        if len(phases) == 1:
            return phases[0]
        starts = [warmup] if warmup else []
        if len(phases) - len(starts) == 2:  # wsd's stable phase, then its decay
            starts.append(steps - decay)
        return sched.SequentialLR(optim, phases, milestones=starts)


def at_step(schedule: sched.LRScheduler, done: int) -> sched.LRScheduler:
    """Move a schedule built at index 0 on by the `done` steps a resumed run has behind it: the
    same calls an uninterrupted run made, so the same lrs (not a checkpointed position: the
    command line's schedule applies). torch's warnings about stepping without an optimizer step
    (and SequentialLR's own epoch argument) say nothing here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(done):
            schedule.step()
    return schedule


class ScheduledOptimizer:
    """The optimizer and its lr schedule, stepped together: `step()` updates the parameters with
    this step's lr (returned, for the step's row), clears the gradients and moves the schedule on."""

    def __init__(self, optim: torch.optim.Optimizer, schedule: sched.LRScheduler):
        self.optim, self.schedule = optim, schedule

    @property
    def lr(self) -> float:
        """The lr the next optimizer step uses (every group follows the one schedule)."""
        return float(self.optim.param_groups[0]["lr"])

    def step(self) -> float:
        lr = self.lr
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # SequentialLR passes an epoch at a milestone; torch warns, the value is right
            warnings.simplefilter("ignore", UserWarning)
            self.schedule.step()
        return lr


@dataclass(frozen=True)
class GradNorm:
    """A step's global gradient norm as the device holds it: `value` is the norm itself on every
    rank, or, with `shared`, this rank's share of its square, which the read-back sums over the
    world (the step then spends no collective on a norm it only logs)."""

    value: torch.Tensor
    shared: bool = False


class GradClip:
    """The global L2 norm of every gradient, and with `max_norm` the clipping to it: torch's
    `clip_grad_norm_` math on each DTensor's local shard. The ranks share the work: each shard
    is counted by one of its replicas (`counted_here`), so DDP's layouts compute each gradient's
    norm once in the world, not once per rank. With `stages`, the pp process group of a
    pipeline, each rank holds only its stages' gradients, summed over every stage as torchtitan
    does. The norm stays a tensor on the device: the step reads it back only when it logs."""

    def __init__(self, max_norm: float | None, stages: Any = None):
        self.max_norm, self.stages = max_norm, stages
        # the parameters with gradients -> which of their shards this rank counts (None: the norm
        # is not split); a parameter's gradient keeps its layout from step to step
        self._counted: dict[tuple[int, ...], list[bool] | None] = {}

    def __call__(self, params: Sequence[torch.Tensor]) -> GradNorm:
        held = [p for p in params if p.grad is not None]
        grads = [p.grad for p in held]
        key = tuple(map(id, held))
        if key not in self._counted:
            split = _splits(grads, self.stages)
            self._counted[key] = counted_here(grads, grads[0].device_mesh.get_coordinate()) if split else None
        counted = self._counted[key]
        if counted is not None:
            share = squared_share(grads, counted)
            if self.max_norm is None:
                return GradNorm(share, shared=True)
            dist.all_reduce(share)  # every rank needs the whole norm before it clips
            norm = share.sqrt()
        else:
            norm = total_norm(grads)
            if self.stages is not None:
                squared = norm.pow(2)
                dist.all_reduce(squared, group=self.stages)
                norm = squared.sqrt()
        if self.max_norm is not None:
            tc.clip_shards_(grads, self.max_norm, norm)
        return GradNorm(norm)


def _splits(grads: Sequence[torch.Tensor], stages: Any) -> bool:
    """Whether the ranks can share the norm's work (`counted_here`): every gradient a DTensor with
    no partial placement on a mesh of real ranks (not a simulated one), one mesh per rank that,
    with the pp group's other stages, makes up the world."""
    if not grads or not dist.is_initialized() or not all(isinstance(g, DTensor) for g in grads):
        return False
    mesh = grads[0].device_mesh
    if any(g.device_mesh != mesh or any(p.is_partial() for p in g.placements) for g in grads):
        return False
    if isinstance(grads[0].to_local(), tc.LocalTensor):  # every rank in this process: one control flow
        return False
    stage_count = dist.get_world_size(stages) if stages is not None else 1
    return mesh.size() * stage_count == dist.get_world_size()


def counted_here(grads: Sequence[DTensor], coordinate: Sequence[int]) -> list[bool]:
    """Which gradients' local shards the rank at `coordinate` of their mesh counts in the norm:
    each shard once in the world.
    A shard replicated over some mesh dims goes to one rank of its replicas, the largest shards
    first to the least loaded (the same choice on every rank: by global sizes), so that the
    replicas share the work that each would otherwise repeat."""
    order = sorted(range(len(grads)), key=lambda i: (-grads[i].numel(), i))
    loads: dict[tuple[int, ...], list[int]] = {}  # replicated dims -> elements given to each replica
    counted = [False] * len(grads)
    for i in order:
        mesh, placements = grads[i].device_mesh, grads[i].placements
        dims = tuple(d for d, p in enumerate(placements) if p.is_replicate())
        sizes = [mesh.size(d) for d in dims]
        load = loads.setdefault(dims, [0] * math.prod(sizes))
        owner = min(range(len(load)), key=lambda k: (load[k], k))
        load[owner] += grads[i].numel()
        here = 0
        for d, size in zip(dims, sizes):
            here = here * size + coordinate[d]
        counted[i] = here == owner
    return counted


@torch.no_grad()
def squared_share(grads: Sequence[DTensor], counted: Sequence[bool]) -> torch.Tensor:
    """The square of torch's `get_total_norm` of the shards this rank counts (`counted_here`):
    summed over the world, the square of the global norm."""
    dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads), torch.float32)  # 16-bit: fp32
    mine = [g.to_local() for g, here in zip(grads, counted) if here]
    if not mine:  # the same dtype as the other ranks' shares: they are summed
        return torch.zeros((), dtype=dtype, device=grads[0].to_local().device)
    return torch.nn.utils.get_total_norm(mine).to(dtype).pow(2)


@torch.no_grad()  # a DTensor's to_local is then its shard itself
def total_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """torch's `get_total_norm` (L2) of every gradient together, from each DTensor's local shard:
    the shards' norms grouped by the mesh dims that shard them, each group's square summed over
    those dims' process groups (a replicated dim's copies counted once). torch's own dispatches
    through DTensor per gradient and per per-tensor norm, several times the kernel's host time on
    a step's many gradients; a partial gradient (a step leaves none) takes torch's."""
    if not grads or any(isinstance(g, DTensor) and any(p.is_partial() for p in g.placements) for g in grads):
        norm = torch.nn.utils.get_total_norm(grads)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        if isinstance(g, DTensor):
            dims = tuple(i for i, p in enumerate(g.placements) if not p.is_replicate())  # Shard, _StridedShard
            groups.setdefault((g.device_mesh, dims), []).append(g.to_local())
        else:
            groups.setdefault((None, ()), []).append(g)
    squares = []
    for (mesh, dims), shards in groups.items():
        norm = torch.nn.utils.get_total_norm(shards)
        squared = norm.to(torch.promote_types(norm.dtype, torch.float32)).pow(2)  # 16-bit: squared in fp32
        for dim in dims:
            dist.all_reduce(squared, group=mesh.get_group(dim))
        squares.append(squared)
    return torch.stack(squares).sum().sqrt()
