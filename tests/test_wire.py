"""The wire meter prices known collectives with the ring model, whichever API issued them:
functional collectives (autoshard's executor, DTensor) and c10d ops (torch.distributed, FSDP2),
including the ones autograd runs in the backward."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from autoshard import _torch_compat as tc
from autoshard.layout import Layout
from autoshard.pricing.planner import Planner
from autoshard.program.collectives import execute
from autoshard.runtime.wire import WireMeter, ring_bytes

X_BYTES = 8 * 4 * 4  # an [8, 4] float32 tensor


@pytest.fixture
def mesh():
    """A (2, 2) mesh on a fake process group: collectives run (no data moves), shapes are real."""
    with tc.fake_process_group(4):
        yield init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def test_ring_model():
    assert ring_bytes("all_gather", 100, 4) == 300  # (n-1)/n of the gathered 400
    assert ring_bytes("reduce_scatter", 400, 4) == 300
    assert ring_bytes("all_reduce", 400, 4) == 600
    assert ring_bytes("all_to_all", 400, 4) == 300
    assert ring_bytes("all_reduce", 400, 1) == 0


def test_functional_collectives(mesh):
    x = torch.ones(8, 4)
    with WireMeter() as meter:
        tc.wait(funcol.all_gather_single(x, 0, (mesh, 0)))
        tc.wait(funcol.reduce_scatter_single(x, "sum", 0, (mesh, 1)))
        tc.wait(funcol.all_reduce(x, "sum", (mesh, 0)))
        tc.wait(funcol.all_to_all_single(x, None, None, (mesh, 1)))
        tc.wait(funcol.all_gather_single(x, 0, tc.flattened_mesh(mesh, (0, 1))))  # one shot over 4 ranks
    s = meter.stats
    assert s.bytes == {
        "all_gather": X_BYTES + 3 * X_BYTES,
        "reduce_scatter": X_BYTES / 2,
        "all_reduce": X_BYTES,
        "all_to_all": X_BYTES / 2,
    }
    assert s.count == {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 1, "all_to_all": 1}
    assert s.total_bytes == 6 * X_BYTES and not s.unpriced


def test_c10d_ops_and_unpriced(mesh):
    x = torch.ones(8, 4)
    with warnings.catch_warnings(), WireMeter() as meter:
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_into_tensor(torch.empty(16, 4), x, group=mesh.get_group(0))
        dist.reduce_scatter_tensor(torch.empty(4, 4), x, group=mesh.get_group(0))
        dist.all_reduce(x)  # the world: 4 ranks
        dist.broadcast(x, 0)
    assert meter.stats.bytes == {"all_gather": X_BYTES, "reduce_scatter": X_BYTES / 2, "all_reduce": 1.5 * X_BYTES}
    assert meter.stats.unpriced == {"broadcast_": 1}


def test_dtensor_and_backward_collectives_are_seen(mesh):
    """DTensor redistributes on local tensors under the mode; autograd's dual collectives count too."""
    d = distribute_tensor(torch.ones(8, 4), mesh["tp"], [Shard(0)], src_data_rank=None)
    with WireMeter() as meter:
        d.redistribute(mesh["tp"], [Replicate()])
    assert meter.stats.bytes == {"all_gather": X_BYTES / 2}

    plan = Planner((2, 2), "cpu-gloo").plan(Layout.parse("S(0)R"), Layout.parse("RR"), (8, 4), torch.float32)
    x = torch.ones(4, 4, requires_grad=True)
    with WireMeter() as meter:
        execute(plan, x, mesh).sum().backward()
    assert meter.stats.bytes == {"all_gather": X_BYTES / 2, "reduce_scatter": X_BYTES / 2}


def test_the_executors_permute_is_metered_as_the_planner_prices_it(mesh):
    """A permute between device orders sends the whole shard to one peer (an all-to-all with one
    nonzero split): metered as a permute, the bytes the planner's plan and CommStats give it."""
    plan = Planner((2, 2), "cpu-gloo").plan(
        Layout.parse("S(0)S(0)[0,1]"), Layout.parse("S(0)S(0)[1,0]"), (8, 4), torch.float32
    )
    assert [s.kind for s in plan.steps] == ["permute"]
    with WireMeter() as meter:
        execute(plan, torch.ones(2, 4), mesh)
    assert meter.stats.bytes == {"permute": plan.steps[0].bytes} and plan.steps[0].bytes == 2 * 4 * 4
    assert meter.stats.count == {"permute": 1}
    with WireMeter() as meter:  # an even all-to-all stays one
        tc.wait(funcol.all_to_all_single(torch.ones(8, 4), None, None, (mesh, 1)))
    assert meter.stats.bytes == {"all_to_all": X_BYTES / 2}
