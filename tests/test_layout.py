"""Layout: text round trip, validation, torch DTensorSpec / _StridedShard conversion."""

from __future__ import annotations

import itertools

import pytest
import torch

from autoshard import _torch_compat as tc
from autoshard.layout import Layout, P, Placement, R, S

TEXTS = [
    "R",
    "S(0)",
    "P",
    "P(avg)",
    "RS(0)",
    "S(0)R",
    "PP",
    "P(avg)R",
    "S(0)S(0)[1,0]",
    "S(0)S(0)[0,1]",
    "S(1)S(0)",
    "S(0)S(0)S(0)[2,0,1]",
    "S(1)PS(1)[2,0]",
    "S(0)S(0)S(1)S(1)[1,0][3,2]",
]


def all_layouts(mesh_ndim, tensor_ndim):
    for placements in itertools.product([R, P(), P("avg")] + [S(d) for d in range(tensor_ndim)], repeat=mesh_ndim):
        base = Layout(placements)
        for combo in itertools.product(*[[(td, o) for o in itertools.permutations(mds)] for td, mds in base.order]):
            yield Layout(placements, combo)


@pytest.fixture(scope="module")
def meshes():
    with tc.fake_process_group(8):
        yield {
            shape: torch.distributed.device_mesh.DeviceMesh("cpu", torch.arange(8).view(shape))
            for shape in ((2, 4), (2, 2, 2))
        }


@pytest.mark.parametrize("text", TEXTS)
def test_print_parse_round_trip(text):
    lay = Layout.parse(text)
    assert str(lay) == text  # all TEXTS are canonical
    assert Layout.parse(str(lay)) == lay and hash(Layout.parse(str(lay))) == hash(lay)


def test_round_trip_every_layout():
    for lay in itertools.chain(all_layouts(2, 3), all_layouts(3, 2)):
        again = Layout.parse(str(lay))
        assert again == lay and hash(again) == hash(lay) and str(again) == str(lay)


def test_canonical_text_and_order_forms():
    assert str(Layout.parse("S(0)S(0)")) == "S(0)S(0)[0,1]"  # the order of a 2+ split is always printed
    assert Layout.parse("S(0)S(0) order (1,0)") == Layout.parse("S(0)S(0)[1,0]") == Layout((S(0), S(0)), {0: (1, 0)})
    assert Layout.parse("P(sum)R") == Layout.parse("PR") and str(Layout.parse("P(sum)R")) == "PR"
    assert Layout.parse(" S(1) S(1) [ 1 , 0 ] ") == Layout((S(1), S(1)), [(1, (1, 0))])
    assert Layout.parse("S(0)S(0)[0,1]") != Layout.parse("S(0)S(0)[1,0]")
    assert len({Layout.parse("S(0)S(0)"), Layout((S(0), S(0))), Layout((S(0), S(0)), ((0, (0, 1)),))}) == 1


def test_queries():
    lay = Layout.parse("S(1)S(0)S(1)[2,0]")
    assert lay.sharded_dims == (0, 1) and lay.order == ((0, (1,)), (1, (2, 0))) and not lay.is_default_order
    assert lay.with_order({1: (0, 2)}) == Layout.parse("S(1)S(0)S(1)") and lay.with_order({1: (0, 2)}).is_default_order
    assert Layout.replicate(3) == Layout.parse("RRR") and Layout.replicate(3).order == ()
    assert lay.local_shape((8, 12), (2, 4, 3)) == (2, 2)
    assert Layout.parse("PR").local_shape((5, 7), (2, 2)) == (5, 7)


@pytest.mark.parametrize(
    "text, message",
    [
        ("X", "cannot parse"),
        ("", "no placements"),
        ("S(-1)R", "negative"),
        ("S(0)S(0)[0,2]", "exactly the mesh dims"),
        ("S(0)S(0)[1,0][0,1]", "2 order annotation"),
        ("(1,0)RR", "must follow 'order'"),
        ("S(0)S(0) order", "needs at least one"),
        ("S(0)[0]R", "placements must come before"),
        ("P(max)", "unsupported partial reduce op"),
        ("S(0)S(0)[1,0] order (1,0)", "give the order once"),
        ("S(0)S(0)[1,x]", "cannot parse"),
    ],
)
def test_bad_text(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Layout.parse(text)


def test_validation_errors():
    with pytest.raises(ValueError, match="shards tensor dim 2, out of range for a rank-2 tensor"):
        Layout.parse("S(2)R").local_shape((4, 4), (2, 2))
    with pytest.raises(ValueError, match=r"has 2 mesh dims but the mesh is \(4,\)"):
        Layout.parse("S(0)R").local_shape((4, 4), (4,))
    with pytest.raises(
        ValueError, match=r"tensor dim 0 of size 6 is not divisible by 4 \(mesh dims \[1, 0\] of sizes \[2, 2\]\)"
    ):
        Layout.parse("S(0)S(0)[1,0]").local_shape((6, 4), (2, 2))
    with pytest.raises(ValueError, match="names tensor dim 1, which no mesh dim shards"):
        Layout((S(0), R), {1: (0,)})
    with pytest.raises(ValueError, match="not sharded"):
        Layout.parse("S(0)R").with_order({1: (0,)})
    for bad in (("R", "R"), (Placement("P", -1, "max"),), (Placement("S", -2),), (Placement("X"),)):
        with pytest.raises(ValueError, match="autoshard Placement"):
            Layout(bad)
    with pytest.raises(ValueError, match="non-negative"):
        S(-1)


def test_spec_round_trip(meshes):
    for shape, mesh in meshes.items():
        for lay in all_layouts(len(shape), 2):
            spec = lay.to_spec(mesh)
            assert spec.shard_order == tuple(tc.ShardOrderEntry(td, mds) for td, mds in lay.order)
            assert Layout.from_spec(spec) == lay


def test_strided_shard_encoding_matches_torch(meshes):
    """The physical encoding is torch's, and torch decodes it back to our order."""
    mesh = meshes[(2, 4)]
    tp_first = Layout.parse("S(0)S(0)[1,0]").to_torch_placements(mesh)
    assert tp_first == (tc._StridedShard(0, split_factor=4), tc.Shard(0))  # FSDP+TP parameter layout
    assert Layout.parse("S(0)S(0)[0,1]").to_torch_placements(mesh) == (tc.Shard(0), tc.Shard(0))
    assert Layout.parse("S(0)S(0)[1,0]").to_torch_placements((2, 4)) == tp_first
    for shape, mesh in meshes.items():
        for lay in all_layouts(len(shape), 2):
            physical = lay.to_torch_placements(mesh)
            assert any(isinstance(p, tc._StridedShard) for p in physical) == (not lay.is_default_order)
            assert Layout.from_spec(tc.DTensorSpec(mesh, physical)) == lay


def test_from_spec_rejects_unknown_placements(meshes):
    from torch.distributed.tensor.placement_types import _MaskPartial

    for bad in (_MaskPartial(), tc.Partial("max")):
        with pytest.raises(ValueError, match="unsupported torch placement"):
            Layout.from_spec(tc.DTensorSpec(meshes[(2, 4)], (bad, tc.Replicate())))


def test_pickle_across_processes():
    """Layouts cross process boundaries (e.g. parallel planning): the cached hash must not."""
    import os
    import pickle
    import subprocess
    import sys

    code = (
        "import pickle, sys; from autoshard.layout import Layout; "
        "sys.stdout.buffer.write(pickle.dumps(Layout.parse('S(0)S(0)[1,0]')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, check=True, env=dict(os.environ, PYTHONHASHSEED="123")
    )
    assert {Layout.parse("S(0)S(0)[1,0]"): "found"}.get(pickle.loads(out.stdout)) == "found"
