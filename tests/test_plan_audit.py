"""The guard on numerics tests (tests/plan_audit.py, conftest): a plan executed here or in a process a
test starts is recorded, a replicated one is flagged, and `sharded_plan` forces sharding."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from autoshard.driver.api import AutoShard
from autoshard.runtime.module import parallelize
from plan_audit import AUDIT_ENV, assert_shards, problems, recorded, sharded_plan, summary
from simulation import simulated_mesh
from test_apply import MLP, mse
from torchrun import ROOT, child_env


def mlp_auto(mesh_shape=(2,)):
    torch.manual_seed(0)
    model = MLP(8, 16)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    return model, AutoShard(model, lambda: (x, y), mesh_shape, loss_fn=mse)


@pytest.mark.replicated_plan  # on purpose: the guard's own check
def test_an_executed_replicated_plan_is_recorded_and_would_fail_the_guard(executed_plans):
    model, auto = mlp_auto()
    plan = auto.optimize()  # free: a tiny MLP is cheapest replicated, with no collective
    with simulated_mesh((2,)) as (mesh, _):
        parallelize(plan, mesh, model)
    (facts,) = executed_plans()
    assert facts == summary(plan) and facts["collectives"] == {"0": {}} and facts["sharded_params"] == 0
    assert problems(facts) == ["no collective on mesh dim 0 (of mesh (2,))"]
    assert problems({**facts, "mesh": [1], "collectives": {"0": {}}}) == ["a world of one: nothing is sharded"]
    with pytest.raises(AssertionError, match="does not test sharding: no collective on mesh dim 0"):
        assert_shards(plan)


def test_sharded_plan_splits_the_batch_and_shards_parameters(executed_plans):
    model, auto = mlp_auto((2, 2))
    plan = sharded_plan(auto)
    facts = assert_shards(plan)
    assert facts["batch_split_on"] == [0] and facts["sharded_params"] > 0
    assert all(sum(kinds.values()) > 0 for kinds in facts["collectives"].values())
    with simulated_mesh((2, 2)) as (mesh, _):
        parallelize(plan, mesh, model)
    assert executed_plans() == [facts]


@pytest.mark.replicated_plan  # the child's plan is the replicated one above
def test_a_process_the_test_starts_records_its_modules(tmp_path):
    """Children get tests/audit_site first on PYTHONPATH (child_env): the plan a child executes
    lands in the file AUTOSHARD_TEST_PLAN_AUDIT names."""
    path = tmp_path / "plans.jsonl"
    child = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from simulation import simulated_mesh
        from test_plan_audit import mlp_auto
        from autoshard.runtime.module import parallelize
        model, auto = mlp_auto()
        plan = auto.optimize()
        with simulated_mesh((2,)) as (mesh, _):
            parallelize(plan, mesh, model)
    """)
    out = subprocess.run(
        [sys.executable, "-c", child],
        env=child_env(**{AUDIT_ENV: str(path)}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (facts,) = recorded(str(path))
    assert facts["mesh"] == [2] and problems(facts)
