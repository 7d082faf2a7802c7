"""`make bench`'s runner (benchmarks.suite.run) in quick mode (the CI smoke check; CI never runs the full benchmark):
every section runs, autoshard's plans cost no more than the hand-written ones, our planner never
loses to torch's, and both parallel trainings (autoshard and the FSDP2+TP recipe) match the
single-device losses under torchrun while reporting throughput and bytes on the wire."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.cost_model.accuracy import _median_case
from benchmarks.cost_model.accuracy import markdown as accuracy_markdown
from benchmarks.gpu.rates import Row, summary
from torchrun import one_launch_at_a_time

ROOT = Path(__file__).resolve().parents[1]
# The fixture runs the whole quick benchmark (~7 minutes on 2 idle cores, more beside other tests on
# a slow machine) and waits for the launch lock in between; the suite's 600 s per test would cut it.
pytestmark = [
    pytest.mark.timeout(2400),
    # the benchmark measures autoshard's default plan, replicated on these tiny models, as
    # users get it; the sharded numerics are the other tests' (tests/plan_audit.py)
    pytest.mark.replicated_plan,
]


PLANNING = "speed,command,quality,memory,planner"  # one process each, no torchrun
LAUNCHING = "training,accuracy"  # torchrun trainings and calibration


def run_quick(out: Path, sections: str) -> tuple[dict, str]:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.suite.run", "--quick", "--only", sections, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1400,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """Every section of the quick run, in two runs: only the one whose sections launch torchrun
    holds the test run's launch lock, so the planning sections (half the time) overlap the other
    tests' launches."""
    out = tmp_path_factory.mktemp("bench")
    planning, planning_stdout = run_quick(out / "planning.json", PLANNING)
    with one_launch_at_a_time():
        launching, launching_stdout = run_quick(out / "launching.json", LAUNCHING)
    assert set(planning) & set(launching) == {"meta"}
    return planning | launching, planning_stdout + launching_stdout


@pytest.mark.slow
def test_quick_planning_sections(quick):
    results, stdout = quick
    (speed,) = results["speed"]
    assert speed["model"] == "llama3-8b" and speed["layers"] == 2 and speed["variables"] > 0
    assert set(speed["timings"]) >= {"trace", "build", "solve", "dry_run"} and speed["rss_gib"] > 0
    assert speed["dry_s"] > 0 and speed["peak_gib"] > 0  # the dry run of rank 0's program ran
    (command,) = results["command"]  # the plan command as a process, with and without the dry run
    assert command["model"] == "llama3-tiny" and 0 < command["no_dry_run_s"] and 0 < command["dry_run_s"]
    (quality,) = results["quality"]
    assert all(quality["checks"].values()), quality["checks"]
    plans = {p["plan"]: p for p in quality["plans"]}
    assert plans["autoshard, param orders forced to default"]["non_default_order"] == 0
    for mesh in results["planner"]["costs"]:
        assert mesh["greedy"]["losses"] == 0 and mesh["graph"]["losses"] == 0
    assert "| plan | step ms |" in stdout and "| mesh | pairs |" in stdout  # the README tables


@pytest.mark.slow
def test_quick_memory_section(quick):
    """llama3-debug (2,2) under 45 MB per rank (the plan as solved needs more): autoshard's fitted plan
    recomputes the blocks and its dry run fits; the recipe with full activation checkpointing ran
    the same dry run; the goal compares their modeled steps."""
    figures = quick[0]["memory"]
    (case,) = figures["cases"]
    ours, theirs = case["autoshard"], case["recipe"]
    assert ours["runs"] and ours["limit_bytes"] == 45e6 and ours["constrained"] and ours["recompute"]
    assert ours["peak_bytes"] <= ours["limit_bytes"] < ours["solved_peak_bytes"] and case["fits"]
    assert theirs["runs"] and theirs["recompute"] and theirs["limit_bytes"] is None and theirs["peak_bytes"] > 0
    assert case["goal"] == (ours["step_ms"] <= theirs["step_ms"] * (1 + 1e-9)) and figures["goal"] == case["goal"]
    assert "| case (seq, device, bf16/fp32) | autoshard under 42.9 MiB" in quick[1]


@pytest.mark.slow
def test_quick_training_section(quick):
    """bf16 with fp32 reduction (every trainer under the same MixedPrecisionPolicy, the reference
    too; quick runs skip fp32): each loss curve follows the single-device one."""
    assert "training" not in quick[0]
    figures = quick[0]["training_bf16"]
    assert figures["workload"]["param_dtype"] == "bf16" and figures["loss_rtol"] == 1e-2
    steps = figures["workload"]["steps"]
    reference = figures["reference"]["losses"]
    assert len(reference) == steps and reference[-1] < reference[0]
    for name in ("autoshard", "recipe", "fsdp2"):  # fsdp2: the recipe script with no TP (Nx1 mesh)
        run = figures[name]
        assert len(run["losses"]) == steps
        assert run["max_rel_loss_dev"] <= figures["loss_rtol"], (name, run["losses"], reference)
        assert run["tokens_per_s"] > 0 and run["peak_rss_mb"] > 0
        assert run["runs_tokens_per_s"] == [run["tokens_per_s"]]  # quick: one run per trainer
        # autoshard's plan may move nothing (llama3-tiny: every rank computes the whole batch when
        # that beats any communication); the meter sees what its plan has
        moves = figures["autoshard"]["modeled_comm_bytes"] > 0 if name == "autoshard" else True
        assert len(run["wire_bytes_per_rank"]) == 4 and (run["wire_bytes"] > 0) == moves
        assert sum(run["wire_bytes_by_kind"].values()) == pytest.approx(run["wire_bytes_per_rank"][0], abs=4)
    assert figures["autoshard"]["planning_s"] > 0 and figures["repeats"] == 1 and "autoshard_sync" not in figures
    assert 0 < figures["autoshard"]["modeled_overlapped_step_s"] <= figures["autoshard"]["modeled_step_s"]
    best = max(("recipe", "fsdp2"), key=lambda k: figures[k]["tokens_per_s"])
    assert figures["best_baseline"] == best and math.isclose(
        figures["best_baseline_ratio"], figures["autoshard"]["tokens_per_s"] / figures[best]["tokens_per_s"]
    )
    assert math.isclose(figures["paired_ratio_median"], figures["best_baseline_ratio"])  # one round
    assert all(v == "Shard(dim=0)" for v in figures["fsdp2"]["layouts"].values())  # fully_shard alone
    assert math.isclose(
        figures["throughput_ratio"], figures["autoshard"]["tokens_per_s"] / figures["recipe"]["tokens_per_s"]
    )
    # the recipe's parameters are laid out as torchtitan's llama3 recipe lays them out
    layouts = figures["recipe"]["layouts"]
    assert layouts["layers.0.attention.wq.weight"].startswith("_StridedShard(dim=0")
    assert layouts["layers.0.feed_forward.w2.weight"] == "Shard(dim=0)Shard(dim=1)"
    assert layouts["norm.weight"] == "Shard(dim=0)Replicate()"


@pytest.mark.slow
def test_quick_accuracy_section(quick):
    """The calibrated profile's modeled step time of each of the three plans beside its measured
    one (the accuracy goal itself is the full benchmark's, not a test's: this machine is shared)."""
    figures = quick[0]["accuracy"]
    (calibrated,) = figures["sets"].values()
    assert list(calibrated["plans"]) == ["autoshard", "FSDP+TP recipe pinned"]  # quick: one recipe beside ours
    assert [c["case"]["mesh"] for c in figures["cases"]] == ["2x2"]
    for r in calibrated["plans"].values():  # the whole step: compute, the optimizer, communication
        assert r["modeled_s"] == pytest.approx(r["compute_s"] + r["optimizer_s"] + r["comm_s"]) and r["modeled_s"] > 0
        assert r["optimizer_s"] > 0
        assert r["measured_s"] > 0 and r["ratio"] == pytest.approx(r["modeled_s"] / r["measured_s"])
    assert sorted(calibrated["modeled_ranking"]) == sorted(calibrated["plans"])
    # train --recipe pinned the recipe's layouts
    recipe = calibrated["plans"]["FSDP+TP recipe pinned"]["layouts"]
    assert recipe["layers.0.attention.wq.weight"] == "S(0)S(0)[1,0]" and recipe["norm.weight"] == "S(0)R"
    assert figures["profile"]["network"]["groups"][0]["mesh_dims"] == [0, 1]
    assert "| profiles | plan | modeled ms" in quick[1]


def test_gpu_rates_summary_and_no_gpu():
    """benchmarks.gpu.rates (run on GPUs only): its summary is the medians a preset carries, and
    without CUDA it says so in one `error:` line."""
    rows = [
        Row("matmul", "bfloat16 fwd a", 1.0, 2.0, 600e12, 0.0),
        Row("matmul", "bfloat16 fwd b", 1.0, 1.0, 700e12, 0.0),
        Row("matmul", "bfloat16 fwd c", 2.0, 1.0, 1300e12, 0.0),
        Row("matmul", "float32 fwd a", 1.0, 1.0, 45e12, 0.0),
        Row("memory", "add", 1e-3, 1e-3, 0.0, 2.4e9),
        Row("optimizer", "adamw", 1.0, 0.5, 0.0, 1e9),
    ]
    got = summary(rows)
    assert got["bf16_flops"] == 650e12 and got["fp32_flops"] == 45e12 and got["memory_bytes_s"] == pytest.approx(2.4e12)
    assert got["modeled_over_measured"] == 1.0  # of 2, 1, 0.5, 1, 1, 0.5
    if not __import__("torch").cuda.is_available():
        done = subprocess.run([sys.executable, "-m", "benchmarks.gpu.rates"], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr == "error: no CUDA device: this benchmark times one GPU\n"


def test_accuracy_rounds_take_the_median_round():
    """benchmarks.cost_model.accuracy over rounds: each plan's row is its median round by modeled / measured,
    every round's ratio beside it; the rankings order the plans by their median steps, not by one
    round's."""

    def plan(modeled, measured):
        return {
            "modeled_s": modeled,
            "compute_s": modeled,
            "optimizer_s": 0.0,
            "comm_s": 0.0,
            "measured_s": measured,
            "ratio": modeled / measured,
        }

    steps = [((1.0, 1.5), (1.2, 1.9)), ((1.0, 1.0), (1.2, 2.0)), ((1.1, 1.2), (1.3, 1.15))]  # (ours, theirs) per round
    rounds = [
        {
            "case": {"model": "m", "batch": 8, "seq": 64, "steps": 12, "warmup": 2, "mesh": "1x2"},
            "calibrate_s": i,
            "profile": {"round": i},
            "sets": {"calibrated": {"plans": {"ours": plan(*ours), "theirs": plan(*theirs)}}},
        }
        for i, (ours, theirs) in enumerate(steps)
    ]
    case = _median_case(rounds)
    ours, theirs = case["sets"]["calibrated"]["plans"]["ours"], case["sets"]["calibrated"]["plans"]["theirs"]
    assert ours["measured_s"] == 1.2 and ours["round_ratios"] == [1.0 / 1.5, 1.0, 1.1 / 1.2]
    assert theirs["measured_s"] == 1.9 and theirs["ratio"] == 1.2 / 1.9  # of 0.63, 0.6 and 1.13
    # medians: modeled 1.0 < 1.2 and measured 1.2 < 1.9; round 3 alone measured theirs first (1.15 < 1.2)
    assert case["sets"]["calibrated"]["measured_ranking"] == ["ours", "theirs"]
    assert case["sets"]["calibrated"]["same_ranking"] and not case["sets"]["calibrated"]["within_goal"]
    assert case["rounds"] == 3 and case["calibrate_s"] == [0, 1, 2] and case["profile"] == {"round": 2}
    assert (
        "| calibrated | ours | 1100.0 (1100.0 + 0.0 + 0.0) | 1200.0 | 0.92 | 0.67 / 1.00 / 0.92 |"
        in accuracy_markdown(case | {"cases": [case]})
    )


def test_throughput_runs_only_the_baselines_named_and_refuses_one_that_does_not_run():
    """`--baselines` picks among the trainers that run on the workload: on 2 ranks (mesh 2x1) there
    is no tensor-parallel recipe, and asking for it fails before any process starts."""
    from benchmarks.training import throughput as training

    with pytest.raises(ValueError, match="--baselines: recipe do not run on this workload"):
        training.run(two_ranks=True, baselines=["ddp", "recipe"])


def test_all_runs_the_three_configurations_and_reports_each_against_its_best(monkeypatch, capsys, tmp_path):
    """benchmarks.training.throughput --all: make train's configuration, seq 256 and wide, in that order,
    without autoshard_sync; one line each of autoshard against its best baseline (throughput and
    wall time); a loss curve off the reference fails the run but not the other configurations."""
    from benchmarks.training import throughput as training

    calls = []

    def fake_run(**kwargs):
        calls.append(kwargs)
        tokens = {"make_train": 1000.0, "wide": 300.0}.get(next(iter(set(kwargs) & {"make_train", "wide"}), ""), 500.0)
        figures = {
            "autoshard": {"tokens_per_s": tokens, "wall_s": 18.0, "planning_s": 2.5},
            "ddp": {"tokens_per_s": 990.0, "wall_s": 9.5},
            "best_baseline": "ddp",
            "best_baseline_ratio": tokens / 990.0,
        }
        if "wide" in kwargs:
            raise training.LossMismatch("loss curve of autoshard differs", figures)
        return figures

    monkeypatch.setattr(training, "run", fake_run)
    code = training.main(["--all", "--repeats", "2", "--json", str(tmp_path / "all.json")])
    assert code == 1 and [sorted(k for k in c if c[k] is True) for c in calls] == [["make_train"], [], ["wide"]]
    assert all(c["overlap"] is False and c["repeats"] == 2 for c in calls)
    assert [Path(c["out_dir"]).name for c in calls] == ["make-train", "seq256", "wide"]  # apart: same model, mesh
    out = capsys.readouterr().out
    assert (
        "make-train  autoshard 1,000 tok/s, ddp 990: 1.010x; torchrun wall 18.0 s (planning 2.5 s) against 9.5 s" in out
    )
    assert "seq256      autoshard 500 tok/s, ddp 990: 0.505x" in out and "wide        autoshard 300 tok/s" in out
    assert list(json.loads((tmp_path / "all.json").read_text())) == ["make-train", "seq256", "wide"]


def test_init_memory_reports_the_later_steps_apart_from_the_first():
    """Three steps: the first step's peak and the later steps' (which hold the AdamW states) are two
    figures, each the largest rank's over its baseline; a code that records no first step apart
    (one step, or a checkout from before the hook) gives the step's peak and no later figure."""
    from benchmarks.training.init_memory import summarize

    def rank(base, first, later):
        return dict(
            base=base,
            plan_peak=base + 20,
            planned_rss=base + 10,
            load_peak=base + 40,
            loaded_rss=base + 30,
            first_step_peak=base + first,
            step_peak=base + later,
        )

    three = {"steps": 3, "ranks": [rank(1000, 70, 80), rank(900, 71, 79)]}
    s = summarize(three, 100)
    assert (s["step_peak_x"], s["later_steps_peak_x"], s["peak_x"]) == (0.71, 0.80, 0.80)
    assert (s["plan_peak_x"], s["load_growth_x"]) == (0.20, 0.30)
    old = {"ranks": [{k: v for k, v in rank(1000, 0, 70).items() if k != "first_step_peak"}]}
    s = summarize(old, 100)
    assert (s["step_peak_x"], s["later_steps_peak_x"], s["peak_x"]) == (0.70, None, 0.70)


def test_host_work_times_each_redistribution_kind_bucket_and_program(tmp_path):
    """benchmarks.executor.host_work at a few calls: a row per redistribution with its raw collectives
    timed apart (none for a local chunk), a per-member figure per bucketed kind, and both programs
    of make train's model with their redistribution modules counted and timed inside the step, and
    no read of a value back to the host in either program's step."""
    from benchmarks.executor import host_work

    assert host_work.main(["--calls", "4", "--steps", "1", "--json", str(tmp_path / "h.json")]) == 0
    result = json.loads((tmp_path / "h.json").read_text())
    rows = {r["redistribution"]: r for r in result["single"]}
    assert len(rows) == len(host_work.SINGLE) and rows["RR -> S(0)R"]["raw_us"] < 1.0  # no collective
    assert all(r["executor_us"] > 0 for r in rows.values()) and rows["PR -> RR"]["steps"] == "all_reduce"
    assert [b["members"].split(" (")[1] for b in result["buckets"]] == [
        "all_reduce)",
        "all_gather)",
        "all_gather)",
        "reduce_scatter)",
    ]
    default, recipe = result["programs"]
    assert (default["plan"], recipe["plan"]) == ("default", "fsdp-tp")
    assert default["buckets"] >= 1 and default["members"] > default["buckets"]
    assert recipe["redistributions"] > default["redistributions"]
    assert all(0 < p["executor_s"] < p["step_s"] for p in (default, recipe))
    # the forward (loss included) and backward never read a value back: on a GPU, no host wait
    assert default["host_reads"] == recipe["host_reads"] == []
    with host_work.HostReads() as reads:
        bool(torch.ones(2).sum() > 0), torch.arange(3).sum().item()
    assert reads.ops == ["_local_scalar_dense", "_local_scalar_dense"]  # what it would catch


def test_op_counts_files_rank_0_s_ops_by_where_and_kind(tmp_path, capsys):
    """benchmarks.executor.op_counts on llama3-8b (8, 8) (fake tensors: seconds): the traced graph's ops
    and the executor's apart, each collective launch with its wait, and a gathered bucket's
    members copied out in one kernel (no clone or slice per member)."""
    from benchmarks.executor import op_counts

    assert op_counts.main(["--json", str(tmp_path / "o.json")]) == 0
    result = json.loads((tmp_path / "o.json").read_text())
    counts, ops = result["counts"], result["ops"]
    assert counts["graph"]["kernels"] > 1000 and counts["graph"]["waits"] == 0
    launches = sum(n for where in ops.values() for name, n in where.items() if name.split("_")[0] in ("all", "reduce"))
    assert sum(c["waits"] for c in counts.values()) == launches  # each collective waited once
    awaits = ops["bucket awaits"]
    assert awaits["split_with_sizes_copy"] == ops["bucket launches"]["all_gather_into_tensor"] > 0
    assert "clone" not in awaits and "slice" not in awaits
    assert "| bucket awaits |" in capsys.readouterr().out


def test_paired_summary_is_the_median_of_each_steps_ratio_past_the_warm_up():
    """benchmarks.training.paired: the ratio is taken step by step (DDP's time over autoshard's of
    the same step), the first steps left out, and the losses of every step compared."""
    from benchmarks.training.paired import WARMUP, summarize

    warm = [{"autoshard_s": 9.0, "ddp_s": 1.0, "autoshard_loss": 2.0, "ddp_loss": 2.0}] * WARMUP
    timed = [(1.0, 1.1), (2.0, 1.8), (1.0, 1.0), (0.5, 0.6), (1.5, 1.5)]  # (autoshard, ddp): slow spells
    rows = warm + [{"autoshard_s": a, "ddp_s": d, "autoshard_loss": 3.0, "ddp_loss": 3.0} for a, d in timed]
    rows[-1] = rows[-1] | {"autoshard_loss": 3.0003}
    s = summarize(rows)
    assert s["steps_timed"] == 5 and s["ddp_over_autoshard_median"] == 1.0  # of 1.1, 0.9, 1.0, 1.2, 1.0
    assert s["autoshard_step_s_median"] == 1.0 and s["ddp_step_s_median"] == 1.1
    assert s["max_rel_loss_dev"] == pytest.approx(1e-4)
