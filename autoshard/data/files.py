"""Which files `--data PATH` names and how their tokens are read, without reading the corpus.

PATH is a file, a directory (every data file under it, recursively, in sorted order) or a glob.
Token files are memory-mapped (numpy), never read whole: `.npy`, and flat little-endian `.bin`
(nanoGPT's: raw uint16/uint32; llm.c's: a 256-int32 header, magic 20240520, then the tokens).
Text files (`.txt`, `.jsonl`/`.json`, `.parquet`) are tokenized once by `autoshard.data.text`.
Every check here is cheap and alike on every rank: a bad path is one `UsageError` before planning.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autoshard.options import UsageError

TOKEN_SUFFIXES = (".bin", ".npy")
TEXT_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
DTYPES = ("auto", "uint16", "uint32")
LLMC_MAGIC = 20240520  # llm.c's header: magic, version (1: uint16, 2: uint32), token count, then zeros
LLMC_HEADER_BYTES = 256 * 4


@dataclass(frozen=True)
class DataFile:
    """One file of a corpus: `kind` is "tokens" or "text"."""

    path: Path
    kind: str


def find_files(specs: tuple[str, ...], flag: str = "--data") -> list[DataFile]:
    """The data files that each of `specs` names, in order (a directory's and a glob's sorted);
    UsageError for a path that names nothing usable."""
    found: list[DataFile] = []
    for spec in specs:
        if any(c in spec for c in "*?["):
            paths = [Path(p) for p in sorted(glob.glob(os.path.expanduser(spec), recursive=True))]
            files = [_data_file(p) for p in paths if p.is_file()]
            if not files:
                raise UsageError(f"{flag} {spec}: the pattern matches no file")
        else:
            path = Path(spec).expanduser()
            if not path.exists():
                raise UsageError(f"{flag} {spec}: no such file or directory")
            if path.is_dir():
                under = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _SUFFIXES)
                files = [
                    _data_file(p) for p in under if not any(part.startswith(".") for part in p.relative_to(path).parts)
                ]
                if not files:
                    raise UsageError(f"{flag} {spec}: the directory holds no data file ({', '.join(_SUFFIXES)})")
            else:
                files = [_data_file(path)]
        found += [f for f in files if f is not None]
    if not found:
        raise UsageError(f"{flag}: no data file among {', '.join(specs)} ({', '.join(_SUFFIXES)})")
    return found


_SUFFIXES = TOKEN_SUFFIXES + TEXT_SUFFIXES


def _data_file(path: Path) -> DataFile:
    suffix = path.suffix.lower()
    if suffix in TOKEN_SUFFIXES:
        return DataFile(path, "tokens")
    if suffix in TEXT_SUFFIXES:
        return DataFile(path, "text")
    raise UsageError(
        f"{path}: unknown data file type {suffix or '(no suffix)'}: token files are "
        f"{', '.join(TOKEN_SUFFIXES)}, text files {', '.join(TEXT_SUFFIXES)}"
    )


def token_dtype(flag: str, vocab_size: int) -> np.dtype:
    """A flat `.bin`'s token type: `--data-dtype`, or by the vocabulary (uint16 when it fits)."""
    if flag != "auto":
        return np.dtype(flag).newbyteorder("<")
    return np.dtype("<u2" if vocab_size <= 2**16 else "<u4")


def open_tokens(path: Path, dtype_flag: str, vocab_size: int) -> np.ndarray:
    """The tokens of a token file as a read-only 1-D memory map (never read whole)."""
    if path.suffix.lower() == ".npy":
        try:
            array = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as err:
            raise UsageError(f"{path}: not a .npy array ({err})") from None
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise UsageError(f"{path}: a token .npy is one flat integer array, this one is {array.dtype} {array.shape}")
        return array
    size = path.stat().st_size
    offset, dtype = 0, token_dtype(dtype_flag, vocab_size)
    header = _llmc_header(path, size)
    if header is not None:
        offset, dtype = LLMC_HEADER_BYTES, np.dtype("<u2" if header[1] == 1 else "<u4")
    if (size - offset) % dtype.itemsize:
        raise UsageError(f"{path}: {size - offset} bytes is not a whole number of {dtype.name} tokens (--data-dtype)")
    if size == offset:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset)


def _llmc_header(path: Path, size: int) -> np.ndarray | None:
    """llm.c's header when the file has one whose token count matches its size, else None."""
    if size < LLMC_HEADER_BYTES:
        return None
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(LLMC_HEADER_BYTES), dtype="<i4")
    if header[0] != LLMC_MAGIC or header[1] not in (1, 2):
        return None
    itemsize = 2 if header[1] == 1 else 4
    return header if LLMC_HEADER_BYTES + int(header[2]) * itemsize == size else None


def check_range(array: np.ndarray, path: Path, vocab_size: int, sample: int = 1 << 20) -> None:
    """The first `sample` tokens lie in the model's vocabulary: a cheap look that catches a wrong
    --data-dtype or a corpus of another tokenizer before planning (the rest is checked per batch)."""
    head = np.asarray(array[:sample])
    if head.size and (int(head.max()) >= vocab_size or int(head.min()) < 0):
        bad = int(head.max()) if int(head.max()) >= vocab_size else int(head.min())
        raise UsageError(
            f"{path}: token {bad} is outside the model's vocabulary of {vocab_size} "
            "(another tokenizer's corpus, or the wrong --data-dtype; --vocab-size or --tokenizer sets "
            "a llama3 model's vocabulary)"
        )
