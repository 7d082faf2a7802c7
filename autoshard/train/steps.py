"""The training steps after planning, in one loop that reads top to bottom (`run_steps`): the step
schedule runs the forward and backward of a step's micro-batches, the optimizer steps, and on a
logged step the loss, gradient norm, memory and stop signals are read back from the device in one
gather, a row goes to every logger, and a checkpoint is written when one is due. The steps
between logged ones never wait on the device. A non-finite loss or a scheduler's signal stops it.

The step schedule is the seam a pipeline plugs into: `PlainStep` runs one micro-batch,
`Accumulation` K of them, reducing held gradients on the last (`ParallelModule.no_sync`), and
`train.pipelined.PipelineStep` one step of torch's pipeline schedule over this rank's stages.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

import torch
import torch.distributed as dist

from autoshard import _torch_compat as tc
from autoshard.data import Feed
from autoshard.options import UsageError
from autoshard.runtime.module import ParallelModule
from autoshard.runtime.wire import WireMeter, wire_row
from autoshard.train.checkpoints import Checkpointer
from autoshard.train.loggers import Logger, Throughput
from autoshard.train.metrics import memory_row, memory_tracker, peak_rss_mb
from autoshard.train.optimizer import GradClip, GradNorm, ScheduledOptimizer
from autoshard.train.signals import Preempted, StopSignals

log = logging.getLogger("autoshard")


class StepSchedule(Protocol):
    """How one step's forward and backward run over its micro-batches: returns each micro-batch's
    loss as a detached tensor, never read on the host here; the losses of rank `loss_rank` are
    the ones logged."""

    micro_batches: int
    loss_rank: int

    def run(self, pmodel: ParallelModule, feed: Feed, step: int) -> list[torch.Tensor]: ...


class PlainStep:
    """One forward and backward of the whole batch."""

    micro_batches = 1
    loss_rank = 0

    def run(self, pmodel: ParallelModule, feed: Feed, step: int) -> list[torch.Tensor]:
        loss = pmodel(*feed.inputs(step, 0))
        loss.backward()
        return [loss.detach()]


@dataclass(frozen=True)
class Accumulation:
    """K micro-batches, each loss scaled by 1/K; gradient reductions held (`no_sync`) until the last."""

    micro_batches: int
    loss_rank = 0

    def run(self, pmodel: ParallelModule, feed: Feed, step: int) -> list[torch.Tensor]:
        losses, k = [], self.micro_batches
        for micro in range(k):
            with pmodel.no_sync() if micro < k - 1 else contextlib.nullcontext():
                loss = pmodel(*feed.inputs(step, micro))
                (loss / k).backward()
            losses.append(loss.detach())
        return losses


def step_schedule(micro_batches: int) -> StepSchedule:
    return PlainStep() if micro_batches == 1 else Accumulation(micro_batches)


@dataclass(frozen=True)
class LoopConfig:
    """The settings the loop reads (`train`'s flags of the same names)."""

    steps: int
    log_every: int = 1
    eval_every: int = 0
    checkpoint_every: int = 0
    wire_step: int = 0
    memory_step: int = 0

    @classmethod
    def from_settings(cls, settings: Any) -> LoopConfig:
        names = ("steps", "log_every", "eval_every", "checkpoint_every", "wire_step", "memory_step")
        return cls(**{name: getattr(settings, name) for name in names})

    def logged(self, step: int) -> bool:
        """Whether `step` reads its figures back and writes a row: every `log_every` steps, the
        last, and the steps that evaluate or checkpoint (they read the device anyway)."""
        due = [self.log_every, self.eval_every, self.checkpoint_every]
        return step == self.steps or any(k and step % k == 0 for k in due) or step in (self.wire_step, self.memory_step)


@dataclass
class Steps:
    """Everything the loop uses, built from the plan (`autoshard.train.parts`)."""

    config: LoopConfig
    pmodel: ParallelModule
    feed: Feed
    schedule: StepSchedule
    optimizer: ScheduledOptimizer
    clip: GradClip
    loggers: list[Logger]
    throughput: Throughput
    checkpointer: Checkpointer
    signals: StopSignals
    modeled_step_s: float
    modeled_overlapped_s: float | None  # the program's own overlap priced (None: not modeled apart)
    memory: Any = None  # the dry run, beside the tracked memory of --memory-step
    reported: set[str] = field(default_factory=set)  # program phases whose compile time is logged


def run_steps(s: Steps, start: int) -> list[float]:
    """Steps start + 1 .. config.steps; returns the losses of the logged ones. Stops early on a
    non-finite loss (UsageError) or a scheduler's signal (Preempted)."""
    params = [p for p in s.pmodel.parameters() if p.requires_grad]
    s.pmodel.random.step = start * s.schedule.micro_batches  # random ops draw what an uninterrupted run draws
    logged_losses: list[tuple[int, float]] = []  # (step, loss) of the rows
    spent, since = 0.0, 0  # host time of the steps since the last row, and how many
    for step in range(start + 1, s.config.steps + 1):
        t0 = time.perf_counter()
        logged = s.config.logged(step)
        with _probes(s, step) as probes:
            micro_losses = s.schedule.run(s.pmodel, s.feed, step)
            with tc.no_dispatch_modes():  # the norm's scalar all-reduces are no part of the metered program
                norm = s.clip(params) if logged or s.clip.max_norm is not None else None
            lr = s.optimizer.step()
        spent, since = spent + time.perf_counter() - t0, since + 1
        if not logged:
            continue
        t1 = time.perf_counter()
        loss, grad_norm, peaks, stop = _read_back(micro_losses, norm, s.signals, s.schedule.loss_rank)  # one sync
        spent, elapsed, since = 0.0, (spent + time.perf_counter() - t1) / since, 0
        logged_losses.append((step, loss))
        if not math.isfinite(loss):  # the same loss on every rank: all stop here, nothing saved
            _broken(step, f"the loss is {loss}", s.checkpointer, logged_losses)
        row = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "step_s": elapsed}
        row |= s.throughput.row(elapsed) | {"peak_rss_mb_per_rank": peaks}
        row |= {"modeled_step_s": s.modeled_step_s, "modeled_over_measured": s.modeled_step_s / elapsed}
        if s.modeled_overlapped_s is not None:
            row["modeled_overlapped_step_s"] = s.modeled_overlapped_s
        row |= _probe_rows(s, probes) | _compile_entry(s.pmodel, s.reported, step) | s.feed.evaluate(step)
        if s.config.checkpoint_every and step % s.config.checkpoint_every == 0:
            row["checkpoint_s"] = _checkpoint(s, step, logged_losses)  # what the loop waited (async: the staging)
        s.checkpointer.poll()
        for logger in s.loggers:
            logger.log(row)
        if stop:
            _stop(step, stop, s, logged_losses)
    return [loss for _, loss in logged_losses]


def _read_back(losses: list[torch.Tensor], norm: GradNorm | None, signals: StopSignals, loss_rank: int) -> tuple:
    """(loss, grad norm, peak RSS per rank, the strongest stop signal of any rank) in one gather
    and one device-to-host copy; the loss is the mean of `loss_rank`'s micro-batches' as float64
    sums them, the norm rank 0's or the root of every rank's share summed."""
    device = losses[0].device
    mine = torch.stack([x.double() for x in losses])
    value = norm.value if norm is not None else torch.tensor(math.nan, device=device)
    host = torch.tensor([peak_rss_mb(), float(signals.received)], dtype=torch.float64)
    mine = torch.cat([mine, value.detach().double().reshape(1).to(device), host.to(device)])
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    table = torch.stack(gathered).tolist()
    loss = 0.0
    for x in table[loss_rank][: len(losses)]:
        loss += x / len(losses)
    grad_norm = table[0][len(losses)]
    if norm is not None and norm.shared:
        grad_norm = math.sqrt(sum(row[len(losses)] for row in table))
    return loss, grad_norm, [round(r[-2], 1) for r in table], int(max(r[-1] for r in table))


@contextlib.contextmanager
def _probes(s: Steps, step: int):
    """The wire meter and the memory tracker around the step they measure (--wire-step, --memory-step)."""
    meter = WireMeter() if step == s.config.wire_step else None
    tracker = memory_tracker(s.pmodel, s.optimizer.optim) if step == s.config.memory_step else None
    with contextlib.ExitStack() as metering:
        for m in (meter, tracker):
            if m is not None:
                metering.enter_context(m)
        yield meter, tracker


def _probe_rows(s: Steps, probes: tuple) -> dict:
    meter, tracker = probes
    row = wire_row(meter.stats) if meter is not None else {}  # every rank takes part
    return row | (memory_row(tracker, s.memory) if tracker is not None else {})


def _checkpoint(s: Steps, step: int, logged: list[tuple[int, float]]) -> float:
    _check_finite(step, s.pmodel, s.checkpointer, logged)  # a checkpoint never holds a broken state
    t = time.perf_counter()
    s.checkpointer.save(step, s.pmodel, s.optimizer.optim, data=s.feed.state_dict())
    return time.perf_counter() - t


def _broken(step: int, what: str, checkpointer: Checkpointer, logged: list[tuple[int, float]]) -> NoReturn:
    """Stop the run (every rank alike) naming the newest good checkpoint: one whose weights gave a
    finite loss that had not diverged (`Checkpointer.newest_good`), to resume from with a lower lr."""
    checkpointer.finish()
    good = checkpointer.newest_good(logged)
    if good is not None:
        named = f"{good.path} (resume from it: remove the checkpoints after it, or copy it to a new --out)"
        if good == checkpointer.newest:
            named = str(good.path)
    else:
        named = "none (no checkpoint written)"
        if checkpointer.newest is not None:
            named = "none (the loss after every checkpoint diverged: start over)"
    raise UsageError(f"step {step}: {what}; the newest good checkpoint is {named}")


def _check_finite(
    step: int, pmodel: ParallelModule, checkpointer: Checkpointer, logged: list[tuple[int, float]]
) -> None:
    """Every rank: stop (naming the newest good checkpoint) unless every parameter shard is finite."""
    shards = [p.to_local() for p in pmodel.parameters()]
    flag = torch.stack([torch.isfinite(t).all() for t in shards]).all().to(torch.int32).reshape(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if not flag.item():
        _broken(step, "the parameters hold non-finite values", checkpointer, logged)


def _stop(step: int, signum: int, s: Steps, logged: list[tuple[int, float]]) -> None:
    """A rank got a scheduler's signal: every rank checkpoints this step and raises Preempted."""
    name = signal.Signals(signum).name
    log.info("autoshard train: %s received; checkpointing step %d", name, step)
    _check_finite(step, s.pmodel, s.checkpointer, logged)
    path = s.checkpointer.save(step, s.pmodel, s.optimizer.optim, data=s.feed.state_dict(), wait=True)
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
