"""Where a step's row goes: metrics.jsonl, the console line, TensorBoard and W&B, each behind one
interface (`log(row)` after every step, `close()` at the end) so the step loop neither knows nor
cares which are on. Every rank calls them; the file and the services write on rank 0 only (the
row is the same on every rank), the console line shows on rank 0 (the others log warnings only).

A row holds the step's loss, `lr`, `grad_norm`, timings and throughput: `tokens_per_s`,
`tokens_per_s_per_device`, and `mfu`, the model flops of the step (the traced forward + backward
on global shapes, by torch's flop counter formulas: matmuls and attention, no recomputation) over
the step time and the world's peak flop/s in the compute dtype (the device profile's rate).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from autoshard.options import UsageError
from autoshard.pricing.compute import graph_work
from autoshard.problem.plan import Plan
from autoshard.profiles.device import DeviceProfile
from autoshard.train.metrics import WARMUP_STEPS, MetricsFile

log = logging.getLogger("autoshard")

TENSORBOARD_DIR = "tensorboard"  # under --out
WANDB_DIR = "wandb"  # under --out: wandb's own folder name


class Logger(Protocol):
    def log(self, row: dict) -> None: ...

    def close(self) -> None: ...


def scalars(row: dict) -> dict[str, float]:
    """The row's numbers a chart can plot (lists, strings and the step itself left out)."""
    return {
        k: float(v)
        for k, v in row.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


class MetricsLog:
    """metrics.jsonl (`MetricsFile`: rank 0 writes, a resumed run keeps the earlier rows)."""

    def __init__(self, metrics: MetricsFile):
        self.metrics = metrics

    def log(self, row: dict) -> None:
        self.metrics.append(row)

    def close(self) -> None:
        pass


class ConsoleLog:
    """One line per step: step/total, loss, lr, gradient norm, throughput, MFU, memory, the step
    time beside the modeled one, and the time left (the mean of this run's steps after its first,
    which warms up, times the steps left). The first step after warm-up whose modeled time is off
    by more than `OFF` either way adds a note, once: the profiles the model used (`profiles`) and
    the command that measures this machine (`calibrate`)."""

    OFF = 1.5

    def __init__(self, total: int, profiles: str = "", calibrate: str = ""):
        self.total = total
        self.last: float | None = None  # when the previous row came
        self.spent, self.timed = 0.0, 0  # wall time between rows, and how many
        self.profiles, self.calibrate, self.noted = profiles, calibrate, False

    def log(self, row: dict) -> None:
        now = time.perf_counter()
        if self.last is not None:
            self.spent, self.timed = self.spent + now - self.last, self.timed + 1
        self.last = now
        per_step = self.spent / self.timed if self.timed else row["step_s"]
        mfu = f"  mfu {100 * row['mfu']:.1f}%" if "mfu" in row else ""
        log.info(
            "step %4d/%d  loss %.4f  lr %.3g  grad norm %.3g  %8.0f tok/s (%.0f/device)%s  peak rss %.0f MiB  "
            "step %.1f ms (modeled %.1f, x%.2f)  eta %s",
            row["step"],
            self.total,
            row["loss"],
            row["lr"],
            row["grad_norm"],
            row["tokens_per_s"],
            row["tokens_per_s_per_device"],
            mfu,
            max(row["peak_rss_mb_per_rank"]),
            row["step_s"] * 1e3,
            row["modeled_step_s"] * 1e3,
            row["modeled_over_measured"],
            duration(per_step * (self.total - row["step"])),
        )
        ratio = row["modeled_over_measured"]
        if not self.noted and row["step"] > WARMUP_STEPS and not 1 / self.OFF <= ratio <= self.OFF:
            self.noted = True
            off = max(ratio, 1 / ratio)
            log.info(
                "note: the modeled step is %.1fx %s than the measured one on this machine (profiles %s): "
                "plans are chosen by the model; measure this machine with `%s` and plan with the file it "
                "writes (--network FILE --device FILE); see docs/calibration.md",
                off,
                "shorter" if ratio < 1 else "longer",
                self.profiles or "the presets",
                self.calibrate or "python -m autoshard calibrate",
            )

    def close(self) -> None:
        pass


def duration(seconds: float) -> str:
    """'42s', '3m05s', '2h07m'."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class TensorBoardLog:
    """Event files under --out/tensorboard (torch's SummaryWriter): every number of the row, by its
    metrics.jsonl name, at its step. Each run purges the events an earlier one wrote past the step it
    starts from (TensorBoard drops them on reading), so a resumed run's charts show one run."""

    def __init__(self, out: Path, resumed_at: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self.out = out
        self.writer = SummaryWriter(log_dir=str(out / TENSORBOARD_DIR), purge_step=(resumed_at or 0) + 1)

    def log(self, row: dict) -> None:
        try:  # the writer's thread hands a failed write (a full disk) back on a later call
            for name, value in scalars(row).items():
                self.writer.add_scalar(name, value, row["step"])
        except OSError as err:
            raise UsageError(
                f"cannot write TensorBoard events in {self.out / TENSORBOARD_DIR}: {err.strerror or err}; the newest "
                f"complete checkpoint is in {self.out / 'checkpoints'} (the same command resumes from it)"
            ) from None

    def close(self) -> None:
        try:
            self.writer.close()
        except OSError as err:  # the run is done: its last events are what is lost
            log.warning("autoshard train: warning: the last TensorBoard events were not written (%s)", err)


class WandbLog:
    """A W&B run in `project` (its files under --out/wandb; WANDB_MODE=offline keeps them there
    for `wandb sync`), with the settings as its config; each launch is a run of its own."""

    def __init__(self, project: str, out: Path, settings: Any):
        import wandb

        config = json.loads(json.dumps(asdict(settings), default=str))
        self.run = wandb.init(project=project, dir=str(out), name=out.name, config=config)

    def log(self, row: dict) -> None:
        self.run.log(scalars(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()


def make_loggers(
    settings: Any, out: Path, metrics: MetricsFile, resumed_at: int | None, profiles: str = ""
) -> list[Logger]:
    """metrics.jsonl and the console line always (`profiles`: the network and device profiles the
    plan was priced with); TensorBoard when it is installed and W&B when asked for (`--wandb`), on
    rank 0."""
    world = math.prod(settings.mesh)
    mesh = "x".join(map(str, settings.mesh))
    command = (
        f"torchrun --nproc_per_node={world} -m autoshard calibrate --mesh {mesh} --out calibrated-{mesh}.json"
        if world > 1
        else f"python -m autoshard calibrate --out calibrated-{mesh}.json"
    )
    loggers: list[Logger] = [MetricsLog(metrics), ConsoleLog(settings.steps, profiles, command)]
    if dist.get_rank() == 0:
        if importlib.util.find_spec("tensorboard") is not None:
            loggers.append(TensorBoardLog(out, resumed_at))
        if settings.wandb is not None:
            loggers.append(WandbLog(settings.wandb, out, settings))
    return loggers


def close_all(loggers: list[Logger]) -> None:
    for logger in loggers:
        logger.close()


# ---------------------------------------------------------------------------------- throughput
class Throughput:
    """A row's tokens/s (all ranks, and per device) and MFU: the step's model flops (the traced
    forward + backward on global shapes, by torch's flop counter formulas: matmuls, attention; a
    recomputed forward not counted, as MFU does not) over the step time and the world's peak
    flop/s in the dtype the matmuls run in (the device profile's rate). No MFU without flops."""

    def __init__(self, tokens: int, flops: float, world: int, peak: float):
        self.tokens, self.flops, self.world, self.peak = tokens, flops, world, peak

    @classmethod
    def of_plan(cls, tokens: int, plan: Plan, device: DeviceProfile, compute_dtype: torch.dtype | None) -> Throughput:
        world = math.prod(plan.mesh_shape)
        flops = graph_work(plan.graph.gm.graph).flops * plan.micro_batches  # the graph is one micro-batch
        return cls(tokens, flops, world, device.peak_for(compute_dtype) * world)

    def row(self, step_s: float) -> dict[str, float]:
        row = {"tokens_per_s": self.tokens / step_s, "tokens_per_s_per_device": self.tokens / step_s / self.world}
        if self.flops > 0:
            row["mfu"] = self.flops / step_s / self.peak
        return row
