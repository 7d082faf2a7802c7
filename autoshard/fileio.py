"""The small files autoshard reads and writes (plans, profiles, reports, configs, run state): a JSON
file read with one error line naming the file and what is wrong with it, and a file written whole
or not at all (a temporary file beside it, renamed into place), so that a reader, or a run that
was killed, never sees half a file. Imports nothing of autoshard: stages and drivers alike use it.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from pathlib import Path
from typing import IO, Any, Iterator


def read_json(path: str | os.PathLike, *, name: str | None = None, error: type[ValueError] = ValueError) -> Any:
    """The JSON value in `path`. Anything in the way is one `error` (ValueError, or a caller's
    subclass such as `options.UsageError`): "NAME: no such file", "NAME: cannot read it (...)" or
    "NAME: not JSON (...)", NAME the path unless `name` says how the user knows the file."""
    label = str(path) if name is None else name
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{label}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise error(f"{label}: cannot read it ({type(err).__name__}: {err})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise error(f"{label}: not JSON ({err})") from None


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w") -> Iterator[IO[Any]]:
    """A file to write `path` through ("w" text in UTF-8, or "wb"): it takes the name `path` only
    once the block ends without an error; otherwise it is removed and `path` is left as it was.
    The temporary name is fresh and opened with "x" (not `tempfile.mkstemp`, whose files are
    0600), so the file gets the usual umask permissions."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes a whole file: mode 'w' or 'wb', got {mode!r}")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, mode.replace("w", "x"), encoding=None if "b" in mode else "utf-8") as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: str | os.PathLike, content: str | bytes) -> Path:
    """Write `content` (text in UTF-8, or bytes) to `path` whole or not at all (`atomic_open`)."""
    with atomic_open(path, "wb" if isinstance(content, bytes) else "w") as f:
        f.write(content)
    return Path(path)
