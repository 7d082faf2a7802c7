"""Distributed checkpoints of a training run (torch's DCP): `RUN/checkpoints/step-NNNNNN/`.

A checkpoint is written to `step-NNNNNN.tmp/` and renamed once every rank's part and DCP's
metadata are on disk, so a `step-*` directory is complete unless the disk lost it since. Saves
are asynchronous by default (DCP's `async_save` on a process group of their own: the next steps
run while it writes), at most one in flight; rank 0 renames a finished one and deletes the oldest
beyond `keep`. Resuming takes the newest checkpoint that loads, warning about any it skips. A save
the disk refuses (full, read-only) stops the run with one `CheckpointWriteError` line; its
temporary directory is removed and the newest complete checkpoint stays as it was.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import statistics
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch.distributed as dist

from autoshard.options import UsageError
from autoshard.train.disk import reason, write_error

log = logging.getLogger("autoshard")

_CKPT = re.compile(r"^step-(\d+)$")
STEP_FILE = "step.json"  # written last, into the temporary directory: marks a finished save


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: its step, directory, and the torchrun job that wrote it (the run id
    torchrun gives every attempt of one job; None outside torchrun)."""

    step: int
    path: Path
    run_id: str | None = None
    data: dict | None = None  # the feed's position (`Feed.state_dict`), None from a checkpoint without one


def checkpoint_dir(root: Path, step: int, *, temporary: bool = False) -> Path:
    """Where checkpoint `step` lives under `root` (RUN/checkpoints), or is written before its rename."""
    return root / f"step-{step:06d}{'.tmp' if temporary else ''}"


def checkpoints(out: Path) -> list[Checkpoint]:
    """The complete checkpoints of run directory `out`, newest first."""
    found = []
    for path in (out / "checkpoints").glob("step-*"):
        if (m := _CKPT.match(path.name)) and (path / STEP_FILE).is_file():
            try:
                record = json.loads((path / STEP_FILE).read_text())
                run_id, data = record.get("run_id"), record.get("data")
            except (OSError, ValueError, AttributeError):
                continue  # not one of ours, or damaged: not complete
            found.append(Checkpoint(int(m.group(1)), path, run_id, data if isinstance(data, dict) else None))
    return sorted(found, key=lambda c: c.step, reverse=True)


def latest_checkpoint(out: Path) -> Checkpoint | None:
    """The newest complete checkpoint in run directory `out`."""
    found = checkpoints(out)
    return found[0] if found else None


def _options(flat: bool):
    """The optimizer's param groups keyed by parameter name (`optim.param_groups.<fqn>.lr`), not by
    group index: a pipeline's ranks hold different groups under the same index, which DCP would
    keep one of. Checkpoints written before this keep the index form (`flat=False` reads them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=flat)


def _state(pmodel, optim, flat: bool = True) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(pmodel, optim, options=_options(flat))
    return {"model": model_state, "optim": optim_state}


def _indexed_groups(metadata) -> bool:
    """Whether a checkpoint keeps its param groups by index (`optim.param_groups.0.params`)."""
    return any(k.startswith("optim.param_groups.") and k.endswith(".params") for k in metadata.state_dict_metadata)


def load_checkpoint(path: Path, pmodel, optim) -> None:
    """Every rank calls this: the model's and the optimizer's state from checkpoint `path`. A part
    that cannot be read raises on every rank alike (DCP gathers the ranks' errors). Its pickled
    pieces are read as `safe_metadata` does (every rank reads `.metadata` itself, so a crafted one
    is refused by all alike, before DCP starts), never by torch's unrestricted unpicklers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from autoshard import _torch_compat as tc
    from autoshard.train.safe_metadata import load_value, read_metadata

    metadata = read_metadata(path)
    flat = not _indexed_groups(metadata)
    state = _state(pmodel, optim, flat)
    dcp.load(
        state,
        storage_reader=tc.dcp_reader(path, metadata),
        planner=tc.dcp_planner(lambda value, file: load_value(value, str(path / file))),
    )
    set_state_dict(
        pmodel, optim, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_options(flat)
    )


def resume_newest(out: Path, pmodel, optim) -> Checkpoint | None:
    """Every rank calls this: load the newest checkpoint of `out` that loads; one warning line per
    one skipped. None when there is none; ValueError when there are some but none loads, and
    UnsafeCheckpointError at once for a crafted one (not skipped: someone is tampering with it)."""
    from torch.distributed.checkpoint import CheckpointException  # a BaseException, not an Exception

    from autoshard.train.safe_metadata import UnsafeCheckpointError

    found = checkpoints(out)
    errors = []
    for ckpt in found:
        try:
            load_checkpoint(ckpt.path, pmodel, optim)
        except UnsafeCheckpointError:
            raise
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - also OSError, KeyError, RuntimeError...
            unsafe = [f for f in _failures(err) if isinstance(f, UnsafeCheckpointError)]
            if unsafe:  # a value DCP read refused (on some rank): the same error on every rank
                raise unsafe[0] from None
            reason = _reason(err)
            errors.append(f"{ckpt.path.name}: {reason}")
            log.warning(
                "autoshard train: warning: checkpoint %s cannot be loaded (%s); trying the one before",
                ckpt.path,
                reason,
            )
            continue
        return ckpt
    if found:
        raise ValueError(f"no checkpoint in {out / 'checkpoints'} can be loaded ({'; '.join(errors)})")
    return None


def _failures(err: BaseException) -> list[BaseException]:
    """The ranks' own errors inside a CheckpointException (rank -> exception or (exception, traceback))."""
    failures = getattr(err, "failures", None) or {}
    return [f[0] if isinstance(f, tuple) else f for f in failures.values()]


def _reason(err: BaseException) -> str:
    """One line on why a checkpoint did not load: the last line of the first failing rank's error."""
    failures = getattr(err, "failures", None)  # CheckpointException: rank -> (exception, traceback)
    if failures:
        rank, failure = next(iter(failures.items()))
        first = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {type(first).__name__}: {' '.join(str(first).split())[:160]}"
    return f"{type(err).__name__}: {' '.join(str(err).split())[:160]}"


class CheckpointWriteError(UsageError):
    """The disk refused a checkpoint (no space, read-only, no permission): the user's to fix, one
    line naming the cause and the newest complete checkpoint, which the failed save left intact."""


class Checkpointer:
    """Saves of one run, made by every rank alike. `keep`: complete checkpoints kept (0: all);
    `asynchronous`: DCP's async_save on a gloo group of its own, at most one save in flight."""

    def __init__(self, out: Path, keep: int, asynchronous: bool):
        self.root = out / "checkpoints"
        self.keep = keep
        self.group = dist.new_group(backend="gloo") if asynchronous else None  # collective: every rank
        self.pending: tuple[int, Path, Future, dict | None] | None = None
        if dist.get_rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("step-*.tmp"):  # a save a killed run left unfinished
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()

    def save(self, step: int, pmodel, optim, *, data: dict | None = None, wait: bool = False) -> Path:
        """Checkpoint `step` (the state after its optimizer step, and `data`, the feed's position,
        as JSON); `wait`: return only once it is complete (the run stops after it). Returns the
        directory it has once complete."""
        import torch.distributed.checkpoint as dcp

        final = checkpoint_dir(self.root, step)
        if self.pending is not None and self.pending[0] == step:  # already being written
            if wait:
                self.finish()
            return final
        self.finish()
        tmp = checkpoint_dir(self.root, step, temporary=True)
        with self._writing(step, tmp):
            if self.group is None or wait:
                dcp.save(_state(pmodel, optim), checkpoint_id=str(tmp))
                self._complete(step, tmp, data)
            else:  # the state is staged (copied) now; the writing overlaps the next steps
                future = dcp.async_save(_state(pmodel, optim), checkpoint_id=str(tmp), process_group=self.group)
                self.pending = (step, tmp, future, data)
        return final

    def poll(self) -> None:
        """Complete a save that has finished writing (cheap; call once a step)."""
        if self.pending is not None and self.pending[2].done():
            self.finish()

    def finish(self) -> None:
        """Wait for the save in flight, if any, and complete it."""
        if self.pending is not None:
            step, tmp, future, data = self.pending
            self.pending = None
            with self._writing(step, tmp):
                future.result()  # on rank 0 this returns once every rank's part and the metadata are written
                self._complete(step, tmp, data)

    @contextlib.contextmanager
    def _writing(self, step: int, tmp: Path) -> Iterator[None]:
        """Around the writing of checkpoint `step` into `tmp`: a failure removes `tmp` (rank 0),
        and one the disk explains (every rank gets DCP's gathered failures) becomes a
        CheckpointWriteError naming the newest complete checkpoint; any other is raised as it is."""
        from torch.distributed.checkpoint import CheckpointException  # a BaseException, not an Exception

        try:
            yield
        except (OSError, CheckpointException) as err:
            cause = write_error(err, tmp if tmp.is_dir() else self.root)  # before removing: the disk still full
            if dist.get_rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # never a complete checkpoint: no step.json, and gone
            if cause is None:
                raise
            newest = self.newest
            raise CheckpointWriteError(
                f"cannot write checkpoint {checkpoint_dir(self.root, step)}: {reason(cause)}; the newest "
                "complete checkpoint is "
                + (f"{newest.path}, intact (the same command resumes from it)" if newest is not None else "none")
            ) from None

    def _complete(self, step: int, tmp: Path, data: dict | None) -> None:
        if dist.get_rank() != 0:
            return
        record = {"step": step, "run_id": os.environ.get("TORCHELASTIC_RUN_ID"), "data": data}
        (tmp / STEP_FILE).write_text(json.dumps(record))
        final = checkpoint_dir(self.root, step)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if self.keep:
            for old in checkpoints(self.root.parent)[self.keep :]:  # never the newest: keep >= 1
                shutil.rmtree(old.path, ignore_errors=True)

    @property
    def newest(self) -> Checkpoint | None:
        """The newest complete checkpoint (as rank 0 sees the directory)."""
        return latest_checkpoint(self.root.parent)

    def newest_good(self, logged: list[tuple[int, float]]) -> Checkpoint | None:
        """The newest complete checkpoint whose weights trained on: the first loss logged after
        its step (`logged`: this run's (step, loss) rows, the failing one included) is finite and
        under twice the median of the last ten logged at or before it (when there are any)."""
        for ckpt in checkpoints(self.root.parent):
            after = [loss for step, loss in logged if step > ckpt.step]
            if not after:
                continue
            before = [loss for step, loss in logged if step <= ckpt.step][-10:]
            median = statistics.median(before) if before else math.inf
            if math.isfinite(after[0]) and after[0] < (2 * median if median > 0 else math.inf):
                return ckpt
        return None
