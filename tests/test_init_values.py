"""`--init-from` checks values, not only names and shapes: a floating parameter stored as integers
is refused from the headers, other float widths are converted, and a non-finite value (stored, or
made by narrowing) is refused naming the tensor, each rank checking only the slices it reads."""

from __future__ import annotations

import pytest
import torch

from autoshard.driver.api import AutoShard
from autoshard.options import UsageError
from autoshard.runtime.module import parallelize
from autoshard.workloads.checkpoints import CheckpointSlices, Start, checkpoint_values
from plan_audit import assert_shards
from simulation import simulated_mesh
from test_init_shards import PINS, Toy, mse, save, toy_workload


def toy_checkpoint(tmp_path, **changed: torch.Tensor):
    """The toy's seed-0 weights as a safetensors directory, some tensors replaced."""
    workload = toy_workload()
    values = {n: v for n, v in workload.initial_state(0).items() if n != "scale"} | changed
    save(values, tmp_path / "ckpt", sharded=False)
    return workload, tmp_path / "ckpt"


def test_an_integer_tensor_for_a_float_parameter_is_refused_from_the_header(tmp_path):
    weight = toy_workload().initial_state(0)["w1.weight"]
    workload, path = toy_checkpoint(tmp_path, **{"w1.weight": (weight * 100).to(torch.int64)})
    with pytest.raises(ValueError, match=r"w1.weight is stored as I64, not a floating type"):
        CheckpointSlices(workload, path)
    with pytest.raises(ValueError, match=r"w1.weight is stored as int64, not a floating type"):
        checkpoint_values(workload, path)
    workload, path = toy_checkpoint(tmp_path / "b", **{"w1.bias": torch.ones(32, dtype=torch.bool)})
    with pytest.raises(ValueError, match=r"w1.bias is stored as BOOL"):
        CheckpointSlices(workload, path)


def test_another_float_width_is_converted(tmp_path):
    state = toy_workload().initial_state(0)
    half, wide = state["w1.weight"].to(torch.bfloat16), state["w2.weight"].to(torch.float64)
    workload, path = toy_checkpoint(tmp_path, **{"w1.weight": half, "w2.weight": wide})
    ckpt = CheckpointSlices(workload, path)
    got = ckpt.read("w1.weight", (slice(0, 8), slice(0, 16)))
    assert got.dtype == torch.float32 and torch.equal(got, half[:8].float())
    assert torch.equal(ckpt.read("w2.weight", (slice(0, 12), slice(0, 32))), wide.float())
    assert checkpoint_values(workload, path)["w1.weight"].dtype == torch.float32


def test_a_nan_is_refused_by_the_rank_that_reads_it(tmp_path):
    weight = toy_workload().initial_state(0)["w1.weight"].clone()
    weight[20, 3] = float("nan")
    workload, path = toy_checkpoint(tmp_path, **{"w1.weight": weight})
    ckpt = CheckpointSlices(workload, path)  # headers only: nothing read yet
    assert torch.equal(ckpt.read("w1.weight", (slice(0, 16), slice(0, 16))), weight[:16])  # not in this box
    with pytest.raises(
        UsageError, match=r"^--init-from .*ckpt: w1.weight holds 1 non-finite value\(s\) \(NaN or inf\)"
    ):
        ckpt.read("w1.weight", (slice(16, 32), slice(0, 16)))
    with pytest.raises(UsageError, match="w1.weight holds 1 non-finite"):
        checkpoint_values(workload, path)


def test_a_value_that_overflows_the_parameter_dtype_is_refused(tmp_path):
    big = toy_workload().initial_state(0)["w3.bias"].to(torch.float64)
    big[2] = 1e300
    workload, path = toy_checkpoint(tmp_path, **{"w3.bias": big})
    with pytest.raises(UsageError, match=r"w3.bias overflows torch.float32 in 1 non-finite"):
        CheckpointSlices(workload, path).read("w3.bias", (slice(0, 6),))


def test_loading_a_sharded_model_stops_at_the_inf(tmp_path):
    """Through `Start.load_into` on a (4,) mesh, w1.weight split by rows: the inf's rank names it."""
    x, y = torch.randn(8, 16), torch.randn(8, 6)
    with AutoShard(Toy(), lambda: (x, y), (4,), loss_fn=mse) as auto:
        auto.pin(PINS[(4,)])
        plan = auto.optimize()
    assert_shards(plan, batch_split=False)
    weight = toy_workload().initial_state(0)["w1.weight"].clone()
    weight[31, 0] = float("-inf")
    workload, path = toy_checkpoint(tmp_path, **{"w1.weight": weight})
    with simulated_mesh((4,)) as (mesh, mode):
        pmodel = parallelize(plan, mesh, workload.build("meta"))
        with pytest.raises(UsageError, match="--init-from .*w1.weight holds 1 non-finite"):
            Start(workload, 0, CheckpointSlices(workload, path)).load_into(pmodel)
