"""autoshard.fileio: a JSON file read with one error line naming the file, a file written whole or not at all."""

from __future__ import annotations

import os

import pytest

from autoshard.fileio import atomic_open, read_json, write_atomic
from autoshard.options import UsageError


def test_read_json_names_the_file_and_the_problem(tmp_path):
    good = tmp_path / "good.json"
    good.write_text('{"a": [1, 2]}')
    assert read_json(good) == {"a": [1, 2]}
    (tmp_path / "bad.json").write_text("{nope")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe")
    (tmp_path / "dir.json").mkdir()
    cases = {
        "missing.json": ": no such file",
        "bad.json": ": not JSON (",
        "binary.json": ": cannot read it (UnicodeDecodeError",
        "dir.json": ": cannot read it (IsADirectoryError",
    }
    for name, message in cases.items():
        with pytest.raises(ValueError) as err:
            read_json(tmp_path / name)
        assert str(err.value).startswith(f"{tmp_path / name}{message}") and "\n" not in str(err.value), name
    with pytest.raises(UsageError, match=r"^--plan-file x: no such file$"):
        read_json(tmp_path / "missing.json", name="--plan-file x", error=UsageError)


def test_write_atomic_replaces_whole_and_leaves_nothing_on_failure(tmp_path):
    path = tmp_path / "out.txt"
    assert write_atomic(path, "first\n") == path and path.read_text() == "first\n"
    write_atomic(path, b"\x00bytes")
    assert path.read_bytes() == b"\x00bytes"
    with pytest.raises(RuntimeError), atomic_open(path) as f:
        f.write("half")
        raise RuntimeError("killed while writing")
    assert path.read_bytes() == b"\x00bytes" and sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]
    with pytest.raises(ValueError, match="mode"), atomic_open(path, "a"):
        pass


def test_write_atomic_keeps_the_umask_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        path = write_atomic(tmp_path / "p.json", "{}")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644
