"""Resuming a run honours or refuses, never silently mixes: whether to look for a checkpoint at all,
the settings that define a run's losses (a change refuses unless `--resume force`, which records it
in metrics.jsonl), and the optimizer settings of this command applied to the restored optimizer
(a checkpoint's param groups carry the old run's; a resume with a lower --lr must use it), each
change recorded in metrics.jsonl. The lr schedule is rebuilt from the command line at the resumed
step (`autoshard.train.optimizer.at_step`)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from autoshard.data.fingerprint import describe_change
from autoshard.options import UsageError
from autoshard.train.checkpoints import latest_checkpoint
from autoshard.train.optimizer import decays
from autoshard.train.settings import Settings

log = logging.getLogger("autoshard")

# what a run's data and model are: resuming with another value would mix two runs' losses (the data
# files and the tokenizer are compared by content: `autoshard.data.fingerprint`)
RUN_DEFINING = ("model", "seq", "batch", "vocab_size", "val_fraction", "data_seed", "lora", "freeze")
# what shapes the updates beside the optimizer's param groups: the command line's applies on resume
SCHEDULE = ("steps", "lr_schedule", "warmup_steps", "min_lr", "decay_fraction", "grad_clip")


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


def run_changes(
    settings: Settings, saved: dict[str, Any], out: Path, data: tuple[dict | None, dict] = (None, {})
) -> dict[str, list]:
    """The run-defining settings this command changes against the run it resumes (`saved`: that
    run's settings from its plan.json; `data`: the fingerprints of its data and of this command's,
    the first None for a run that recorded none), as {name: [old, new]} ({"data": [what differs]}
    for the data). UsageError naming each unless `--resume force`."""
    now = {name: _as_json(getattr(settings, name)) for name in RUN_DEFINING}  # plan.json keeps tuples as lists
    changes = {name: [saved[name], now[name]] for name in RUN_DEFINING if name in saved and saved[name] != now[name]}
    listed = [f"--{name.replace('_', '-')} {old} -> {new}" for name, (old, new) in changes.items()]
    if data[0] is not None and data[0] != data[1]:
        changes["data"] = describe_change(data[0], data[1]) or ["the data changed"]
        listed += changes["data"]
    if changes and settings.resume != "force":
        listed = "; ".join(listed)
        raise UsageError(
            f"resuming {out} with settings that define another run ({listed}): its losses would mix two "
            "runs; use another --out, or --resume force to continue anyway (recorded in metrics.jsonl)"
        )
    return changes


def _as_json(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def apply_optimizer_settings(optim: Any, settings: Settings, saved: dict[str, Any] | None = None) -> dict[str, list]:
    """Set this command's optimizer settings on the restored optimizer's param groups (lr, and the
    `initial_lr` its schedule starts from; betas; weight decay on the groups that decay); with the
    resumed run's settings (`saved`), its schedule and clipping too. The changes as {name: [old, new]}."""
    changes = {}
    # the peak lr the checkpoint's schedule started from (its groups' lr is that of its last step)
    old_lrs = sorted({group.get("initial_lr", group["lr"]) for group in optim.param_groups})
    old_betas = sorted({tuple(group["betas"]) for group in optim.param_groups})
    decaying = [g for g in optim.param_groups if all(decays(p) for p in g["params"])]
    old_decay = sorted({group["weight_decay"] for group in decaying})
    for group in optim.param_groups:
        group["lr"] = group["initial_lr"] = settings.lr
        group["betas"] = tuple(settings.betas)
    for group in decaying:
        group["weight_decay"] = settings.weight_decay
    if old_lrs != [settings.lr]:
        changes["lr"] = [_one(old_lrs), settings.lr]
        log.info(
            "autoshard train: --lr %g applies from here on (the checkpoint's optimizer had %s)",
            settings.lr,
            ", ".join(f"{lr:g}" for lr in old_lrs),
        )
    if old_betas != [tuple(settings.betas)]:
        changes["betas"] = [_one([list(b) for b in old_betas]), list(settings.betas)]
    if decaying and old_decay != [settings.weight_decay]:
        changes["weight_decay"] = [_one(old_decay), settings.weight_decay]
    for name in SCHEDULE:
        if saved and name in saved and saved[name] != getattr(settings, name):
            changes[name] = [saved[name], getattr(settings, name)]
    for name, (old, new) in changes.items():
        if name != "lr":
            flag = f"--{name.replace('_', '-')}"
            log.info("autoshard train: %s %s applies from here on (the resumed run had %s)", flag, new, old)
    return changes


def _one(values: list) -> Any:
    return values[0] if len(values) == 1 else values
