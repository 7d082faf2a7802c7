"""3D meshes with roles (HSDP: dp_replicate x dp_shard x tp): the replicate dim is planned first as
data parallelism, parameters are replicated over it, and the run matches the single device."""

from __future__ import annotations

import json
import math

import pytest
import torch

from autoshard import PlanConfig
from autoshard.driver.api import AutoShard
from autoshard.layout import Layout, R, S
from autoshard.problem.build import FixedMeshDim, dim_placements
from autoshard.profiles.network import NetworkProfile
from autoshard.strategies import Strategy
from autoshard_models import build_model, cross_entropy_loss
from autoshard_models.train_single import TrainSettings, train_single
from plan_audit import assert_shards, force_sharding
from test_apply import BATCH, SEQ, TINY, single_device, trains_like_single_device
from test_train import SHARDED_ON_4, metrics, torchrun

ROLES3 = ("dp_replicate", "dp_shard", "tp")


def plan_3d(**config):
    """The (2,2,2) plan with roles, parameters sharded over dp_shard x tp by a budget (the roles
    split the batch over both dp dims)."""
    meta = build_model(TINY, device="meta")
    example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    with AutoShard(
        meta, example, config=PlanConfig(mesh=(2, 2, 2), mesh_names=ROLES3, **config), loss_fn=cross_entropy_loss
    ) as auto:
        force_sharding(auto, budget=None, split_batch=False)
        auto.memory_budget(float(SHARDED_ON_4[1]))  # replicated over dp_replicate: 4 ranks share them
        plan = auto.optimize()
        assert_shards(plan)
        return plan, auto


def plan_2d():
    meta = build_model(TINY, device="meta")
    example = lambda: (torch.empty(BATCH // 2, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    with AutoShard(meta, example, config=PlanConfig(mesh=(2, 2)), loss_fn=cross_entropy_loss) as auto:
        return auto.optimize()


def test_the_replicate_dim_keeps_only_its_data_parallel_placements():
    a, b = Strategy((Layout((R, S(0))),), (Layout((S(0), S(0))),)), Strategy((Layout((S(0), R)),), (None,))
    fixed = FixedMeshDim(0, {"x": dim_placements(b)})
    assert dim_placements(a) == ((R,), (S(0),)) and dim_placements(b, 1) == ((R,), (None,))
    assert fixed.keep("x", (a, b)) == [1] and fixed.keep("y", (a, b)) == [0, 1]  # unlisted: all kept
    assert FixedMeshDim(0, {"x": ((S(1),), ())}).keep("x", (a, b)) == [0, 1]  # none agrees: all kept


@pytest.mark.slow
def test_hsdp_plan_respects_roles_and_trains_like_single_device():
    """Every parameter (so every gradient) is Replicate on dp_replicate and the batch enters split
    over it; the 3D problem is no larger than the 2D one of the other dims; 3 steps on 8 simulated
    ranks match the single device."""
    plan, auto = plan_3d()
    assert all(lay.placements[0] == R for lay in plan.param_layouts.values()), plan.param_layouts
    assert [lay.placements[0] for lay in plan.input_layouts] == [S(0), S(0)]
    # every node kept only the strategies with the 1D solve's placements on dim 0
    assert all(len({dim_placements(s) for s in choices}) == 1 for choices in auto.sharding.strategies.values())
    two_d = plan_2d()
    assert plan.solution.stats.variables <= 1.5 * two_d.solution.stats.variables, (
        plan.solution.stats,
        two_d.solution.stats,
    )
    pmodel = trains_like_single_device(plan, (2, 2, 2), single_device(3), ROLES3)
    # parameters never move over dp_replicate: what crosses it is activations and gradient reductions
    assert not [s for s in pmodel.comm.steps["forward"] if 0 in s[3] and s[2] != "all_gather"]


def test_network_presets_put_the_tp_dims_inside_a_node():
    h100 = NetworkProfile.preset("h100-node", 3)
    assert h100.beta[2] > h100.beta[0] == h100.beta[1]  # default: the last dim is the node's
    tp_first = NetworkProfile.preset("h100-node", 3, intra_node_dims=(0,))
    assert tp_first.beta == (h100.beta[2], h100.beta[0], h100.beta[0])
    one = h100.restricted_to(2)
    assert (one.alpha, one.beta, one.launch_s) == ((h100.alpha[2],), (h100.beta[2],), h100.launch_s)


@pytest.mark.slow
@pytest.mark.ranks
def test_eight_gloo_ranks_train_hsdp_like_single_device(tmp_path, executed_plans):
    """`train` on 8 real gloo processes, mesh (2,2,2) with roles, parameters sharded over dp_shard x
    tp: 2 steps with the single-device losses; the log and plan.json name each dim's role."""
    out = tmp_path / "run"
    torchrun(
        "--model",
        "llama3-tiny",
        "--batch",
        "8",
        "--seq",
        "16",
        "--mesh",
        "2x2x2",
        "--mesh-names",
        ",".join(ROLES3),
        *SHARDED_ON_4,
        "--steps",
        "2",
        "--out",
        str(out),
        nproc=8,
        timeout=600,
    )
    (facts,) = executed_plans()
    assert_shards(facts)
    want = train_single(TrainSettings(model="llama3-tiny", steps=2, batch=8, seq=16)).losses
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(abs(r["loss"] - loss) <= 1e-5 for r, loss in zip(rows, want)), (rows, want)
    report = json.loads((out / "plan.json").read_text())
    assert report["mesh_names"] == list(ROLES3) and math.prod(report["mesh_shape"]) == 8
    assert all(p["layout"].startswith("R") for p in report["parameters"])
    log = (out / "sharding.log").read_text().splitlines()
    assert log[0] == "autoshard sharding log: mesh (2, 2, 2) = dp_replicate 2 x dp_shard 2 x tp 2"
    assert log[1].startswith("dp_replicate (mesh dim 0): parameters replicated over it, the batch split")
