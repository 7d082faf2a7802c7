"""Strategies from DTensor's sharding registries, converted to our layouts.

DTensor's single-dim registry gives per-mesh-dim rules (expanded over the mesh here); its
multi-dim registry gives strategy functions, called with every candidate input layout so that
functions which "follow" their inputs enumerate everything. Both reason in default shard order.
Torch placements a `Layout` cannot express (`_StridedShard` with its own split factor,
`_MaskPartial`, max/min partials) drop the strategy that uses them.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from autoshard import _torch_compat as cs
from autoshard.layout import Layout, P, Placement, R, S
from autoshard.strategies.call import OpCall, tensor
from autoshard.strategies.expand import expand
from autoshard.strategies.layouts import LayoutCache
from autoshard.strategies.strategy import Found

log = logging.getLogger(__name__)
aten = torch.ops.aten


# ---------------------------------------------------------------------------------- torch <-> ours
def from_torch(p: Any, ndim: int) -> Placement | None:
    """Our placement for a torch one; None when a Layout cannot express it."""
    t = type(p)
    if t is cs.Replicate:
        return R
    if t is cs.Shard:
        return S(p.dim % ndim if ndim else p.dim)
    if t is cs.Partial and p.reduce_op in ("sum", "avg"):
        return P(p.reduce_op)
    return None


def layout_from_torch(placements: Sequence[Any], ndim: int) -> Layout | None:
    ours = [from_torch(p, ndim) for p in placements]
    return None if any(p is None for p in ours) else Layout(tuple(ours))


def _rule_from_torch(rule: Sequence[Any], ndims: Sequence[int]) -> list | None:
    ours = [None if p is None else from_torch(p, nd) for p, nd in zip(rule, ndims)]
    return None if any(q is None and p is not None for q, p in zip(ours, rule)) else ours


def _schema(call: OpCall, wrap: Any, schema_info: Any) -> Any:
    """DTensor's OpSchema for this call, each tensor input replaced by `wrap(tensor)`."""

    def conv(x: Any) -> Any:
        if isinstance(x, fx.Node):
            t = tensor(x.meta.get("val"))
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


def _convert_spec(call: OpCall, spec: Any) -> Found | None:
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
    if any(s is not None and len(s.placements) != len(call.mesh_shape) for s in list(outs_t) + ins_t):
        return None  # torch 2.11's constant_pad_nd rule gives one placement whatever the mesh
    layouts = []
    for s, t in zip(list(outs_t) + ins_t, call.out_vals + call.in_vals):
        lay = None if s is None or t is None else layout_from_torch(s.placements, t.dim())
        if lay is None and t is not None:
            return None
        layouts.append(lay)
    return tuple(layouts[: call.n_out]), tuple(layouts[call.n_out :])


# A pending average pays for a mean loss (a scalar) and for the means themselves (RMSNorm's over a
# sharded hidden dim), which DTensor's multi-dim rules offered up to torch 2.13; its per-dim rules
# of 2.14 offer it for every reduction (elsewhere it only adds choices the ILP never takes) and
# take pending inputs into a mean, which 2.13 did not: the same choices on both.
_MEANS = frozenset({aten.mean.dim, aten.mean.default})

# Strategy functions that index several inputs' candidate lists with one index (they only read
# the tensor metadata of the others): give every input a list of the same length.
_ALIGNED = frozenset({aten.nll_loss_forward.default, aten.nll_loss_backward.default})


# ---------------------------------------------------------------------------------- the sources
class DTensorRegistry:
    """DTensor's registries as a source of strategies on one mesh (a mesh without a process
    group). Strategy functions run with DTensor's redistribute pricing off: autoshard prices edges
    with its own planner."""

    def __init__(self, mesh_shape: Sequence[int], layouts: LayoutCache):
        self.mesh_shape = tuple(mesh_shape)
        self.layouts = layouts
        with cs.no_dispatch_modes():
            self.mesh = cs.strategy_mesh(self.mesh_shape)

    def strategies(self, call: OpCall) -> list[Found] | None:
        """The registry's strategies of `call` (those a Layout can express); None if the registry
        has none for this op (or it has no tensor input). Raises what a strategy function raises."""
        kind, func, schema_info = cs.registry_entry(call.op)
        if kind == "none" or not any(t is not None for t in call.in_vals):
            return None
        source = self.from_single_dim if kind == "single" else self.from_multi_dim
        return [f for f in source(call, func, schema_info) if f is not None]

    def from_single_dim(self, call: OpCall, info: Any, schema_info: Any) -> list[Found | None]:
        mesh = self.mesh
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
            rule = _rule_from_torch(torch_rule, ndims)
            if rule is None or (P("avg") in rule and not scalar_out and call.op not in _MEANS):
                continue
            if call.op in _MEANS and any(p is not None and p.kind == "P" for p in rule[len(metas) :]):
                continue
            full = rule[: call.n_out] + [None] * len(call.in_vals)  # back to one entry per input slot
            for j, pos in enumerate(slot_of):
                full[pos] = rule[call.n_out + j]
            rules.append(full)
        return expand(rules, len(call.mesh_shape), call.n_out) if rules else []

    def from_multi_dim(self, call: OpCall, func: Any, schema_info: Any) -> list[Found | None]:
        mesh = self.mesh
        cands = [
            None if t is None else self.layouts(t.shape, allow_partial=t.dtype.is_floating_point, all_orders=False)
            for t in call.in_vals
        ]
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
