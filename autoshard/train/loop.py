"""Train a model with an autoshard plan: set up the process group, plan beside the other ranks,
apply, write the report, run the steps with metrics and checkpoints.

Every rank traces the step and builds the ILP; rank 0 solves it (or takes the solution of a
`--plan-file` made for the same problem) and fits the memory limit for all (`driver.ranks`).
Rank 0 dry-runs its program on fake tensors and logs the peak memory per rank, then writes
`sharding.log`, `report.html` and `plan.json` (reusable as `--plan-file`), one `metrics.jsonl` row
per step, and distributed checkpoints every `checkpoint_every` steps; at the end it rewrites
report.html with the loss and tokens/s curves. Resuming continues from the newest complete
checkpoint with the losses an uninterrupted run would have had: the data is a pure function of
(seed, step). Bad input raises `UsageError` on every rank alike.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import math
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autoshard import _torch_compat as tc
from autoshard.data import open_feed
from autoshard.options import UsageError
from autoshard.profiles.files import device_profile, network_profile
from autoshard.report.files import JSON_NAME, load_metrics, write_html, write_report
from autoshard.report.text import summary_lines
from autoshard.train.checkpoints import Checkpoint, Checkpointer, resume_newest
from autoshard.train.disk import check_out
from autoshard.train.loggers import Throughput, close_all, make_loggers
from autoshard.train.metrics import MetricsFile, step_time_line
from autoshard.train.optimizer import GradClip, ScheduledOptimizer, at_step, make_optimizer, make_schedule
from autoshard.train.resume import apply_optimizer_settings, resume_check, run_changes
from autoshard.train.rundir import RunDirLock, first_attempt, refuse_earlier_run, run_directory
from autoshard.train.settings import Settings
from autoshard.train.planning import PlanFile, plan_run
from autoshard.train.signals import StopSignals
from autoshard.train.steps import PlannedRun, StepParts, run_steps
from autoshard.train.supervision import AgentWatch
from autoshard.workloads import CheckpointSlices, Start, Workload, get_workload

log = logging.getLogger("autoshard")


# ---------------------------------------------------------------------------------- set-up
def _workload(settings: Settings) -> Workload:
    try:
        return get_workload(settings.model, settings.seq)  # ValueError names the known models
    except ValueError as err:
        raise UsageError(str(err)) from None


def _initial_values(settings: Settings, workload: Workload) -> Start:
    """What to train from: the --init-from checkpoint (checked now from its headers; buffers from
    the seed's init), else the seed's init. Loaded after planning, each rank reading its shards
    alone (`Start.load_into`)."""
    if settings.init_from is None:
        return Start(workload, settings.seed)
    try:
        return Start(workload, settings.seed, CheckpointSlices(workload, settings.init_from))
    except ValueError as err:
        raise UsageError(f"--init-from {err}") from None


def _check_profiles(settings: Settings) -> None:
    """A profile named on the command line (preset or file) is usable for this mesh: every rank
    checks before the process group exists, so a bad file is one error line, not a hang."""
    try:
        if settings.network is not None:
            network_profile(settings.network, settings.mesh, settings.intra_node_dims)
        if settings.device_profile is not None:
            device_profile(settings.device_profile)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _load_plan_file(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"--plan-file {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"--plan-file {path}: not a plan file ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("fingerprint"), str) or "solution" not in data:
        raise UsageError(
            f"--plan-file {path}: not a plan file (no fingerprint/solution; write one with "
            "`python -m autoshard plan` or a training run)"
        )
    return data


def _init_distributed(settings: Settings) -> tuple[Any, str]:
    """Process group (nccl on GPUs, gloo on CPU; a world of 1 without torchrun) and the mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "nccl" if device == "cuda" else "gloo"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if math.prod(settings.mesh) != world:
        raise UsageError(
            f"mesh {'x'.join(map(str, settings.mesh))} has {math.prod(settings.mesh)} devices "
            f"but the world size is {world} (torchrun --nproc_per_node={math.prod(settings.mesh)})"
        )
    if "RANK" in os.environ:
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        store = _restart_store()
        if store is None:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=world)
    else:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="autoshard-"), "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    return init_device_mesh(device, settings.mesh, mesh_dim_names=settings.mesh_names), device


def _restart_store() -> dist.Store | None:
    """The store of a torchrun restart on one node: torchrun (torch 2.13) hands restarted workers
    the store of the first attempt, where the process group would read the dead workers' addresses
    (gloo: "connection refused"); keys under the attempt's own prefix avoid them. None otherwise:
    a first attempt, or several nodes, whose restart counts differ (torch's store as it is)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    one_node = os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")
    if attempt == 0 or not one_node or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    return dist.PrefixStore(f"autoshard/attempt-{attempt}", store)


def _write_report(settings: Settings, run: PlannedRun) -> None:
    """Rank 0: sharding.log, plan.json (with what `--plan-file` needs) and report.html."""
    paths = write_report(
        run.plan,
        Path(settings.out),
        program=run.pmodel.program,
        dry_run=run.memory,
        memory_fit=run.auto.fit,
        device=run.auto.device,
        timings=run.auto.timings,
        mesh_names=settings.mesh_names,
        extra={"fingerprint": run.fingerprint, "solution": run.plan.solution.to_json(), "settings": asdict(settings)},
    )
    for line in summary_lines(json.loads(paths[1].read_text())):
        log.info("  %s", line)
    log.info("autoshard train: sharding log %s", paths[0])


# ---------------------------------------------------------------------------------- training
def train(settings: Settings) -> list[float]:
    """Plan, apply and train; returns this run's per-step losses. Raises `Preempted` when a
    scheduler's signal stopped it (after a checkpoint)."""
    check_out(Path(settings.out), settings.checkpoint_every > 0)  # first: a bad --out fails every rank alike
    workload = _workload(settings)
    settings, workload, feed = open_feed(settings, workload)  # bad data: every rank alike, before planning
    initial = _initial_values(settings, workload)  # every rank: a bad checkpoint fails them together
    out = Path(settings.out)
    overwrite = settings.overwrite and first_attempt()  # a restart resumes what this job wrote
    RunDirLock(out).refuse_if_held()  # every rank, before anything else about --out: "in use" says it all
    resuming = not overwrite and resume_check(settings, out)
    if not resuming and not overwrite:
        refuse_earlier_run(out)
    own = _own_plan(out) if resuming else None
    # every rank reads the run's plan.json before rank 0 rewrites it: a refusal fails them together
    changes = run_changes(settings, own.data.get("settings") or {}, out) if own is not None else {}
    if settings.plan_file:  # every rank reads it: fail together
        saved = PlanFile(_load_plan_file(settings.plan_file), f"--plan-file {settings.plan_file}", required=True)
    else:
        saved = own
    _check_profiles(settings)
    with contextlib.ExitStack() as held:
        signals = held.enter_context(StopSignals())  # from here on a SIGTERM stops the run cleanly
        held.enter_context(AgentWatch())  # and a worker whose torchrun agent died stops too
        mesh, device = _init_distributed(settings)
        rank = dist.get_rank()
        logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s", force=True)
        why = tc.inductor_unavailable(device) if settings.compile else None
        if why is not None:  # every rank alike, before planning (and before anything is written)
            raise UsageError(f"--compile: {why}")
        held.enter_context(run_directory(out, overwrite))  # this run's alone until it ends
        profiled = settings.with_default_profiles(device)  # profiles not named: those of where it runs
        log.info(
            "autoshard train: %s on mesh %s (%s), %s/%s profiles",
            settings.model,
            "x".join(map(str, settings.mesh)),
            ",".join(settings.mesh_names),
            profiled.network,
            profiled.device_profile,
        )

        run = plan_run(profiled, workload, mesh, saved)
        settings = settings.replace(grad_accum=run.plan.micro_batches)  # what it runs, also when it chose
        feed.micro_batches = run.plan.micro_batches
        signals.arm()  # planned: a signal before this stopped the run at once, from here on it checkpoints
        if rank == 0:
            _write_report(settings, run)
        release_free_heap()  # what planning freed, before the weights and the step need memory
        initial.load_into(run.pmodel)  # one tensor, or one rank's slices, at a time
        optim = make_optimizer(run.pmodel.parameters(), settings)
        start = _resume(out, run, optim) if resuming else None
        start_step = start.step if start is not None else 0
        # random ops draw what an uninterrupted run draws: the program has run once per micro-batch
        run.pmodel.random.step = start_step * run.plan.micro_batches
        metrics = MetricsFile(out, start_step if start is not None else None)
        if start is not None:
            changes |= apply_optimizer_settings(optim, settings, own.data.get("settings") if own else None)
            if changes:  # on the first row this run writes
                metrics.note_next({"changed_on_resume": changes})
        parts = _step_parts(settings, run, optim, metrics, start_step if start is not None else None)
        held.callback(close_all, parts.loggers)
        asynchronous = settings.checkpoint_writes == "async" or (
            settings.checkpoint_writes == "auto" and device == "cuda"
        )
        checkpointer = Checkpointer(out, settings.keep_checkpoints, asynchronous)
        try:
            losses = run_steps(settings, feed, run, parts, checkpointer, signals, start_step)
        finally:
            checkpointer.finish()  # a save in flight completes, whatever stopped the steps
        dist.barrier()  # nobody tears the process group down while a peer still talks
        if rank == 0:
            _finish(settings, run, metrics, bool(losses))
    return losses


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's `malloc_trim`; nothing elsewhere).
    Rank 0 solves on a thread, whose malloc arena the main thread's tensors never reuse: what the
    solver freed there would stay resident through training."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc (Windows: no process handle)
        return
    trim(0)


def _step_parts(
    settings: Settings, run: PlannedRun, optim: torch.optim.Optimizer, metrics: MetricsFile, resumed_at: int | None
) -> StepParts:
    """The step's optimizer with its schedule (at the resumed step), clipping, loggers and
    throughput figures, from the command line's settings."""
    schedule = at_step(make_schedule(optim, settings), resumed_at or 0)
    dtype = settings.precision.param_dtype or next(run.pmodel.parameters()).dtype  # what the matmuls run in
    return StepParts(
        ScheduledOptimizer(optim, schedule),
        GradClip(settings.grad_clip),
        make_loggers(settings, Path(settings.out), metrics, resumed_at, _profiles(run)),
        Throughput(settings.batch * settings.seq, run.plan, run.auto.device, dtype),
    )


def _profiles(run: PlannedRun) -> str:
    """The network and device profiles the plan was priced with, as the console names them."""
    return f"{run.auto.config.network}/{run.auto.config.device_profile}"


def _own_plan(out: Path) -> PlanFile | None:
    """The run's own plan.json, reused on resume when it solves the same problem (the same plan
    gives the same losses); ignored when unreadable or made for another problem."""
    try:
        return PlanFile(_load_plan_file(str(out / JSON_NAME)), f"{out / JSON_NAME} (resuming)", required=False)
    except UsageError:
        return None


def _resume(out: Path, run: PlannedRun, optim) -> Checkpoint | None:
    """Load the newest checkpoint that loads (every rank); None when there is none."""
    try:
        found = resume_newest(out, run.pmodel, optim)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if found is not None:
        log.info("autoshard train: resumed from %s (step %d)", found.path, found.step)
    return found


def _finish(settings: Settings, run: PlannedRun, metrics: MetricsFile, trained: bool) -> None:
    """Rank 0, after the last step: modeled vs measured step time, report.html with the curves."""
    out = Path(settings.out)
    if trained:
        line = step_time_line(run.plan.step_time_s, load_metrics(metrics.path))
        log.info("autoshard train: %s (profiles %s)", line, _profiles(run))
        log.info(
            "autoshard train: modeled step with the program's overlap %.1f ms (prefetch %d; no overlap %.1f ms)",
            run.pmodel.program.step_s(settings.grad_accum) * 1e3,
            settings.prefetch,
            run.plan.step_time_s * 1e3,
        )
    html_path = write_html(json.loads((out / JSON_NAME).read_text()), out, load_metrics(metrics.path))
    log.info(
        "autoshard train: done; metrics %s, sharding log %s, report %s", metrics.path, out / "sharding.log", html_path
    )
