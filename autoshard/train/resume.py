"""Resuming a run honours or refuses, never silently mixes: whether to look for a checkpoint at all,
the settings that define a run's losses (a change refuses unless `--resume force`, which records it
in metrics.jsonl), and the optimizer settings of this command applied to the restored optimizer
(a checkpoint's param groups carry the old run's; a resume with a lower --lr must use it)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from autoshard.options import UsageError
from autoshard.train.checkpoints import latest_checkpoint
from autoshard.train.settings import Settings

log = logging.getLogger("autoshard")

# what a run's data and model are: resuming with another value would mix two runs' losses
RUN_DEFINING = ("model", "seq", "batch", "data_seed")


def resume_check(settings: Settings, out: Path) -> bool:
    """Whether to look for a checkpoint of `out` to resume from; bad combinations raise (every
    rank alike). `no` still resumes from checkpoints this very torchrun job wrote (a restart)."""
    newest = latest_checkpoint(out)
    if settings.resume == "yes" and newest is None:
        raise UsageError(f"--resume: no complete checkpoint in {out / 'checkpoints'}")
    if settings.resume == "no" and newest is not None:
        job = os.environ.get("TORCHELASTIC_RUN_ID")
        if job is None or newest.run_id != job:
            raise UsageError(
                f"--resume no: {out / 'checkpoints'} holds an earlier run's checkpoints (newest step "
                f"{newest.step}); choose another --out, resume (--resume auto), or --overwrite to replace that run"
            )
    return newest is not None


def run_changes(settings: Settings, saved: dict[str, Any], out: Path) -> dict[str, list]:
    """The run-defining settings this command changes against the run it resumes (`saved`: that
    run's settings from its plan.json), as {name: [old, new]}. UsageError naming each unless
    `--resume force`."""
    changes = {
        name: [saved[name], getattr(settings, name)]
        for name in RUN_DEFINING
        if name in saved and saved[name] != getattr(settings, name)
    }
    if changes and settings.resume != "force":
        listed = "; ".join(f"--{name.replace('_', '-')} {old} -> {new}" for name, (old, new) in changes.items())
        raise UsageError(
            f"resuming {out} with settings that define another run ({listed}): its losses would mix two "
            "runs; use another --out, or --resume force to continue anyway (recorded in metrics.jsonl)"
        )
    return changes


def apply_optimizer_settings(optim: Any, settings: Settings) -> dict[str, list]:
    """Set this command's lr on the restored optimizer's param groups; the changes as {name: [old, new]}."""
    old = {group["lr"] for group in optim.param_groups}
    for group in optim.param_groups:
        group["lr"] = settings.lr
    if old == {settings.lr}:
        return {}
    log.info(
        "autoshard train: --lr %g applies from here on (the checkpoint's optimizer had %s)",
        settings.lr,
        ", ".join(f"{lr:g}" for lr in sorted(old)),
    )
    return {"lr": [sorted(old)[0] if len(old) == 1 else sorted(old), settings.lr]}
