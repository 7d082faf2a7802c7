"""Train a model with an autoshard plan, one way through: resolve the run (every input checked,
alike on every rank, before the process group), plan beside the other ranks, build the parts from
the plan, run the steps, finish.

Every rank traces the step and builds the ILP; rank 0 solves it (or takes the solution of a
`--plan-file` made for the same problem) and fits the memory limit for all (`driver.ranks`).
Rank 0 dry-runs its program on fake tensors and logs the peak memory per rank, then writes
`sharding.log`, `report.html` and `plan.json` (reusable as `--plan-file`), one `metrics.jsonl` row
per logged step, and distributed checkpoints every `checkpoint_every` steps; at the end it rewrites
report.html with the loss and tokens/s curves. Resuming continues from the newest complete
checkpoint with the losses an uninterrupted run would have had. Bad input raises `UsageError` on
every rank alike.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import asdict

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autoshard import _torch_compat as tc
from autoshard.driver.processes import start_process_group
from autoshard.fileio import read_json
from autoshard.options import UsageError
from autoshard.report.files import JSON_NAME, load_metrics, write_html
from autoshard.train.export import keep_tokenizer
from autoshard.train.host_heap import keep_freed_for_next_step, release_free_heap
from autoshard.train.loggers import close_all
from autoshard.train.metrics import MetricsFile, step_time_line
from autoshard.train.parts import Parts, build_feed, build_optimizer, build_steps, restore
from autoshard.train.pipelined import PlannedPipeline, plan_pipelined
from autoshard.train.planning import PlannedRun, plan_run
from autoshard.train.run import ResolvedRun, resolve
from autoshard.train.rundir import run_directory
from autoshard.train.settings import Settings
from autoshard.train.signals import StopSignals
from autoshard.train.steps import run_steps
from autoshard.train.supervision import AgentWatch

log = logging.getLogger("autoshard")

Planned = PlannedRun | PlannedPipeline  # what planning gives the steps: one stage mesh, or a pipeline of them


def train(settings: Settings, parts: Parts | None = None) -> list[float]:
    """Plan, apply and train; returns the losses of this run's logged steps. `parts`: components
    to use instead of those the settings build (an API user's optimizer, data, loggers). Raises
    `Preempted` when a scheduler's signal stopped it (after a checkpoint)."""
    parts = parts if parts is not None else Parts()
    with contextlib.ExitStack() as held:
        signals = held.enter_context(StopSignals())  # from here on a SIGTERM stops the run cleanly
        held.enter_context(AgentWatch())  # and a worker whose torchrun agent died stops too
        resolved = resolve(settings, own_data=parts.data is not None)  # may tokenize for minutes
        settings = resolved.settings
        if settings.pipeline_ranks is not None:
            _check_pipelined(resolved)
        mesh, device = _start(settings)
        held.enter_context(run_directory(resolved.out, resolved.overwrite))  # this run's alone until it ends
        profiled = settings.with_default_profiles(device)
        if settings.pipeline_ranks is not None:
            planned: Planned = plan_pipelined(profiled, resolved.workload, mesh, resolved.plan_file)
        else:
            planned = plan_run(profiled, resolved.workload, mesh, resolved.plan_file)
        signals.arm()  # planned: a signal before this stopped the run at once, from here on it checkpoints
        if dist.get_rank() == 0:
            keep_tokenizer(resolved.out, settings.tokenizer)  # what export ships, whatever happens to the path
            recorded = asdict(settings.replace(grad_accum=planned.micro_batches))
            extra = {"fingerprint": planned.fingerprint, "settings": recorded}
            planned.write_report(extra | {"data_fingerprint": resolved.data_fingerprint}, resolved.out)
        release_free_heap()  # what planning freed, before the weights and the step need memory
        resolved.initial.load_into(planned.pmodel)  # one tensor, or one rank's slices, at a time
        feed = build_feed(resolved, parts, planned.pmodel, planned.feed_micro_batches)
        optim = build_optimizer(resolved, parts, planned.pmodel)
        start, changes = restore(resolved, parts, planned.pmodel, optim, feed)
        keep_freed_for_next_step()  # the steps free and reallocate the same large blocks
        metrics = MetricsFile(resolved.out, start or None)  # a resumed run keeps its rows up to `start`
        if changes:  # on the first row this run writes
            metrics.note_next({"changed_on_resume": changes})
        steps = build_steps(resolved, parts, planned, (feed, optim, metrics), start, signals, device)
        held.callback(close_all, steps.loggers)
        try:
            losses = run_steps(steps, start)
        finally:
            steps.checkpointer.finish()  # a save in flight completes, whatever stopped the steps
        dist.barrier()  # nobody tears the process group down while a peer still talks
        if dist.get_rank() == 0:
            _finish(resolved, planned, metrics, bool(losses))
    return losses


def _start(settings: Settings):
    """The process group and the mesh; logging for this rank; what `--compile` needs, checked."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if math.prod(settings.mesh) != world:
        raise UsageError(
            f"mesh {'x'.join(map(str, settings.mesh))} has {math.prod(settings.mesh)} devices "
            f"but the world size is {world} (torchrun --nproc_per_node={math.prod(settings.mesh)})"
        )
    device = start_process_group()
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s", force=True)
    why = tc.inductor_unavailable(device) if settings.compile else None
    if why is not None:  # every rank alike, before planning (and before anything is written)
        raise UsageError(f"--compile: {why}")
    mesh = init_device_mesh(device, settings.mesh, mesh_dim_names=settings.mesh_names)
    profiled = settings.with_default_profiles(device)  # profiles not named: those of where it runs
    mesh_text = f"{'x'.join(map(str, settings.mesh))} ({','.join(settings.mesh_names)})"
    log.info(
        "autoshard train: %s on mesh %s, %s/%s profiles",
        settings.model,
        mesh_text,
        profiled.network,
        profiled.device_profile,
    )
    return mesh, device


def _check_pipelined(resolved: ResolvedRun) -> None:
    """What a pipelined run does not take yet, known once the data is open."""
    from autoshard.data import Instructions

    if isinstance(resolved.data, Instructions):
        raise UsageError("instruction data (packed or padded examples) does not run on a pp mesh dim yet")


def _finish(resolved: ResolvedRun, run: Planned, metrics: MetricsFile, trained: bool) -> None:
    """Rank 0, after the last step: modeled vs measured step time, report.html with the curves."""
    out, settings = resolved.out, resolved.settings
    if trained:
        line = step_time_line(run.modeled_step_s, load_metrics(metrics.path))
        log.info("autoshard train: %s (profiles %s)", line, run.profiles)
        if run.modeled_overlapped_s is not None:
            log.info(
                "autoshard train: modeled step with the program's overlap %.1f ms (prefetch %d; no overlap %.1f ms)",
                run.modeled_overlapped_s * 1e3,
                settings.prefetch,
                run.modeled_step_s * 1e3,
            )
    html_path = write_html(read_json(out / JSON_NAME), out, load_metrics(metrics.path))
    log.info(
        "autoshard train: done; metrics %s, sharding log %s, report %s", metrics.path, out / "sharding.log", html_path
    )
