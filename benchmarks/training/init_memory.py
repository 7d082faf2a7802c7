"""Host memory of a training run's start, per rank: an HF Llama of 181M parameters (725 MB of
fp32 safetensors) trained 3 steps (`--steps`) under torchrun on gloo, its parameters forced fully
sharded (`--memory-budget` = parameter bytes / world, so a rank's parameters, gradients and AdamW
states are 0.5x the checkpoint on 8 ranks), from a random init and from `--init-from` its
safetensors (one file; four files with `model.safetensors.index.json`).

Each rank records its RSS once everything is imported (the baseline) and the peak RSS (`VmHWM`,
reset through `/proc/self/clear_refs` between phases) of four phases: up to the weights' loading
(planning), the loading, the first step, and the later steps (which also hold the AdamW states
the first step made). Printed per case: the largest rank's figures
over its baseline, as a fraction of the checkpoint's bytes (docs/models.md has the table).

    python -m benchmarks.training.init_memory                      # 8 ranks on 4x2, batch 8, seq 16
    python -m benchmarks.training.init_memory --mesh 2x2           # 4 ranks
    python -m benchmarks.training.init_memory --batch 16 --seq 64  # a step with more working memory
    python -m benchmarks.training.init_memory --code /tmp/old      # another checkout (`git worktree add /tmp/old REV`)
    python -m benchmarks.training.init_memory --json out.json

Linux only (/proc). 8 ranks on 2 CPU cores: ~1.5 min a case.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.launch import ROOT, torchrun

# the model: 9 layers of 1024 wide, vocabulary 32000, untied output: 181.16M parameters
CONFIG = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=9,
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)

# runs inside each torchrun rank: measure, then train
RANK_SCRIPT = r"""
import json, os, sys
def _status(key):
    with open("/proc/self/status") as f:
        return int(f.read().split(key + ":")[1].split()[0]) * 1024
def _reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
import torch, transformers, safetensors  # noqa: F401  (the baseline has the libraries in it)
from autoshard.cli import train as cli_train
from autoshard.runtime.module import ParallelModule
out = {"base": _status("VmRSS")}
_reset_peak()
def _after_load(fn):
    def wrapped(*args, **kwargs):
        first = "load_peak" not in out
        if first:
            out["plan_peak"], out["planned_rss"] = _status("VmHWM"), _status("VmRSS")
            _reset_peak()
        result = fn(*args, **kwargs)
        if first:
            out["load_peak"], out["loaded_rss"] = _status("VmHWM"), _status("VmRSS")
            _reset_peak()
        return result
    return wrapped
ParallelModule.load_full = _after_load(ParallelModule.load_full)  # the code before per-shard loading
try:
    from autoshard.workloads.checkpoints import Start
    Start.load_into = _after_load(Start.load_into)
except ImportError:
    pass
def _after_first_step(fn):
    def wrapped(*args, **kwargs):
        result = fn(*args, **kwargs)
        if "first_step_peak" not in out:
            out["first_step_peak"] = _status("VmHWM")
            _reset_peak()
        return result
    return wrapped
try:
    from autoshard.train.optimizer import ScheduledOptimizer
    ScheduledOptimizer.step = _after_first_step(ScheduledOptimizer.step)
except ImportError:
    pass
code = cli_train.main(sys.argv[1:])
out["step_peak"] = _status("VmHWM")  # after the first step's: the later steps' (and the run's end)
with open(os.path.join(os.environ["MEASURE_DIR"], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(out, f)
sys.exit(code)
"""


def save_model(directory: Path) -> tuple[int, int]:
    """The model saved with save_pretrained, once as one file (directory/one) and once in files
    of at most 200 MB with an index (directory/sharded); returns (parameters, checkpoint bytes)."""
    import transformers

    from autoshard.workloads import hf

    config = transformers.LlamaConfig(**CONFIG)
    model = hf.build(hf.training_config(config), "cpu", seed=0)
    n = sum(p.numel() for p in model.parameters())
    model.config.use_cache = True  # what a downloaded config says; the workload turns it off
    model.save_pretrained(directory / "one", max_shard_size="10GB")
    model.save_pretrained(directory / "sharded", max_shard_size="200MB")
    del model
    size = sum(f.stat().st_size for f in (directory / "one").glob("*.safetensors"))
    return n, size


def run_case(
    model_dir: Path,
    init_from: Path | None,
    mesh: str,
    budget: float,
    code: Path,
    work: Path,
    batch: int,
    seq: int,
    steps: int = 1,
) -> dict:
    """One training run of `steps` steps; per-rank measurements."""
    world = math.prod(int(s) for s in mesh.split("x"))
    measure = Path(tempfile.mkdtemp(dir=work))
    out = Path(tempfile.mkdtemp(dir=work))
    script = work / "rank.py"
    script.write_text(RANK_SCRIPT)
    args = ["--model", f"hf:{model_dir}", "--mesh", mesh, "--steps", str(steps), "--batch", str(batch)]
    args += ["--seq", str(seq)]
    args += ["--memory-budget", str(int(budget)), "--checkpoint-every", "0", "--out", str(out), "--overwrite"]
    if init_from is not None:
        args += ["--init-from", str(init_from)]
    paths = [str(code)]
    if code != ROOT:  # the other checkout's models/ under its import name
        alias = work / "models-alias"
        alias.mkdir(exist_ok=True)
        link = alias / "autoshard_models"
        if not link.exists():
            link.symlink_to(code / "models")
        paths.append(str(alias))
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MEASURE_DIR=str(measure),
        PYTHONPATH=os.pathsep.join(filter(None, [*paths, os.environ.get("PYTHONPATH")])),
    )
    cmd = [*torchrun(), "--standalone", f"--nproc_per_node={world}", str(script), *args]
    done = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"training failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    ranks = [json.loads(f.read_text()) for f in sorted(measure.glob("rank*.json"))]
    shutil.rmtree(out, ignore_errors=True)
    return {"ranks": ranks, "steps": steps}


def summarize(case: dict, size: int) -> dict:
    """The largest rank's figures, x the checkpoint's bytes: peak RSS over the baseline (whole
    run; and in each phase: to the end of planning, loading, the step), RSS over the baseline
    after planning and after loading, and the loading's peak over the RSS it started from. With
    more than one step, the first step's peak and the later steps' apart: the later ones also hold
    the AdamW states the first step made."""
    ranks = case["ranks"]

    def worst(f):
        return max(f(r) for r in ranks) / size

    def first(r):  # a code from before the hook's time records no first step apart
        return r.get("first_step_peak", r["step_peak"])

    later = all("first_step_peak" in r for r in ranks) and case.get("steps", 1) > 1
    return {
        "peak_x": worst(lambda r: max(r["plan_peak"], r["load_peak"], first(r), r["step_peak"]) - r["base"]),
        "plan_peak_x": worst(lambda r: r["plan_peak"] - r["base"]),
        "planned_x": worst(lambda r: r["planned_rss"] - r["base"]),
        "load_peak_x": worst(lambda r: r["load_peak"] - r["base"]),
        "load_growth_x": worst(lambda r: r["load_peak"] - r["planned_rss"]),
        "loaded_x": worst(lambda r: r["loaded_rss"] - r["base"]),
        "step_peak_x": worst(lambda r: first(r) - r["base"]),
        "later_steps_peak_x": worst(lambda r: r["step_peak"] - r["base"]) if later else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mesh", default="4x2")
    parser.add_argument("--code", type=Path, default=ROOT, help="the checkout to measure (default: this one)")
    parser.add_argument("--cases", default="random,one,sharded", help="random, one (file), sharded (with index)")
    parser.add_argument("--batch", type=int, default=8, help="global batch (default 8)")
    parser.add_argument("--seq", type=int, default=16, help="sequence length (default 16)")
    parser.add_argument(
        "--steps", type=int, default=3, help="steps to train (default 3: the first, then the later ones apart)"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="init_memory_"))
    try:
        n, size = save_model(work)
        world = math.prod(int(s) for s in args.mesh.split("x"))
        budget = 4 * n / world  # fp32 parameter bytes / world: every parameter split over every rank
        print(
            f"HF Llama {n / 1e6:.2f}M parameters, checkpoint {size / 1e6:.0f} MB, mesh {args.mesh}, "
            f"batch {args.batch}, seq {args.seq}, code {args.code}"
        )
        results = {}
        for name in args.cases.split(","):
            init_from = {"random": None, "one": work / "one", "sharded": work / "sharded"}[name]
            case = run_case(
                work / "one", init_from, args.mesh, budget, args.code.resolve(), work, args.batch, args.seq, args.steps
            )
            results[name] = summarize(case, size) | {"raw": case["ranks"]}
            s = results[name]
            print(
                f"  {name:8s} peak {s['peak_x']:.2f}x: planning {s['plan_peak_x']:.2f}x (then {s['planned_x']:.2f}x), "
                f"loading {s['load_peak_x']:.2f}x (+{s['load_growth_x']:.2f}x over its start; then "
                f"{s['loaded_x']:.2f}x), first step {s['step_peak_x']:.2f}x"
                + (f", later steps {s['later_steps_peak_x']:.2f}x" if s["later_steps_peak_x"] is not None else ""),
                flush=True,
            )
        if args.json is not None:
            head = {"parameters": n, "checkpoint_bytes": size, "mesh": args.mesh, "batch": args.batch, "seq": args.seq}
            head["steps"] = args.steps
            args.json.write_text(json.dumps(head | results))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
