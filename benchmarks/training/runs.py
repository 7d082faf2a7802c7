"""One parallel training run under torchrun: its workload (the flags every trainer shares), its
launch, and its figures read back from its metrics.jsonl (`benchmarks.training.throughput` and
`benchmarks.training.lora` compare such runs)."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.launch import ROOT, rank_env, torchrun

LOSS_RTOL = 1e-4  # |loss - reference| / |reference|, every step; fp32 runs land near 1e-6


@dataclass(frozen=True)
class Workload:
    model: str
    batch: int  # global
    seq: int
    steps: int
    mesh: str = "2x2"
    lr: float = 3e-3
    seed: int = 0
    data_seed: int = 0
    warmup: int = 2  # steps left out of the throughput mean
    wire_step: int = 2  # the metered step: a warm-up step, since metering slows it
    param_dtype: str | None = None  # mixed precision (both trainers: MixedPrecisionPolicy's meaning)
    reduce_dtype: str | None = None

    def args(self) -> list[str]:
        """Command-line flags both trainers share."""
        return [
            "--model",
            self.model,
            "--mesh",
            self.mesh,
            "--batch",
            str(self.batch),
            "--seq",
            str(self.seq),
            "--steps",
            str(self.steps),
            "--lr",
            str(self.lr),
            "--seed",
            str(self.seed),
            "--data-seed",
            str(self.data_seed),
            "--wire-step",
            str(self.wire_step),
            *(["--param-dtype", self.param_dtype] if self.param_dtype else []),
            *(["--reduce-dtype", self.reduce_dtype] if self.reduce_dtype else []),
        ]

    routed: bool = False  # a mixture of experts: see loss_rtol

    @property
    def loss_rtol(self) -> float:
        """fp32 runs match the single-device run to ~1e-6; bf16 ones round differently per shard. A
        mixture of experts' curves part too: the ulps of a batch split move a token's router
        scores, now and then across a top-k tie, and that token then trains other experts."""
        return 1e-2 if self.param_dtype or self.routed else LOSS_RTOL


@dataclass
class RunFigures:
    """One parallel run, read back from its metrics.jsonl."""

    name: str
    tokens_per_s: float  # mean over the steps after warm-up
    median_tokens_per_s: float  # same steps; less sensitive to a busy machine
    step_s: float  # mean, same steps
    peak_rss_mb_per_rank: list[float]  # at the end of the run
    wire_bytes_per_rank: list[int]  # during the metered step
    wire_bytes_by_kind: dict[str, int]  # rank 0, metered step
    wire_count_by_kind: dict[str, int]
    losses: list[float]
    max_abs_loss_dev: float = 0.0  # vs the single-device reference, over all steps
    max_rel_loss_dev: float = 0.0
    wall_s: float = 0.0  # the whole torchrun, start-up and planning included
    run_dir: str = ""
    runs_tokens_per_s: list[float] = field(default_factory=list)  # each repeat's tokens/s (this is the median run)
    layouts: dict[str, str] = field(default_factory=dict)  # the parameters a comparison shows

    @property
    def peak_rss_mb(self) -> float:
        return max(self.peak_rss_mb_per_rank)

    @property
    def wire_bytes(self) -> int:
        return max(self.wire_bytes_per_rank)


class LossMismatch(RuntimeError):
    """A parallel run's losses left the single-device curve; carries the figures."""

    def __init__(self, message: str, figures: dict):
        super().__init__(message)
        self.figures = figures


# ---------------------------------------------------------------------------------- running
def launch(name: str, target: list[str], work: Workload, out: Path) -> float:
    """Run one 4-process training job; its console output goes to `out/console.txt`. Returns wall s."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    world = 1
    for size in work.mesh.split("x"):
        world *= int(size)
    cmd = [*torchrun(), "--standalone", f"--nproc_per_node={world}", *target, *work.args(), "--out", str(out)]
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    with (out / "console.txt").open("w") as console:
        done = subprocess.run(cmd, env=rank_env(), cwd=ROOT, stdout=console, stderr=subprocess.STDOUT, timeout=1800)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        tail = (out / "console.txt").read_text()[-4000:]
        raise RuntimeError(f"{name} training failed (exit {done.returncode}):\n{tail}")
    return wall


def read_figures(name: str, out: Path, work: Workload, wall: float) -> RunFigures:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if [r["step"] for r in rows] != list(range(1, work.steps + 1)):
        raise RuntimeError(f"{name}: {out / 'metrics.jsonl'} has steps {[r['step'] for r in rows]}")
    timed = rows[work.warmup :]
    metered = next(r for r in rows if r["step"] == work.wire_step)
    return RunFigures(
        name=name,
        tokens_per_s=statistics.mean(r["tokens_per_s"] for r in timed),
        median_tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed),
        step_s=statistics.mean(r["step_s"] for r in timed),
        peak_rss_mb_per_rank=rows[-1]["peak_rss_mb_per_rank"],
        wire_bytes_per_rank=metered["wire_bytes_per_rank"],
        wire_bytes_by_kind=metered["wire_bytes_by_kind"],
        wire_count_by_kind=metered["wire_count_by_kind"],
        losses=[r["loss"] for r in rows],
        wall_s=wall,
        run_dir=str(out),
    )


def compare_losses(run: RunFigures, reference: list[float]) -> None:
    devs = [abs(a - b) for a, b in zip(run.losses, reference)]
    run.max_abs_loss_dev = max(devs)
    run.max_rel_loss_dev = max(d / abs(b) for d, b in zip(devs, reference))


def median_run(runs: list[RunFigures]) -> RunFigures:
    """The run with the median tokens/s (the lower middle of an even count), knowing all of them."""
    ranked = sorted(runs, key=lambda r: r.tokens_per_s)
    median = ranked[(len(ranked) - 1) // 2]
    median.runs_tokens_per_s = [r.tokens_per_s for r in runs]
    return median
