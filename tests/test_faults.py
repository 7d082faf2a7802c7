"""Faults the user can fix end with one `error:` line on stderr and exit code 2, never a traceback,
found as early as they can be, with nothing half-written: an --out that is a file, a checkpoint the
disk refuses (full, read-only), exporting a damaged checkpoint, a --time-limit that stopped the
solver without a solution, and an `hf:` config with a size that is not positive. Each test runs in
this process (a world of 1); a fault the disk causes is made by monkeypatching where the disk
would raise, as a real full disk would (torch.save's short-write RuntimeError included)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

import autoshard_solver
from autoshard.__main__ import main as autoshard_main
from autoshard.cli.plan import plan_main
from autoshard.cli.train import main
from autoshard.train import disk

TINY = ["--model", "llama3-tiny", "--batch", "8", "--seq", "16", "--mesh", "1"]
ONE_PROCESS = pytest.mark.replicated_plan  # what is checked is the process's behaviour, not the plan
TIME_LIMIT_LINE = "the solver stopped at --time-limit 5 s without any solution; give it a larger --time-limit"


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err[-3000:]
    return [line for line in err.splitlines() if line.startswith("error:")]


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def kept(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


# ---------------------------------------------------------------------------------- --out
@pytest.mark.parametrize("under", ["", "sub/run"])
def test_an_out_that_is_a_file_is_refused_before_the_process_group(tmp_path, capsys, monkeypatch, under):
    import autoshard.train.loop as loop

    def reached(*args, **kwargs):
        raise AssertionError("the process group was set up")

    monkeypatch.setattr(loop, "start_process_group", reached)
    file = tmp_path / "notes"
    file.write_text("mine")
    out = file / under if under else file
    assert main([*TINY, "--steps", "2", "--out", str(out)]) == 2
    want = f"--out {out} exists and is not a directory" if not under else f"--out {out}: {file} is not a directory"
    assert error_lines(capsys.readouterr().err) == [f"error: {want}"]
    assert file.read_text() == "mine"


def test_an_unwritable_checkpoints_dir_is_refused_before_the_process_group(tmp_path, capsys, monkeypatch):
    """Checkpointing into a read-only directory is refused up front (a root's chmod changes
    nothing: then os.access says so for it)."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints").chmod(0o555)
    if os.geteuid() == 0:
        access = os.access
        monkeypatch.setattr(
            os, "access", lambda path, mode, **kw: Path(path) != out / "checkpoints" and access(path, mode, **kw)
        )
    try:
        assert main([*TINY, "--steps", "2", "--checkpoint-every", "1", "--out", str(out)]) == 2
    finally:
        (out / "checkpoints").chmod(0o755)
    assert error_lines(capsys.readouterr().err) == [
        f"error: --out {out}: {out / 'checkpoints'} is not writable (--checkpoint-every writes there)"
    ]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints"]


# ---------------------------------------------------------------------------------- checkpoints
def fail_writing(monkeypatch, step: int, error: BaseException) -> None:
    """DCP's writes of checkpoint `step` raise `error` (as the disk would, inside DCP's gathering)."""
    write = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if f"step-{step:06d}" in str(self.path):
            raise error
        return write(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)


def refused_line(out: Path, step: int, cause: str, newest: int) -> str:
    return (
        f"error: cannot write checkpoint {out / 'checkpoints' / f'step-{step:06d}'}: {cause}; the newest complete "
        f"checkpoint is {out / 'checkpoints' / f'step-{newest:06d}'}, intact (the same command resumes from it)"
    )


@pytest.fixture(scope="module")
def clean_losses(tmp_path_factory) -> dict[int, float]:
    """Losses of an uninterrupted 6-step run."""
    out = tmp_path_factory.mktemp("clean") / "run"
    assert main([*TINY, "--steps", "6", "--out", str(out)]) == 0
    return losses(out)


@pytest.mark.slow
@ONE_PROCESS
@pytest.mark.parametrize("writes", ["sync", "async"])
def test_a_full_disk_stops_with_one_line_and_the_newest_checkpoint_resumes(
    tmp_path, capsys, monkeypatch, clean_losses, writes
):
    """ENOSPC while writing step 4's checkpoint: one line naming the cause, the checkpoint and the
    newest complete one; no step-000004(.tmp) left; the same command then resumes from step 2 with
    an uninterrupted run's losses."""
    out = tmp_path / "run"
    args = [*TINY, "--steps", "6", "--checkpoint-every", "2", "--checkpoint-writes", writes, "--out", str(out)]
    with monkeypatch.context() as patch:
        fail_writing(patch, 4, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out / "x.distcp")))
        assert main(args) == 2
    assert error_lines(capsys.readouterr().err) == [refused_line(out, 4, "No space left on device", 2)]
    assert kept(out) == ["step-000002"]
    assert main(args) == 0
    assert f"resumed from {out / 'checkpoints' / 'step-000002'} (step 2)" in capsys.readouterr().err
    assert losses(out) == clean_losses


@ONE_PROCESS
def test_a_checkpoints_dir_made_read_only_mid_run_stops_with_one_line(tmp_path, capsys, monkeypatch):
    """The checkpoints directory turns read-only after step 2's checkpoint (chmod; for root, whom
    chmod does not stop, DCP's mkdir is made to fail as it would)."""
    import autoshard.train.checkpoints as checkpoints

    out = tmp_path / "run"
    root = out / "checkpoints"
    save = checkpoints.Checkpointer.save

    def save_read_only(self, step, *args, **kwargs):
        if step == 4:
            root.chmod(0o555)
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(checkpoints.Checkpointer, "save", save_read_only)
    if os.geteuid() == 0:  # chmod does not stop root: DCP's mkdir fails as it would for anyone else
        mkdir = FileSystem.mkdir

        def refused(self, path):
            if Path(path).parent == root and not root.stat().st_mode & 0o200:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return mkdir(self, path)

        monkeypatch.setattr(FileSystem, "mkdir", refused)
    try:
        assert main([*TINY, "--steps", "6", "--checkpoint-every", "2", "--out", str(out)]) == 2
    finally:
        root.chmod(0o755)
    assert error_lines(capsys.readouterr().err) == [refused_line(out, 4, "Permission denied", 2)]
    assert kept(out) == ["step-000002"]
    monkeypatch.undo()
    assert main([*TINY, "--steps", "6", "--checkpoint-every", "2", "--out", str(out)]) == 0
    assert f"resumed from {root / 'step-000002'} (step 2)" in capsys.readouterr().err


SHORT_WRITE = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


@ONE_PROCESS
def test_a_short_write_is_the_disks_when_the_disk_refuses_writes_else_a_traceback(tmp_path, capsys, monkeypatch):
    """torch.save reports a full disk as a RuntimeError: the disk is probed, and its error named;
    when the disk takes writes the failure is not the user's and keeps its traceback. Either way
    the temporary directory is gone."""
    from torch.distributed.checkpoint import CheckpointException

    out = tmp_path / "run"
    args = [*TINY, "--steps", "4", "--checkpoint-every", "2", "--checkpoint-writes", "sync", "--out", str(out)]
    fail_writing(monkeypatch, 2, SHORT_WRITE)
    monkeypatch.setattr(disk, "probe", lambda directory: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    assert main(args) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: cannot write checkpoint {out / 'checkpoints' / 'step-000002'}: No space left on device; the newest "
        "complete checkpoint is none"
    ]
    assert kept(out) == []
    monkeypatch.setattr(disk, "probe", lambda directory: None)
    other = tmp_path / "other"
    with pytest.raises(CheckpointException):
        main([*args[:-1], str(other)])
    assert kept(other) == []


def test_the_probe_names_the_disks_error_and_leaves_nothing(tmp_path, monkeypatch):
    assert disk.probe(tmp_path) is None and list(tmp_path.iterdir()) == []
    missing = disk.probe(tmp_path / "gone")
    assert isinstance(missing, FileNotFoundError)
    write = os.write

    def filling(fd, data):  # a disk with one block left: a short write, then ENOSPC
        if os.fstat(fd).st_size >= 4096:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(fd, data[:4096])

    monkeypatch.setattr(os, "write", filling)
    full = disk.probe(tmp_path)
    monkeypatch.undo()
    assert isinstance(full, OSError) and full.errno == errno.ENOSPC and list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------- export
@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("export") / "run"
    assert main([*TINY, "--steps", "2", "--checkpoint-every", "1", "--out", str(run)]) == 0
    return run


@pytest.mark.parametrize(
    "damage, message",
    [
        ("__0_0.distcp", "__0_0.distcp is missing"),
        (".metadata", "its .metadata is missing"),
        ("truncate", "__0_0.distcp is truncated to 1000 of its {size} bytes"),
    ],
)
@ONE_PROCESS
def test_exporting_a_damaged_checkpoint_is_one_line_and_writes_nothing(
    tmp_path, capsys, two_checkpoints, damage, message
):
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    newest = run / "checkpoints" / "step-000002"
    size = (newest / "__0_0.distcp").stat().st_size
    if damage == "truncate":
        os.truncate(newest / "__0_0.distcp", 1000)
    else:
        (newest / damage).unlink()
    with pytest.raises(SystemExit) as exit_:
        autoshard_main(["export", str(run), "--hf", str(tmp_path / "o")])
    assert exit_.value.code == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: {newest}: damaged checkpoint: {message.format(size=size)} (export another with --step: 1)"
    ]
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*"))


# ---------------------------------------------------------------------------------- --time-limit
def test_plan_stopped_by_the_time_limit_without_a_solution_is_one_line(tmp_path, capsys, monkeypatch):
    """HiGHS stops at the time limit with no solution (its status when the limit runs out first)."""
    import autoshard_solver.model as model

    monkeypatch.setattr(model, "_run_highs", lambda *args: ("none", None, None))
    args = ["--model", "llama3-tiny", "--batch", "8", "--seq", "16", "--mesh", "2", "--backend", "highs"]
    with pytest.raises(SystemExit) as exit_:
        plan_main([*args, "--time-limit", "5", "--out", str(tmp_path / "p")])
    assert exit_.value.code == 2 and not (tmp_path / "p").exists()
    assert error_lines(capsys.readouterr().err) == [f"error: planning autoshard failed: {TIME_LIMIT_LINE}"]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["the first solve", "a memory-fit solve"])
def test_train_stopped_by_the_time_limit_without_a_solution_is_one_line(tmp_path, capsys, monkeypatch, which):
    """Rank 0's solve, or one of the budgeted solves fitting --memory-limit (rank 0 solving beside
    the fit); without --time-limit the same stop is the solver's failure: its traceback."""
    solve, calls = autoshard_solver.solve, []

    def stopped(problem, backend="auto", time_limit=None, **kwargs):
        calls.append(time_limit)
        if which == "the first solve" or len(calls) > 1:
            raise autoshard_solver.SolveError(f"highs stopped without a solution (time_limit={time_limit})")
        return solve(problem, backend=backend, time_limit=time_limit, **kwargs)

    monkeypatch.setattr(autoshard_solver, "solve", stopped)
    args = [*TINY, "--steps", "2", "--memory-limit", "3MiB"]
    out = tmp_path / "run"
    assert main([*args, "--time-limit", "5", "--out", str(out)]) == 2
    assert error_lines(capsys.readouterr().err) == [f"error: {TIME_LIMIT_LINE}"]
    assert (len(calls) == 1) == (which == "the first solve") and not (out / "plan.json").exists()
    calls.clear()
    with pytest.raises(autoshard_solver.SolveError):
        main([*args, "--out", str(tmp_path / "other")])


# ---------------------------------------------------------------------------------- hf: sizes
@pytest.mark.parametrize("field, value", [("hidden_size", -8), ("num_hidden_layers", 0), ("n_embd", -8)])
@pytest.mark.parametrize("command", ["plan", "train"])
def test_an_hf_config_with_a_size_that_is_not_positive_is_one_line(tmp_path, capsys, field, value, command):
    """`n_embd`: GPT-2's name for hidden_size (its config class's attribute_map)."""
    config = {"model_type": "gpt2" if field == "n_embd" else "llama", "vocab_size": 128, "hidden_size": 32}
    config |= {"intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, field: value}
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    args = [
        "--model",
        f"hf:{tmp_path / 'm'}",
        "--mesh",
        "1",
        "--batch",
        "2",
        "--seq",
        "8",
        "--out",
        str(tmp_path / "o"),
    ]
    if command == "plan":
        with pytest.raises(SystemExit) as exit_:
            plan_main(args)
        code = exit_.value.code
    else:
        code = main(args)
    assert code == 2 and not (tmp_path / "o").exists()
    assert error_lines(capsys.readouterr().err) == [
        f'error: hf:{tmp_path / "m" / "config.json"}: "{field}" is {value}; a size must be a positive integer'
    ]
