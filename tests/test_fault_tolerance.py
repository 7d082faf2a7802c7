"""Runs that survive: resuming by itself (a restart, a rerun), preemption by SIGTERM, retention,
skipping a damaged checkpoint, stopping on a non-finite loss, and torchrun restarts after SIGKILLs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from autoshard.cli.train import main
from benchmarks.training.fault import survive
from test_train import SHARDED_ON_4
from torchrun import child_env

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "llama3-tiny", "--batch", "8", "--seq", "16", "--mesh", "1"]
# What these check is the process's behaviour (signals, retention, damaged files, non-finite
# values), in one process; resuming sharded checkpoints exactly is the torchrun tests' (the last
# one here, tests/test_train.py and tests/test_precision.py), on sharded plans.
ONE_PROCESS = pytest.mark.replicated_plan


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), f"duplicated or unordered steps {steps}"
    return {r["step"]: r["loss"] for r in rows}


def train(*args: str) -> subprocess.CompletedProcess:
    """`python -m autoshard train` as its own process, one thread (same numerics in every run)."""
    env = child_env()
    return subprocess.run(
        [sys.executable, "-m", "autoshard", "train", *TINY, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def kept(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


@pytest.mark.slow
@ONE_PROCESS
def test_sigterm_finishes_the_step_checkpoints_and_the_same_command_resumes_exactly(tmp_path):
    """SIGTERM mid-run: the step finishes, its checkpoint is written, the exit code is 128 + 15 with
    one line naming it; the same command again resumes there and every step's loss equals an
    uninterrupted run's, one metrics row per step."""
    args = ["--steps", "60", "--checkpoint-every", "25"]
    clean = train(*args, "--out", str(tmp_path / "clean"))
    assert clean.returncode == 0, clean.stderr[-3000:]
    out = tmp_path / "stopped"
    env = child_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "autoshard", "train", *TINY, *args, "--out", str(out)],
        env=env,
        cwd=ROOT,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("step    3/"):
            proc.send_signal(signal.SIGTERM)
            break
    err = "".join(lines) + proc.stderr.read()
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM, err[-3000:]
    (stop_line,) = [x for x in err.splitlines() if "stopped by SIGTERM" in x]
    step = int(stop_line.split("after step ")[1].split(";")[0])
    assert 3 <= step < 25 and f"checkpoint {out / 'checkpoints' / f'step-{step:06d}'}" in stop_line
    assert kept(out) == [f"step-{step:06d}"] and "Traceback" not in err
    again = train(*args, "--out", str(out))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step-{step:06d}'} (step {step})" in again.stderr
    assert losses(out) == losses(tmp_path / "clean")


@ONE_PROCESS
def test_retention_keeps_the_newest_k_and_a_rerun_resumes_by_itself(tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        main(
            [
                *TINY,
                "--steps",
                "9",
                "--checkpoint-every",
                "2",
                "--keep-checkpoints",
                "2",
                "--checkpoint-writes",
                "async",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert kept(out) == ["step-000006", "step-000008"]
    first = losses(out)
    assert (
        main(
            [
                *TINY,
                "--steps",
                "11",
                "--checkpoint-every",
                "2",
                "--keep-checkpoints",
                "0",
                "--checkpoint-writes",
                "sync",
                "--out",
                str(out),
            ]
        )
        == 0
    )  # --resume auto: from step 8
    assert "resumed from" in capsys.readouterr().err
    assert kept(out) == ["step-000006", "step-000008", "step-000010"]
    again = losses(out)
    assert list(again) == list(range(1, 12)) and all(again[s] == first[s] for s in range(1, 9))


@pytest.mark.slow
@ONE_PROCESS
def test_a_damaged_newest_checkpoint_is_skipped_with_one_warning(tmp_path, capsys):
    """The newest checkpoint's data truncated: one warning line naming it, the one before is loaded,
    and the steps after it repeat the first run's losses exactly."""
    out = tmp_path / "run"
    assert main([*TINY, "--steps", "8", "--checkpoint-every", "3", "--keep-checkpoints", "0", "--out", str(out)]) == 0
    first = losses(out)
    for part in (out / "checkpoints" / "step-000006").glob("*.distcp"):
        part.write_bytes(part.read_bytes()[: part.stat().st_size // 3])
    capsys.readouterr()
    assert main([*TINY, "--steps", "8", "--checkpoint-every", "3", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    warnings = [x for x in err.splitlines() if "warning" in x]
    assert len(warnings) == 1 and f"{out / 'checkpoints' / 'step-000006'} cannot be loaded" in warnings[0], err
    assert f"resumed from {out / 'checkpoints' / 'step-000003'} (step 3)" in err
    assert losses(out) == first


@ONE_PROCESS
def test_a_non_finite_loss_stops_with_one_error_line_and_saves_nothing_of_it(tmp_path, capsys):
    out = tmp_path / "run"
    code = main([*TINY, "--steps", "8", "--lr", "1e30", "--checkpoint-every", "1", "--out", str(out)])
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and "Traceback" not in err
    assert errors == [
        "error: step 2: the loss is nan; the newest good checkpoint is none (the loss after every checkpoint "
        "diverged: start over)"
    ]  # step 1's weights, updated at lr 1e30, are what gave the NaN
    assert kept(out) == ["step-000001"] and list(losses(out)) == [1]


@ONE_PROCESS
def test_non_finite_parameters_are_never_checkpointed(tmp_path, capsys, monkeypatch):
    """An optimizer that breaks a parameter at step 3 (the loss of step 3 is still finite): the
    checkpoint of step 3 is refused with one error line and step 2's stays the newest."""
    from autoshard.train.optimizer import OptimizerConfig

    make = OptimizerConfig.build

    def breaking(config, params):
        optim = make(config, params)

        def after_step(optim, args, kwargs):
            if optim.state[optim.param_groups[0]["params"][0]]["step"] == 3:
                with __import__("torch").no_grad():
                    optim.param_groups[0]["params"][0].fill_(float("nan"))

        optim.register_step_post_hook(after_step)
        return optim

    monkeypatch.setattr(OptimizerConfig, "build", breaking)
    out = tmp_path / "run"
    code = main([*TINY, "--steps", "6", "--checkpoint-every", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and [x for x in err.splitlines() if x.startswith("error:")] == [
        f"error: step 3: the parameters hold non-finite values; the newest good checkpoint is "
        f"{out / 'checkpoints' / 'step-000002'}"
    ]
    assert kept(out)[-1] == "step-000002"


@ONE_PROCESS
def test_resume_no_refuses_an_earlier_runs_checkpoints(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, "--steps", "2", "--checkpoint-every", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main([*TINY, "--steps", "4", "--resume", "no", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"error: --resume no: {out / 'checkpoints'} holds an earlier run's checkpoints "
        "(newest step 2); choose another --out, resume (--resume auto), or --overwrite to replace that run"
    ]


@pytest.mark.slow
@pytest.mark.ranks
def test_torchrun_restarts_after_sigkills_continue_with_the_same_losses():
    """4 gloo ranks (2,2), parameters sharded, 12 steps, checkpoints every 4 written in the background: a random rank
    SIGKILLed at a random step (maybe mid-write) under --max-restarts 1; torchrun exits 0 and every
    step's loss equals the uninterrupted run's. (Several kills in one run: benchmarks.training.fault.)"""
    figures = survive(
        steps=12, checkpoint_every=4, kills=1, seed=1, extra=("--checkpoint-writes", "async", *SHARDED_ON_4)
    )
    assert figures["clean_returncode"] == 0 and figures["returncode"] == 0, figures["stderr_tail"]
    assert len(figures["killed_at"]) == 1 and figures["rows"] == 12
    assert figures["differing_steps"] == []


def test_a_torn_last_metrics_row_is_cut_with_a_warning_and_a_bad_one_before_it_named(tmp_path, caplog):
    """A run killed while writing metrics.jsonl leaves its last line torn: resuming cuts it (and the
    rows past the resumed step) with one warning naming the file and line; a bad line before the
    last is an error naming them."""
    import logging

    from autoshard import _torch_compat as tc
    from autoshard.options import UsageError
    from autoshard.train.metrics import MetricsFile

    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3)]
    with tc.fake_process_group(1):
        path.write_text("\n".join(rows) + '\n{"step": 4, "lo')
        with caplog.at_level(logging.WARNING, logger="autoshard"):
            MetricsFile(tmp_path, keep_until=2)
        assert path.read_text().splitlines() == rows[:2]
        assert f"{path}:4 is a torn row" in caplog.text
        path.write_text("\n".join([rows[0], "{not json", rows[2]]) + "\n")
        with pytest.raises(UsageError, match=f"{path}:2: not a metrics row"):
            MetricsFile(tmp_path, keep_until=3)


@pytest.mark.slow
@ONE_PROCESS
def test_a_run_killed_mid_row_resumes_with_the_uninterrupted_losses(tmp_path):
    """The torn row of a killed run (`python -m autoshard train`, checkpoint at step 2) no longer
    blocks the same command: it resumes from step 2, cuts the row with a warning, and every
    step's loss equals an uninterrupted run's."""
    args = ["--steps", "4", "--checkpoint-every", "2"]
    clean = train(*args, "--out", str(tmp_path / "clean"))
    assert clean.returncode == 0, clean.stderr[-3000:]
    out = tmp_path / "killed"
    first = train("--steps", "2", "--checkpoint-every", "2", "--out", str(out))
    assert first.returncode == 0, first.stderr[-3000:]
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "loss": 5.')
    again = train(*args, "--out", str(out))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{out / 'metrics.jsonl'}:3 is a torn row" in again.stderr
    assert losses(out) == losses(tmp_path / "clean")


@pytest.mark.slow
@ONE_PROCESS
def test_a_resume_applies_a_new_lr_and_refuses_another_run_unless_forced(tmp_path):
    """Resuming with another --lr uses it from the next update on (logged, and recorded in the first
    resumed row); another --seq refuses with one error line naming old and new, and nothing is
    written; `--resume force` continues and records the change."""
    clean = train("--steps", "4", "--out", str(tmp_path / "clean"))
    assert clean.returncode == 0, clean.stderr[-3000:]
    out = tmp_path / "run"
    assert train("--steps", "2", "--checkpoint-every", "2", "--out", str(out)).returncode == 0
    refused = train("--steps", "4", "--seq", "32", "--out", str(out))
    lines = [x for x in refused.stderr.splitlines() if x.startswith("error:")]
    assert refused.returncode == 2 and len(lines) == 1 and "--seq 16 -> 32" in lines[0], refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr and len(losses(out)) == 2
    lower = train("--steps", "4", "--lr", "0.0001", "--out", str(out))
    assert lower.returncode == 0, lower.stderr[-3000:]
    assert "--lr 0.0001 applies from here on (the checkpoint's optimizer had 0.003)" in lower.stderr
    got, want = losses(out), losses(tmp_path / "clean")
    assert got[3] == want[3] and got[4] != want[4]  # step 3's update is the first with the new lr
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # --steps re-times the schedule: recorded too
    assert rows[2]["changed_on_resume"] == {"lr": [0.003, 0.0001], "steps": [2, 4]}
    assert "changed_on_resume" not in rows[3]
    forced = train("--steps", "6", "--seq", "32", "--resume", "force", "--out", str(out))
    assert forced.returncode == 0, forced.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # from the step-2 checkpoint again (the lr run saved none): its rows past step 2 replaced
    assert rows[2]["changed_on_resume"] == {"seq": [16, 32], "steps": [4, 6]}
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
