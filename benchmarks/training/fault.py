"""Runs that survive lost ranks: SIGKILL a random worker at random steps under torchrun's restarts
and compare the losses with an uninterrupted run; and the step stall of checkpointing, sync vs async.

    python -m benchmarks.training.fault                # llama3-tiny 2x2, 200 steps, checkpoints every 10,
                                                       # 3 kills under --max-restarts 3; then the stall figures
    python -m benchmarks.training.fault --steps 30 --kills 2 --checkpoint-every 5   # the suite's smaller case
    python -m benchmarks.training.fault --stall-only   # llama3-debug 2x2: checkpoint steps with and without async

The killer watches metrics.jsonl (rank 0 writes a row per step): once the run reaches the next
kill step it sends SIGKILL to one of torchrun's workers, chosen at random; torchrun restarts them
all and `train` resumes from the newest complete checkpoint by itself. The check: every step
1..N has exactly one row, and its loss equals the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.launch import ROOT


@dataclass
class FaultRun:
    """One torchrun: its exit code, the losses of metrics.jsonl by step, the steps it killed at and
    its wall time."""

    returncode: int
    losses: dict[int, float]
    killed_at: list[int]
    wall_s: float
    stderr: str


def train_args(model: str, steps: int, checkpoint_every: int, seq: int = 64, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        "-m",
        "autoshard",
        "train",
        "--model",
        model,
        "--mesh",
        "2x2",
        "--batch",
        "8",
        "--seq",
        str(seq),
        "--steps",
        str(steps),
        "--checkpoint-every",
        str(checkpoint_every),
        *extra,
    ]


def _rows(out: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError):  # not written yet, or a line half-written
        return []


def _workers(parent: int) -> list[int]:
    """The processes whose parent is `parent` (torchrun's workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(entry.name))
    return found


def torchrun(
    args: list[str],
    out: Path,
    *,
    kill_steps: list[int] = (),
    max_restarts: int = 0,
    seed: int = 0,
    timeout: float = 900,
) -> FaultRun:
    """torchrun 4 workers of `python <args> --out OUT`; SIGKILL a random worker once the run
    reaches each of `kill_steps` (ascending)."""
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))  # a caller's path kept
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=4",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.2",
        *args,
        "--out",
        str(out),
    ]
    pick = random.Random(seed)
    start = time.time()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, text=True)
        killed: list[int] = []
        try:
            while proc.poll() is None:
                if time.time() - start > timeout:
                    proc.kill()
                    raise TimeoutError(f"torchrun ran past {timeout:.0f} s")
                rows = _rows(out)
                due = len(killed) < len(kill_steps) and rows and rows[-1]["step"] >= kill_steps[len(killed)]
                workers = _workers(proc.pid) if due else []
                if len(workers) == 4:
                    victim = pick.choice(workers)
                    os.kill(victim, signal.SIGKILL)
                    killed.append(rows[-1]["step"])
                    while victim in _workers(proc.pid):  # until torchrun has noticed
                        time.sleep(0.05)
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                proc.kill()
        err.seek(0)
        stderr = err.read()
    losses: dict[int, float] = {}
    for row in _rows(out):
        if row["step"] in losses:
            raise AssertionError(f"step {row['step']} has two rows in {out / 'metrics.jsonl'}")
        losses[row["step"]] = row["loss"]
    return FaultRun(proc.returncode, losses, killed, time.time() - start, stderr)


def survive(
    steps: int = 200,
    checkpoint_every: int = 10,
    kills: int = 3,
    model: str = "llama3-tiny",
    seed: int = 0,
    work: Path | None = None,
    extra: tuple[str, ...] = (),
) -> dict:
    """An uninterrupted run and one with `kills` SIGKILLs at random steps under --max-restarts
    `kills` (`extra`: more train flags for both): their losses, step by step."""
    rng = random.Random(seed)
    kill_steps = sorted(rng.sample(range(checkpoint_every + 1, steps - 1), kills))
    work = Path(work or tempfile.mkdtemp(prefix="autoshard-fault-"))
    args = train_args(model, steps, checkpoint_every, extra=extra)
    clean = torchrun(args, work / "clean")
    hit = torchrun(args, work / "killed", kill_steps=kill_steps, max_restarts=kills, seed=seed)
    differing = [s for s in range(1, steps + 1) if clean.losses.get(s) != hit.losses.get(s)]
    return {
        "model": model,
        "steps": steps,
        "checkpoint_every": checkpoint_every,
        "kill_steps": kill_steps,
        "killed_at": hit.killed_at,
        "returncode": hit.returncode,
        "clean_returncode": clean.returncode,
        "rows": len(hit.losses),
        "differing_steps": differing,
        "clean_wall_s": clean.wall_s,
        "killed_wall_s": hit.wall_s,
        "stderr_tail": hit.stderr[-3000:] if hit.returncode else "",
    }


def stall(
    model: str = "llama3-debug",
    steps: int = 30,
    checkpoint_every: int = 5,
    seq: int = 256,
    work: Path | None = None,
    rounds: int = 3,
) -> dict:
    """What checkpointing costs the step loop, `--checkpoint-writes sync` vs `async`,
    interleaved `rounds` times: the time a checkpoint step waits for the save (`checkpoint_s`), and
    how much slower the step after it runs (async writing competes with it) than the others."""
    work = Path(work or tempfile.mkdtemp(prefix="autoshard-stall-"))
    times: dict[str, dict[str, list[float]]] = {}
    for r in range(rounds):
        for mode in ("sync", "async"):
            extra = ("--checkpoint-writes", mode)
            out = work / f"{mode}-{r}"
            run = torchrun(train_args(model, steps, checkpoint_every, seq, extra), out)
            if run.returncode:
                raise RuntimeError(f"{mode} run failed:\n{run.stderr[-3000:]}")
            rows = {row["step"]: row for row in _rows(out)}
            entry = times.setdefault(mode, {"wait": [], "next_step": [], "other_step": []})
            for s, row in rows.items():
                if "checkpoint_s" in row:
                    entry["wait"].append(row["checkpoint_s"])
                elif s > 2:  # warm-up steps left out
                    after = (s - 1) % checkpoint_every == 0 and s > 1
                    entry["next_step" if after else "other_step"].append(row["step_s"])
    out: dict = {"model": model, "seq": seq, "steps": steps, "checkpoint_every": checkpoint_every, "rounds": rounds}
    for mode, entry in times.items():
        ms = {k: statistics.median(v) * 1e3 for k, v in entry.items()}
        out[mode] = ms | {"stall_ms": ms["wait"] + ms["next_step"] - ms["other_step"]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stall-only", action="store_true")
    p.add_argument("--no-stall", action="store_true")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    figures: dict = {}
    if not a.stall_only:
        figures["survive"] = s = survive(a.steps, a.checkpoint_every, a.kills, seed=a.seed)
        print(
            f"killed a random rank at steps {s['killed_at']} (aimed at {s['kill_steps']}); exit code "
            f"{s['returncode']}; {s['rows']} of {s['steps']} steps in metrics.jsonl; steps whose loss differs "
            f"from the uninterrupted run: {s['differing_steps'] or 'none'}; wall {s['killed_wall_s']:.0f} s "
            f"vs {s['clean_wall_s']:.0f} s uninterrupted"
        )
    if not a.no_stall:
        figures["stall"] = st = stall()
        for mode in ("sync", "async"):
            f = st[mode]
            print(
                f"{mode:>5} checkpoints: the loop waits {f['wait']:.1f} ms per checkpoint, the next step takes "
                f"{f['next_step']:.1f} ms vs {f['other_step']:.1f} ms: stall {f['stall_ms']:.1f} ms per checkpoint "
                f"(medians over {st['rounds']} runs)"
            )
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1) + "\n")
    ok = "survive" not in figures or (
        figures["survive"]["returncode"] == 0
        and not figures["survive"]["differing_steps"]
        and len(figures["survive"]["killed_at"]) == a.kills
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
