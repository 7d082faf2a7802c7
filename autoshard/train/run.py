"""What a run is, resolved before the process group and planning, alike on every rank: the model
(its vocabulary fitted to the data), the data opened and checked, the weights to start from, the
run directory's state (fresh, overwritten or resumed), the plan file planning may reuse, and what a
resume changes. Every bad input here is one `UsageError` on every rank, before anything is written."""

from __future__ import annotations

import netrc
import os
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoshard.data import Corpus, DataConfig, Instructions, Synthetic, fitted_vocab, open_data, with_layout
from autoshard.data.fingerprint import data_fingerprint
from autoshard.data.text import Tokenizer, load_tokenizer
from autoshard.options import UsageError
from autoshard.profiles.files import device_profile, network_profile
from autoshard.report.files import JSON_NAME, METRICS_NAME
from autoshard.train.disk import check_out
from autoshard.train.metrics import metrics_rows
from autoshard.train.planfile import PlanFile
from autoshard.train.resume import resume_check, run_changes
from autoshard.train.rundir import RunDirLock, first_attempt, refuse_earlier_run
from autoshard.train.settings import Settings
from autoshard.workloads import CheckpointSlices, Start, Workload, get_workload
from autoshard.workloads.finetune import fine_tuned


@dataclass(frozen=True)
class ResolvedRun:
    """A run before planning. `settings.vocab_size` records the vocabulary the model is built with
    (for resuming and exporting); `data` is None when the caller brings its own."""

    settings: Settings
    workload: Workload
    data: Corpus | Synthetic | Instructions | None
    initial: Start
    overwrite: bool  # start over in an --out that holds an earlier run
    resuming: bool  # --out holds a checkpoint to continue from
    plan_file: PlanFile | None  # whose solution planning takes: --plan-file, or the resumed run's own
    data_fingerprint: dict[str, Any] = field(default_factory=dict)  # what the data is (recorded in plan.json)
    own_settings: dict[str, Any] = field(default_factory=dict)  # the resumed run's settings (its plan.json)
    changes: dict[str, list] = field(default_factory=dict)  # run-defining settings a forced resume changes

    @property
    def out(self) -> Path:
        return Path(self.settings.out)


def resolve(settings: Settings, *, own_data: bool = False) -> ResolvedRun:
    """Every check of the command's input, in the order a user fixes them; `own_data`: the caller
    hands in its data (no --data to open)."""
    out = Path(settings.out)
    check_out(out, settings.checkpoint_every > 0)  # first: a bad --out fails every rank alike
    tokenizer = load_tokenizer(settings.tokenizer) if settings.tokenizer else None
    workload, settings = _model(settings, tokenizer)
    data_config = with_layout(DataConfig.from_settings(settings), workload)  # pack or pad: what the model can
    data = None if own_data else open_data(data_config, workload, tokenizer)
    if isinstance(data, Instructions):  # packed rows: the model takes positions too
        workload = data.model_workload(workload)
    fingerprint = data_fingerprint(data_config, tokenizer.digest if tokenizer is not None else None)
    initial = _initial_values(settings, workload)  # every rank: a bad checkpoint fails them together
    overwrite = settings.overwrite and first_attempt()  # a restart resumes what this job wrote
    RunDirLock(out).refuse_if_held()  # every rank, before anything else about --out: "in use" says it all
    resuming = not overwrite and resume_check(settings, out)
    if not resuming and not overwrite:
        refuse_earlier_run(out)
    if resuming and (out / METRICS_NAME).is_file():
        metrics_rows(out / METRICS_NAME, warn=False)  # a damaged row: one error now, not after planning
    own = _own_plan(out) if resuming else None  # read before rank 0 rewrites it: a refusal fails all ranks
    own_settings = own.settings if own is not None else {}
    changes = run_changes(settings, own_settings, out, (own.data, fingerprint)) if own is not None else {}
    plan_file = own
    if settings.plan_file:
        plan_file = PlanFile.read(Path(settings.plan_file), f"--plan-file {settings.plan_file}", required=True)
    _check_profiles(settings)
    _check_wandb(settings.wandb)
    return ResolvedRun(
        settings, workload, data, initial, overwrite, resuming, plan_file, fingerprint, own_settings, changes
    )


def _model(settings: Settings, tokenizer: Tokenizer | None) -> tuple[Workload, Settings]:
    """The workload as it is built: resized to `--vocab-size` or the tokenizer's vocabulary where
    it can be, the settings recording that vocabulary."""
    try:
        workload = get_workload(settings.model, settings.seq)  # ValueError names the known models
    except ValueError as err:
        raise UsageError(str(err)) from None
    vocab = fitted_vocab(settings.vocab_size, tokenizer, workload, settings.tokenizer or "")
    if vocab is not None and vocab != workload.vocab_size:
        assert workload.resize_vocab is not None  # fitted_vocab refuses otherwise
        workload = workload.resize_vocab(vocab)
    try:
        workload = fine_tuned(workload, settings.fine_tune)  # --lora, --freeze
    except ValueError as err:
        raise UsageError(str(err)) from None
    return workload, settings if vocab is None else settings.replace(vocab_size=vocab)


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


def _check_wandb(project: str | None) -> None:
    """`--wandb` online needs an API key (WANDB_API_KEY, or `wandb login`'s netrc entry): say so
    now rather than after planning."""
    if project is None or os.environ.get("WANDB_MODE", "online") in ("offline", "disabled", "dryrun"):
        return
    if os.environ.get("WANDB_API_KEY"):
        return
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        if netrc.netrc(os.environ.get("NETRC")).authenticators(host or ""):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    raise UsageError(
        f"--wandb {project}: no W&B API key (set WANDB_API_KEY or run `wandb login`; WANDB_MODE=offline logs "
        "without one)"
    )


def _own_plan(out: Path) -> PlanFile | None:
    """The run's own plan.json, reused on resume when it solves the same problem (the same plan
    gives the same losses); ignored when unreadable or made for another problem."""
    try:
        return PlanFile.read(out / JSON_NAME, f"{out / JSON_NAME} (resuming)", required=False)
    except UsageError:
        return None
