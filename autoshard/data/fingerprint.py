"""What a run's data is, as a resume compares it: for each file of `--data` and `--val-data` its
size and a digest of sampled blocks, and the tokenizer's digest. Reading a few blocks per file
keeps it to seconds on a terabyte corpus; the paths themselves are left out, so the same files
under another spelling (relative, absolute, a trailing slash, moved) are the same data."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from autoshard.data.files import find_files
from autoshard.data.instruct import chat_template
from autoshard.data.instruction_feed import instruction_files

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
    if config.data and instruction_files(find_files(config.data, "--data"), "--data"):
        found["instruction"] = instruction_fingerprint(config)
    return found


def instruction_fingerprint(config: Any) -> dict[str, Any]:
    """What else makes instruction data's rows: the loss's tokens, the layout, the chat template."""
    spec = Path(config.tokenizer).expanduser() if config.tokenizer else None
    template = chat_template(spec / "tokenizer.json" if spec.is_dir() else spec) if spec is not None else None
    return {
        "loss_on": config.loss_on or "completion",
        "layout": config.instruction_layout or "pack",
        "chat_template": template.digest if template is not None else None,
    }


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
    before, after = old.get("instruction") or {}, new.get("instruction") or {}
    for key, flag in (("loss_on", "--loss-on"), ("layout", "--instruction-layout")):
        if before.get(key) != after.get(key):
            said.append(f"{flag} {after.get(key)}: the run's was {before.get(key)}")
    if before.get("chat_template") != after.get("chat_template"):
        said.append("--tokenizer: its chat template (tokenizer_config.json) is not the run's")
    return said
