"""A run directory is one run's: a fresh start refuses an earlier run's files unless --overwrite, a
second run into a held --out refuses naming the holder (a dead holder's lock is taken over), and
workers whose torchrun agent died stop by themselves."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from autoshard.cli.train import main
from autoshard.options import UsageError
from autoshard.train.rundir import LOCK_NAME, LockHolder, RunDirLock
from autoshard_models import build_model, get_config
from plan_audit import budget_bytes
from torchrun import child_env, torchrun_command

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "llama3-tiny", "--batch", "8", "--seq", "16"]
ONE_PROCESS = pytest.mark.replicated_plan  # what is checked is the directory, not the plan
SHARDED_ON_2 = ["--memory-budget", str(budget_bytes(build_model(get_config("llama3-tiny"), device="meta"), (2,)))]


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


def steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def holder_of(pid: int) -> LockHolder:
    """The lock a run in process `pid` on this host would hold."""
    start = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    return LockHolder(pid, socket.gethostname(), "2026-01-01T00:00:00", None, start)


def write_lock(out: Path, holder: LockHolder) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / LOCK_NAME).write_text(json.dumps(holder.__dict__))


@ONE_PROCESS
def test_a_fresh_start_refuses_an_earlier_run_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, "--steps", "2", "--out", str(out)]) == 0
    before = files(out)
    capsys.readouterr()
    assert main([*TINY, "--steps", "3", "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --out {out} holds an earlier run (metrics.jsonl, plan.json, report.html, sharding.log) and no "
        "checkpoint to resume from; choose another --out, or --overwrite to replace that run"
    ]
    assert files(out) == before  # nothing written
    assert main([*TINY, "--steps", "3", "--overwrite", "--resume", "yes", "--out", str(out)]) == 2
    assert "cannot be combined with --resume yes" in capsys.readouterr().err
    assert main([*TINY, "--steps", "3", "--overwrite", "--out", str(out)]) == 0
    assert steps(out) == [1, 2, 3] and not (out / LOCK_NAME).exists()


@pytest.mark.slow
@ONE_PROCESS
def test_overwrite_starts_over_instead_of_resuming_and_removes_the_old_checkpoints(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, "--steps", "4", "--checkpoint-every", "2", "--out", str(out)]) == 0
    assert main([*TINY, "--steps", "1", "--overwrite", "--out", str(out)]) == 0
    assert steps(out) == [1]
    assert not any((out / "checkpoints").iterdir())
    assert "--overwrite: removed the earlier run's metrics.jsonl, plan.json" in capsys.readouterr().err


@pytest.mark.slow
@ONE_PROCESS
def test_a_live_holder_refuses_before_anything_is_written_and_a_dead_ones_lock_is_taken_over(tmp_path, capsys):
    out = tmp_path / "run"
    with subprocess.Popen(["sleep", "60"]) as other:
        write_lock(out, holder_of(other.pid))
        assert main([*TINY, "--steps", "1", "--out", str(out)]) == 2
        other.kill()
    assert capsys.readouterr().err.splitlines() == [
        f"error: --out {out} is in use by another run (pid {other.pid} on {socket.gethostname()}, started "
        f"2026-01-01T00:00:00); wait for it to end or choose another --out (if that run is gone, remove "
        f"{out / LOCK_NAME})"
    ]
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing else written
    assert main([*TINY, "--steps", "1", "--out", str(out)]) == 0  # `other` is gone now
    assert f"took over {out / LOCK_NAME} from a run that ended (pid {other.pid}" in capsys.readouterr().err
    assert steps(out) == [1] and not (out / LOCK_NAME).exists()


def test_a_reused_pid_or_a_zombie_does_not_hold_a_lock_and_another_hosts_lock_is_refused(tmp_path):
    me = holder_of(os.getpid())
    assert not me.gone()
    assert LockHolder(me.pid, me.host, me.started, None, str(int(me.proc_start) + 1)).gone()  # another process
    zombie = subprocess.Popen(["true"])
    time.sleep(0.5)  # ended, not yet reaped
    assert holder_of(zombie.pid).gone()  # /proc keeps its start time; its state is Z
    zombie.wait()
    write_lock(tmp_path, LockHolder(1, "elsewhere", "2026-01-01T00:00:00", None, "1"))
    with pytest.raises(UsageError, match=r"pid 1 on elsewhere.*remove .*autoshard.lock"):
        RunDirLock(tmp_path).acquire()
    (tmp_path / LOCK_NAME).write_text("{torn")  # unreadable: nobody can tell it is stale
    with pytest.raises(UsageError, match="in use by another run"):
        RunDirLock(tmp_path).acquire()
    (tmp_path / LOCK_NAME).unlink()
    lock = RunDirLock(tmp_path)
    lock.acquire()
    assert lock.holder() == lock.me
    lock.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no staged or stale file left


def launch(out: Path, *args: str, log: Path | None = None) -> subprocess.Popen:
    """`train` under torchrun on 2 gloo ranks; its output piped, or into `log` (a long run that
    nobody reads would block on a full pipe)."""
    cmd = torchrun_command("-m", "autoshard", "train", *TINY, *SHARDED_ON_2, "--out", str(out), *args, nproc=2)
    sink = subprocess.PIPE if log is None else log.open("w")
    return subprocess.Popen(cmd, env=child_env(), cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, text=True)


def wait_for(check, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not check():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.ranks
def test_a_second_launch_into_a_held_out_refuses_and_workers_of_a_killed_agent_stop(tmp_path):
    """Two torchrun launches into one --out: the second refuses in one line naming the first's rank
    0; then the first's agent is killed with -9: its workers checkpoint their step and end within
    60 s, releasing the directory, and the same command resumes."""
    out = tmp_path / "run"
    first = launch(out, "--steps", "100000", log=tmp_path / "first.log")
    try:
        wait_for(lambda: (out / "metrics.jsonl").exists() and steps(out), 300, "the first run's first step")
        holder = json.loads((out / LOCK_NAME).read_text())
        second = launch(out, "--steps", "2", "--resume", "no")
        err, _ = second.communicate(timeout=300)
        assert second.returncode != 0
        said = [line for line in err.splitlines() if line.startswith("error:")]
        assert said == [
            f"error: --out {out} is in use by another run (pid {holder['pid']} on {holder['host']}, started "
            f"{holder['started']}); wait for it to end or choose another --out (if that run is gone, remove "
            f"{out / LOCK_NAME})"
        ]
        workers = [
            int(p)
            for p in subprocess.run(["pgrep", "-P", str(first.pid)], capture_output=True, text=True).stdout.split()
        ]
        assert len(workers) == 2
        killed = time.time()
        first.send_signal(signal.SIGKILL)
        first.wait()
        wait_for(lambda: not any(Path(f"/proc/{w}").exists() and not zombie(w) for w in workers), 60, "the workers")
        assert time.time() - killed < 60
    finally:
        first.kill()
        first.wait()
    assert not (out / LOCK_NAME).exists()
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved and saved[-1] == f"step-{steps(out)[-1]:06d}"  # the stopped step, checkpointed
    assert "stopped by SIGTERM after step" in (tmp_path / "first.log").read_text()
    again = subprocess.run(
        torchrun_command(
            "-m",
            "autoshard",
            "train",
            *TINY,
            *SHARDED_ON_2,
            "--out",
            str(out),
            "--steps",
            str(steps(out)[-1] + 1),
            nproc=2,
        ),
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr + again.stdout


def zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False
