"""The optimizer side of a step: torch's fused AdamW with weight decay on matrices only, its lr
schedule built from torch's own lr_scheduler classes, and gradient clipping by the global norm.

Each is a function of the settings and the step alone, so a resumed run rebuilds them: the
schedule is replayed to the resumed step (its lrs are those of an uninterrupted run), and the
norm is torch's `clip_grad_norm_` / `get_total_norm`, which on DTensor gradients of any layout
(sharded, replicated, partial, uneven) reduces the per-tensor norms over the mesh itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import lr_scheduler as sched

LR_SCHEDULES = ("constant", "cosine", "linear", "wsd")


def decays(p: torch.Tensor) -> bool:
    """Whether weight decay applies to `p`: matrices (embeddings, projections) do, norms' scales and
    biases (vectors) do not, as in most recipes: decaying a norm's scale towards 0 only fights it."""
    return p.ndim >= 2


def make_optimizer(params, settings: Any) -> torch.optim.AdamW:
    """torch's fused AdamW (as `autoshard_models.train_single.make_optimizer`: element by element,
    so a shard updates as the same elements of the whole tensor do) over two param groups: the
    matrices with `settings.weight_decay`, the rest without (empty groups left out). Each group
    holds the `initial_lr` its schedule starts from, so a checkpoint carries the peak lr, not only
    the scheduled one of its step."""
    params = list(params)
    groups = [
        {"params": [p for p in params if decays(p)], "weight_decay": settings.weight_decay},
        {"params": [p for p in params if not decays(p)], "weight_decay": 0.0},
    ]
    for group in groups:
        group["initial_lr"] = settings.lr
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=settings.lr, betas=tuple(settings.betas), fused=True
    )


def decay_steps(settings: Any) -> int:
    """How many of the last steps the lr decays over: all after the warm-up, or for wsd the last
    `decay_fraction` of the steps (at least one)."""
    if settings.lr_schedule == "wsd":
        return max(1, round(settings.decay_fraction * settings.steps))
    return settings.steps - settings.warmup_steps


def make_schedule(optim: torch.optim.Optimizer, settings: Any) -> sched.LRScheduler:
    """The lr schedule over steps 1..settings.steps (scheduler index = step - 1), from torch's
    classes: a linear warm-up from lr/(W+1) at step 1 to the peak at step W+1 (LinearLR), then
    constant; cosine or linear from the peak down to `min_lr` at the last step (CosineAnnealingLR,
    LinearLR); or wsd: the peak held (ConstantLR) until a linear decay over the last `decay_steps`
    reaches `min_lr` at the last step. Built at index 0: `at_step` moves it on."""
    warmup, steps = settings.warmup_steps, settings.steps
    phases: list[sched.LRScheduler] = []
    if warmup:
        phases.append(sched.LinearLR(optim, start_factor=1 / (warmup + 1), end_factor=1.0, total_iters=warmup))
    floor = settings.min_lr / settings.lr
    decay = decay_steps(settings)
    if settings.lr_schedule == "constant":
        phases.append(sched.ConstantLR(optim, factor=1.0, total_iters=0))
    elif settings.lr_schedule == "cosine":
        phases.append(sched.CosineAnnealingLR(optim, T_max=max(decay - 1, 1), eta_min=settings.min_lr))
    else:  # linear, wsd: linear from the peak (first decay step) to min_lr (the last)
        if settings.lr_schedule == "wsd" and steps - warmup - decay > 0:
            phases.append(sched.ConstantLR(optim, factor=1.0, total_iters=0))
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


class GradClip:
    """The global L2 norm of every gradient, and with `max_norm` the clipping to it: torch's own
    `clip_grad_norm_` (or `get_total_norm`, nothing scaled), whose per-tensor norms of DTensor
    gradients are partial over the mesh dims that shard them and reduced once for all."""

    def __init__(self, max_norm: float | None):
        self.max_norm = max_norm

    def __call__(self, params: Sequence[torch.Tensor]) -> float:
        if self.max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)
