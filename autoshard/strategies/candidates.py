"""Candidate strategies per node of the joint graph: which layouts an op can consume and produce.

Sources, in order: our own rules (attention on CPU, fill-factory ops), DTensor's single-dim
registry (per-mesh-dim rules, expanded over the mesh here), DTensor's multi-dim registry (called with
every candidate input layout, so strategy functions that "follow" their inputs enumerate everything),
and, for ops nothing knows, replicate-everything with a warning naming the op.

DTensor reasons in default shard order (ascending mesh dims). Device order is added afterwards as
order variants of each strategy (see `_order_variants`), so the ILP chooses order like placements.

Everything works on global shapes. Only layouts that split every sharded tensor dim evenly are kept:
even splits make the executor's local shapes and the cost model exact.

Strategy lists are cached by (op, input/output shapes and dtypes, non-tensor args, mesh shape,
device): the identical layers of a transformer cost one computation each.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import operator
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import fx
from torch.utils.flop_counter import flop_registry

from autoshard import _torch_compat as cs
from autoshard.profiles.device import DeviceProfile
from autoshard.layout import Layout, P, Placement, R, S

log = logging.getLogger(__name__)
aten = torch.ops.aten


@dataclass(frozen=True)
class Strategy:
    """One way to run a node: the layout of each output (None for non-tensor outputs), the layout
    each input slot must arrive in (None for non-tensor slots), and modeled compute time per rank."""

    outputs: tuple[Layout | None, ...]
    inputs: tuple[Layout | None, ...]
    compute_s: float

    def __str__(self) -> str:
        fmt = lambda ls: ", ".join("-" if x is None else str(x) for x in ls)  # noqa: E731
        return f"({fmt(self.inputs)}) -> ({fmt(self.outputs)})"

    @functools.cached_property
    def label(self) -> str:
        """`str(self)`, formatted once: the nodes of repeated blocks share Strategy objects (cached
        per op signature), and formatting layouts is slow."""
        return str(self)


def input_slots(node: fx.Node) -> list[fx.Node]:
    """The fx.Node leaves of (args, kwargs), in order, duplicates kept: `mul(x, x)` has 2 slots.
    This is also the order DTensor lists input specs in."""
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


# ---------------------------------------------------------------------------------- layouts
def _even(layout: Layout, shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
    for td, mds in layout.order:
        if td >= len(shape):
            return False
        n = math.prod(mesh_shape[m] for m in mds)
        if shape[td] == 0 or shape[td] % n:
            return False
    return True


@lru_cache(maxsize=None)
def _layouts_for(shape: tuple[int, ...], mesh_shape: tuple[int, ...], allow_partial: bool,
                 all_orders: bool) -> tuple[Layout, ...]:
    choices: list[Placement] = [R] + [S(d) for d in range(len(shape))] + ([P()] if allow_partial else [])
    out = []
    for placements in itertools.product(choices, repeat=len(mesh_shape)):
        base = Layout(placements)
        if not _even(base, shape, mesh_shape):
            continue
        if not all_orders:
            out.append(base)
            continue
        options = [itertools.permutations(mds) if len(mds) > 1 else [mds] for _, mds in base.order]
        for orders in itertools.product(*options):
            out.append(Layout(placements, tuple(zip(base.sharded_dims, orders))))
    return tuple(out)


def layouts_for(shape: Sequence[int], mesh_shape: Sequence[int], *, allow_partial: bool) -> list[Layout]:
    """Every even layout of a tensor of `shape` on a mesh of `mesh_shape`: R / S(d) / P(sum) per mesh
    dim, and every shard order of each tensor dim sharded over 2+ mesh dims."""
    return list(_layouts_for(tuple(shape), tuple(mesh_shape), allow_partial, True))


# ---------------------------------------------------------------------------------- torch <-> ours
def _from_torch(p: Any, ndim: int) -> Placement | None:
    """Our placement for a torch one; None when a Layout cannot express it (`_StridedShard`
    with its own split factor, `_MaskPartial`, max/min partials): those strategies are dropped."""
    t = type(p)
    if t is cs.Replicate:
        return R
    if t is cs.Shard:
        return S(p.dim % ndim if ndim else p.dim)
    if t is cs.Partial and p.reduce_op in ("sum", "avg"):
        return P(p.reduce_op)
    return None


def _layout_from_torch(placements: Sequence[Any], ndim: int) -> Layout | None:
    ours = [_from_torch(p, ndim) for p in placements]
    return None if any(p is None for p in ours) else Layout(tuple(ours))


# ---------------------------------------------------------------------------------- node facts
def _tensor(v: Any) -> torch.Tensor | None:
    return v if isinstance(v, torch.Tensor) else None


def _output_values(node: fx.Node) -> list[torch.Tensor | None]:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return [_tensor(v) for v in val]
    return [_tensor(val)]


def _freeze(x: Any) -> Any:
    """Hashable form of the non-tensor arguments; tensors become their shape and dtype."""
    if isinstance(x, fx.Node):
        v = x.meta.get("val")
        return ("T", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("N", repr(v))
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(a) for a in x)
    if isinstance(x, dict):
        return tuple((k, _freeze(v)) for k, v in x.items())
    try:
        hash(x)
        return (type(x).__name__, x)  # 1, 1.0 and True hash alike
    except TypeError:
        return repr(x)


def _signature(node: fx.Node) -> tuple:
    outs = tuple(None if t is None else (tuple(t.shape), t.dtype) for t in _output_values(node))
    return (node.target, _freeze(node.args), _freeze(node.kwargs), outs)


# ---------------------------------------------------------------------------------- rule expansion
Rule = Sequence[Placement | None]  # placements on ONE mesh dim: [outputs..., input slots...]


def _expand(rules: Sequence[Rule], mesh_ndim: int, n_out: int) -> list[tuple[tuple, tuple]]:
    """Every combination of one rule per mesh dim (DTensor's own expansion, without its costs)."""
    found = []
    for combo in itertools.product(rules, repeat=mesh_ndim):
        layouts = []
        for t in range(len(rules[0])):
            ps = tuple(rule[t] for rule in combo)
            layouts.append(None if any(p is None for p in ps) else Layout(ps))
        found.append((tuple(layouts[:n_out]), tuple(layouts[n_out:])))
    return found


def _torch_rule(rule: Sequence[Any], ndims: Sequence[int]) -> list | None:
    ours = [None if p is None else _from_torch(p, nd) for p, nd in zip(rule, ndims)]
    return None if any(q is None and p is not None for q, p in zip(ours, rule)) else ours


# ---------------------------------------------------------------------------------- sources
class _Call:
    """One op call with global tensor metadata, shared by every source of strategies."""

    def __init__(self, node: fx.Node, mesh_shape: tuple[int, ...]):
        self.node, self.op, self.mesh_shape = node, node.target, mesh_shape
        self.slots = input_slots(node)
        self.in_vals = [_tensor(s.meta.get("val")) for s in self.slots]
        self.out_vals = _output_values(node)

    @property
    def n_out(self) -> int:
        return len(self.out_vals)


def _from_single_dim(call: _Call, info: Any, schema_info: Any) -> list:
    mesh = cs.strategy_mesh(call.mesh_shape)
    tensors = [t for t in call.in_vals if t is not None]
    sharded = next((i for i, t in enumerate(tensors) if t.dim() > 0), None)
    counter = itertools.count()

    def dummy(t: torch.Tensor) -> Any:
        # torch fills its Shard placeholders from the placements it sees: show it one Shard.
        first = cs.Shard(0) if next(counter) == sharded else cs.Replicate()
        placements = (first,) + (cs.Replicate(),) * (mesh.ndim - 1)
        return cs.OpStrategy([cs.OpSpec(cs.DTensorSpec(mesh, placements, tensor_meta=cs.tensor_meta(t)))])

    schema = _schema(call, dummy, schema_info)
    metas = [None if t is None else cs.tensor_meta(t) for t in call.out_vals]
    ndims = [0 if t is None else t.dim() for t in call.out_vals + tensors]
    slot_of = [call.n_out + i for i, t in enumerate(call.in_vals) if t is not None]
    scalar_out = all(t is not None and t.dim() == 0 for t in call.out_vals)
    rules = []
    for torch_rule in cs.single_dim_rules(info, schema, metas[0] if len(metas) == 1 else tuple(metas)):
        rule = _torch_rule(torch_rule, ndims)
        if rule is None or (P("avg") in rule and not scalar_out):  # P(avg) only pays for a mean loss
            continue
        full = rule[:call.n_out] + [None] * len(call.in_vals)  # back to one entry per input slot
        for j, pos in enumerate(slot_of):
            full[pos] = rule[call.n_out + j]
        rules.append(full)
    return _expand(rules, len(call.mesh_shape), call.n_out) if rules else []


def _schema(call: _Call, wrap: Any, schema_info: Any) -> Any:
    """DTensor's OpSchema for this call, each tensor input replaced by `wrap(tensor)`."""

    def conv(x: Any) -> Any:
        if isinstance(x, fx.Node):
            t = _tensor(x.meta.get("val"))
            return x.meta.get("val") if t is None else wrap(t)
        if isinstance(x, (list, tuple)):
            items = [conv(a) for a in x]
            if items and all(isinstance(a, cs.OpStrategy) for a in items):
                return cs.TupleStrategy(items)
            return type(x)(items)
        return x

    args = tuple(conv(a) for a in call.node.args)
    kwargs = {k: conv(v) for k, v in call.node.kwargs.items()}
    return cs.OpSchema(call.op, args, kwargs, schema_info=schema_info)


# Strategy functions that index several inputs' candidate lists with one index (they only read
# the tensor metadata of the others): give every input a list of the same length.
_ALIGNED = {aten.nll_loss_forward.default, aten.nll_loss_backward.default}


def _from_multi_dim(call: _Call, func: Any, schema_info: Any) -> list:
    ms, mesh = call.mesh_shape, cs.strategy_mesh(call.mesh_shape)
    cands = [None if t is None else _layouts_for(tuple(t.shape), ms, t.dtype.is_floating_point, False)
             for t in call.in_vals]
    longest = max((len(c) for c in cands if c), default=1)

    def run(pick: dict[int, Layout]) -> list:
        it = iter([i for i, t in enumerate(call.in_vals) if t is not None])  # wrap() sees tensors only

        def wrap(t: torch.Tensor) -> Any:
            i = next(it)
            layouts = [pick[i]] if i in pick else list(cands[i])
            if call.op in _ALIGNED and i not in pick:
                layouts = list(itertools.islice(itertools.cycle(layouts), longest))
            meta = cs.tensor_meta(t)
            return cs.OpStrategy([cs.OpSpec(lay.to_spec(mesh, meta)) for lay in layouts])

        with cs.no_redistribute_costs():
            result = func(_schema(call, wrap, schema_info))
        children = result.children if isinstance(result, cs.TupleStrategy) else [result]
        return [_convert_spec(call, spec) for child in children for spec in child.strategies]

    try:
        return run({})
    except Exception as e:  # some candidates make a strategy function raise: try them one by one
        log.debug("%s: strategy function failed on the full candidate set (%s); trying one by one", call.op, e)
    found = []
    for i, c in enumerate(cands):
        for layout in c or ():
            try:
                found += run({i: layout})
            except Exception:
                pass
    return found


def _convert_spec(call: _Call, spec: Any) -> tuple[tuple, tuple] | None:
    """(outputs, inputs) layouts of a DTensor OpSpec; None if a Layout cannot express it."""
    outs_t = spec.output_specs
    if not isinstance(outs_t, (tuple, list)):  # DTensor's shorthand: one spec for every output
        outs_t = (outs_t,) * call.n_out
    if spec.input_specs is None:  # DTensor's shorthand: inputs follow the output
        ins_t = [outs_t[0] if t is not None else None for t in call.in_vals]
    else:
        it = iter(spec.input_specs)
        ins_t = [next(it, None) if t is not None else None for t in call.in_vals]
    if len(outs_t) != call.n_out:
        return None
    layouts = []
    for s, t in zip(list(outs_t) + ins_t, call.out_vals + call.in_vals):
        lay = None if s is None or t is None else _layout_from_torch(s.placements, t.dim())
        if lay is None and t is not None:
            return None
        layouts.append(lay)
    return tuple(layouts[:call.n_out]), tuple(layouts[call.n_out:])


def _replicated(call: _Call) -> tuple[tuple, tuple]:
    rep = Layout.replicate(len(call.mesh_shape))
    return (tuple(None if t is None else rep for t in call.out_vals),
            tuple(None if t is None else rep for t in call.in_vals))


# ---------------------------------------------------------------------------------- own rules
def _attention_rules(call: _Call) -> list[Rule]:
    """Flash attention on CPU (+ backward), tensors [b, h, s, d] and logsumexp [b, h, s]: shard
    batch or heads of everything, or replicate. Outputs are never partial: attention is nonlinear
    in its inputs. Sequence sharding is left out (causal masks would need position offsets)."""
    rules: list[Rule] = [[None if t is None else R for t in call.out_vals + call.in_vals]]
    for dim in (0, 1):  # batch, heads
        rule = [S(dim) if t is not None else None for t in call.out_vals]
        for slot, t in zip(call.slots, call.in_vals):
            if t is None:
                rule.append(None)
            elif call.node.kwargs.get("attn_mask") is slot:  # broadcast dims stay replicated
                rule.append(S(dim) if t.dim() == 4 and t.shape[dim] > 1 else R)
            else:
                rule.append(S(dim))
        rules.append(rule)
    return rules


_FILL_FACTORIES = {aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format,
                   aten.scalar_tensor.default, aten.empty_strided.default}


def _factory(call: _Call) -> list[tuple[tuple, tuple]]:
    """Constant-filled tensors can be created directly in any R/S layout (each rank makes its
    local shard), so the ILP is free to place them where their consumers want them."""
    (out,) = call.out_vals
    return [((lay,), ()) for lay in _layouts_for(tuple(out.shape), call.mesh_shape, False, True)]


_OWN_RULES = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: _attention_rules,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _attention_rules,
}

_warned: set[Any] = set()


def _fallback(call: _Call, why: str) -> list:
    if call.op not in _warned:
        _warned.add(call.op)
        msg = f"autoshard: {why} for op {call.op}; it will run replicated on every rank"
        log.warning(msg)
        warnings.warn(msg, stacklevel=3)
    return [_replicated(call)]


def _base_strategies(call: _Call) -> list[tuple[tuple, tuple]]:
    if call.op in _OWN_RULES:
        return _expand(_OWN_RULES[call.op](call), len(call.mesh_shape), call.n_out)
    if call.op in _FILL_FACTORIES and len(call.out_vals) == 1 and call.out_vals[0] is not None:
        return _factory(call)
    if not isinstance(call.op, torch._ops.OpOverload):
        return _fallback(call, "no sharding strategy (not an aten op)")
    kind, func, schema_info = cs.registry_entry(call.op)
    if kind == "none" or not any(t is not None for t in call.in_vals):
        return _fallback(call, "no sharding strategy in DTensor's registry")
    try:
        found = (_from_single_dim if kind == "single" else _from_multi_dim)(call, func, schema_info)
    except Exception as e:
        return _fallback(call, f"DTensor's strategy failed ({type(e).__name__}: {e})")
    return [f for f in found if f is not None]


# ---------------------------------------------------------------------------------- order variants
def _order_variants(outs: tuple, ins: tuple, mesh_ndim: int) -> list[tuple[tuple, tuple]]:
    """Non-default device orders of a default-order strategy.

    A variant applies ONE permutation of the mesh dims to the shard order of every tensor dim
    sharded over 2+ mesh dims, in every input and output. Why that is valid: let M be such a
    group of mesh dims. If every tensor of the strategy either shards one tensor dim over exactly
    M, or is replicated on all of M, or partial (same op) on all of M, then reordering M in all
    shard orders equals running the default strategy on a relabeled set of ranks (the rank
    holding chunk i under the new order is the one that held chunk i under the default). R and
    P over all of M do not notice a relabeling within M, and the relabeling keeps the coordinates
    of the other mesh dims, so corresponding chunks of all tensors stay on the same rank: exactly
    what pointwise ops, matmuls (contraction dims included) and views need. Strategies that mix
    M with other placements (say S(0) on one of M's mesh dims and R on the other) get no
    variants. For 3D meshes, permutations that change nothing are dropped by deduplication.
    """
    layouts = [lay for lay in outs + ins if lay is not None]
    groups = {tuple(sorted(mds)) for lay in layouts for _, mds in lay.order if len(mds) > 1}
    if not groups:
        return []
    for group in groups:
        for lay in layouts:
            ps = {lay.placements[m] for m in group}
            if len(ps) != 1:
                return []
            (p,) = ps
            if p.kind == "S" and tuple(sorted(dict(lay.order)[p.dim])) != group:
                return []
    found = []
    for perm in itertools.permutations(range(mesh_ndim)):
        rank = {m: i for i, m in enumerate(perm)}

        def reorder(lay: Layout | None) -> Layout | None:
            if lay is None or not any(len(mds) > 1 for _, mds in lay.order):
                return lay
            return Layout(lay.placements, tuple((td, tuple(sorted(mds, key=rank.__getitem__))) for td, mds in lay.order))

        found.append((tuple(map(reorder, outs)), tuple(map(reorder, ins))))
    return found


# ---------------------------------------------------------------------------------- compute cost
_FLOP_ALIASES = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: (aten._scaled_dot_product_flash_attention, 3),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        (aten._scaled_dot_product_flash_attention_backward, 4),
}
# Ops that return views of their input (or, like _unsafe_view, a relabeled fresh tensor): no kernel.
_FREE = {aten._unsafe_view.default, aten.detach.default, aten.alias.default}


def _global_flops(call: _Call) -> float:
    """Flops of the op on global shapes, from torch's flop counter formulas (matmuls, attention,
    convolutions); 0 for everything else, whose cost is its memory traffic."""
    op = call.op
    if op in _FLOP_ALIASES:
        packet, n = _FLOP_ALIASES[op]
        args, kwargs = tuple(call.in_vals[:n]), {}
    else:
        packet = getattr(op, "_overloadpacket", None)
        val = lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a  # noqa: E731
        args = fx.node.map_aggregate(call.node.args, val)
        kwargs = fx.node.map_aggregate(dict(call.node.kwargs), val)
    if packet not in flop_registry:
        return 0.0
    out = call.out_vals[0] if call.n_out == 1 else tuple(call.out_vals)
    try:
        return float(flop_registry[packet](*args, out_val=out, **kwargs))
    except Exception as e:
        log.debug("no flop count for %s: %s", op, e)
        return 0.0


def _is_free(op: Any) -> bool:
    if op in _FREE:
        return True
    schema = getattr(op, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def _compute_s(call: _Call, outs: tuple, ins: tuple, flops: float, device: DeviceProfile) -> float:
    """Roofline per rank: flops divided by the work split (product of the sizes of mesh dims on
    which anything is not replicated), bytes = local input + output sizes."""
    if _is_free(call.op):
        return 0.0
    ms = call.mesh_shape
    split, nbytes = 1, 0
    layouts = outs + ins
    for m, size in enumerate(ms):
        if any(lay is not None and lay.placements[m].kind != "R" for lay in layouts):
            split *= size
    for lay, t in zip(layouts, call.out_vals + call.in_vals):
        if lay is not None and t is not None:
            nbytes += math.prod(lay.local_shape(t.shape, ms)) * t.element_size()
    return device.roofline_s(flops / split, nbytes)


# ---------------------------------------------------------------------------------- entry point
_cache: dict[tuple, tuple[Strategy, ...]] = {}


def clear_cache() -> None:
    _cache.clear()


def _mesh_shape(mesh: Any) -> tuple[int, ...]:
    return tuple(mesh.shape) if hasattr(mesh, "shape") else tuple(mesh)


def node_strategies(node: fx.Node, mesh: Any, device: DeviceProfile) -> list[Strategy]:
    """Every candidate strategy of a call_function node (not getitem) on `mesh` (a DeviceMesh or a
    mesh shape), deduplicated, each with its modeled compute time on `device`."""
    if node.op != "call_function" or node.target is operator.getitem:
        raise ValueError(f"node_strategies takes call_function nodes other than getitem, got {node.op} {node.name}")
    mesh_shape = _mesh_shape(mesh)
    key = (_signature(node), mesh_shape, device)
    hit = _cache.get(key)
    if hit is None:
        with cs.no_dispatch_modes():
            hit = _cache[key] = _compute(_Call(node, mesh_shape), device)
    return list(hit)


def _fits(lay: Layout | None, t: torch.Tensor | None, mesh_shape: tuple[int, ...]) -> bool:
    """An even layout for a tensor (None for a non-tensor); integer tensors are never partial."""
    if lay is None or t is None:
        return lay is None and t is None
    if not t.dtype.is_floating_point and any(p.kind == "P" for p in lay.placements):
        return False
    return _even(lay, t.shape, mesh_shape)


def _compute(call: _Call, device: DeviceProfile) -> tuple[Strategy, ...]:
    ms = call.mesh_shape
    tensors = call.out_vals + call.in_vals

    def valid(outs: tuple, ins: tuple) -> bool:
        return len(outs) == call.n_out and all(_fits(lay, t, ms) for lay, t in zip(outs + ins, tensors))

    base = [f for f in _base_strategies(call) if valid(*f)]
    seen = dict.fromkeys([_replicated(call)] + base)  # all-replicate is always valid: keep it
    for outs, ins in list(seen):
        seen.update(dict.fromkeys(_order_variants(outs, ins, len(ms))))
    flops = _global_flops(call)
    return tuple(Strategy(outs, ins, _compute_s(call, outs, ins, flops, device)) for outs, ins in seen)
