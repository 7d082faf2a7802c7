"""The trainer's parts, built from the plan: the feed, the optimizer and its lr schedule, the
gradient clipping, the loggers, the checkpointer and the step schedule. Each comes from a small
config of the settings it reads, or from `Parts`, where an API user hands in their own:

    autoshard.train.train(settings, Parts(optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                                          data=my_batches, loggers=[my_logger]))
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim import lr_scheduler as sched

from autoshard.data import BatchesFeed, Feed
from autoshard.options import UsageError
from autoshard.train.checkpoints import Checkpoint, Checkpointer, resume_newest
from autoshard.train.loggers import Logger, make_loggers
from autoshard.train.metrics import MetricsFile
from autoshard.train.optimizer import GradClip, OptimizerConfig, ScheduleConfig, ScheduledOptimizer, at_step
from autoshard.train.resume import apply_optimizer_settings
from autoshard.train.run import ResolvedRun
from autoshard.train.signals import StopSignals
from autoshard.train.steps import LoopConfig, Steps

log = logging.getLogger("autoshard")


@dataclass
class Parts:
    """What an API user brings in place of what the settings build (None: the settings' own).

    - `optimizer`: the parallel module's trainable parameters -> a torch optimizer (default:
      fused AdamW with `--lr`, `--betas`, `--weight-decay`);
    - `lr_schedule`: optimizer -> a torch lr scheduler, stepped once a step (default:
      `--lr-schedule`); on resume it is stepped to the resumed step;
    - `data`: an iterable of global batches, one a step (`autoshard.data.BatchesFeed`), or a
      callable (parallel module, micro-batches) -> `Feed`;
    - `loggers`: more loggers beside metrics.jsonl and the console (each `log(row)`, `close()`).
    """

    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None
    lr_schedule: Callable[[torch.optim.Optimizer], sched.LRScheduler] | None = None
    data: Iterable | Callable[[Any, int], Feed] | None = None
    loggers: Sequence[Logger] = field(default_factory=list)


def build_feed(resolved: ResolvedRun, parts: Parts, pmodel: Any, micro_batches: int) -> Feed:
    """This rank's feed of the planned module."""
    if parts.data is None:
        assert resolved.data is not None
        return resolved.data.feed(pmodel, micro_batches)
    if callable(parts.data) and not isinstance(parts.data, Iterable):
        return parts.data(pmodel, micro_batches)
    return BatchesFeed(parts.data, pmodel, micro_batches)


def build_optimizer(resolved: ResolvedRun, parts: Parts, pmodel: Any) -> torch.optim.Optimizer:
    params = [p for p in pmodel.parameters() if p.requires_grad]
    if parts.optimizer is not None:
        return parts.optimizer(params)
    return OptimizerConfig.from_settings(resolved.settings).build(params)


def restore(
    resolved: ResolvedRun, parts: Parts, pmodel: Any, optim: torch.optim.Optimizer, feed: Feed
) -> tuple[int, dict[str, list]]:
    """Every rank: load the newest checkpoint that loads into the module, the optimizer and the
    feed. The step to continue from (0: a fresh start) and what this command changes against the
    resumed run ({name: [old, new]})."""
    if not resolved.resuming:
        return 0, {}
    try:
        found: Checkpoint | None = resume_newest(resolved.out, pmodel, optim)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if found is None:
        return 0, {}
    log.info("autoshard train: resumed from %s (step %d)", found.path, found.step)
    if resolved.settings.init_from:
        log.warning(
            "autoshard train: warning: --init-from %s is not used: the run continues from its checkpoint",
            resolved.settings.init_from,
        )
    feed.load_state_dict(found.data if found.data is not None else {"steps": found.step})
    changes = dict(resolved.changes)
    if parts.optimizer is None:  # our AdamW: this command's lr, betas and decay apply from here on
        changes |= apply_optimizer_settings(optim, resolved.settings, resolved.own_settings)
    return found.step, changes


def build_steps(
    resolved: ResolvedRun,
    parts: Parts,
    planned: Any,  # train.planning.PlannedRun or train.pipelined.PlannedPipeline
    pieces: tuple[Feed, torch.optim.Optimizer, MetricsFile],  # built before the checkpoint loads
    start: int,
    signals: StopSignals,
    device: str,
) -> Steps:
    """The loop's parts for a run that continues after step `start` (0: a fresh one)."""
    settings, (feed, optim, metrics) = resolved.settings, pieces
    pmodel = planned.pmodel
    if parts.lr_schedule is not None:
        schedule = at_step(parts.lr_schedule(optim), start)
    else:
        schedule = at_step(ScheduleConfig.from_settings(settings).build(optim), start)
    dtype = settings.precision.param_dtype or next(pmodel.parameters()).dtype  # what the matmuls run in
    loggers = make_loggers(settings, resolved.out, metrics, start or None, planned.profiles) + list(parts.loggers)
    writes = settings.checkpoint_writes
    asynchronous = writes == "async" or (writes == "auto" and device == "cuda")
    return Steps(
        LoopConfig.from_settings(settings),
        pmodel,
        feed,
        planned.schedule,
        ScheduledOptimizer(optim, schedule),
        GradClip(settings.grad_clip, planned.stages),
        loggers,
        planned.throughput(settings.batch * settings.seq, dtype),
        Checkpointer(resolved.out, settings.keep_checkpoints, asynchronous),
        signals,
        planned.modeled_step_s,
        planned.modeled_overlapped_s,
        planned.memory,
    )
