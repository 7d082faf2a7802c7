"""The entry point: every candidate strategy of a node on one mesh, cached per op signature.

Sources, in order: our own rules (`rules/`), DTensor's registries (`registry.py`), and, for ops
nothing knows, replicate-everything with a warning naming the op. Each strategy found (in default
shard order) then gets its device-order variants (`order.py`). Everything works on global shapes;
only layouts that split every sharded tensor dim evenly are kept.

A `StrategyCatalog` owns every cache of this stage and lives as long as one planning run: the
identical layers of a transformer cost one computation each and share the very same `Strategy`
objects (the problem builder keys cost matrices by their identity). Strategies do not depend on
the device profile: pricing them is `autoshard.pricing.compute`'s job.
"""

from __future__ import annotations

import logging
import operator
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from autoshard import _torch_compat as cs
from autoshard.layout import Layout
from autoshard.strategies.call import OpCall, signature
from autoshard.strategies.layouts import LayoutCache, is_even
from autoshard.strategies.order import order_variants
from autoshard.strategies.registry import DTensorRegistry
from autoshard.strategies.rules import RULES
from autoshard.strategies.strategy import Found, Strategy

log = logging.getLogger(__name__)


def mesh_shape_of(mesh: Any) -> tuple[int, ...]:
    """The shape of a DeviceMesh, or a mesh shape itself."""
    return tuple(mesh.shape) if hasattr(mesh, "shape") else tuple(mesh)


class StrategyCatalog:
    """Candidate strategies of graph nodes on a mesh (a DeviceMesh or a mesh shape)."""

    def __init__(self, mesh: Any):
        self.mesh_shape = mesh_shape_of(mesh)
        self.layouts = LayoutCache(self.mesh_shape)
        self.registry = DTensorRegistry(self.mesh_shape, self.layouts)
        self._by_signature: dict[tuple, tuple[Strategy, ...]] = {}
        self._by_node: dict[fx.Node, tuple[Strategy, ...]] = {}  # a rebuild of the same graph skips signatures
        self._by_shape: dict[tuple[int, ...], tuple[Strategy, ...]] = {}
        self._warned: set[Any] = set()  # ops already warned about (one warning per op)

    # ------------------------------------------------------------------------------ public
    def strategies(self, node: fx.Node) -> tuple[Strategy, ...]:
        """Every candidate strategy of a call_function node (not getitem), deduplicated. Nodes with
        equal op signatures get the same tuple of the same Strategy objects."""
        hit = self._by_node.get(node)
        if hit is not None:
            return hit
        if node.op != "call_function" or node.target is operator.getitem:
            raise ValueError(f"node_strategies takes call_function nodes other than getitem, got {node.op} {node.name}")
        key = signature(node)
        hit = self._by_signature.get(key)
        if hit is None:
            with cs.no_dispatch_modes():
                hit = self._by_signature[key] = self._enumerate(OpCall(node, self.mesh_shape))
        self._by_node[node] = hit
        return hit

    def source_strategies(self, shape: Sequence[int]) -> tuple[Strategy, ...]:
        """Strategies of a tensor that is given rather than computed (a parameter, an input): every
        even, non-partial layout as its one output, no inputs. Shared per shape, so the
        placeholders of repeated blocks share Strategy objects too."""
        shape = tuple(shape)
        hit = self._by_shape.get(shape)
        if hit is None:
            layouts = self.layouts(shape, allow_partial=False)
            hit = self._by_shape[shape] = tuple(Strategy(outputs=(lay,), inputs=()) for lay in layouts)
        return hit

    # ------------------------------------------------------------------------------ enumeration
    def _enumerate(self, call: OpCall) -> tuple[Strategy, ...]:
        ms = call.mesh_shape
        tensors = call.out_vals + call.in_vals

        def valid(outs: tuple, ins: tuple) -> bool:
            return len(outs) == call.n_out and all(_fits(lay, t, ms) for lay, t in zip(outs + ins, tensors))

        base = [f for f in self._base(call) if valid(*f)]
        seen = dict.fromkeys([call.replicated()] + base)  # all-replicate is always valid: keep it
        for outs, ins in list(seen):
            seen.update(dict.fromkeys(order_variants(outs, ins, len(ms))))
        return tuple(Strategy(outs, ins) for outs, ins in seen)

    def _base(self, call: OpCall) -> list[Found]:
        """Default-order strategies: our rules, else DTensor's registry, else replicated."""
        own = RULES.get(call.op)
        if own is not None:
            found = own(call, self.layouts)
            if found is not None:
                return found
        if not cs.is_op_overload(call.op):
            return self._fallback(call, "no sharding strategy (not an aten op)")
        try:
            found = self.registry.strategies(call)
        except Exception as e:
            return self._fallback(call, f"DTensor's strategy failed ({type(e).__name__}: {e})")
        if found is None:
            return self._fallback(call, "no sharding strategy in DTensor's registry")
        return found

    def _fallback(self, call: OpCall, why: str) -> list[Found]:
        if call.op not in self._warned:
            self._warned.add(call.op)
            msg = f"autoshard: {why} for op {call.op}; it will run replicated on every rank"
            log.warning(msg)
            warnings.warn(msg, stacklevel=4)
        return [call.replicated()]


def _fits(lay: Layout | None, t: torch.Tensor | None, mesh_shape: tuple[int, ...]) -> bool:
    """An even layout for a tensor (None for a non-tensor); integer tensors are never partial."""
    if lay is None or t is None:
        return lay is None and t is None
    if not t.dtype.is_floating_point and any(p.kind == "P" for p in lay.placements):
        return False
    return is_even(lay, t.shape, mesh_shape)


def node_strategies(node: fx.Node, catalog: StrategyCatalog) -> list[Strategy]:
    """`catalog.strategies(node)` as a list: every candidate strategy of a call_function node."""
    return list(catalog.strategies(node))
