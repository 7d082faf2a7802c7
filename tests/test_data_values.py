"""The data is never silently wrong: a token-file format guess that a sample contradicts is an
error naming the flag that settles it, token ids out of either bound are an error line, not a
traceback, and only regular files are read. (The token cache and special tokens in text:
tests/test_text_values.py.)"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from autoshard.cli.train import main
from autoshard.data.files import LLMC_HEADER_BYTES, LLMC_MAGIC, check_range, find_files, open_tokens
from autoshard.options import UsageError

TINY = ["--model", "llama3-tiny", "--mesh", "1", "--batch", "4", "--seq", "8", "--steps", "2"]


def corpus(n: int, vocab: int = 50257, seed: int = 0) -> np.ndarray:
    """Token ids with a Zipf-like spread (token 0 common, as "!" or a space can be)."""
    rng = np.random.default_rng(seed)
    return np.minimum(rng.zipf(1.2, n) - 1, vocab - 1)


def one_error_line(capsys, args: list[str], tmp_path: Path) -> str:
    code = main([*TINY, *args, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------------------- regular files only
def test_a_named_pipe_is_refused_not_read_forever(tmp_path, capsys):
    fifo = tmp_path / "x.npy"
    os.mkfifo(fifo)
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "dir" / "y.bin")
    np.arange(100, dtype="<u2").tofile(tmp_path / "dir" / "a.bin")
    for spec in (str(fifo), str(tmp_path / "dir"), str(tmp_path / "dir" / "*.bin")):
        with pytest.raises(UsageError, match=r"is a named pipe, not a regular file"):
            find_files((spec,))

    done = threading.Event()

    def unblock() -> None:  # were the pipe opened for reading, this ends the read instead of a hang
        if not done.wait(20):
            with open(os.open(fifo, os.O_WRONLY), "wb"):
                pass

    threading.Thread(target=unblock, daemon=True).start()
    line = one_error_line(capsys, ["--data", str(fifo)], tmp_path)
    done.set()
    assert f"--data: {fifo} is a named pipe, not a regular file" in line, line


# ---------------------------------------------------------------------------- format guesses
def test_a_headerless_uint32_file_is_not_read_as_uint16(tmp_path, capsys):
    tokens = corpus(300_000)
    tokens.astype("<u4").tofile(tmp_path / "wide.bin")
    with pytest.raises(UsageError, match=r"every second value is 0 .* --data-dtype uint32"):
        open_tokens(tmp_path / "wide.bin", "auto", 50257)
    assert np.array_equal(open_tokens(tmp_path / "wide.bin", "uint32", 50257), tokens)  # the flag settles it
    assert len(open_tokens(tmp_path / "wide.bin", "uint16", 50257)) == 2 * len(tokens)  # as the user says
    line = one_error_line(capsys, ["--data", str(tmp_path / "wide.bin"), "--vocab-size", "50257"], tmp_path)
    assert "the pattern of uint32 tokens" in line


@pytest.mark.parametrize("zeros", [0.0, 0.5, 0.9])
def test_uint16_files_with_many_zero_tokens_are_read_as_uint16(tmp_path, zeros):
    """The uint32 test asks every sampled odd value to be 0: a uint16 corpus passes even when most
    of its tokens are 0; so does one too short to tell (a 5-token file)."""
    tokens = corpus(200_000, seed=1)
    tokens[np.random.default_rng(2).random(len(tokens)) < zeros] = 0
    tokens.astype("<u2").tofile(tmp_path / "a.bin")
    assert np.array_equal(open_tokens(tmp_path / "a.bin", "auto", 50257), tokens)
    np.array([7, 0, 9, 0, 1], "<u2").tofile(tmp_path / "short.bin")
    assert open_tokens(tmp_path / "short.bin", "auto", 50257).tolist() == [7, 0, 9, 0, 1]


def llmc_file(path: Path, tokens: np.ndarray, version: int = 1, count: int | None = None) -> None:
    header = np.zeros(256, "<i4")
    header[:3] = (LLMC_MAGIC, version, len(tokens) if count is None else count)
    path.write_bytes(header.tobytes() + tokens.astype("<u2" if version == 1 else "<u4").tobytes())


@pytest.mark.parametrize("dtype_flag", ["auto", "uint16"])
def test_a_truncated_llmc_file_is_named_as_such(tmp_path, dtype_flag):
    tokens = corpus(10_000)
    llmc_file(tmp_path / "whole.bin", tokens)
    assert np.array_equal(open_tokens(tmp_path / "whole.bin", dtype_flag, 50257), tokens)
    llmc_file(tmp_path / "cut.bin", tokens[:6_000], count=len(tokens))  # the writer stopped
    with pytest.raises(UsageError, match=r"an llm.c token file \(magic 20240520\) whose header counts 10000 tokens "):
        open_tokens(tmp_path / "cut.bin", dtype_flag, 50257)
    (tmp_path / "stub.bin").write_bytes((tmp_path / "whole.bin").read_bytes()[: LLMC_HEADER_BYTES // 2])
    with pytest.raises(UsageError, match=r"starts with llm.c's magic number 20240520"):
        open_tokens(tmp_path / "stub.bin", dtype_flag, 50257)


# ---------------------------------------------------------------------------- token bounds
@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype, value, message",
    [
        (np.int64, -100, r"token -100 is negative: token ids are 0 to 255 \(a loss's ignore label"),
        (np.int32, -1, r"token -1 is negative"),
        (np.uint64, 2**64 - 100, r"token 18446744073709551516 is outside .* \(a negative id written as uint64\)"),
        (np.uint16, 256, r"token 256 is outside the model's vocabulary of 256"),
    ],
)
@pytest.mark.parametrize("where", [5, 3_000_000, -1], ids=["head", "middle-block", "last"])
def test_check_range_checks_both_bounds_beyond_the_first_million(tmp_path, dtype, value, message, where):
    tokens = corpus(4_000_000, vocab=256).astype(dtype)
    at = where if where >= 0 else len(tokens) - 1
    if where == 3_000_000:  # a position inside one of the sampled blocks
        from autoshard.data.files import RANGE_BLOCK, RANGE_BLOCKS

        at = (len(tokens) - RANGE_BLOCK) * 11 // RANGE_BLOCKS + 123
    tokens[at] = value
    np.save(tmp_path / "t.npy", tokens)
    with pytest.raises(UsageError, match=message):
        check_range(open_tokens(tmp_path / "t.npy", "auto", 256), tmp_path / "t.npy", 256)


def test_check_range_reads_a_sample_not_the_file(tmp_path, monkeypatch):
    """About 2M tokens of any file: the head and 17 spread blocks (timed in docs/data.md)."""
    tokens = open_tokens_of(tmp_path, corpus(30_000_000, vocab=256).astype("<u2"))
    read = []
    original = np.min
    monkeypatch.setattr(np, "min", lambda a, *k, **kw: read.append(len(a)) or original(a, *k, **kw))
    check_range(tokens, tmp_path / "t.bin", 256)
    assert sum(read) <= (1 << 20) + 17 * (1 << 16), sum(read)


def open_tokens_of(tmp_path: Path, tokens: np.ndarray) -> np.ndarray:
    tokens.tofile(tmp_path / "t.bin")
    return open_tokens(tmp_path / "t.bin", "uint16", 256)
