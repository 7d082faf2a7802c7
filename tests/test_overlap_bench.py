"""benchmarks.cost_model.overlap at its smallest (`--quick`: llama3-tiny on 4 gloo ranks, one round of
prefetch 0 and 1, 3 steps each; about 40 s on 2 idle cores): both runs train the same plan, which
gathers parameters on the dp dim, and the figures the docs quote are there and consistent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import plan_audit
from torchrun import child_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.ranks
def test_overlap_benchmark_quick(tmp_path, executed_plans):
    out = tmp_path / "overlap.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.cost_model.overlap",
            "--quick",
            "--out",
            str(tmp_path / "runs"),
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["case"]["prefetch"] == [0, 1] and figures["case"]["rounds"] == 1
    (presets,) = figures["sets"].values()
    plan = presets["plan"]
    assert plan["params_sharded_on_dp"] > 0 and plan["all_gathers_on_dp"] > 0, plan
    assert presets["same_plan_every_run"]
    rows = presets["rows"]
    assert [r["prefetch"] for r in rows] == [0, 1]
    for r in rows:
        assert r["measured_s"] > 0 and len(r["rounds_measured_s"]) == 1
        assert len(r["modeled_values"]) == 1 and r["modeled_s"] == rows[0]["modeled_s"]  # one plan
        assert r["overlapped_s"] > 0 and r["overlapped_over_measured"] == pytest.approx(
            r["overlapped_s"] / r["measured_s"]
        )
    assert rows[0]["measured_speedup"] == 1.0 and rows[0]["modeled_speedup"] == 1.0
    assert rows[1]["overlapped_s"] <= rows[0]["overlapped_s"]  # prefetch hides, never adds, modeled time
    assert "| prefetch | measured step ms |" in done.stdout
    plans = executed_plans()  # rank 0 of both runs, recorded by tests/audit_site
    assert len(plans) >= 2
    for facts in plans:
        plan_audit.assert_shards(facts, params_sharded=True, batch_split=False)
