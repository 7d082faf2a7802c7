"""The training CLI: real torchrun processes match the single-device run, resume continues the same
trajectory, and bad input is one clear line with a non-zero exit."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autoshard.cli.train import main
from autoshard_models import build_model, get_config
from autoshard_models.train_single import TrainSettings, train_single
from plan_audit import assert_shards, budget_bytes
from torchrun import child_env, torchrun_command

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "llama3-tiny", "--batch", "8", "--seq", "16"]
# llama3-tiny on 4 ranks plans replicated unless its parameters must shard
SHARDED_ON_4 = ["--memory-budget", str(budget_bytes(build_model(get_config("llama3-tiny"), device="meta"), (4,)))]


def torchrun(*args: str, timeout: int = 400, nproc: int = 4, ok: bool = True) -> subprocess.CompletedProcess:
    """`train` under torchrun on `nproc` ranks; `ok`: it must succeed."""
    env = child_env()
    cmd = torchrun_command("-m", "autoshard", "train", *args, nproc=nproc)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0 or not ok, f"torchrun failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    return out


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.ranks
def test_torchrun_trains_like_single_device_and_resumes(tmp_path, executed_plans):
    """4 gloo ranks on (2,2), parameters sharded: 10 steps equal the single-device losses; the log
    and plan.json list every parameter; a run resumed from the step-3 checkpoint (later ones gone,
    as if killed after step 3) reproduces steps 4-6, reusing the saved plan."""
    first = tmp_path / "first"
    out = torchrun(
        *TINY,
        *SHARDED_ON_4,
        "--mesh",
        "2x2",
        "--steps",
        "10",
        "--checkpoint-every",
        "3",
        "--memory-step",
        "2",
        "--out",
        str(first),
    )
    (facts,) = executed_plans()
    assert_shards(facts, batch_split=False)
    rows = metrics(first)
    # modeled vs measured step time, per row and in the log (median of steps 3-10)
    modeled = json.loads((first / "plan.json").read_text())["totals"]["step_time_s"]
    assert all(r["modeled_step_s"] == modeled and r["modeled_over_measured"] == modeled / r["step_s"] for r in rows)
    assert "step time: modeled" in out.stdout + out.stderr and "(median of steps 3-10)" in out.stdout + out.stderr
    # torch's MemTracker on every real gloo rank, step 2 (AdamW states exist): the dry run's estimate
    # of rank 0 (in plan.json and the row) is within 10% of every rank's measured peak
    tracked, estimated = rows[1]["tracked_peak_bytes_per_rank"], rows[1]["dry_run_peak_bytes"]
    assert len(tracked) == 4 and all(abs(estimated - real) <= 0.10 * real for real in tracked), (estimated, tracked)
    assert "tracked_peak_bytes_per_rank" not in rows[2]
    assert [r["step"] for r in rows] == list(range(1, 11))
    want = train_single(TrainSettings(model="llama3-tiny", steps=10, batch=8, seq=16)).losses
    for row, loss in zip(rows, want):
        assert abs(row["loss"] - loss) <= 1e-5, (row, loss)
        assert row["tokens_per_s"] > 0 and len(row["peak_rss_mb_per_rank"]) == 4
    report = json.loads((first / "plan.json").read_text())
    assert report["memory"]["peak_bytes"] == estimated and report["memory"]["device"] == "cpu"
    names = [n for n, _ in build_model(get_config("llama3-tiny"), device="meta").named_parameters()]
    assert [p["fqn"] for p in report["parameters"]] == names
    assert all(p["layout"] for p in report["parameters"])
    log = (first / "sharding.log").read_text()
    assert all(name in log for name in names)
    page = (first / "report.html").read_text()  # rewritten by rank 0 after the last step: with the curves
    assert all(name in page for name in names) and page.count("<polyline") == 2 and "at step 10 (10 steps)" in page
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == ["step-000003", "step-000006", "step-000009"]

    second = tmp_path / "second"
    shutil.copytree(first, second)
    for late in ("step-000006", "step-000009"):
        shutil.rmtree(second / "checkpoints" / late)
    out = torchrun(
        *TINY,
        *SHARDED_ON_4,
        "--mesh",
        "2x2",
        "--steps",
        "6",
        "--resume",
        "--plan-file",
        str(first / "plan.json"),
        "--out",
        str(second),
    )
    assert "reusing the solution" in out.stdout + out.stderr
    resumed = metrics(second)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(resumed[3:], rows[3:6]):
        assert a["loss"] == b["loss"], (a, b)


@pytest.mark.slow
@pytest.mark.ranks
def test_torchrun_under_a_memory_limit_recomputes_and_trains_like_single_device(tmp_path, executed_plans):
    """llama3-debug on 4 gloo ranks (2,2) under 56 MB per rank: the plan as solved does not fit
    (~150 MiB); the ranks fit it together (rank 0 solving and dry-running for all) into one plan
    that recomputes the blocks, every rank's measured peak (MemTracker, step 2) stays under the
    limit, and the losses are the single-device run's, as the unconstrained plan's are. (Under
    60 MB the same fit spends ~50 s in one budgeted MIP, proving a 0.4% gap closed.)"""
    run = tmp_path / "run"
    torchrun(
        "--model",
        "llama3-debug",
        "--batch",
        "8",
        "--seq",
        "128",
        "--mesh",
        "2x2",
        "--steps",
        "3",
        "--memory-limit",
        "56MB",
        "--memory-step",
        "2",
        "--out",
        str(run),
    )
    (facts,) = executed_plans()
    assert_shards(facts, batch_split=False)  # the limit alone shards parameters
    report = json.loads((run / "plan.json").read_text())
    fit = report["memory_fit"]
    assert fit["constrained"] and fit["recompute"] and report["recompute"]["blocks"] == ["layers"]
    assert fit["tried"][0]["peak_bytes"] > 56e6 >= report["memory"]["peak_bytes"]
    rows = metrics(run)
    assert max(rows[1]["tracked_peak_bytes_per_rank"]) <= 56e6
    want = train_single(TrainSettings(model="llama3-debug", steps=3, batch=8, seq=128)).losses
    for row, loss in zip(rows, want, strict=True):
        assert abs(row["loss"] - loss) <= 1e-5 * loss, (row, loss)


def run_main(args: list[str], capsys) -> tuple[int, str]:
    code = main(args)
    err = capsys.readouterr().err
    return code, err


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "llama3-nope"], "unknown model"),
        ([*TINY, "--mesh", "2x2"], "mesh 2x2 has 4 devices but the world size is 1"),
        (["--model", "llama3-tiny", "--mesh", "2x2", "--batch", "3"], "--batch 3 is not divisible by the dp size 2"),
        ([*TINY, "--mesh", "2x"], "bad mesh '2x'"),
        ([*TINY, "--mesh", "1", "--resume", "--out", "{tmp}/empty"], "--resume: no complete checkpoint in"),
        ([*TINY, "--mesh", "1", "--plan-file", "{tmp}/corrupt.json"], ": not JSON ("),
        ([*TINY, "--mesh", "1", "--plan-file", "{tmp}/missing.json"], "no such file"),
        ([*TINY, "--mesh", "1", "--memory-budget", "1", "--out", "{tmp}/run"], "infeasible"),
        ([*TINY, "--mesh", "1", "--recipe", "fsdp-tp"], "recipe 'fsdp-tp' needs a 2-D (dp, tp) mesh"),
        ([*TINY, "--mesh", "1", "--wire-step", "-1"], "--wire-step must be >= 0"),
        ([*TINY, "--mesh", "1", "--memory-step", "-1"], "--memory-step must be >= 0"),
        ([*TINY, "--mesh", "1", "--memory-limit", "0"], "--memory-limit: bad byte count '0': must be positive"),
        ([*TINY, "--mesh", "1", "--memory-limit", "lots"], "--memory-limit: bad byte count 'lots'"),
        (
            [*TINY, "--mesh", "1", "--memory-limit", "1MiB", "--out", "{tmp}/run"],
            "no plan fits 1.0 MiB per rank: the smallest peak reached is",
        ),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, args, message):
    (tmp_path / "corrupt.json").write_text("{not json")
    code, err = run_main([a.replace("{tmp}", str(tmp_path)) for a in args], capsys)
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.replicated_plan  # what it checks is the memory fit of `train`, in one process
def test_memory_limit_in_train(tmp_path, capsys):
    """One process (mesh 1): by default the plan is checked against the cpu profile's capacity less
    the reserve; `none` checks nothing; under 3 MiB (the plan as solved peaks at ~3.7 MiB) the
    blocks are recomputed, the run stays under it with the single-device losses, and its plan file
    reused (with checkpointing, as saved) trains alike."""
    from autoshard.driver.config import MEMORY_RESERVE
    from autoshard.profiles.files import device_profile

    def run(name: str, *extra: str) -> tuple[dict, str]:
        code, err = run_main([*TINY, "--mesh", "1", "--steps", "3", "--out", str(tmp_path / name), *extra], capsys)
        assert code == 0, err
        return json.loads((tmp_path / name / "plan.json").read_text()), err

    default = run("default")[0]["memory_fit"]
    assert default["limit_bytes"] == device_profile("cpu").memory_bytes * (1 - MEMORY_RESERVE)
    assert not default["constrained"] and not default["recompute"]
    assert "memory_fit" not in run("none", "--memory-limit", "none")[0]
    tight, _ = run("tight", "--memory-limit", "3MiB")
    fit = tight["memory_fit"]
    assert fit["constrained"] and fit["recompute"] and tight["recompute"]["blocks"] == ["layers"]
    assert fit["tried"][0]["mode"] == "keep"  # the plan as solved, dry-run first: over the limit
    assert fit["tried"][0]["peak_bytes"] > 3 * 2**20 >= tight["memory"]["peak_bytes"] == fit["peak_bytes"]
    want = train_single(TrainSettings(model="llama3-tiny", steps=3, batch=8, seq=16)).losses
    for row, loss in zip(metrics(tmp_path / "tight"), want, strict=True):
        assert abs(row["loss"] - loss) <= 1e-5 * loss, (row, loss)
    reused, err = run("reused", "--memory-limit", "3MiB", "--plan-file", str(tmp_path / "tight" / "plan.json"))
    assert "reusing the solution" in err and not reused["memory_fit"]["constrained"]  # it fits as saved
    assert reused["solution"] == tight["solution"] and reused["recompute"]["blocks"] == ["layers"]
    assert [r["loss"] for r in metrics(tmp_path / "reused")] == [r["loss"] for r in metrics(tmp_path / "tight")]


def test_plan_file_for_another_problem_is_refused(tmp_path, capsys):
    stale = tmp_path / "plan.json"
    stale.write_text(json.dumps({"fingerprint": "0123456789abcdef", "solution": "{}"}))
    code, err = run_main(
        [*TINY, "--mesh", "1", "--steps", "1", "--plan-file", str(stale), "--out", str(tmp_path / "run")], capsys
    )
    assert code == 2
    assert "was made for another problem (fingerprint 0123456789abcdef" in err and "Traceback" not in err


def test_cli_entry_point_exits_nonzero_without_traceback():
    out = subprocess.run(
        [sys.executable, "-m", "autoshard", "train", "--model", "nope"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=child_env(),
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("error: unknown model")
    assert "Traceback" not in out.stderr


@pytest.mark.replicated_plan  # a world of one: what it checks is the error line
def test_a_program_that_cannot_run_is_one_error_line_before_training(tmp_path, capsys, monkeypatch):
    """Rank 0's dry run fails: every rank (here the only one) stops with one error line, exit 2,
    before any step runs."""
    from autoshard.runtime import dryrun

    def broken(program, rank=0, module_paths=None):
        raise dryrun.DryRunError("dry run of rank 0, backward: node view_3 failed: cannot view")

    monkeypatch.setattr(dryrun, "estimate", broken)
    root = logging.getLogger()
    before = (root.handlers[:], root.level)
    code, err = run_main([*TINY, "--mesh", "1", "--steps", "2", "--out", str(tmp_path / "run")], capsys)
    assert code == 2
    # the caller's logging is as it was: no handler left writing to the stream captured during the run
    assert (root.handlers, root.level) == before
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: the planned program cannot run: dry run of rank 0, backward: node view_3 failed: cannot view"
    ]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.ranks
def test_bad_input_under_torchrun_prints_its_error_line_every_launch():
    """Every rank checks its input alike and torchrun ends the others as soon as one exits, so the
    line cannot wait for rank 0: whichever rank fails first says it, once per host (2 launches of a
    mesh that is not the world size, and a --steps of 0)."""
    for args, message in [(["--mesh", "2x4"], "mesh 2x4 has 8 devices but the world size is 4")] * 2 + [
        (["--mesh", "2x2", "--steps", "0"], "--steps must be >= 1, got 0")
    ]:
        out = torchrun(*TINY, *args, ok=False, timeout=300)
        lines = [x for x in (out.stdout + out.stderr).splitlines() if x.startswith("error:")]
        assert out.returncode != 0 and len(lines) == 1 and message in lines[0], (args, out.stderr[-3000:])
