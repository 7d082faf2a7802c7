"""Train a model (ours, or `hf:PATH`; `--init-from` safetensors weights) with an autoshard plan under torchrun.

    torchrun --standalone --nproc_per_node=4 -m autoshard train --model llama3-debug --mesh 2x2 \\
        --steps 50 --out runs/debug

Every rank traces the step and builds the ILP (cheap, deterministic); rank 0 solves it, or takes the
solution from `--plan-file` when that file was made for the same problem (same fingerprint: graph,
mesh, profiles, constraints), and broadcasts it; every rank checks it traced the same problem.
The plan must fit `--memory-limit` per rank (default: the device profile's capacity less 10%; `none`:
no limit), as in `plan`: every rank runs the fit beside the others, rank 0 solving its budgeted
problems and dry-running the candidates, so every rank takes the same decisions; the ranks then
check that they hold the same plan.
Rank 0 dry-runs its program on fake tensors (every rank holds the same local shapes) and logs the
peak memory per rank, then writes `sharding.log`, `report.html` and `plan.json` (reusable as
`--plan-file`, with that memory section), one `metrics.jsonl` row per step, and distributed
checkpoints every `--checkpoint-every` steps (written to a temporary directory, renamed when
complete); at the end it rewrites report.html with the loss and tokens/s curves. `--resume`
continues from the newest complete checkpoint with the losses an uninterrupted run would have had:
the data is a pure function of (seed, step).
`--wire-step K` meters step K's collectives on every rank (`autoshard.runtime.wire`: ring-model bytes per
rank, measured the same way as any other program) and adds them to that step's metrics row;
`--memory-step K` measures step K's live memory on every rank with torch's MemTracker, beside the
dry run's estimate. `--compile` runs the program through torch.compile from step 2 on (step 1 is the
checked run); the step that compiles logs its compile time and carries `compile_s` in its row.
Run without torchrun, it trains on one process (a world of 1).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import solver

from autoshard import _torch_compat as tc
from autoshard.api import AutoShard
from autoshard.cli import args as shared
from autoshard.cli.args import RaisingArgumentParser, UsageError, add_dataclass_arguments, mesh_names, setting
from autoshard.profiles.files import device_profile, network_profile
from autoshard.report.files import JSON_NAME, load_metrics, write_html, write_report
from autoshard.report.text import human_bytes, summary_lines
from autoshard.runtime.dryrun import DryRunResult
from autoshard.runtime.fit import FitSteps, MemoryLimitError
from autoshard.runtime.wire import WireMeter, wire_row
from autoshard.workloads import Workload, get_workload

log = logging.getLogger("autoshard")


@dataclass
class Settings:
    """One training run. Every field is a command-line option (--field-name; `setting`): a new
    setting is one line here."""

    model: str = setting("llama3-debug", shared.MODEL)
    mesh: tuple[int, ...] = setting((2, 2), shared.MESH)
    # the parser leaves it None when not given; _parse names dp, tp, ... as many as the mesh needs
    mesh_names: tuple[str, ...] = setting(("dp", "tp"), shared.MESH_NAMES, default=None)
    batch: int = setting(8, shared.BATCH)
    seq: int = setting(64, shared.SEQ)
    steps: int = setting(50, type=int, help="train until this step")
    lr: float = setting(3e-3, type=float)
    seed: int = setting(0, type=int, help="weight init seed")
    init_from: str | None = setting(None, shared.INIT_FROM)
    data_seed: int = setting(0, type=int)
    network: str | None = setting(None, shared.NETWORK,  # None: by device
                                  help="network profile for planning (default: cpu-gloo on CPU, h100-node on GPUs)")
    device_profile: str | None = setting(None, shared.DEVICE, "--device-profile", "--device",
                                         help="compute profile for planning (default: cpu on CPU, h100 on GPUs)")
    memory_budget: float | None = setting(None, shared.MEMORY_BUDGET)
    param_dtype: str | None = setting(None, shared.PARAM_DTYPE)
    reduce_dtype: str | None = setting(None, shared.REDUCE_DTYPE)
    recompute: bool = setting(False, shared.RECOMPUTE)
    reshard_after_forward: bool = setting(False, shared.RESHARD)
    # None: the device profile's capacity less the reserve; inf: no limit (`--memory-limit none`)
    memory_limit: float | None = setting(None, shared.MEMORY_LIMIT)
    compile: bool = setting(False, help="run the program's forward and backward through torch.compile (inductor) "
                                        "from step 2 on (step 1 runs checked, uncompiled; the next unmetered step compiles)")
    plan_file: str | None = setting(None, help="reuse a plan.json written by an earlier run or `plan`")
    recipe: str | None = setting(None, choices=("fsdp-tp", "fsdp"),
                                 help="pin the parameters to a hand-written recipe's layouts (autoshard.problem.recipes), "
                                      "at its own parameter bytes per rank: to measure it beside autoshard's plan")
    prefetch: int = setting(1, type=int, help="launch bucketed parameter gathers and gradient reductions up to N "
                                              "buckets ahead of their use, overlapping compute (0: wait on each "
                                              "where it is launched)")
    checkpoint_every: int = setting(0, type=int, help="checkpoint every K steps (0: never)")
    resume: bool = setting(False, help="continue from the newest checkpoint in --out")
    wire_step: int = setting(0, type=int,
                             help="meter step K's collectives into its metrics row (slows that step; 0: never)")
    memory_step: int = setting(0, type=int, help="measure step K's live tensor memory on every rank with torch's "
                                                 "MemTracker into its metrics row, beside the dry run's estimate "
                                                 "(K >= 2: AdamW states exist; slows that step; 0: never)")
    out: str = setting("runs/debug", shared.OUT, help="run directory")


# ---------------------------------------------------------------------------------- set-up
def _parse(argv: list[str] | None) -> Settings:
    parser = RaisingArgumentParser(prog="python -m autoshard train", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    s = Settings(**vars(add_dataclass_arguments(parser, Settings).parse_args(argv)))
    try:
        s = replace(s, mesh_names=mesh_names(s.mesh_names, s.mesh))
    except ValueError as err:
        raise UsageError(str(err)) from None
    if s.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {s.steps}")
    if s.batch % s.mesh[0]:
        raise UsageError(f"--batch {s.batch} is not divisible by the {s.mesh_names[0]} size {s.mesh[0]} (mesh dim 0)")
    if s.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every must be >= 0, got {s.checkpoint_every}")
    if s.wire_step < 0:
        raise UsageError(f"--wire-step must be >= 0, got {s.wire_step}")
    if s.memory_step < 0:
        raise UsageError(f"--memory-step must be >= 0, got {s.memory_step}")
    if s.prefetch < 0:
        raise UsageError(f"--prefetch must be >= 0, got {s.prefetch}")
    return s


def _workload(settings: Settings) -> Workload:
    try:
        return get_workload(settings.model, settings.seq)  # ValueError names the known models
    except ValueError as err:
        raise UsageError(str(err)) from None


def _initial_values(settings: Settings, workload: Workload) -> dict[str, torch.Tensor]:
    """Full values to train from: the --init-from checkpoint (buffers from the seed's init), else
    the seed's init."""
    from autoshard.workloads import checkpoint_values

    if settings.init_from is None:
        return workload.initial_state(settings.seed)
    try:
        return checkpoint_values(workload, settings.init_from, settings.seed)
    except ValueError as err:
        raise UsageError(f"--init-from {err}") from None


def _init_distributed(settings: Settings) -> tuple[Any, str]:
    """Process group (nccl on GPUs, gloo on CPU; a world of 1 without torchrun) and the mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "nccl" if device == "cuda" else "gloo"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if math.prod(settings.mesh) != world:
        raise UsageError(f"mesh {'x'.join(map(str, settings.mesh))} has {math.prod(settings.mesh)} devices "
                         f"but the world size is {world} (torchrun --nproc_per_node={math.prod(settings.mesh)})")
    if "RANK" in os.environ:
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    else:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="autoshard-"), "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    return init_device_mesh(device, settings.mesh, mesh_dim_names=settings.mesh_names), device


# ---------------------------------------------------------------------------------- planning
def _load_plan_file(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"--plan-file {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"--plan-file {path}: not a plan file ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("fingerprint"), str) or "solution" not in data:
        raise UsageError(f"--plan-file {path}: not a plan file (no fingerprint/solution; write one with "
                         "`python -m autoshard plan` or a training run)")
    return data


def _broadcast(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _same_on_every_rank(what: str, value: str) -> None:
    """Every rank calls this: one error, raised alike everywhere, unless all ranks hold the same
    `value` (a fingerprint)."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    if len(set(values)) != 1:
        raise UsageError(f"ranks {what} (fingerprints {values}); same code and inputs on every rank?")


def _solve_on_rank0(settings: Settings, saved: dict | None):
    """`solve_with` hook: rank 0 solves (or reuses the saved solution), everyone gets its answer."""

    def solve_with(sharding):
        fingerprint = sharding.fingerprint()
        _same_on_every_rank("traced different problems", fingerprint)
        answer: tuple[str, str] = ("", "")
        if dist.get_rank() == 0:
            if saved is not None and saved["fingerprint"] != fingerprint:
                answer = ("error", f"--plan-file {settings.plan_file} was made for another problem (fingerprint "
                                   f"{saved['fingerprint']}, this run's is {fingerprint}): different model, "
                                   "shapes, mesh, profiles or constraints")
            elif saved is not None:
                answer = ("ok", saved["solution"])
                log.info("autoshard: reusing the solution in %s", settings.plan_file)
            else:
                try:
                    answer = ("ok", solver.solve(sharding.problem).to_json())
                except ValueError as e:  # infeasible constraints: every rank must hear it, not hang
                    answer = ("error", str(e))
        kind, payload = _broadcast(answer)
        if kind == "error":
            raise UsageError(payload)
        return solver.Solution.from_json(payload)

    return solve_with


def _fit_steps(mesh) -> FitSteps:
    """The memory fit's solves and dry runs, with the same result on every rank: rank 0 solves a
    budgeted problem and broadcasts the solution (or that none fits); every rank lowers a
    candidate (lowering may create flattened groups, a collective) and gets rank 0's dry run."""
    from autoshard.program.lower import lower

    def solve(problem: solver.Problem) -> solver.Solution:
        answer = ("", "")
        if dist.get_rank() == 0:
            try:
                answer = ("ok", solver.solve(problem).to_json())
            except solver.InfeasibleError as err:
                answer = ("infeasible", str(err))
        kind, payload = _broadcast(answer)
        if kind == "infeasible":
            raise solver.InfeasibleError(payload)
        return solver.Solution.from_json(payload)

    return FitSteps(solve, lambda plan: _dry_run_on_rank0(lower(plan, mesh), plan))


def _plan(settings: Settings, workload: Workload, mesh, network: str, profile: str, saved: dict | None):
    """Plan on every rank (rank 0 solving for all) and apply; returns (plan, parallel module,
    AutoShard, fingerprint of the problem the plan solves)."""
    example = lambda: workload.example_inputs(settings.batch, settings.seq, "meta")  # noqa: E731
    model = workload.build("meta")
    # a plan file whose plan recomputes or reshards the blocks (the fit chose it) solves that problem
    recompute = settings.recompute or bool(((saved or {}).get("recompute") or {}).get("blocks"))
    reshard = settings.reshard_after_forward or bool(((saved or {}).get("reshard") or {}).get("blocks"))
    with AutoShard(model, example, mesh, loss_fn=workload.loss_fn, n_model_inputs=workload.n_model_inputs,
                   network=network, device=profile,
                   mp_policy=shared.mp_policy(settings.param_dtype, settings.reduce_dtype),
                   recompute=recompute, reshard_after_forward=reshard, compile=settings.compile) as auto:
        if settings.recipe is not None:
            from autoshard.problem.recipes import param_bytes_per_rank, recipe_layouts, recipe_pins

            auto.pin(recipe_pins(settings.recipe))
            auto.memory_budget(param_bytes_per_rank(model, recipe_layouts(model, settings.recipe), settings.mesh))
        if settings.memory_budget is not None:
            auto.memory_budget(settings.memory_budget)
        if settings.memory_limit is not None:  # else the device's capacity less the reserve
            auto.memory_limit(None if math.isinf(settings.memory_limit) else settings.memory_limit)
        try:
            plan = auto.optimize(solve_with=_solve_on_rank0(settings, saved), fit_steps=_fit_steps(mesh))
        except MemoryLimitError as err:  # every rank reached it alike: one line, from rank 0
            raise UsageError(str(err)) from None
        fingerprint = auto.sharding.fingerprint()  # the fit may have moved to the problem with recomputation
        _same_on_every_rank("planned different plans",
                            fingerprint + hashlib.sha256(plan.solution.to_json().encode()).hexdigest()[:16])
        pmodel = auto.apply(plan, prefetch=settings.prefetch)
    return plan, pmodel, auto, fingerprint


# ---------------------------------------------------------------------------------- checkpoints
_CKPT = re.compile(r"^step-(\d+)$")


def _latest_checkpoint(out: Path) -> tuple[int, Path] | None:
    found = [(int(m.group(1)), p) for p in (out / "checkpoints").glob("step-*") if (m := _CKPT.match(p.name))]
    return max(found) if found else None


def _save_checkpoint(out: Path, step: int, pmodel, optim) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = out / "checkpoints" / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(pmodel, optim)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        (tmp / "step.json").write_text(json.dumps({"step": step}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # a checkpoint directory is either complete or absent
    dist.barrier()


def _load_checkpoint(path: Path, pmodel, optim) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(pmodel, optim)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(pmodel, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


# ---------------------------------------------------------------------------------- memory
def _dry_run_on_rank0(program, plan) -> DryRunResult:
    """Every rank calls this with its program of `plan`: rank 0 dry-runs its own (fake tensors: no
    memory, no communication; every rank holds the same local shapes) and every rank gets the
    result; a program that cannot run is every rank's one-line error, not rank 0's traceback and
    the others' hang."""
    from autoshard.runtime.dryrun import DryRunError, estimate

    outcome: tuple[str, Any] = ("", None)
    if dist.get_rank() == 0:
        start = time.perf_counter()
        try:
            result = DryRunResult(plan.mesh_shape, {0: estimate(program, 0, plan.module_paths)})
            result.seconds = time.perf_counter() - start
            outcome = ("ok", result)
        except DryRunError as err:
            outcome = ("error", err.line)
    kind, payload = _broadcast(outcome)
    if kind == "error":
        raise UsageError(f"the planned program cannot run: {payload}")
    return payload


def _memory_tracker(pmodel, optim, inputs):
    """torch's MemTracker over one step, told about the tensors that exist before it."""
    tracker = tc.mem_tracker()
    tracker.track_external(pmodel, optim, *inputs)
    return tracker


def _memory_row(tracker, memory) -> dict:
    """Every rank calls this: the tracked peak of each rank, and rank 0's dry-run estimate."""
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, int(tc.tracker_total(tracker.get_tracker_snapshot("peak"))))
    row = {"tracked_peak_bytes_per_rank": peaks}
    if memory is not None:
        row["dry_run_peak_bytes"] = memory.peak_bytes
        log.info("memory: tracked peak %s per rank, dry run estimate %s (ratio %.3f)",
                 [human_bytes(p) for p in peaks], human_bytes(memory.peak_bytes), memory.peak_bytes / max(max(peaks), 1))
    return row


# ---------------------------------------------------------------------------------- training
WARMUP_STEPS = 2  # left out of the measured step time: the first steps allocate and warm caches


def _check_profiles(settings: Settings) -> None:
    """A profile named on the command line (preset or file) is usable for this mesh: every rank
    checks before the process group exists, so a bad file is one error line, not a hang."""
    try:
        if settings.network is not None:
            network_profile(settings.network, settings.mesh)
        if settings.device_profile is not None:
            device_profile(settings.device_profile)
    except ValueError as err:
        raise UsageError(str(err)) from None


def step_time_line(modeled_s: float, rows: list[dict]) -> str:
    """Modeled vs measured step time: the median of the steps after warm-up (all steps when
    there are no more), and their ratio."""
    timed = [r for r in rows if r["step"] > WARMUP_STEPS] or rows
    measured = statistics.median(r["step_s"] for r in timed)
    steps = f"step {timed[0]['step']}" if len(timed) == 1 else f"steps {timed[0]['step']}-{timed[-1]['step']}"
    return (f"step time: modeled {modeled_s * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms (median of {steps}); "
            f"modeled / measured {modeled_s / measured:.2f}")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def train(settings: Settings) -> list[float]:
    """Plan, apply and train; returns this run's per-step losses."""
    from models.train_single import TrainSettings, make_optimizer

    workload = _workload(settings)
    initial = _initial_values(settings, workload)  # every rank: a bad checkpoint fails them together
    out = Path(settings.out)
    resume_from = None
    if settings.resume:
        resume_from = _latest_checkpoint(out)
        if resume_from is None:
            raise UsageError(f"--resume: no complete checkpoint in {out / 'checkpoints'}")
    saved = _load_plan_file(settings.plan_file) if settings.plan_file else None  # every rank: fail together
    _check_profiles(settings)
    mesh, device = _init_distributed(settings)
    why = tc.inductor_unavailable(device) if settings.compile else None
    if why is not None:  # every rank alike, before planning
        raise UsageError(f"--compile: {why}")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s", force=True)
    network = settings.network or ("cpu-gloo" if device == "cpu" else "h100-node")
    profile = settings.device_profile or ("cpu" if device == "cpu" else "h100")
    log.info("autoshard train: %s on mesh %s (%s), %s/%s profiles", settings.model,
             "x".join(map(str, settings.mesh)), ",".join(settings.mesh_names), network, profile)

    plan, pmodel, auto, fingerprint = _plan(settings, workload, mesh, network, profile, saved)
    timings = auto.timings
    if auto.fit is not None and auto.fit.plan is plan and auto.fit.dry_run is not None:
        memory = auto.fit.dry_run  # fitting the memory limit dry-ran this very plan
    else:
        memory = _dry_run_on_rank0(pmodel.program, plan)
        timings["dry_run"] = memory.seconds
    log.info("autoshard train: dry run estimate: %s", memory.summary())
    if rank == 0:
        paths = write_report(plan, out, program=pmodel.program, dry_run=memory, memory_fit=auto.fit,
                             device=device_profile(profile), timings=timings, extra={
            "fingerprint": fingerprint, "solution": plan.solution.to_json(), "settings": asdict(settings)})
        for line in summary_lines(json.loads(paths[1].read_text())):
            log.info("  %s", line)
        log.info("autoshard train: sharding log %s", paths[0])

    pmodel.load_full(initial)
    del initial
    optim = make_optimizer(pmodel.parameters(), TrainSettings(lr=settings.lr))
    start_step = 0
    if resume_from is not None:
        _load_checkpoint(resume_from[1], pmodel, optim)
        start_step = resume_from[0]
        log.info("autoshard train: resumed from %s (step %d)", resume_from[1], start_step)
    metrics_path = out / "metrics.jsonl"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        kept = [line for line in (metrics_path.read_text().splitlines() if metrics_path.exists() else [])
                if line.strip() and json.loads(line)["step"] <= start_step] if settings.resume else []
        metrics_path.write_text("".join(line + "\n" for line in kept))

    data = workload.data(settings.data_seed)
    losses = []
    reported: set[str] = set()  # program phases whose compile time is logged
    tokens = settings.batch * settings.seq
    for step in range(start_step + 1, settings.steps + 1):
        t0 = time.perf_counter()
        inputs = pmodel.shard_inputs(*data.batch(step - 1, settings.batch, settings.seq))  # to the mesh's device
        meter = WireMeter() if step == settings.wire_step else None
        tracker = _memory_tracker(pmodel, optim, inputs) if step == settings.memory_step else None
        with contextlib.ExitStack() as metering:
            for m in (meter, tracker):
                if m is not None:
                    metering.enter_context(m)
            loss = pmodel(*inputs)
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            value = loss.item()
        elapsed = time.perf_counter() - t0
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, round(_peak_rss_mb(), 1))
        losses.append(value)
        row = {"step": step, "loss": value, "step_s": elapsed, "tokens_per_s": tokens / elapsed,
               "peak_rss_mb_per_rank": peaks, "modeled_step_s": plan.step_time_s,
               "modeled_over_measured": plan.step_time_s / elapsed,
               "modeled_overlapped_step_s": pmodel.program.step.overlapped_s}
        if meter is not None:
            row |= wire_row(meter.stats)  # every rank takes part
        if tracker is not None:
            row |= _memory_row(tracker, memory)  # every rank takes part
        compiled = {phase: st for phase, st in pmodel.compile_stats.items() if phase not in reported}
        if compiled:  # this step compiled (part of) the program: its time is mostly compiling
            reported |= compiled.keys()
            row["compile_s"] = sum(st.seconds for st in compiled.values())
            log.info("autoshard train: compiled %s on step %d (rank 0)", ", ".join(
                f"{phase} in {st.seconds:.1f} s ({st.graphs} graph(s), {st.graph_breaks} graph break(s))"
                for phase, st in compiled.items()), step)
        if rank == 0:
            with metrics_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            log.info("step %4d/%d  loss %.4f  %8.0f tok/s  peak rss %.0f MiB  step %.1f ms (modeled %.1f, x%.2f)",
                     step, settings.steps, value, tokens / elapsed, max(peaks), elapsed * 1e3, plan.step_time_s * 1e3,
                     plan.step_time_s / elapsed)
        if settings.checkpoint_every and step % settings.checkpoint_every == 0:
            _save_checkpoint(out, step, pmodel, optim)
    dist.barrier()  # nobody tears the process group down while a peer still talks
    if rank == 0 and losses:
        log.info("autoshard train: %s", step_time_line(plan.step_time_s, load_metrics(metrics_path)))
        log.info("autoshard train: modeled step with the program's overlap %.1f ms (prefetch %d; no overlap %.1f ms)",
                 pmodel.program.step.overlapped_s * 1e3, settings.prefetch, plan.step_time_s * 1e3)
    if rank == 0:  # metrics.jsonl is complete: report.html again, now with the loss and tokens/s curves
        html_path = write_html(json.loads((out / JSON_NAME).read_text()), out, load_metrics(metrics_path))
        log.info("autoshard train: done; metrics %s, sharding log %s, report %s", metrics_path,
                 out / "sharding.log", html_path)
    return losses


def main(argv: list[str] | None = None) -> int:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level  # train configures logging for its run; put it back
    try:
        train(_parse(argv))
    except ValueError as e:  # UsageError, unknown model, infeasible constraints...
        # usage errors are the same on every rank (checked alike, or broadcast from rank 0): print once
        if int(os.environ.get("RANK", "0")) == 0 or not isinstance(e, UsageError):
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        root.handlers[:] = handlers  # in-process callers keep their own: none left writing to our stderr
        root.setLevel(level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
