"""What a run's data is, as a resume compares it: for each file of `--data` and `--val-data` its
size and a digest of sampled blocks, and the tokenizer's digest. Reading a few blocks per file
keeps it to seconds on a terabyte corpus; the paths themselves are left out, so the same files
under another spelling (relative, absolute, a trailing slash, moved) are the same data."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from autoshard.data.files import find_files

BLOCK = 1 << 16  # bytes read per sample
SAMPLES = 32  # blocks spread evenly over a file larger than SAMPLES blocks (the first and last among them)


def file_digest(path: Path) -> str:
    """blake2b of the file's size and of SAMPLES + 1 evenly spaced blocks (the whole of a small file)."""
    size = path.stat().st_size
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    with path.open("rb") as f:
        if size <= (SAMPLES + 1) * BLOCK:
            h.update(f.read())
        else:
            for k in range(SAMPLES + 1):
                f.seek((size - BLOCK) * k // SAMPLES)
                h.update(f.read(BLOCK))
    return h.hexdigest()


def data_fingerprint(config: Any, tokenizer_digest: str | None) -> dict[str, Any]:
    """{"data": [[size, digest], ...], "val_data": ..., "tokenizer": digest}, for what the run has
    (empty without --data)."""
    found: dict[str, Any] = {}
    for name, flag in (("data", "--data"), ("val_data", "--val-data")):
        specs = getattr(config, name)
        if specs:
            found[name] = [[f.path.stat().st_size, file_digest(f.path)] for f in find_files(specs, flag)]
    if tokenizer_digest is not None:
        found["tokenizer"] = tokenizer_digest
    return found


def describe_change(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two fingerprints, in words (empty: the same data)."""
    said = []
    for name, flag in (("data", "--data"), ("val_data", "--val-data")):
        before, after = old.get(name) or [], new.get(name) or []
        if before == after:
            continue
        if len(before) != len(after):
            said.append(f"{flag}: {len(after)} files, the run's had {len(before)}")
        else:
            changed = sum(a != b for a, b in zip(before, after))
            said.append(f"{flag}: {changed} of its {len(after)} files differ from the run's (size or content)")
    if old.get("tokenizer") != new.get("tokenizer"):
        said.append("--tokenizer: not the run's tokenizer (its tokenizer.json or EOS token differ)")
    return said
