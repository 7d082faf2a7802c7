"""The sharding log / plan JSON (autoshard.report.text) and the `python -m autoshard plan` command."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autoshard.__main__ import main
from autoshard.driver.api import AutoShard
from autoshard.options import parse_bytes, parse_mesh
from autoshard.profiles.device import DeviceProfile
from autoshard.report.build import plan_report
from autoshard.report.files import write_report
from autoshard.report.html import render_html
from autoshard.report.text import format_log, human_bytes, human_time, memory_line, summary_lines
from autoshard.runtime.dryrun import dry_run
from autoshard.runtime.module import parallelize
from autoshard_models import build_model, cross_entropy_loss, get_config
from plan_audit import sharded_plan
from simulation import simulated_mesh

ROOT = Path(__file__).resolve().parents[1]
TINY_ARGS = ["--model", "llama3-tiny", "--mesh", "2x2", "--batch", "4", "--seq", "16"]


@pytest.fixture(scope="module")
def tiny():
    model = build_model(get_config("llama3-tiny"), device="meta")
    inputs = lambda: (torch.empty(4, 16, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    with AutoShard(model, inputs, (2, 2), loss_fn=cross_entropy_loss) as auto:
        plan = sharded_plan(auto, budget=1.0)  # every parameter sharded (gathers), the batch split
    return plan, plan_report(plan, timings=auto.timings, extra={"fingerprint": "abc"}), auto.timings


@pytest.mark.slow
def test_report_lists_every_parameter_with_its_layout(tiny):
    plan, report, _ = tiny
    params = {p["fqn"]: p for p in report["parameters"]}
    assert list(params) == list(plan.graph.params)  # graph order
    for fqn, layout in plan.param_layouts.items():
        p = params[fqn]
        assert p["layout"] == str(layout)
        assert tuple(p["local_shape"]) == layout.local_shape(tuple(p["shape"]), plan.mesh_shape)
        assert p["bytes_per_rank"] == 4 * torch.Size(p["local_shape"]).numel()  # float32
    assert report["totals"]["non_default_order_params"] == len(plan.non_default_order_params())
    assert {i["kind"] for i in report["inputs"]} == {"input", "buffer", "tangent"}


def test_report_accounts_for_every_redistribution_and_round_trips(tiny):
    plan, report, timings = tiny
    entries = [r for group in ("nodes", "sinks") for item in report[group] for r in item["redistributions"]]
    assert len(entries) == len(plan.redistributions)
    assert sum(r["cost_s"] for r in entries) == pytest.approx(plan.comm_s)
    assert sum(r["bytes"] for r in entries) == pytest.approx(plan.comm_bytes)
    assert any(s.startswith("all_gather[") for r in entries for s in r["steps"])
    assert not any(n["op"] == "<built-in function getitem>" for n in report["nodes"])
    assert {s["name"] for s in report["sinks"]} == {name for name in plan.strategies if name.startswith("sink:")}
    totals = report["totals"]
    assert totals["step_time_s"] == pytest.approx(plan.step_time_s)
    assert totals["ilp"]["variables"] > 0 and totals["ilp"]["status"] == plan.solution.status
    assert report["timings"] == timings and report["fingerprint"] == "abc"
    assert json.loads(json.dumps(report)) == report


def test_log_has_table_graph_and_totals(tiny):
    plan, report, _ = tiny
    log = format_log(report)
    assert f"== parameters ({len(plan.param_layouts)}) ==" in log
    assert "parameter (FQN)" in log and "local shape" in log and "bytes/rank" in log
    for fqn, layout in plan.param_layouts.items():
        assert any(line.startswith(fqn + " ") and f" {layout} " in line for line in log.splitlines()), fqn
    assert human_bytes(12 * 1024) == "12.0 KiB" and "12.0 KiB" in log  # the w1/w3 shards
    gathers = [line for line in log.splitlines() if line.lstrip().startswith("<-") and "all_gather[" in line]
    assert gathers and all("µs" in line or "ns" in line for line in gathers)
    assert "== totals ==" in log and "modeled step time" in log and "ILP:" in log and "== timings ==" in log
    assert "fingerprint: abc" in log
    assert plan.solution.status == "optimal" and report["totals"]["ilp"]["bound"] == pytest.approx(
        plan.solution.objective
    )
    (ilp,) = [line for line in log.splitlines() if line.startswith("ILP:")]
    assert ilp.endswith(f"proven lower bound {human_time(plan.solution.objective)} (objective within 0.000%)")
    lines = summary_lines(report)
    assert 1 <= len(lines) <= 8 and "modeled step" in lines[0]


def test_applied_plan_reports_what_the_program_runs(tiny):
    """After apply, the log shows the collectives the program runs (buckets counted once) beside
    the modeled ones."""
    plan, _, _ = tiny
    with simulated_mesh((2, 2)) as (mesh, _mode):
        pmodel = parallelize(plan, mesh, build_model(get_config("llama3-tiny"), device="meta"))
    report = plan_report(plan, program=pmodel.program)
    ran = report["totals"]["program_count_by_collective"]
    assert ran == dict(sorted(pmodel.comm.total_count().items()))
    assert ran["all_gather"] < report["totals"]["count_by_collective"]["all_gather"]  # gathers bucketed
    assert f"all_gather x{ran['all_gather']}" in format_log(report)
    assert f"run as all_gather x{ran['all_gather']}" in summary_lines(report)[1]


def test_write_report_writes_all_three_files(tiny, tmp_path):
    plan, _, timings = tiny
    log_path, json_path = write_report(plan, tmp_path / "new" / "dir", timings=timings)
    assert log_path.read_text(encoding="utf-8").startswith("autoshard sharding log")
    report = plan_report(plan, timings=timings)
    assert json.loads(json_path.read_text()) == report
    lines = json_path.read_text().splitlines()  # one line per top-level key and per entry of a list
    assert len(json.loads(json_path.read_text())["parameters"]) == len(plan.param_layouts)
    for key in ("parameters", "nodes"):
        start = lines.index(f' "{key}": [')
        assert [json.loads(line.rstrip(",")) for line in lines[start + 1 : start + 1 + len(report[key])]] == report[key]
    assert lines[0] == "{" and lines[-1] == "}" and f' "mesh_shape": {json.dumps(report["mesh_shape"])},' in lines
    assert sorted(p.name for p in log_path.parent.iterdir()) == ["plan.json", "report.html", "sharding.log"]  # no temp


def test_parse_mesh_and_bytes():
    assert parse_mesh("8x8") == (8, 8) and parse_mesh("4") == (4,) and parse_mesh("2x2x2") == (2, 2, 2)
    for bad in ("2x", "x2", "8*8", "", "2x0", "-2x2"):
        with pytest.raises(ValueError):
            parse_mesh(bad)
    assert parse_bytes("16GiB") == 16 * 2**30 and parse_bytes("2e9") == 2e9
    with pytest.raises(ValueError):
        parse_bytes("lots")


@pytest.mark.slow
def test_plan_command_writes_log_json_and_comparison(tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["plan", *TINY_ARGS, "--out", str(out), "--compare", "manual", "--mesh-names", "dp,tp"]) == 0
    printed = capsys.readouterr().out
    assert "modeled step" in printed and "fsdp-tp pinned" in printed and str(out / "plan.json") in printed
    report = json.loads((out / "plan.json").read_text())
    assert len(report["parameters"]) == 21 and report["mesh_shape"] == [2, 2]
    assert report["run"]["model"] == "llama3-tiny" and set(report["timings"]) >= {"trace", "solve"}
    manual = report["compare"]["manual"]
    assert manual["recipe"] == "fsdp-tp" and manual["step_time_s"] > 0 and manual["bytes_by_collective"]
    # the recipe's program, dry-run as ours is: its overlapped step and peak beside ours
    assert 0 < manual["overlapped_step_s"] <= 1.1 * manual["step_time_s"] and manual["peak_bytes"] > 0
    for row in ("overlapped", "peak memory"):
        assert any(line.startswith(row) for line in printed.splitlines()), row
    log = (out / "sharding.log").read_text(encoding="utf-8")
    assert "== compare" in log and "== parameters (21) ==" in log
    assert "layers.*.attention.wq.weight" in (out / "report.html").read_text(encoding="utf-8")
    # the dry run ran by default: peak memory per rank beside the h100's capacity, in all three places
    memory = report["memory"]
    (rank0,) = memory["ranks"]
    assert rank0["rank"] == 0 and memory["peak_bytes"] == rank0["peak_bytes"] > rank0["params"] > 0
    assert memory["capacity_bytes"] == DeviceProfile.preset("h100").memory_bytes and memory["fits"] is True
    assert rank0["optimizer"] == 2 * rank0["params"] and "dry_run" in report["timings"]
    assert "== memory per rank" in log and memory_line(memory) in log and memory_line(memory) in printed


def test_memory_line_says_whether_the_peak_fits():
    rank = {"rank": 0, "phase": "backward", "peak_bytes": 90 * 2**30}
    over = {"ranks": [rank], "capacity_bytes": 80 * 2**30, "device": "h100", "fits": False}
    assert memory_line(over) == (
        "memory per rank: peak 90.0 GiB (rank 0, backward) of 80.0 GiB on h100 (112%): DOES NOT FIT (10.0 GiB over)"
    )
    assert memory_line({**over, "capacity_bytes": None}) == "memory per rank: peak 90.0 GiB (rank 0, backward)"


@pytest.mark.slow
def test_plan_command_dry_run_failure_is_one_error_line_and_no_dry_run_skips_it(tmp_path, capsys, monkeypatch):
    from autoshard.runtime import dryrun

    def broken(program, rank=0, module_paths=None):
        raise dryrun.DryRunError("dry run of rank 0, backward: node view_3 failed: cannot view")

    monkeypatch.setattr(dryrun, "estimate", broken)
    with pytest.raises(SystemExit) as exc:
        main(["plan", *TINY_ARGS, "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and not (tmp_path / "a").exists()
    assert (
        err == "error: the planned program cannot run: dry run of rank 0, backward: node view_3 failed: cannot view\n"
    )
    assert main(["plan", *TINY_ARGS, "--out", str(tmp_path / "b"), "--no-dry-run"]) == 0
    report = json.loads((tmp_path / "b" / "plan.json").read_text())
    assert "memory" not in report and report["run"]["dry_run"] is False


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "llama3-nope", "--mesh", "2x2", "--batch", "4", "--seq", "16"], "unknown model config"),
        (["--model", "llama3-tiny", "--mesh", "2x", "--batch", "4", "--seq", "16"], "bad mesh '2x'"),
        (["--model", "llama3-tiny", "--mesh", "2x2", "--batch", "3", "--seq", "16"], "not divisible by mesh dim 0"),
        (["--model", "llama3-tiny", "--mesh", "2x2", "--batch", "4", "--seq", "0"], "positive integer"),
        (["--model", "llama3-tiny", "--mesh", "4", "--batch", "4", "--seq", "16", "--compare", "manual"], "2-D"),
    ],
)
def test_plan_command_bad_input_is_one_error_line(args, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["plan", *args, "--out", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not list(tmp_path.iterdir())


def test_plan_command_error_as_a_process():
    cmd = [sys.executable, "-m", "autoshard", "plan", *TINY_ARGS[:-1], "nope"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith("error: argument --seq") and done.stderr.count("\n") == 1
    assert "Traceback" not in done.stderr and not done.stdout


@pytest.mark.slow
def test_plan_command_llama3_8b(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "autoshard",
        "plan",
        "--model",
        "llama3-8b",
        "--mesh",
        "8x8",
        "--batch",
        "8",
        "--seq",
        "8192",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "plan.json").read_text())
    assert len(report["parameters"]) == 291 and report["totals"]["params"] == 291
    assert "== parameters (291) ==" in (tmp_path / "sharding.log").read_text(encoding="utf-8")
    # the dry run of rank 0's program completed (its backward used to crash: a view after a gather)
    memory = report["memory"]
    assert memory["ranks"][0]["activations"] > 10 * 2**30 and memory["peak_bytes"] > 20 * 2**30
    assert "memory per rank: peak" in done.stdout


def test_a_gpu_profile_prices_the_hosts_dispatch_and_names_a_host_bound_rank(tiny):
    """Where the host runs ahead of the device (`host_op_s`: the GPU presets), the report sets the
    ops rank 0 dispatches (the dry run's count) at that price beside the modeled device step: a
    tiny model's step is all host. A CPU profile has no host term: dispatch is in each op's time."""
    plan, _, _ = tiny
    result = dry_run(plan)
    ops = result.ranks[0].ops
    assert ops > len([n for n in plan.graph.nodes if n.op == "call_function"]) / 2
    h200 = DeviceProfile.preset("h200")
    host = plan_report(plan, dry_run=result, device=h200)["host"]
    assert host["ranks"] == [{"rank": 0, "ops": ops, "host_s": ops * h200.host_op_s}]
    assert host["host_bound_ranks"] == [0] and host["step_s"] == host["host_s"] > host["device_step_s"]
    report = plan_report(plan, dry_run=result, device=h200)
    line = f"host: rank 0 dispatches {ops:,} ops a step, {human_time(ops * 21e-6)} at 21 us each on h200, over"
    assert any(x.startswith(line) and x.endswith(f"host-bound, a step takes {human_time(ops * 21e-6)}")
               for x in summary_lines(report))  # fmt: skip
    fast = dataclasses.replace(h200, host_op_s=1e-12)
    report = plan_report(plan, dry_run=result, device=fast)
    assert report["host"]["host_bound_ranks"] == [] and report["host"]["step_s"] == report["host"]["device_step_s"]
    assert "the device bounds the step" in format_log(report) and not any(
        x.startswith("host:") for x in summary_lines(report)
    )
    assert "host" not in plan_report(plan, dry_run=result, device=DeviceProfile.preset("cpu"))
    assert "<dt>host</dt><dd>rank 0 dispatches" in render_html(report)
