"""The drivers above the stages: one PlanConfig (mesh roles, the batch check, flags generated from
it), and planning inside a process group: rank 0 solves for every rank."""

from __future__ import annotations

import math

import pytest
import torch

from autoshard import AutoShard, PlanConfig
from autoshard.cli.args import ArgumentParser, add_dataclass_arguments
from autoshard.options import from_values, parse_limit
from plan_audit import assert_shards
from torchrun import run_ranks


def test_the_config_names_roles_and_checks_the_batch():
    assert PlanConfig(mesh=(2, 2)).mesh_names == ("dp", "tp") and PlanConfig(mesh=(2, 2)).roles == ("dp_shard", "tp")
    three = PlanConfig(mesh=(2, 2, 2), mesh_names=("dp_replicate", "dp_shard", "tp"))
    assert three.roles == ("dp_replicate", "dp_shard", "tp") and three.data_parallel_dims == (0, 1)
    three.check_batch(4)
    with pytest.raises(
        ValueError,
        match=r"--batch 6 is not divisible by the dp size 4: .* mesh dims 0 'dp_replicate' x 1 'dp_shard' of size 4",
    ):
        three.check_batch(6)
    assert (three.replicate_dim, three.intra_node_dims) == (0, (2,))
    assert PlanConfig(mesh=(1, 4), mesh_names=("dp_replicate", "dp")).replicate_dim is None  # size 1: nothing to plan
    assert PlanConfig(mesh=(8, 2), mesh_names=("tp", "dp")).intra_node_dims == (0,)
    assert PlanConfig(mesh=(4,)).intra_node_dims is None  # no tp dim: the preset's last dim
    with pytest.raises(ValueError, match="must give 2 distinct names"):
        PlanConfig(mesh=(2, 2), mesh_names=("tp", "tp"))
    with pytest.raises(ValueError, match="memory limit must be positive"):
        PlanConfig(memory_limit=0)
    with pytest.raises(ValueError, match="reduce_dtype must be a floating-point dtype"):
        PlanConfig(reduce_dtype=torch.int32)


def test_the_config_resolves_profiles_precision_and_the_memory_limit():
    from autoshard.profiles.files import device_profile

    config = PlanConfig(mesh=(2, 2), param_dtype="bf16", reduce_dtype="fp32")
    assert config.with_default_profiles().network == "h100-node"
    assert config.with_default_profiles("cpu").device_profile == "cpu"
    assert config.replace(network="x").with_default_profiles("cpu").network == "x"
    policy = config.mp_policy
    assert (str(policy.param_dtype), str(policy.reduce_dtype)) == ("torch.bfloat16", "torch.float32")
    assert PlanConfig().mp_policy is None and PlanConfig().with_policy(policy).precision == config.precision
    h100 = device_profile("h100")
    assert config.memory_limit_bytes(h100) == pytest.approx(h100.memory_bytes * 0.9)
    assert config.replace(memory_limit=parse_limit("none")).memory_limit_bytes(h100) is None
    assert config.replace(memory_limit=5e9).memory_limit_bytes(h100) == 5e9
    # AutoShard.memory_limit means what the config's field means: None the default, inf none
    auto = AutoShard(torch.nn.Linear(4, 4), lambda: torch.zeros(2, 4), (2, 2), device="h100")
    for value, want in ((5e9, 5e9), (math.inf, None), (None, h100.memory_bytes * 0.9)):
        auto.memory_limit(value)
        assert auto.resolved_memory_limit == pytest.approx(want) if want else auto.resolved_memory_limit is None


def test_every_config_field_with_a_flag_is_an_option_of_plan_and_train():
    """A new PlanConfig field with a flag reaches both CLIs without another edit."""
    from autoshard.cli.plan import plan_parser
    from autoshard.cli.train import _parse

    parser = add_dataclass_arguments(ArgumentParser(prog="t"), PlanConfig)
    values = vars(
        parser.parse_args(
            [
                "--mesh",
                "4x2",
                "--mesh-names",
                "dp,tp",
                "--memory-limit",
                "none",
                "--param-dtype",
                "bfloat16",
                "--backend",
                "cbc",
                "--time-limit",
                "5",
            ]
        )
    )
    config = from_values(PlanConfig, values)
    assert (
        config.mesh,
        config.mesh_names,
        math.isinf(config.memory_limit),
        config.param_dtype,
        config.backend,
        config.time_limit,
    ) == ((4, 2), ("dp", "tp"), True, "bf16", "cbc", 5.0)
    plan_args = plan_parser().parse_args(
        ["--model", "m", "--mesh", "2x2", "--batch", "2", "--seq", "4", "--backend", "cbc", "--reshard-after-forward"]
    )
    assert from_values(PlanConfig, vars(plan_args)) == PlanConfig(
        mesh=(2, 2), backend="cbc", reshard_after_forward=True
    )
    train = _parse(["--backend", "cbc", "--time-limit", "5", "--mesh", "2x2", "--mesh-names", "dp_shard,tp"])
    assert (train.backend, train.time_limit, train.mesh_names) == ("cbc", 5.0, ("dp_shard", "tp"))


@pytest.mark.slow
@pytest.mark.ranks
def test_auto_shard_under_torchrun_solves_on_rank_0_only(executed_plans):
    """4 gloo ranks, mesh (2,2): auto_shard() runs the solver once, on rank 0, and every rank holds
    its plan and computes the single-device loss; a memory limit below the plan's dry-run peak is
    fitted by rank 0's solves alone, every rank ending with the same fitted plan; rank 0's solver
    failing is an error on every rank, not a hang of the other three."""
    ranks = run_ranks("dist_auto_shard.py", timeout=400)
    (facts,) = executed_plans()
    assert_shards(facts)
    assert [r["solves"] for r in ranks] == [1, 0, 0, 0]
    assert len({r["plan"] for r in ranks}) == 1
    for r in ranks:
        assert abs(r["loss"] - r["single_device_loss"]) <= 1e-5 * r["single_device_loss"]
    assert ranks[0]["fit_solves"] >= 1 and [r["fit_solves"] for r in ranks[1:]] == [0, 0, 0]
    assert len({r["fitted"] for r in ranks}) == 1
    fit = ranks[0]
    assert fit["fit_tried"] >= 2 and fit["fit_peak"] <= fit["fit_limit"] < fit["peak"]
    stopped = "SolveError: highs stopped without a solution (time_limit=1)"
    assert [r["failure"] for r in ranks] == [stopped] + [
        f"RankZeroFailed: rank 0 failed while planning for every rank: {stopped}"
    ] * 3


def test_mesh_roles_are_checked_with_one_error_line(capsys):
    """A mistyped role would plan something else silently: unknown roles, a role given twice (dp is
    dp_shard) and a mesh that is not the world size are one error line each, before any work."""
    from autoshard.__main__ import main

    with pytest.raises(
        ValueError,
        match=r"unknown role 'dp_replicte'; each mesh dim is one of pp, dp_replicate, "
        r"dp_shard, tp, cp \(dp means dp_shard\)",
    ):
        PlanConfig(mesh=(2, 2, 2), mesh_names=("dp_replicte", "dp_shard", "tp"))
    with pytest.raises(ValueError, match="role dp_shard is given twice"):
        PlanConfig(mesh=(2, 2), mesh_names=("dp", "dp_shard"))
    with pytest.raises(ValueError, match=r"mesh 2x2x2x2 has 4 dims: name them with --mesh-names"):
        PlanConfig(mesh=(2,) * 4)
    # no role is invented: unnamed meshes get what the docs' examples use; pp is named, first
    assert [PlanConfig(mesh=(2,) * n).mesh_names for n in (1, 2, 3)] == [
        ("dp",),
        ("dp", "tp"),
        ("dp_replicate", "dp_shard", "tp"),
    ]
    with pytest.raises(ValueError, match=r"pp must name the first \(outermost\) mesh dim"):
        PlanConfig(mesh=(2, 2, 2), mesh_names=("dp", "tp", "pp"))
    with pytest.raises(ValueError, match=r"a pipeline needs a dim beside pp"):
        PlanConfig(mesh=(2,), mesh_names=("pp",))
    piped = PlanConfig(mesh=(4, 2, 2), mesh_names=("pp", "dp", "tp"), network="h100-node")
    assert piped.pipeline_ranks == 4 and PlanConfig(mesh=(2, 2)).pipeline_ranks is None
    stage = piped.stage_config()
    assert (stage.mesh, stage.mesh_names, stage.data_parallel_dims) == ((2, 2), ("dp", "tp"), (0,))
    with pytest.raises(ValueError, match=r"AutoShard plans one stage's mesh, without a pp dim"):
        AutoShard(torch.nn.Linear(2, 2), lambda: (torch.ones(4, 2),), config=piped)
    base = ["--model", "llama3-tiny", "--batch", "8", "--seq", "16"]
    for argv, message in (
        (["plan", *base, "--mesh", "2x2x2", "--mesh-names", "dp_replicate,fsdp,tp"], "unknown role 'fsdp'"),
        (["plan", *base, "--mesh", "2x2x2", "--mesh-names", "dp,tp,dp_shard"], "role dp_shard is given twice"),
        (["plan", *base, "--mesh", "2x2x2", "--mesh-names", "dp,tp,pp"], "pp must name the first (outermost) mesh dim"),
        (
            ["plan", *base, "--mesh", "2x2", "--mesh-names", "pp,dp", "--explain", "output.wieght"],
            "--explain 'output.wieght' matches no parameter; close matches: output.weight",
        ),
        (["train", *base, "--mesh", "2x2", "--mesh-names", "pp,dp", "--compile"], "does not take --compile yet"),
        (
            ["plan", *base, "--mesh", "2x2", "--mesh-names", "pp,dp", "--compare", "manual"],
            "--compare manual plans one",
        ),
        (["plan", *base, "--mesh", "2x2", "--compare", "no-pp"], "--compare no-pp needs a mesh with a pp dim"),
        (
            ["train", *base, "--mesh", "2x2x2", "--mesh-names", "dp_replicate,dp_shard,tp"],
            "has 8 devices but the world size is 1",
        ),
    ):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argument errors exit from the parser
            code = exit_.code
        assert code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


@pytest.mark.slow
def test_planning_pauses_the_cyclic_garbage_collector_and_restores_it(monkeypatch):
    """Every gen-2 collection walks all of planning's objects (a quarter of a 70B plan's time):
    optimize() runs with the collector paused, and leaves it as it found it, also on an error."""
    import gc

    import autoshard.driver.api as api
    from autoshard_models import build_model, cross_entropy_loss, get_config

    seen = []
    build = api.build_problem

    def recording_build(*args, **kwargs):
        seen.append(gc.isenabled())
        return build(*args, **kwargs)

    monkeypatch.setattr(api, "build_problem", recording_build)
    net = build_model(get_config("llama3-tiny"), device="meta")
    inputs = lambda: (torch.randint(0, 16, (4, 8)),) * 2  # noqa: E731
    config = PlanConfig(mesh=(2, 2), memory_limit=math.inf)
    assert gc.isenabled()
    api.AutoShard(net, inputs, config=config, loss_fn=cross_entropy_loss).optimize()
    assert seen == [False] and gc.isenabled()

    def failing_build(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(api, "build_problem", failing_build)
    with pytest.raises(RuntimeError, match="boom"):
        api.AutoShard(net, inputs, config=config, loss_fn=cross_entropy_loss).optimize()
    assert gc.isenabled()
    gc.disable()
    try:  # a caller that paused it keeps it paused
        monkeypatch.setattr(api, "build_problem", build)
        api.AutoShard(net, inputs, config=config, loss_fn=cross_entropy_loss).optimize()
        assert not gc.isenabled()
    finally:
        gc.enable()
