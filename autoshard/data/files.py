"""Which files `--data PATH` names and how their tokens are read, without reading the corpus.

PATH is a file, a directory (every data file under it, recursively, in sorted order) or a glob.
Token files are memory-mapped (numpy), never read whole: `.npy`, and flat little-endian `.bin`
(nanoGPT's: raw uint16/uint32; llm.c's: a 256-int32 header, magic 20240520, then the tokens).
Text files (`.txt`, `.jsonl`/`.json`, `.parquet`) are tokenized once by `autoshard.data.text`.
Every check here is cheap and alike on every rank: a bad path is one `UsageError` before planning.
A guess that reads the wrong tokens trains on garbage without a sign, so a guess that a sample
contradicts is an error naming the flag that settles it, never a quiet choice: a headerless `.bin`
read as uint16 whose every second value is 0 (uint32 tokens), an llm.c header whose token count
disagrees with the file's size (truncated). Only regular files are read: a pipe or a device
would hang the ranks or give each other bytes.
"""

from __future__ import annotations

import glob
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autoshard.options import UsageError

TOKEN_SUFFIXES = (".bin", ".npy")
TEXT_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
DTYPES = ("auto", "uint16", "uint32")
LLMC_MAGIC = 20240520  # llm.c's header: magic, version (1: uint16, 2: uint32), token count, then zeros
LLMC_HEADER_BYTES = 256 * 4
PATTERN_BLOCK = 1 << 15  # uint32-sized pairs read per sample of a headerless .bin (128 KiB)
PATTERN_SAMPLES = 8  # samples spread evenly over it, the first and last among them
PATTERN_MIN_PAIRS = 64  # fewer pairs than this say nothing either way
RANGE_HEAD = 1 << 20  # tokens at the start of a token file that `check_range` reads
RANGE_BLOCK = 1 << 16  # and the tokens of each of RANGE_BLOCKS blocks spread evenly after them
RANGE_BLOCKS = 16


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
            files = [_data_file(p, flag) for p in paths if not p.is_dir()]
            if not files:
                raise UsageError(f"{flag} {spec}: the pattern matches no file")
        else:
            path = Path(spec).expanduser()
            if not path.exists():
                raise UsageError(f"{flag} {spec}: no such file or directory")
            if path.is_dir():
                under = sorted(p for p in path.rglob("*") if not p.is_dir() and p.suffix.lower() in _SUFFIXES)
                files = [
                    _data_file(p, flag)
                    for p in under
                    if not any(part.startswith(".") for part in p.relative_to(path).parts)
                ]
                if not files:
                    raise UsageError(f"{flag} {spec}: the directory holds no data file ({', '.join(_SUFFIXES)})")
            else:
                files = [_data_file(path, flag)]
        found += [f for f in files if f is not None]
    if not found:
        raise UsageError(f"{flag}: no data file among {', '.join(specs)} ({', '.join(_SUFFIXES)})")
    return found


_SUFFIXES = TOKEN_SUFFIXES + TEXT_SUFFIXES


_NOT_REGULAR = {stat.S_IFIFO: "a named pipe", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device"}


def _data_file(path: Path, flag: str = "--data") -> DataFile:
    try:
        mode = path.stat().st_mode
    except OSError as err:  # a dangling link, a file gone since the listing
        raise UsageError(f"{flag}: {path}: cannot read it ({err.strerror or err})") from None
    if not stat.S_ISREG(mode):
        kind = _NOT_REGULAR.get(stat.S_IFMT(mode), "a block device" if stat.S_ISBLK(mode) else "not a file")
        raise UsageError(
            f"{flag}: {path} is {kind}, not a regular file: every rank reads its rows of the data by position, "
            "more than once, so give a file (write the stream to one first)"
        )
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
    tokens = np.memmap(path, dtype=dtype, mode="r", offset=offset)
    if header is None and dtype_flag == "auto" and dtype.itemsize == 2 and _looks_uint32(tokens):
        raise UsageError(
            f"{path}: read as uint16 (the vocabulary has at most 65536 tokens), every second value is 0 in every "
            "sample: the pattern of uint32 tokens. Say which: --data-dtype uint32 (most likely), or --data-dtype "
            "uint16 if they are uint16"
        )
    return tokens


def _llmc_header(path: Path, size: int) -> np.ndarray | None:
    """llm.c's header when the file starts with its magic number, else None (a headerless file).
    A header whose version is unknown, or whose token count disagrees with the file's size (a
    truncated file, or one still being written), is a UsageError: read headerless, its header
    would be trained on as tokens."""
    if size < 8:
        return None
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(min(size, LLMC_HEADER_BYTES) // 4 * 4), dtype="<i4")
    if header[0] != LLMC_MAGIC:
        return None
    if header[1] not in (1, 2) or size < LLMC_HEADER_BYTES:
        raise UsageError(
            f"{path}: starts with llm.c's magic number {LLMC_MAGIC} but its header is not one llm.c writes "
            f"(version {header[1]}, {size} bytes); write the file again"
        )
    itemsize = 2 if header[1] == 1 else 4
    want, has = int(header[2]), size - LLMC_HEADER_BYTES
    if want * itemsize != has:
        raise UsageError(
            f"{path}: an llm.c token file (magic {LLMC_MAGIC}) whose header counts {want} tokens "
            f"({want * itemsize} bytes) but which holds {has} bytes after it: truncated (or still being written); "
            "write it again"
        )
    return header


def _looks_uint32(tokens: np.ndarray) -> bool:
    """Whether uint16 `tokens` look like uint32 ones: in samples spread over the file, every odd
    value (a uint32's high half) is 0 and some even one is not. uint16 tokens of a real corpus
    do not do that (the odd ones would all have to be token 0); a file too short to tell passes."""
    pairs = len(tokens) // 2
    if pairs < PATTERN_MIN_PAIRS:
        return False
    blocks = [tokens[2 * s : 2 * (s + PATTERN_BLOCK)] for s in _spread(pairs, PATTERN_BLOCK, PATTERN_SAMPLES)]
    high = any(np.any(np.asarray(b[1::2])) for b in blocks)
    return not high and any(np.any(np.asarray(b[0::2])) for b in blocks)


def _spread(n: int, block: int, count: int) -> list[int]:
    """The starts of `count` + 1 blocks of `block` spread evenly over [0, n), the first at 0 and
    the last ending at n (one block when n holds no more)."""
    if n <= block:
        return [0]
    return sorted({(n - block) * k // count for k in range(count + 1)})


def check_range(array: np.ndarray, path: Path, vocab_size: int) -> None:
    """The smallest and largest token of a sample lie in the model's vocabulary: the first
    RANGE_HEAD tokens and RANGE_BLOCKS blocks of RANGE_BLOCK spread to the end (about 2M tokens
    however large the file). A cheap look before planning that catches a wrong --data-dtype,
    another tokenizer's corpus, a -100 label or a uint64 id past 2^63; every batch is checked
    again as it is read (`feed`), so a bad token past the sample stops the run with an error line too."""
    if not len(array):
        return
    n = len(array)
    parts = [array[:RANGE_HEAD]] + [array[s : s + RANGE_BLOCK] for s in _spread(n, RANGE_BLOCK, RANGE_BLOCKS)]
    low = min(int(np.min(p)) for p in parts)  # Python ints: a uint64 id is not wrapped
    high = max(int(np.max(p)) for p in parts)
    if low < 0:
        raise UsageError(
            f"{path}: token {low} is negative: token ids are 0 to {vocab_size - 1} (a loss's ignore label such as "
            "-100 belongs in no token file; or the wrong --data-dtype)"
        )
    if high >= vocab_size:
        wrapped = " (a negative id written as uint64)" if high >= 2**63 else ""
        raise UsageError(
            f"{path}: token {high} is outside the model's vocabulary of {vocab_size}{wrapped} "
            "(another tokenizer's corpus, or the wrong --data-dtype; --vocab-size or --tokenizer sets "
            "a llama3 model's vocabulary)"
        )
