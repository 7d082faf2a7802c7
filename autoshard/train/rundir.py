"""A run directory belongs to one run at a time, and a fresh start never replaces an earlier run's
files without being asked: a lock file (pid, host, start time) held while a run writes into the
directory, and a refusal of a directory that holds an earlier run unless `--overwrite`.

A lock left by a run that died (a dead pid on this host) is taken over with a warning, as is the
lock of this very torchrun job's earlier attempt (a restart). A lock held from another host cannot
be checked from here: the refusal names the file to remove once that run is gone."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch.distributed as dist

from autoshard.options import UsageError

log = logging.getLogger("autoshard")

LOCK_NAME = "autoshard.lock"
RUN_FILES = ("metrics.jsonl", "plan.json", "report.html", "sharding.log", "checkpoints", "tokenizer")  # a run's
# what the optional loggers write beside them: removed with the run it belongs to, not named in a refusal
RUN_LOGS = ("tensorboard", "wandb")


def first_attempt() -> bool:
    """Whether this process is the job's first attempt (not a torchrun restart, whose run
    directory holds the files the job's earlier attempts wrote)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0


def earlier_run_files(out: Path) -> list[str]:
    """The files of a run in `out` (an empty checkpoints directory does not count)."""
    found = []
    for name in RUN_FILES:
        path = out / name
        if (path.is_dir() and any(path.iterdir())) or path.is_file():
            found.append(name)
    return found


def refuse_earlier_run(out: Path) -> None:
    """A fresh start must not replace another run's files: UsageError naming them, unless this is
    a restart of the job that wrote them or that run never ran a step."""
    found = earlier_run_files(out) if first_attempt() and _trained(out) else []
    if found:
        raise UsageError(
            f"--out {out} holds an earlier run ({', '.join(found)}) and no checkpoint to resume from; "
            "choose another --out, or --overwrite to replace that run"
        )


def _trained(out: Path) -> bool:
    """Whether a run in `out` ran a step: a metrics row or a checkpoint (a start that failed after
    planning leaves only the plan and its report, which a fresh start may replace)."""
    metrics, saved = out / "metrics.jsonl", out / "checkpoints"
    return (metrics.is_file() and metrics.stat().st_size > 0) or (saved.is_dir() and any(saved.iterdir()))


def remove_earlier_run(out: Path) -> None:
    """Delete what an earlier run wrote into `out` (`--overwrite`), nothing else."""
    removed = earlier_run_files(out)
    removed += [name for name in RUN_LOGS if removed and (out / name).exists()]
    for name in removed:
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    if removed:
        log.warning("autoshard train: --overwrite: removed the earlier run's %s from %s", ", ".join(removed), out)


@dataclass(frozen=True)
class LockHolder:
    """Who holds a run directory: enough to tell a live run from a dead one on this host."""

    pid: int
    host: str
    started: str
    job: str | None  # torchrun's run id
    proc_start: str | None  # /proc's start time of `pid`: a reused pid is another process

    @staticmethod
    def me() -> LockHolder:
        return LockHolder(
            os.getpid(),
            socket.gethostname(),
            datetime.datetime.now().isoformat(timespec="seconds"),
            os.environ.get("TORCHELASTIC_RUN_ID"),
            _proc_start(os.getpid()),
        )

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}"

    def gone(self) -> bool:
        """Whether the holder certainly no longer runs (only knowable on its own host)."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # another user's process
            return False
        if self.proc_start is None:  # no /proc where it was taken: the pid lives, so does the run
            return False
        return _proc_start(self.pid) != self.proc_start  # ended (a zombie), or the pid is another's now


def _proc_start(pid: int) -> str | None:
    """The start time of `pid` from /proc (None: no /proc, or a zombie: a process that ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return None if fields[0] == "Z" else fields[19]


class RunDirLock:
    """The lock file of run directory `out`, created atomically with its contents (a file linked
    into place), so that a reader never sees it half-written."""

    def __init__(self, out: Path):
        self.out = out
        self.path = out / LOCK_NAME
        self.me = LockHolder.me()

    def acquire(self) -> None:
        """Take the lock, or raise UsageError naming the live run that holds it."""
        self.out.mkdir(parents=True, exist_ok=True)
        staged = self.out / f".{LOCK_NAME}.{self.me.pid}"
        staged.write_text(json.dumps(asdict(self.me)) + "\n")
        try:
            for _ in range(3):  # the holder may come and go while we look
                try:
                    os.link(staged, self.path)
                    return
                except FileExistsError:
                    self._take_over_or_refuse()
            raise UsageError(f"--out {self.out}: could not take the run directory's lock {self.path}")
        finally:
            staged.unlink()

    def refuse_if_held(self) -> LockHolder | None:
        """UsageError naming the holder when another live run holds the lock; else the holder to
        take the lock over from (a run that ended, this job's earlier attempt), or None."""
        holder = self.holder()
        if holder is None:
            return None
        restart = holder.job is not None and holder.job == self.me.job and not first_attempt()
        if not (holder.gone() or restart):
            raise UsageError(
                f"--out {self.out} is in use by another run ({holder.describe()}); wait for it to end or "
                f"choose another --out (if that run is gone, remove {self.path})"
            )
        return holder

    def _take_over_or_refuse(self) -> None:
        holder = self.refuse_if_held()
        if holder is None:  # released meanwhile
            return
        with contextlib.suppress(FileNotFoundError):  # one taker wins the rename, the others retry
            os.rename(self.path, self.out / f".{LOCK_NAME}.stale.{self.me.pid}")
            (self.out / f".{LOCK_NAME}.stale.{self.me.pid}").unlink()
            log.warning("autoshard train: took over %s from a run that ended (%s)", self.path, holder.describe())

    def holder(self) -> LockHolder | None:
        """Who holds the lock now (None: nobody). An unreadable lock file counts as a holder
        nobody can check: it is refused, naming the file."""
        try:
            data = json.loads(self.path.read_text())
            return LockHolder(**data)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError):
            return LockHolder(-1, "an unknown host", "at an unknown time", None, None)

    def release(self) -> None:
        """Remove the lock if it is still ours."""
        if self.holder() == self.me:
            self.path.unlink()


@contextlib.contextmanager
def run_directory(out: Path, overwrite: bool) -> Iterator[None]:
    """Every rank, with the process group up: rank 0 takes the lock of `out` (and, `overwrite`,
    deletes the earlier run's files) and tells the others, so a held directory is every rank's
    one UsageError; the lock is released when the run ends, however it ends."""
    lock = RunDirLock(out) if dist.get_rank() == 0 else None
    verdict: list[str | None] = [None]
    if lock is not None:
        try:
            lock.acquire()
        except UsageError as err:
            verdict = [str(err)]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise UsageError(verdict[0])
    try:
        if lock is not None and overwrite:
            remove_earlier_run(out)
        yield
    finally:
        if lock is not None:
            lock.release()
