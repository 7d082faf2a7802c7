"""The training steps after planning: forward, backward, gradient norm (and clipping), optimizer
step and lr schedule, one row each to every logger, checkpoints as asked; a non-finite loss or a
scheduler's signal stops them. Apart from `train()`'s set-up (loop.py), with the step's varying
parts as small objects (`StepParts`) rather than flags inside the loop."""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from autoshard import _torch_compat as tc
from autoshard.data import Feed
from autoshard.driver.api import AutoShard
from autoshard.options import UsageError
from autoshard.problem.plan import Plan
from autoshard.runtime.dryrun import DryRunResult
from autoshard.runtime.module import ParallelModule
from autoshard.runtime.wire import WireMeter, wire_row
from autoshard.train.checkpoints import Checkpointer
from autoshard.train.loggers import Logger, Throughput
from autoshard.train.metrics import memory_row, memory_tracker, peak_rss_mb
from autoshard.train.optimizer import GradClip, ScheduledOptimizer
from autoshard.train.settings import Settings
from autoshard.train.signals import Preempted, StopSignals

log = logging.getLogger("autoshard")


@dataclass
class PlannedRun:
    """What planning gave a run (`loop._plan`): the plan, its parallel module, the AutoShard that
    made it, the fingerprint of the problem it solves, and its dry run."""

    plan: Plan
    pmodel: ParallelModule
    auto: AutoShard
    fingerprint: str
    memory: DryRunResult


@dataclass
class StepParts:
    """What varies between runs inside a step, each a small object of its own: the optimizer with
    its lr schedule, the gradient clipping (the norm is measured either way), where the rows go,
    and the throughput figures of a row."""

    optimizer: ScheduledOptimizer
    clip: GradClip
    loggers: list[Logger]
    throughput: Throughput


def run_steps(
    settings: Settings,
    feed: Feed,
    run: PlannedRun,
    parts: StepParts,
    checkpointer: Checkpointer,
    signals: StopSignals,
    start_step: int,
) -> list[float]:
    """Steps start_step + 1 .. settings.steps: one row each to every logger, checkpoints as asked;
    stops early on a non-finite loss (UsageError) or a scheduler's signal (Preempted)."""
    pmodel, plan, optim = run.pmodel, run.plan, parts.optimizer.optim
    params = list(pmodel.parameters())
    losses = []
    reported: set[str] = set()  # program phases whose compile time is logged
    micro_batches = settings.grad_accum
    for step in range(start_step + 1, settings.steps + 1):
        t0 = time.perf_counter()
        inputs = feed.inputs(step - 1, pmodel)  # this rank's local inputs, on the mesh's device
        meter = WireMeter() if step == settings.wire_step else None
        tracker = memory_tracker(pmodel, optim, inputs) if step == settings.memory_step else None
        with contextlib.ExitStack() as metering:
            for m in (meter, tracker):
                if m is not None:
                    metering.enter_context(m)
            value = 0.0
            for micro in range(micro_batches):  # the last one reduces what no_sync() held
                if micro:
                    inputs = feed.inputs(step - 1, pmodel, micro)
                with pmodel.no_sync() if micro < micro_batches - 1 else contextlib.nullcontext():
                    loss = pmodel(*inputs)
                    (loss / micro_batches if micro_batches > 1 else loss).backward()
                value += loss.item() / micro_batches
            with tc.no_dispatch_modes():  # the norm's scalar all-reduces are no part of the metered program
                grad_norm = parts.clip(params)
            lr = parts.optimizer.step()
        elapsed = time.perf_counter() - t0
        gathered = [None] * dist.get_world_size()  # (peak RSS, a stop signal) of every rank
        dist.all_gather_object(gathered, (round(peak_rss_mb(), 1), signals.received))
        peaks = [peak for peak, _ in gathered]
        if not math.isfinite(value):  # the same loss on every rank: all stop here, nothing saved
            _broken(step, f"the loss is {value}", checkpointer)
        losses.append(value)
        row = {
            "step": step,
            "loss": value,
            "lr": lr,
            "grad_norm": grad_norm,
            "step_s": elapsed,
            **parts.throughput.row(elapsed),
            "peak_rss_mb_per_rank": peaks,
            "modeled_step_s": plan.step_time_s,
            "modeled_over_measured": plan.step_time_s / elapsed,
            "modeled_overlapped_step_s": pmodel.program.step_s(micro_batches),
        }
        if meter is not None:
            row |= wire_row(meter.stats)  # every rank takes part
        if tracker is not None:
            row |= memory_row(tracker, run.memory)  # every rank takes part
        row |= _compile_entry(pmodel, reported, step)
        row |= feed.evaluate(step, pmodel)  # every --eval-every steps: val_loss, val_ppl
        stop = max(signum for _, signum in gathered)
        if settings.checkpoint_every and step % settings.checkpoint_every == 0:
            _check_finite(step, pmodel, checkpointer)  # a checkpoint never holds a broken state
            t1 = time.perf_counter()
            checkpointer.save(step, pmodel, optim)
            row["checkpoint_s"] = time.perf_counter() - t1  # what the step loop waited (async: the staging)
        checkpointer.poll()
        for logger in parts.loggers:
            logger.log(row)
        if stop:
            _stop(step, stop, settings, checkpointer, pmodel, optim)
    return losses


def _broken(step: int, what: str, checkpointer: Checkpointer) -> NoReturn:
    """Stop the run (every rank alike) naming the newest good checkpoint."""
    checkpointer.finish()
    newest = checkpointer.newest
    raise UsageError(
        f"step {step}: {what}; the newest good checkpoint is "
        f"{newest.path if newest else 'none (no checkpoint written)'}"
    )


def _check_finite(step: int, pmodel: ParallelModule, checkpointer: Checkpointer) -> None:
    """Every rank: stop (naming the newest good checkpoint) unless every parameter shard is finite."""
    shards = [p.to_local() for p in pmodel.parameters()]
    flag = torch.tensor([int(all(bool(torch.isfinite(t).all()) for t in shards))], device=shards[0].device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if not flag.item():
        _broken(step, "the parameters hold non-finite values", checkpointer)


def _stop(step: int, signum: int, settings: Settings, checkpointer: Checkpointer, pmodel, optim) -> None:
    """A rank got a scheduler's signal: every rank checkpoints this step and raises Preempted."""
    name = signal.Signals(signum).name
    log.info("autoshard train: %s received; checkpointing step %d", name, step)
    _check_finite(step, pmodel, checkpointer)
    checkpointer.save(step, pmodel, optim, wait=True)
    path = Path(settings.out) / "checkpoints" / f"step-{step:06d}"
    raise Preempted(
        signum,
        f"autoshard train: stopped by {name} after step {step}; checkpoint {path} (the same command resumes from it)",
    )


def _compile_entry(pmodel: ParallelModule, reported: set[str], step: int) -> dict:
    """`compile_s` for a step that compiled (part of) the program (its time is mostly compiling),
    logged once per phase."""
    compiled = {phase: st for phase, st in pmodel.compile_stats.items() if phase not in reported}
    if not compiled:
        return {}
    reported.update(compiled)
    log.info(
        "autoshard train: compiled %s on step %d (rank 0)",
        ", ".join(
            f"{phase} in {st.seconds:.1f} s ({st.graphs} graph(s), {st.graph_breaks} graph break(s))"
            for phase, st in compiled.items()
        ),
        step,
    )
    return {"compile_s": sum(st.seconds for st in compiled.values())}
