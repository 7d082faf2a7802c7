"""What a training run measures: one metrics.jsonl row per step, live memory on a chosen step
(torch's MemTracker), and the modeled step time beside the measured one."""

from __future__ import annotations

import json
import logging
import resource
import statistics
from pathlib import Path

import torch.distributed as dist

from autoshard import _torch_compat as tc
from autoshard.fileio import write_atomic
from autoshard.options import UsageError
from autoshard.report.files import METRICS_NAME
from autoshard.report.text import human_bytes
from autoshard.runtime.dryrun import DryRunResult

log = logging.getLogger("autoshard")

WARMUP_STEPS = 2  # left out of the measured step time: the first steps allocate and warm caches


def metrics_rows(path: Path, warn: bool = True) -> list[tuple[str, dict]]:
    """The rows of a run's metrics.jsonl (line, row); a torn last line is cut (with a warning), a
    bad line before it is a UsageError naming the file and line (checked before planning on resume)."""
    numbered = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    rows = []
    for n, line in numbered:
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("no step number")
        except ValueError as err:
            if n == numbered[-1][0]:  # the row being written when the run was stopped
                if warn:
                    log.warning("autoshard train: %s:%d is a torn row (%s); cut", path, n, err)
                break
            raise UsageError(f"{path}:{n}: not a metrics row ({err}); repair or remove that line to resume") from None
        rows.append((line, row))
    return rows


class MetricsFile:
    """RUN/metrics.jsonl, written by rank 0: a resumed run keeps the rows up to the step it resumes
    from, so every step has one row. A run killed while writing a row leaves it torn: that last
    line is cut with a warning; a bad line before it is an error naming the file and line."""

    def __init__(self, out: Path, keep_until: int | None):
        self.path = out / METRICS_NAME
        self._note: dict = {}  # fields for the next row (`note_next`)
        rows = (
            metrics_rows(self.path) if keep_until is not None and self.path.exists() else []
        )  # every rank: fail alike
        if dist.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            kept = [line for line, row in rows if row["step"] <= keep_until]
            write_atomic(self.path, "".join(line + "\n" for line in kept))  # a kill here loses no row

    def note_next(self, fields: dict) -> None:
        """Add `fields` to the next row written (what a resume changed)."""
        self._note |= fields

    def append(self, row: dict) -> None:
        row, self._note = {**row, **self._note}, {}
        if dist.get_rank() == 0:
            try:
                with self.path.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            except OSError as err:  # a full or read-only disk: the user's to fix (checkpoints say what is kept)
                raise UsageError(
                    f"cannot write {self.path}: {err.strerror or err}; the newest complete checkpoint is in "
                    f"{self.path.parent / 'checkpoints'} (the same command resumes from it)"
                ) from None


def memory_tracker(pmodel, optim):
    """torch's MemTracker over one step, told about the tensors that exist before it."""
    tracker = tc.mem_tracker()
    tracker.track_external(pmodel, optim)
    return tracker


def memory_row(tracker, memory: DryRunResult | None) -> dict:
    """Every rank calls this: the tracked peak of each rank, and rank 0's dry-run estimate."""
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, int(tc.tracker_total(tracker.get_tracker_snapshot("peak"))))
    row = {"tracked_peak_bytes_per_rank": peaks}
    if memory is not None:
        row["dry_run_peak_bytes"] = memory.peak_bytes
        log.info(
            "memory: tracked peak %s per rank, dry run estimate %s (ratio %.3f)",
            [human_bytes(p) for p in peaks],
            human_bytes(memory.peak_bytes),
            memory.peak_bytes / max(max(peaks), 1),
        )
    return row


def step_time_line(modeled_s: float, rows: list[dict]) -> str:
    """Modeled vs measured step time: the median of the steps after warm-up (all steps when
    there are no more), and their ratio."""
    timed = [r for r in rows if r["step"] > WARMUP_STEPS] or rows
    measured = statistics.median(r["step_s"] for r in timed)
    steps = f"step {timed[0]['step']}" if len(timed) == 1 else f"steps {timed[0]['step']}-{timed[-1]['step']}"
    return (
        f"step time: modeled {modeled_s * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms (median of {steps}); "
        f"modeled / measured {modeled_s / measured:.2f}"
    )


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
