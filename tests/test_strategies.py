"""Candidate strategies per node: coverage on llama, order variants, and numerics of every
strategy of a sample of ops, simulated rank by rank under LocalTensorMode."""

import contextlib
import functools
import itertools
import math
import operator
import warnings

import pytest
import torch
from torch import fx
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode

from autoshard.capture.trace import trace_joint
from autoshard.layout import Layout
from autoshard.pricing.compute import ComputePricer
from autoshard.profiles.device import DeviceProfile
from autoshard.strategies import Strategy, StrategyCatalog, input_slots, layouts_for, node_strategies, order_variants
from autoshard_models import build_model, cross_entropy_loss, get_config

aten = torch.ops.aten
CPU = DeviceProfile.preset("cpu")


@pytest.fixture(scope="module")
def tiny():
    tokens = torch.zeros(4, 32, dtype=torch.int64)
    with contextlib.ExitStack() as stack:  # closing it leaves the trace's fake mode
        return trace_joint(
            build_model(get_config("llama3-tiny"), device="meta"),
            lambda m, x, y: cross_entropy_loss(m(x), y),
            (tokens, tokens),
            stack,
        )


@functools.cache
def catalog(mesh):
    """One catalog per mesh for this module: its caches are shared across tests, as in one build."""
    return StrategyCatalog(mesh)


def strategies_of(node, mesh):
    return node_strategies(node, catalog(mesh))


def call_nodes(graph):
    return [n for n in graph.gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]


def first(graph, target, pred=lambda n: True):
    return next(n for n in call_nodes(graph) if n.target == target and pred(n))


def L(text):
    return Layout.parse(text)


def texts(strategies):
    return {(tuple(map(str, s.inputs)), tuple(map(str, s.outputs))) for s in strategies}


# ------------------------------------------------------------------------------- coverage
@pytest.mark.parametrize("mesh", [(2, 2), (4,)])
def test_every_llama_node_has_strategies_and_mm_has_megatron_ones(tiny, mesh):
    pricer = ComputePricer(CPU, mesh)
    for node in call_nodes(tiny):
        strategies = catalog(mesh).strategies(node)
        assert strategies, node.format_node()
        assert len(set(strategies)) == len(strategies)
        slots = input_slots(node)
        for s in strategies:
            assert len(s.inputs) == len(slots)
        assert all(c >= 0 for c in pricer.node_compute_s(node, strategies))

    # x @ W^T of the first attention projection: x [128, 64], W^T [64, 64]
    mm = first(tiny, aten.mm.default)
    got = texts(strategies_of(mm, mesh))
    if mesh == (2, 2):
        assert (("RR", "RS(1)"), ("RS(1)",)) in got  # column-parallel on tp
        assert (("RS(1)", "RS(0)"), ("RP",)) in got  # row-parallel on tp
        assert (("S(0)R", "RR"), ("S(0)R",)) in got  # data-parallel on dp
        assert (("S(0)R", "RS(1)"), ("S(0)S(1)",)) in got  # dp x column-parallel
    else:
        assert {(("R", "S(1)"), ("S(1)",)), (("S(1)", "S(0)"), ("P",)), (("S(0)", "R"), ("S(0)",))} <= got


def test_nll_loss_follows_the_batch_sharding_of_its_input(tiny):
    fwd = texts(strategies_of(first(tiny, aten.nll_loss_forward.default), (2, 2)))
    # the trace asks for the sum (capture.losses): the sum and the total weight both pend a sum
    assert (("S(0)R", "S(0)R"), ("PR", "PR")) in fwd
    assert not [f for f in fwd if "P(avg)" in "".join(f[1])]
    bwd = texts(strategies_of(first(tiny, aten.nll_loss_backward.default), (2, 2)))
    assert (("RR", "S(0)R", "S(0)R", "RR"), ("S(0)R",)) in bwd


def test_a_mean_over_a_sharded_dim_is_a_pending_average_of_unpending_inputs(tiny):
    """RMSNorm's mean over the hidden dim: a shard of that dim gives a pending average; inputs are
    never pending (the same choices on torch 2.13, whose rule this was, and 2.14)."""
    node = first(tiny, aten.mean.dim)
    found = texts(strategies_of(node, (2, 2)))
    hidden = node.args[0].meta["val"].dim() - 1
    assert ((f"RS({hidden})",), ("RP(avg)",)) in found
    assert not [f for f in found if "P" in "".join(f[0])]


def test_strategy_functions_that_raise_are_tried_candidate_by_candidate(tiny):
    from autoshard import _torch_compat as cs
    from autoshard.strategies.call import OpCall

    node = first(tiny, aten.view.default)
    _, func, info = cs.registry_entry(node.target)
    call = OpCall(node, (2, 2))
    registry = catalog((2, 2)).registry

    def picky(schema):  # raises unless every input comes with a single candidate
        if any(len(s.strategies) > 1 for s in schema.args_strategy):
            raise ValueError("uneven")
        return func(schema)

    one_by_one = registry.from_multi_dim(call, picky, info)
    assert len(one_by_one) > 5 and set(one_by_one) == set(registry.from_multi_dim(call, func, info))


def test_flash_attention_shards_batch_or_heads_never_partial(tiny):
    fwd = first(tiny, aten._scaled_dot_product_flash_attention_for_cpu.default)
    got = strategies_of(fwd, (2, 2))
    assert (("S(0)R",) * 3, ("S(0)R",) * 2) in texts(got)
    assert (("RS(1)",) * 3, ("RS(1)",) * 2) in texts(got)
    assert all(p.kind != "P" for s in got for lay in s.outputs for p in lay.placements)


# ------------------------------------------------------------------------------- order variants
def test_pointwise_gets_both_orders_with_input_order_equal_output_order(tiny):
    silu = first(tiny, aten.silu.default)
    got = texts(strategies_of(silu, (2, 2)))
    for order in ("[0,1]", "[1,0]"):
        assert ((f"S(0)S(0){order}",), (f"S(0)S(0){order}",)) in got
    assert (("S(0)S(0)[0,1]",), ("S(0)S(0)[1,0]",)) not in got


def test_3d_mesh_orders_are_one_permutation_applied_everywhere(tiny):
    mm = first(tiny, aten.mm.default)
    got = strategies_of(mm, (2, 2, 2))
    batch = [
        s
        for s in got
        if s.inputs[1] == Layout.replicate(3) and s.inputs[0].sharded_dims == (0,) and len(s.inputs[0].order[0][1]) == 3
    ]
    assert sorted(s.inputs[0].order[0][1] for s in batch) == sorted(itertools.permutations(range(3)))
    assert all(s.inputs[0] == s.outputs[0] for s in batch)
    # A dim sharded over 2 of the 3 mesh dims has exactly two orders, however many permutations.
    two = [s for s in got if str(s.inputs[0]).startswith("S(0)S(0)R") and s.inputs[1] == Layout.replicate(3)]
    assert sorted(str(s.outputs[0]) for s in two) == ["S(0)S(0)R[0,1]", "S(0)S(0)R[1,0]"]


# ------------------------------------------------------------------------------- layouts_for
def test_layouts_for_counts():
    assert len(layouts_for((4, 4), (2, 2), allow_partial=False)) == 11  # 9 placements, 2 with 2 orders
    assert len(layouts_for((4, 4), (2, 2), allow_partial=True)) == 18
    assert {str(x) for x in layouts_for((2,), (2, 2), allow_partial=False)} == {"RR", "RS(0)", "S(0)R"}
    assert len(layouts_for((4,), (4,), allow_partial=True)) == 3
    assert len(layouts_for((6,), (4,), allow_partial=False)) == 1  # uneven: replicate only
    # (8,) on (2,2,2): 1 replicated + 3 single + 3 pairs x 2 orders + 1 triple x 6 orders
    assert len(layouts_for((8,), (2, 2, 2), allow_partial=False)) == 16


# ------------------------------------------------------------------------------- fallback, costs
def test_unknown_op_runs_replicated_with_a_warning_naming_it():
    lib = torch.library.Library("autoshard_test", "FRAGMENT")
    lib.define("mystery(Tensor x) -> Tensor")
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(8, 4, device="meta")
    y = graph.call_function(torch.ops.autoshard_test.mystery.default, (x,))
    y.meta["val"] = torch.empty(8, 4, device="meta")
    z = graph.call_function(torch.ops.autoshard_test.mystery.default, (x,))
    z.meta["val"] = torch.empty(8, 4, 2, device="meta")  # another signature: not a cache hit
    fresh = StrategyCatalog((2, 2))
    with pytest.warns(UserWarning, match="autoshard_test.mystery"):
        got = node_strategies(y, fresh)
    assert got == [Strategy((L("RR"),), (L("RR"),))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per op (per catalog: one planning run)
        node_strategies(z, fresh)


def test_fill_factories_can_be_created_in_any_even_layout():
    graph = fx.Graph()
    full = graph.call_function(aten.full.default, ([8, 6], 0.0), {"dtype": torch.float32})
    full.meta["val"] = torch.empty(8, 6)
    got = strategies_of(full, (2, 2))
    assert {s.outputs[0] for s in got} == set(layouts_for((8, 6), (2, 2), allow_partial=False))
    assert all(s.inputs == () for s in got)


def test_roofline_compute_cost_and_device_presets(tiny):
    mm = first(tiny, aten.mm.default)  # [128, 64] @ [64, 64]: compute-bound on the cpu profile
    pricer = ComputePricer(CPU, (2, 2))
    strategies = catalog((2, 2)).strategies(mm)
    by = {texts([s]).pop(): c for s, c in zip(strategies, pricer.node_compute_s(mm, strategies))}
    full = by[(("RR", "RR"), ("RR",))]
    overhead = CPU.op_overhead_s  # one op's dispatch, whatever its layout
    assert overhead > 0 and full == pytest.approx(overhead + 2 * 128 * 64 * 64 / CPU.peak_flops)
    assert by[(("S(0)S(0)[0,1]", "RR"), ("S(0)S(0)[0,1]",))] == pytest.approx(overhead + (full - overhead) / 4)
    view = first(tiny, aten.view.default)  # no kernel: the dispatch alone
    assert all(c == overhead for c in pricer.node_compute_s(view, catalog((2, 2)).strategies(view)))
    with pytest.raises(ValueError, match="known: .*cpu.*h100"):
        DeviceProfile.preset("tpu")


def test_identical_layers_share_cached_strategies(tiny):
    mms = [n for n in call_nodes(tiny) if n.target == aten.mm.default]
    paths = {tiny.module_path(n): n for n in mms}
    a = strategies_of(paths["layers.0.feed_forward.w1"], (2, 2))
    b = strategies_of(paths["layers.1.feed_forward.w1"], (2, 2))
    assert all(x is y for x, y in zip(a, b))


# ------------------------------------------------------------------------------- numerics
def _coords(mesh_shape):
    return list(itertools.product(*map(range, mesh_shape)))  # rank r = row-major coordinate


def _chunk(layout, shape, mesh_shape, coord):
    """The slice of a global tensor rank `coord` holds: tensor dim td, split over mesh dims
    (m1, m2, ...) in that order, is cut into chunks indexed m1-major."""
    index = [slice(None)] * len(shape)
    for td, mds in layout.order:
        k, n = 0, 1
        for m in mds:
            k, n = k * mesh_shape[m] + coord[m], n * mesh_shape[m]
        step = shape[td] // n
        index[td] = slice(k * step, (k + 1) * step)
    return tuple(index)


def test_chunking_here_matches_torchs_physical_encoding_of_orders():
    """The numerics below chunk by hand; this pins that reading of `[1,0]` to the
    `_StridedShard` placements the executor will hand to torch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from autoshard._torch_compat import fake_process_group

    t = torch.arange(16.0).reshape(16, 1)
    with fake_process_group(8):
        for mesh_shape, text in [
            ((2, 4), "S(0)S(0)[1,0]"),
            ((4, 2), "S(0)S(0)[1,0]"),
            ((2, 2, 2), "S(0)S(0)S(0)[2,0,1]"),
            ((2, 2, 2), "S(0)RS(0)[2,0]"),
        ]:
            mesh = init_device_mesh("cpu", mesh_shape)
            lay = L(text)
            with LocalTensorMode(8):
                dt = distribute_tensor(t, mesh, lay.to_torch_placements(mesh), src_data_rank=None)
                theirs = dict(dt._local_tensor._local_tensors)
            ours = _shard(t, lay, mesh_shape)._local_tensors
            for r in range(8):
                torch.testing.assert_close(ours[r], theirs[r], msg=f"{text} on {mesh_shape}, rank {r}")


def _shard(t, layout, mesh_shape):
    """Per-rank values: chunks of `t`, and on partial mesh dims random parts that add up to it."""
    pdims = [m for m, p in enumerate(layout.placements) if p.kind == "P"]
    k = math.prod(mesh_shape[m] for m in pdims)
    parts = [torch.randn_like(t) for _ in range(k - 1)]
    parts.append(
        t * (k if any(layout.placements[m].op == "avg" for m in pdims) else 1) - sum(parts, torch.zeros_like(t))
    )
    values = {}
    for r, c in enumerate(_coords(mesh_shape)):
        pi = 0
        for m in pdims:
            pi = pi * mesh_shape[m] + c[m]
        values[r] = parts[pi][_chunk(layout, t.shape, mesh_shape, c)].clone()
    return LocalTensor(values)


def _assemble(local, layout, shape, mesh_shape):
    """The global tensor per-rank values describe; replicas must agree."""
    out, seen = None, {}
    avg = math.prod(mesh_shape[m] for m, p in enumerate(layout.placements) if p.kind == "P" and p.op == "avg")
    for r, c in enumerate(_coords(mesh_shape)):
        v = local._local_tensors[r]
        key = tuple(c[m] for m, p in enumerate(layout.placements) if p.kind != "R")
        if key in seen:
            torch.testing.assert_close(v, seen[key], msg=f"replicas differ for {layout}")
            continue
        seen[key] = v
        if out is None:
            out = torch.zeros(shape, dtype=v.dtype)
        out[_chunk(layout, shape, mesh_shape, c)] += v / avg
    return out


def _global_inputs(node):
    torch.manual_seed(0)
    vals = []
    for s in input_slots(node):
        meta = s.meta["val"]
        if meta.dtype.is_floating_point:
            vals.append(torch.randn(meta.shape, dtype=meta.dtype))
        else:
            vals.append(torch.randint(0, 16, meta.shape, dtype=meta.dtype))
    if node.target == aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        vals[4], vals[5] = aten._scaled_dot_product_flash_attention_for_cpu(*vals[1:4], 0.0, True)
    if node.target == aten.nll_loss_backward.default:
        vals[-1] = torch.tensor(7.0)
    return vals


_SHAPE_ARG = {aten.view.default, aten._unsafe_view.default, aten.expand.default, aten.reshape.default}


def _run(node, values, strategy=None, mesh_shape=None):
    """Run the node's op on `values` (one per input slot); with a strategy, the shape argument of
    view-like ops becomes the local output shape, as the executor will do."""
    it = iter(values)
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda _: next(it))
    if strategy is not None and node.target in _SHAPE_ARG:
        shape = strategy.outputs[0].local_shape(node.meta["val"].shape, mesh_shape)
        args = (args[0], list(shape)) + tuple(args[2:])
    out = node.target(*args, **kwargs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def check_strategy(node, strategy, mesh_shape, global_values, expected):
    world = math.prod(mesh_shape)
    slots = input_slots(node)
    local_in = [_shard(v, lay, mesh_shape) for v, lay in zip(global_values, strategy.inputs)]
    with LocalTensorMode(world):
        local_out = _run(node, local_in, strategy, mesh_shape)
    for i, (lay, want) in enumerate(zip(strategy.outputs, expected)):
        if lay is None:
            continue
        got = _assemble(local_out[i], lay, want.shape, mesh_shape)
        torch.testing.assert_close(
            got, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{node.target} {strategy} output {i}: {m}"
        )
    assert len(slots) == len(strategy.inputs)


NUMERIC_OPS = [
    aten.mm.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.t.default,
    aten.transpose.int,
    aten.embedding.default,
    aten.embedding_dense_backward.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten.nll_loss_forward.default,
    aten.nll_loss_backward.default,
    aten._log_softmax.default,
    aten._log_softmax_backward_data.default,
    aten.sum.dim_IntList,
    aten.mean.dim,
    aten.cat.default,
    aten.split.Tensor,
    aten.mul.Tensor,
    aten.silu.default,
    aten.expand.default,
    aten.slice.Tensor,
]


@pytest.mark.parametrize("target", NUMERIC_OPS, ids=str)
def test_every_strategy_of_sampled_ops_is_numerically_exact_on_2x2(tiny, target):
    node = first(tiny, target)
    values = _global_inputs(node)
    expected = _run(node, values)
    strategies = strategies_of(node, (2, 2))
    assert any(not lay.is_default_order for s in strategies for lay in s.outputs if lay) or target in (
        aten.nll_loss_forward.default,
        aten.mean.dim,
        aten.sum.dim_IntList,
    )
    for strategy in strategies:
        check_strategy(node, strategy, (2, 2), values, expected)


@pytest.mark.parametrize("mesh", [(4,), (2, 2, 2)], ids=str)
@pytest.mark.parametrize(
    "target",
    [
        aten.mm.default,
        aten._unsafe_view.default,
        aten.embedding.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten.nll_loss_forward.default,
    ],
    ids=str,
)
def test_strategies_are_numerically_exact_on_1d_and_3d(tiny, target, mesh):
    node = first(tiny, target)
    values = _global_inputs(node)
    expected = _run(node, values)
    for strategy in strategies_of(node, mesh):
        check_strategy(node, strategy, mesh, values, expected)


def test_no_order_variant_when_a_tensor_splits_the_mesh_dims_differently():
    """x [8] S(0)S(0) viewed as y [2, 4] (S(0), S(1)) is valid (y's row comes from mesh dim 0,
    its column chunk from mesh dim 1), but reordering x alone is not: such strategies get none."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(8)
    y = graph.call_function(aten.view.default, (x, [2, 4]))
    y.meta["val"] = torch.empty(2, 4)
    base = Strategy((L("S(0)S(1)"),), (L("S(0)S(0)[0,1]"),))
    values = [torch.randn(8)]
    expected = _run(y, values)
    check_strategy(y, base, (2, 2), values, expected)
    with pytest.raises(AssertionError):
        check_strategy(y, Strategy(base.outputs, (L("S(0)S(0)[1,0]"),)), (2, 2), values, expected)
    assert order_variants(base.outputs, base.inputs, 2) == []


def _elementwise(target, shapes, *scalars):
    """A one-op graph: `target` applied to placeholders of `shapes` (float), then `scalars`."""
    graph = fx.Graph()
    inputs = []
    for i, shape in enumerate(shapes):
        x = graph.placeholder(f"x{i}")
        x.meta["val"] = torch.empty(shape)
        inputs.append(x)
    node = graph.call_function(target, (*inputs, *scalars))
    node.meta["val"] = torch.empty(shapes[0])
    return node


@pytest.mark.parametrize(
    "node",
    [
        _elementwise(aten.softplus_backward.default, [(4, 8), (4, 8)], 1.0, 20.0),  # Mamba's dt
        _elementwise(aten.copy.default, [(4, 8), (4, 8)]),  # T5's `_shift_right` writes
        _elementwise(aten.fill.Tensor, [(4, 8), ()]),
        _elementwise(aten.fill.Scalar, [(4, 8)], 3.0),
    ],
    ids=lambda n: str(n.target),
)
def test_elementwise_ops_missing_from_dtensor_shard_in_any_layout_exactly(node):
    values = _global_inputs(node)
    expected = _run(node, values)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to replicated
        strategies = strategies_of(node, (2, 2))
    outputs = {s.outputs[0] for s in strategies}
    assert {L("S(0)R"), L("RS(1)"), L("S(1)S(1)[1,0]")} <= outputs
    assert not any(p.kind == "P" for o in outputs for p in o.placements)
    for strategy in strategies:
        check_strategy(node, strategy, (2, 2), values, expected)


def test_the_checker_catches_a_wrong_strategy(tiny):
    """The harness must be able to fail: silu is not linear, so partial in -> partial out is wrong,
    and a reversed output order scrambles rows."""
    silu = first(tiny, aten.silu.default)
    values = _global_inputs(silu)
    expected = _run(silu, values)
    for inp, out in [("RP", "RP"), ("S(0)S(0)[0,1]", "S(0)S(0)[1,0]")]:
        with pytest.raises(AssertionError):
            check_strategy(silu, Strategy((L(out),), (L(inp),)), (2, 2), values, expected)


# ------------------------------------------------------------------------------- plumbing
def test_own_rules_are_a_read_only_mapping_built_from_the_rule_modules():
    from autoshard.strategies.rules import RULES, attention, factories

    assert RULES[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] is attention.flash_attention
    assert RULES[aten.full.default] is factories.fill_factory
    with pytest.raises(TypeError):
        RULES[aten.mm.default] = attention.flash_attention


def test_redistribute_costs_are_off_only_inside_the_block_and_only_in_its_thread():
    import threading

    from torch.distributed.tensor._ops import utils as ops_utils

    from autoshard import _torch_compat as cs

    torchs = ops_utils.redistribute_cost
    seen = {}
    mesh = cs.strategy_mesh((2,))
    meta = cs.tensor_meta(torch.empty(4))
    src, dst = (L("S(0)").to_spec(mesh, meta), L("R").to_spec(mesh, meta))
    with cs.no_redistribute_costs():
        with cs.no_redistribute_costs():  # nests
            assert ops_utils.redistribute_cost(src, dst) == 0.0
        assert ops_utils.redistribute_cost(src, dst) == 0.0
        other = threading.Thread(target=lambda: seen.update(cost=ops_utils.redistribute_cost(src, dst)))
        other.start()
        other.join()
    assert seen["cost"] == torchs(src, dst) > 0  # another thread meanwhile gets torch's price
    assert ops_utils.redistribute_cost is torchs  # restored
