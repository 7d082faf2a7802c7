"""Mixed precision with FSDP2's `MixedPrecisionPolicy` meaning: bf16 compute and parameter gathers,
fp32 master weights and optimizer states, gradients reduced in the policy's reduce dtype and landing
in fp32 in the parameter's layout; checked against a single-device run with the same policy."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from autoshard import _torch_compat as tc
from autoshard.capture.precision import gradient_tail, is_cast
from autoshard.driver.api import AutoShard
from autoshard.problem.build import grad_sink
from autoshard.profiles.device import DeviceProfile
from autoshard.profiles.network import NetworkProfile
from autoshard.runtime.module import parallelize
from autoshard.runtime.wire import WireMeter
from autoshard_models import MarkovTokens, build_model, cross_entropy_loss, get_config
from autoshard_models.train_single import TrainSettings, make_optimizer, step_loss, train_single
from plan_audit import assert_shards, sharded_plan
from simulation import simulated_mesh
from test_train import ROOT, SHARDED_ON_4, TINY, metrics, torchrun

BF16_FP32 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # reduce in bf16, FSDP2's default
BATCH, SEQ, STEPS = 8, 16, 10
# the (2,2) plans pinned to FSDP over TP, so fp32 and bf16 plans gather the same parameters
DATA_PARALLEL = ("S(0)R", "S(0)R")  # tokens and targets split over dp
# h100-node's links without latency and free local copies: llama3-tiny's collectives are all launch
# otherwise, and the copies of a bucket of its tiny weights tip the plans one way or the other
BYTES_ONLY = NetworkProfile((0.0, 0.0), (45e9, 360e9), launch_s=0.0, mem_bw=1e30)
FSDP_TP = {
    "layers.*.attention.w[qkv].weight": "S(0)S(0)[1,0]",
    "layers.*.attention.wo.weight": "S(1)S(1)[1,0]",
    "layers.*.feed_forward.w[13].weight": "S(0)S(0)[1,0]",
    "layers.*.feed_forward.w2.weight": "S(1)S(1)[1,0]",
}


def plan(
    name: str,
    mesh_shape,
    policy: MixedPrecisionPolicy | None,
    pins=None,
    device="h100",
    inputs=None,
    network=None,
    shard=False,
):
    """The plan for `name` under `policy`; `shard`: sharding forced and checked (plan_audit)."""
    meta = build_model(get_config(name), device="meta")
    example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    with AutoShard(
        meta, example, mesh_shape, loss_fn=cross_entropy_loss, mp_policy=policy, device=device, network=network
    ) as auto:
        if pins:
            auto.pin(pins)
        if inputs:
            auto.constrain_inputs(*inputs)
        return sharded_plan(auto) if shard else auto.optimize()


def reference(name: str, policy: MixedPrecisionPolicy | None, steps: int = STEPS):
    """Single-device losses and first-step gradients under `policy` (models.train_single.step_loss)."""
    cfg = get_config(name)
    model = build_model(cfg, seed=0)
    optim = make_optimizer(model.parameters(), TrainSettings())
    data = MarkovTokens(cfg.vocab_size, seed=0)
    losses, grads = [], None
    for step in range(steps):
        batch = data.batch(step, BATCH, SEQ)
        loss = step_loss(
            model, batch.inputs, batch.targets, policy and policy.param_dtype, policy and policy.reduce_dtype
        )
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, grads


@pytest.mark.parametrize(
    "name, mesh_shape, steps",
    [
        ("llama3-tiny", (2, 2), STEPS),
        pytest.param("llama3-tiny", (4,), STEPS, marks=pytest.mark.slow),
        pytest.param("llama3-debug", (2, 2), 4, marks=pytest.mark.slow),  # the larger model: fewer steps
    ],
)
def test_bf16_training_follows_the_single_device_policy(name, mesh_shape, steps):
    """`steps` AdamW steps under LocalTensorMode follow the single-device run with the same policy
    within 1e-2 relative loss; parameters, AdamW states and gradients stay fp32 DTensors in the
    parameter's layout; and bf16's curve stays within a few percent of fp32's."""
    ref_losses, ref_grads = reference(name, BF16_FP32, steps)
    fp32_losses, _ = reference(name, None, steps)
    assert max(abs(a - b) / b for a, b in zip(ref_losses, fp32_losses)) < 0.03
    p = plan(name, mesh_shape, BF16_FP32, shard=True)
    cfg = get_config(name)
    data = MarkovTokens(cfg.vocab_size, seed=0)
    with simulated_mesh(mesh_shape) as (mesh, mode):
        pmodel = parallelize(p, mesh, build_model(cfg, device="meta"))
        pmodel.init_weights(0)
        optim = make_optimizer(pmodel.parameters(), TrainSettings())
        for step in range(steps):
            with mode.disable():
                batch = data.batch(step, BATCH, SEQ)
            loss = pmodel(*pmodel.shard_inputs(batch.inputs, batch.targets))
            assert loss.dtype == torch.float32  # the loss function upcasts the bf16 logits
            loss.backward()
            if step == 0:
                for fqn, param in pmodel.named_parameters():
                    assert isinstance(param.grad, DTensor) and param.grad.placements == param.placements, fqn
                    assert param.dtype == param.grad.dtype == torch.float32, fqn
                    with mode.disable():
                        got = list(tc.rank_values(param.grad.full_tensor()).values())
                    for g in got:  # bf16 compute on shards vs on the whole: rounding differs a little
                        torch.testing.assert_close(g, ref_grads[fqn], rtol=0.05, atol=2e-3, msg=fqn)
            optim.step()
            optim.zero_grad()
            with mode.disable():
                values = [v.item() for v in tc.rank_values(loss).values()]
            for v in values:
                assert abs(v - ref_losses[step]) <= 1e-2 * ref_losses[step], (step, v, ref_losses[step])
        states = [t for s in optim.state.values() for t in s.values() if isinstance(t, DTensor)]
        assert states and all(t.dtype == torch.float32 for t in states)


def _first_gathers(p) -> dict[str, float]:
    """Parameter FQN -> wire bytes of the first all-gather on an edge out of it or its cast."""
    fqn_of = {param.name: fqn for fqn, param in p.graph.params.items()}
    fqn_of |= {u.name: fqn for fqn, param in p.graph.params.items() for u in param.users if is_cast(u)}
    out = {}
    for r in p.redistributions:
        gathers = [s for s in r.plan.steps if s.kind == "all_gather"]
        if r.producer in fqn_of and gathers:
            out.setdefault(fqn_of[r.producer], gathers[0].bytes)
    return out


def _reductions(p) -> dict[str, tuple[tuple, float]]:
    """Parameter FQN -> (the steps that reduce its gradient, their wire bytes)."""
    tail = {grad_sink(fqn): fqn for fqn in p.graph.grads}
    tail |= {n.name: fqn for fqn, g in p.graph.grads.items() for n in gradient_tail(g)}
    out: dict[str, tuple[tuple, float]] = {}
    for r in p.redistributions:
        steps = [s for s in r.plan.steps if s.kind in ("reduce_scatter", "all_reduce")]
        if r.consumer in tail and steps:
            kinds, nbytes = out.get(tail[r.consumer], ((), 0.0))
            out[tail[r.consumer]] = (
                kinds + tuple((s.kind, s.mesh_dims) for s in steps),
                nbytes + sum(s.bytes for s in steps),
            )
    return out


def _reducing_edges(p):
    """(producer dtype, consumer) of every redistribution into a gradient sink or a gradient's tail
    whose planner path reduces a partial value."""
    graph = p.graph
    tails = {grad_sink(fqn) for fqn in graph.grads} | {n.name for g in graph.grads.values() for n in gradient_tail(g)}
    nodes = {n.name: n for n in graph.nodes}
    out = []
    for r in p.redistributions:
        if r.consumer in tails and any(s.kind in ("reduce_scatter", "all_reduce") for s in r.plan.steps):
            out.append((nodes[r.producer].meta["val"].dtype, r.consumer))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy, reduce_dtype", [(BF16_FP32, torch.float32), (BF16, torch.bfloat16)], ids=["reduce-fp32", "reduce-bf16"]
)
def test_gradients_are_reduced_in_the_reduce_dtype_and_gathers_halve(policy, reduce_dtype):
    """Same pinned layouts in fp32 and bf16: the lowered program's parameter all-gather bytes halve,
    gradient reduce-scatter bytes follow the reduce dtype, every gradient reduction in the plan runs
    in the reduce dtype, and a wire meter on a step of the program agrees with its CommStats."""
    # the batch split over dp, as the recipe splits it (H100s would rather compute llama3-tiny's
    # whole batch on every rank than reduce a gradient), on links without latency: llama3-tiny's
    # collectives are all launch otherwise, and a bf16 gather no cheaper than an fp32 one
    fp32 = plan("llama3-tiny", (2, 2), None, FSDP_TP, inputs=DATA_PARALLEL, network=BYTES_ONLY, device="cpu")
    mixed = plan("llama3-tiny", (2, 2), policy, FSDP_TP, inputs=DATA_PARALLEL, network=BYTES_ONLY, device="cpu")
    edges = _reducing_edges(mixed)
    assert edges and {dtype for dtype, _ in edges} == {reduce_dtype}
    assert {dtype for dtype, _ in _reducing_edges(fp32)} == {torch.float32}
    with tc.fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        programs = {}
        for key, p in (("fp32", fp32), ("mixed", mixed)):
            pmodel = parallelize(p, mesh, build_model(get_config("llama3-tiny"), device="meta"))
            tokens = torch.zeros(
                pmodel.shard_inputs(*[torch.zeros(BATCH, SEQ, dtype=torch.int64)] * 2)[0].shape, dtype=torch.int64
            )
            with WireMeter() as meter:
                pmodel(tokens, tokens).backward()
            programs[key] = pmodel.comm.total_bytes()
            assert dict(meter.stats.bytes) == pytest.approx(dict(programs[key]))
    # each parameter's first gather (of its pinned shard, over dp) moves half the bytes in bf16;
    # each gradient reduced by the same steps in both plans moves bytes of the reduce dtype (the
    # activations' layouts are free: the two plans may split the rest of the step differently)
    first = {k: _first_gathers(p) for k, p in (("fp32", fp32), ("mixed", mixed))}
    assert first["fp32"] and first["fp32"].keys() == first["mixed"].keys()
    assert all(first["mixed"][fqn] == first["fp32"][fqn] / 2 for fqn in first["fp32"])
    reductions = {k: _reductions(p) for k, p in (("fp32", fp32), ("mixed", mixed))}
    same = [fqn for fqn, (steps, _) in reductions["mixed"].items() if reductions["fp32"].get(fqn, (None,))[0] == steps]
    assert same and all(
        reductions["mixed"][fqn][1] == reductions["fp32"][fqn][1] * reduce_dtype.itemsize / 4 for fqn in same
    )


@pytest.mark.slow
def test_compute_is_priced_at_the_dtypes_rate():
    h100 = DeviceProfile.preset("h100")
    assert h100.peak_for(torch.bfloat16) == 640e12 and h100.peak_for(torch.float32) == 46e12  # sustained, measured
    assert h100.roofline_s(1e12, 0, torch.float32) == pytest.approx(1 / 46)
    flops_bound = DeviceProfile(989e12, mem_bw=1e30, peak_flops_fp32=67e12)  # tiny matmuls, priced by flops
    fp32, mixed = (plan("llama3-tiny", (2, 2), policy, FSDP_TP, device=flops_bound) for policy in (None, BF16_FP32))
    mm = lambda p: sum(s for n, s in p.node_compute_s.items() if n.startswith("mm"))  # noqa: E731
    assert 0 < mm(mixed) < mm(fp32) / 5  # matmuls run at the 16-bit rate (67/989 with equal splits)


def test_policy_that_is_not_floating_is_refused():
    with pytest.raises(ValueError, match="param_dtype must be a floating-point dtype"):
        plan("llama3-tiny", (2,), MixedPrecisionPolicy(param_dtype=torch.int32))
    with pytest.raises(TypeError, match="MixedPrecisionPolicy"):
        AutoShard(build_model(get_config("llama3-tiny"), device="meta"), lambda: (), (2,), mp_policy="bf16")


def _plan_cli(tmp_path, *extra):
    cmd = [
        sys.executable,
        "-m",
        "autoshard",
        "plan",
        *TINY,
        "--mesh",
        "2x2",
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
        *extra,
    ]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )


@pytest.mark.slow
def test_plan_cli_shows_dtypes(tmp_path):
    out = _plan_cli(tmp_path, "--param-dtype", "bfloat16", "--reduce-dtype", "fp32")
    assert out.returncode == 0, out.stderr
    assert "mixed precision: param bf16, reduce fp32" in out.stderr + out.stdout
    report = json.loads((tmp_path / "plan.json").read_text())
    assert report["precision"]["param_dtype"] == "bf16" and report["precision"]["reduce_dtype"] == "fp32"
    assert {p["dtype"] for p in report["parameters"]} == {"fp32"}  # master weights
    mm = [n for n in report["nodes"] if n["op"] == "aten.mm.default"]
    assert mm and {n["dtype"] for n in mm} == {"bf16"}
    log = (tmp_path / "sharding.log").read_text()
    assert "mixed precision: param bf16, reduce fp32" in log and " bf16 " in log


@pytest.mark.slow
@pytest.mark.parametrize("flag, value", [("--param-dtype", "int8"), ("--reduce-dtype", "fp8")])
def test_plan_cli_bad_dtype_is_one_line(tmp_path, flag, value):
    out = _plan_cli(tmp_path, flag, value)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"unknown dtype {value!r}" in lines[0] and "Traceback" not in out.stderr
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.slow
@pytest.mark.ranks
def test_torchrun_bf16_trains_checkpoints_and_resumes(tmp_path, executed_plans):
    """4 gloo ranks, --param-dtype bf16 --reduce-dtype fp32: the losses follow the single-device run
    with the same policy; resuming from the step-2 checkpoint (fp32 master weights and AdamW states)
    reproduces steps 3-4 exactly (reusing the saved bf16 plan)."""
    args = [*TINY, *SHARDED_ON_4, "--mesh", "2x2", "--param-dtype", "bf16", "--reduce-dtype", "fp32"]
    first = tmp_path / "first"
    torchrun(*args, "--steps", "4", "--checkpoint-every", "2", "--out", str(first))
    (facts,) = executed_plans()
    assert_shards(facts, batch_split=False)
    rows = metrics(first)
    want = train_single(
        TrainSettings(
            model="llama3-tiny", steps=4, batch=8, seq=16, param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    ).losses
    for row, loss in zip(rows, want, strict=True):
        assert abs(row["loss"] - loss) <= 1e-2 * loss, (row, loss)
    assert json.loads((first / "plan.json").read_text())["precision"]["param_dtype"] == "bf16"
    second = tmp_path / "second"
    second.mkdir()
    (second / "checkpoints").mkdir()
    import shutil

    shutil.copytree(first / "checkpoints" / "step-000002", second / "checkpoints" / "step-000002")
    torchrun(*args, "--steps", "4", "--resume", "--plan-file", str(first / "plan.json"), "--out", str(second))
    assert [r["loss"] for r in metrics(second)] == [r["loss"] for r in rows[2:]]
