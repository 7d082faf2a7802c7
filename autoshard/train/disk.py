"""Where a run writes, and what to tell the user when the disk refuses: a `--out` that cannot be a
run directory is one error line before planning (on every rank alike, before the process group
exists), and a write that failed is traced to the disk's own error (full, read-only, no
permission) so that the run stops with one line instead of a traceback. Any other failure is a
bug and keeps its traceback."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from autoshard.options import UsageError

PROBE_BYTES = 2**20  # a failed write fills the disk to its last block: this much no longer fits


def check_out(out: Path, checkpoints: bool) -> None:
    """UsageError unless `out` is a directory this process can write into, or can be made one
    (its nearest existing ancestor a writable directory); with `checkpoints`, the same for an
    existing `out/checkpoints`. Cheap: every rank checks before planning (minutes) and before the
    process group, so a bad --out fails every rank alike."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory")
    existing = next((p for p in (out, *out.absolute().parents) if p.exists()), None)
    if existing is None:
        return  # nothing exists up to the root: the mkdir says why
    if not existing.is_dir():
        raise UsageError(f"--out {out}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out}: {existing} is not writable")
    try:  # what access() cannot tell: a read-only or virtual file system (/proc)
        os.rmdir(tempfile.mkdtemp(prefix=".autoshard-probe-", dir=existing))
    except OSError as err:
        raise UsageError(f"--out {out}: cannot write into {existing} ({reason(err)})") from None
    root = out / "checkpoints"
    if root.exists() and not root.is_dir():
        raise UsageError(f"--out {out}: {root} exists and is not a directory")
    if checkpoints and root.is_dir() and not os.access(root, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out}: {root} is not writable (--checkpoint-every writes there)")


def write_error(err: BaseException, directory: Path) -> OSError | None:
    """The disk's error behind a failed write: an OSError the write raised (DCP's
    CheckpointException carries each rank's failure), else what writing into `directory` raises
    now (torch.save reports a short write on a full disk as a RuntimeError, 'unexpected pos').
    None when the disk takes writes: then the failure is not the disk's."""
    failures = getattr(err, "failures", None)  # CheckpointException: rank -> exception (and traceback)
    causes = [f[0] if isinstance(f, tuple) else f for f in failures.values()] if failures else [err]
    for cause in causes:
        if isinstance(cause, OSError):
            return cause
    return probe(directory)


def probe(directory: Path, size: int = PROBE_BYTES) -> OSError | None:
    """Write `size` bytes into a scratch file in `directory` (removed again): the OSError that
    raises (no space, read-only, no permission, no such directory), or None when it succeeds."""
    path = directory / f".autoshard-write-probe-{os.getpid()}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError as err:
        return err
    try:
        try:
            block, left = bytes(min(size, 2**16)), size
            while left > 0:
                written = os.write(fd, block[: min(left, len(block))])  # a short write: the next one says why
                if written == 0:
                    break
                left -= written
            os.fsync(fd)  # a network filesystem may report a full disk only here
        finally:
            os.close(fd)
    except OSError as err:
        return err
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
    return None


def reason(err: OSError) -> str:
    """'No space left on device': the cause in the system's words."""
    return err.strerror or str(err)
