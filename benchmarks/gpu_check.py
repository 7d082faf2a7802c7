"""One GPU's check of autoshard: its training step against plain torch's, and rank 0's program at
scale against the cost model and the dry run.

    python3 benchmarks/gpu_check.py --out gpu-check          # one H100 or H200: a 450 s budget
    python3 benchmarks/gpu_check.py --big --out gpu-check    # also llama3-70b (64, 8): an H200's memory
    python benchmarks/gpu_check.py --tiny --out /tmp/gc      # every part at toy sizes, on CPU
    ... --parts step-eager,rank0 --profile DIR               # some parts; one profiled step each

Parts, each in a process of its own (a CUDA fault or an out-of-memory ends that part, not the
check; the time budget ends a part that outruns it):
- step, eager and compiled: llama3-1b, bf16 compute / fp32 gradient reduction, batch 2, seq 4096,
  a whole step (forward, backward, fused AdamW) on one device: autoshard's plan on mesh (1,) in a
  process group of one (NCCL; gloo on CPU) beside plain torch (the same model and values, the same
  casts as FSDP2's MixedPrecisionPolicy, the same fused AdamW), torch.compile off, then on.
  Tokens/s and MFU (flops as `train` counts them, over the datasheet's dense bf16 peak); goal:
  autoshard >= 0.97x plain torch.
- rank0 (and rank0-big with --big): llama3-8b on (8, 8), batch 8, seq 8192, bf16 / fp32 (70b on
  (64, 8), batch 64), planned as `plan` does; rank 0's program then runs forward and backward on
  real tensors of its local shapes on the device, its collectives on torch's fake process group
  (they return at once; gathers copy the local shard). Compute time (CUDA events, median after
  warm steps; the collectives' local copies included) against the program's modeled compute, and
  `torch.cuda.max_memory_allocated` over a steady step (the AdamW states live) against the dry
  run's peak; goals: within 15% and 10%. On CPU there is no allocator peak: skipped, said so.

Writes gpu_check.json and gpu_check.md under --out, after every part. Needs torch and this
repository (not installed: its solver/ and models/ are found here), and an ILP backend for planning
(pulp; highspy is faster): on a GPU machine without them, carry their wheels (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
_HERE = str(Path(__file__).resolve().parent)
# run as a file, this folder leads sys.path: its modules (plan.py, memory.py) must not shadow others
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu_check_measure import (  # noqa: E402
    CastStep,
    attention_check,
    device_type,
    figures,
    free,
    initial_state,
    measure_program,
    peak_flops,
    run_steps,
    say,
)
from benchmarks.gpu_check_report import FULL, GOALS, TINY, case_of, table, write  # noqa: E402

# the parts in the order they run, each with the least it needs to be worth starting (seconds: GPU,
# CPU tiny)
MIN_SECONDS = {"step-eager": (60, 10), "rank0": (45, 10), "rank0-big": (60, 10), "step-compiled": (90, 20)}


def importable() -> None:
    """On a GPU machine the repository is a bare copy, not installed: its solver/ and models/
    folders are registered under the names they install as."""
    for name, folder in (("autoshard_solver", "solver"), ("autoshard_models", "models")):
        if importlib.util.find_spec(name) is None:
            spec = importlib.util.spec_from_file_location(
                name, ROOT / folder / "__init__.py", submodule_search_locations=[str(ROOT / folder)]
            )
            assert spec is not None and spec.loader is not None
            sys.modules[name] = module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)


# ---------------------------------------------------------------------------------- helpers
def profiles(device: str) -> tuple[str, str]:
    """(network, device) presets to plan with: the GPU's own, or the CPU's."""
    if device == "cpu":
        return "cpu-gloo", "cpu"
    return "h100-node", "h200" if "H200" in torch.cuda.get_device_name() else "h100"


def profile_path(a: argparse.Namespace, part: str) -> Path | None:
    """Where --profile puts a part's tables (None without it)."""
    return a.profile / f"profile-{part}.txt" if a.profile else None


def one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: " + (str(err).strip().splitlines() or [""])[0][:300]


# ---------------------------------------------------------------------------------- a. the step
def step_part(a: argparse.Namespace, compiled: bool) -> dict:
    """autoshard's plan on mesh (1,) and plain torch, the same step, the same values."""
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard import _torch_compat as tc
    from autoshard.driver.api import AutoShard
    from autoshard.driver.config import PlanConfig
    from autoshard.pricing.compute import graph_work
    from autoshard.profiles.files import device_profile
    from autoshard.workloads import get_workload
    from autoshard_models import build_model, get_config

    device = device_type()
    model_name, batch, seq = (TINY if a.tiny else FULL)["step"]
    warm, steps = (2, 3) if a.tiny else (3, 10)
    part: dict[str, Any] = {"model": model_name, "batch": batch, "seq": seq, "mesh": [1], "compiled": compiled}
    profile_to = profile_path(a, a.part)
    part.update(param_dtype="bf16", reduce_dtype="fp32", warm_steps=warm, timed_steps=steps, variants={}, notes=[])
    why = tc.inductor_unavailable(device) if compiled else None
    if why is not None:
        return {**part, "status": "skipped", "notes": [f"torch.compile: {why}"]}
    workload = get_workload(model_name, seq)
    cfg = get_config(model_name)
    cfg = cfg.with_(max_seq_len=max(seq, cfg.max_seq_len))
    say(f"step ({'compiled' if compiled else 'eager'}): {model_name}, batch {batch}, seq {seq}: initial values")
    state = initial_state(cfg, device)
    gen = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen).to(device) for _ in range(2))
    network, preset = profiles(device)
    flops, peak = 0.0, 0.0
    if device == "cuda":
        torch.cuda.set_device(0)
    part["attention"] = attention_check(device)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:  # a failure here (out of memory, a kernel missing) leaves plain torch's figures to measure
        mesh = init_device_mesh(device, (1,), mesh_dim_names=("dp",))
        config = PlanConfig(param_dtype="bf16", reduce_dtype="fp32", network=network, device_profile=preset)
        auto = AutoShard(
            build_model(cfg, device="meta"),
            lambda: workload.example_inputs(batch, seq, "meta"),
            mesh,
            config=config,
            loss_fn=workload.loss_fn,
            n_model_inputs=workload.n_model_inputs,
            compile=compiled,
        )
        plan = auto.optimize()
        flops = graph_work(plan.graph.gm.graph).flops
        peak, peak_source = peak_flops(device, device_profile(preset))
        part.update(flops_per_step=flops, peak_flops=peak, peak_source=peak_source, plan=plan.summary())
        part["recompute"] = bool(plan.recompute_blocks)
        part["notes"].append(
            f"MFU: the step's {flops:.3g} flops (matmuls, attention: as `train` counts) over {peak_source}"
        )
        say(f"step: planned ({plan.summary()}); autoshard's steps")
        pmodel = auto.apply(plan)
        pmodel.load_full(state)
        optim = torch.optim.AdamW(pmodel.parameters(), lr=1e-4, fused=True)
        inputs = pmodel.shard_inputs(tokens, targets)
        seconds, losses = run_steps(
            lambda m=pmodel, x=inputs: m(*x), optim, warm, steps, device, profile_to, "autoshard's step"
        )
        part["variants"]["autoshard"] = figures(seconds, losses, batch * seq, flops, peak)
        say(f"step: autoshard {part['variants']['autoshard']['tokens_per_s']:,.0f} tokens/s")
        del pmodel, optim, inputs, auto, plan
    except Exception as err:  # noqa: BLE001 - said in the report, in one line
        part["notes"].append(f"autoshard failed: {one_line(err)}")
        say(f"step: autoshard failed: {one_line(err)}")
    finally:
        dist.destroy_process_group()
        free(device)
    say("step: plain torch's steps")
    model = build_model(cfg, device="meta").to_empty(device=device)
    model.load_state_dict(state, strict=False)
    for name, buf in model.named_buffers():
        buf.copy_(state[name])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    step = CastStep(model, torch.bfloat16, compiled)
    seconds, losses = run_steps(
        lambda: step(tokens, targets), optim, warm, steps, device, profile_to, "plain torch's step"
    )
    part["variants"]["torch"] = figures(seconds, losses, batch * seq, flops, peak)
    say(f"step: plain torch {part['variants']['torch']['tokens_per_s']:,.0f} tokens/s")
    if "autoshard" not in part["variants"]:
        return {**part, "status": "failed"}
    part["ratio"] = part["variants"]["autoshard"]["tokens_per_s"] / part["variants"]["torch"]["tokens_per_s"]
    first = part["variants"]["autoshard"]["loss_first"], part["variants"]["torch"]["loss_first"]
    part["first_loss_rel_diff"] = abs(first[0] - first[1]) / abs(first[1])
    last = part["variants"]["autoshard"]["loss_last"], part["variants"]["torch"]["loss_last"]
    part["last_loss_rel_diff"] = abs(last[0] - last[1]) / abs(last[1])
    part["met"] = part["ratio"] >= GOALS["step"]
    return {**part, "status": "ok"}


# ---------------------------------------------------------------------------------- b, c. rank 0
def rank0_part(a: argparse.Namespace, which: str) -> dict:
    """Plan as `plan` does, then run rank 0's program on the device under a fake process group."""
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard import _torch_compat as tc
    from autoshard.driver.config import PlanConfig
    from autoshard.program.lower import lower
    from autoshard.runtime.dryrun import dry_run
    from autoshard.workloads import get_workload

    device = device_type()
    model_name, shape, batch, seq = (TINY if a.tiny else FULL)[which]
    warm, steps = (1, 2) if a.tiny else (2, 5)
    part: dict[str, Any] = {"model": model_name, "mesh": list(shape), "batch": batch, "seq": seq, "notes": []}
    part.update(param_dtype="bf16", reduce_dtype="fp32", warm_steps=warm, timed_steps=steps)
    network, preset = profiles(device)
    workload = get_workload(model_name, seq)
    config = PlanConfig(mesh=shape, param_dtype="bf16", reduce_dtype="fp32", network=network, device_profile=preset)
    say(f"{which}: planning {model_name} on {shape}, batch {batch}, seq {seq} ({network}, {preset})")
    with tc.fake_process_group(math.prod(shape), 0):
        auto = auto_shard(workload, config, batch, seq)
        plan = auto.optimize()
        memory = auto.fit_dry_run or dry_run(plan, mesh_dim_names=auto.config.mesh_names)
        peak = memory.ranks[0].peak_bytes
        part.update(plan=plan.summary(), dry_run_peak_bytes=peak, recompute=bool(plan.recompute_blocks))
        if device == "cuda":
            total = torch.cuda.mem_get_info()[1]
            part["device_memory_bytes"] = total
            if peak > 0.95 * total:
                note = f"the dry run's peak {peak / 2**30:.1f} GiB does not fit this device's {total / 2**30:.1f} GiB"
                return {**part, "status": "skipped", "notes": [note]}
        say(f"{which}: planned ({plan.summary()}); dry-run peak {peak / 2**30:.2f} GiB; lowering on {device}")
        program = lower(plan, init_device_mesh(device, shape, mesh_dim_names=auto.config.mesh_names))
        part["compute_modeled_s"], part["optimizer_modeled_s"] = program.step.compute_s, program.step.optimizer_s
        part["plan_compute_s"] = plan.compute_s
        profile_to = profile_path(a, which)
        part.update(measure_program(program, workload.vocab_size, device, warm, steps, which, profile_to))
    part["compute_ratio"] = part["compute_measured_s"] / part["compute_modeled_s"]
    part["met_compute"] = abs(part["compute_ratio"] - 1) <= GOALS["compute"]
    if part.get("memory_measured_bytes") is not None:
        part["memory_ratio"] = part["memory_measured_bytes"] / peak
        part["met_memory"] = abs(part["memory_ratio"] - 1) <= GOALS["memory"]
    else:
        part["notes"].append("no max_memory_allocated on CPU: the memory comparison is skipped")
    return {**part, "status": "ok"}


def auto_shard(workload: Any, config: Any, batch: int, seq: int) -> Any:
    """The planner of `workload` built on meta with its example inputs, as `plan` builds it."""
    from autoshard.driver.api import AutoShard

    return AutoShard(
        workload.build("meta"),
        lambda: workload.example_inputs(batch, seq, "meta"),
        config=config,
        loss_fn=workload.loss_fn,
        n_model_inputs=workload.n_model_inputs,
    )


# ---------------------------------------------------------------------------------- running
def run_part(a: argparse.Namespace) -> int:
    """A child: one part, its result (or the one line it failed with) to --result."""
    importable()
    if a.part.startswith("step"):
        work = lambda: step_part(a, compiled=a.part == "step-compiled")  # noqa: E731
    else:
        work = lambda: rank0_part(a, a.part)  # noqa: E731
    try:
        result = work()
    except Exception as err:  # noqa: BLE001 - the report says why the part failed, in one line
        result = {"status": "failed", "notes": [one_line(err)]}
        say(f"{a.part} failed: {one_line(err)}")
    Path(a.result).write_text(json.dumps(result) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="where gpu_check.json and .md go")
    parser.add_argument("--tiny", action="store_true", help="every part at toy sizes (CPU or GPU)")
    parser.add_argument("--big", action="store_true", help="also llama3-70b on (64, 8) (always with --tiny)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile'd step")
    parser.add_argument("--budget", type=float, default=None, help="seconds for every part (default 450; tiny 300)")
    parser.add_argument("--profile", type=Path, default=None, help="one more profiled step per part: tables here")
    parser.add_argument("--parts", default=None, help="run only these parts (comma-separated names)")
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # a child: run this part
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.part is not None:
        return run_part(a)
    start = time.perf_counter()
    budget = a.budget if a.budget is not None else (300.0 if a.tiny else 450.0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not a.tiny:
        print("error: no CUDA device: the full check needs a GPU (--tiny runs it at toy sizes on CPU)", file=sys.stderr)
        return 2
    # the compiled step last: its compiles take the longest, and a spent budget should skip it, not
    # the goals the other parts measure
    parts = (
        ["step-eager", "rank0"]
        + (["rank0-big"] if a.big or a.tiny else [])
        + ([] if a.no_compile else ["step-compiled"])
    )
    if a.parts is not None:
        wanted = set(a.parts.split(","))
        if unknown := sorted(wanted - set(MIN_SECONDS)):
            print(f"error: --parts: no part {', '.join(unknown)} (parts: {', '.join(MIN_SECONDS)})", file=sys.stderr)
            return 2
        parts = [p for p in MIN_SECONDS if p in wanted]
    result: dict[str, Any] = {
        "meta": {
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__,
            "tiny": a.tiny,
            "budget_s": budget,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(["python", "benchmarks/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
            "goals": GOALS,
            "seconds": 0.0,
        },
        "parts": {},
    }
    for name in parts:
        left = budget - (time.perf_counter() - start)
        if left < MIN_SECONDS[name][1 if a.tiny else 0]:
            result["parts"][name] = {
                **case_of(name, a.tiny),
                "status": "skipped",
                "notes": [f"the time budget was spent ({left:.0f} s left of {budget:.0f} s)"],
            }
            say(f"{name}: skipped, {left:.0f} s left")
        else:
            result["parts"][name] = {**case_of(name, a.tiny), **child(name, a, left)}
        result["meta"]["seconds"] = time.perf_counter() - start
        write(a.out, result)
    say(f"done in {result['meta']['seconds']:.0f} s: {a.out / 'gpu_check.md'}")
    print(table(result))
    return 0


def child(name: str, a: argparse.Namespace, left: float) -> dict:
    """Run one part in a process of its own, stopped when the budget's `left` seconds are spent."""
    result = a.out.resolve() / f".{name}.json"
    a.out.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--result", str(result)]
    command += ["--tiny"] if a.tiny else []
    command += ["--profile", str(a.profile.resolve())] if a.profile else []
    say(f"{name}: starting ({left:.0f} s left)")
    start = time.perf_counter()
    try:
        code = subprocess.run(command, timeout=left).returncode
    except subprocess.TimeoutExpired:
        return {"status": "timed out", "notes": [f"stopped after {left:.0f} s: the time budget was spent"]}
    seconds = time.perf_counter() - start
    if not result.exists():
        return {"status": "failed", "notes": [f"its process ended with code {code} and no result"], "seconds": seconds}
    found = json.loads(result.read_text())
    result.unlink()
    return {**found, "seconds": seconds}


if __name__ == "__main__":
    sys.exit(main())
