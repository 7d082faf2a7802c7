"""Compute price of a node's strategies: a per-rank roofline on the device profile, plus the
profile's dispatch overhead of one op.

flops come from torch's flop counter formulas on global shapes (matmuls, attention,
convolutions), divided by the work split of the strategy, at the device's rate for the dtype the
op computes in; bytes are the local input + output sizes. Views run no kernel: they cost the
dispatch only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils.flop_counter import flop_registry

from autoshard import _torch_compat as cs
from autoshard.pricing.experts import exchange_s
from autoshard.profiles.device import DeviceProfile
from autoshard.profiles.network import NetworkProfile
from autoshard.strategies.call import OpCall, signature
from autoshard.strategies.strategy import Layouts, Strategy

log = logging.getLogger(__name__)
aten = torch.ops.aten

# Ops without a flop formula of their own, counted as the op (overload packet) with one, on their
# first n tensor inputs.
_FLOP_ALIASES = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: (aten._scaled_dot_product_flash_attention, 3),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (
        aten._scaled_dot_product_flash_attention_backward,
        4,
    ),
}
# Ops that return views of their input (or, like _unsafe_view, a relabeled fresh tensor): no kernel.
_FREE = frozenset({aten._unsafe_view.default, aten.detach.default, aten.alias.default})


def global_flops(call: OpCall) -> float:
    """Flops of the op on global shapes, from torch's flop counter formulas; 0 for everything
    else, whose cost is its memory traffic."""
    op = call.op
    if op in _FLOP_ALIASES:
        packet, n = _FLOP_ALIASES[op]
        args, kwargs = tuple(call.in_vals[:n]), {}
    else:
        packet = getattr(op, "overloadpacket", None)
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


def is_free(op: Any) -> bool:
    """Whether the op runs no kernel (a view)."""
    return op in _FREE or cs.returns_alias(op)


def roofline_s(call: OpCall, outs: Layouts, ins: Layouts, flops: float, device: DeviceProfile) -> float:
    """Roofline per rank: flops divided by the work split (product of the sizes of mesh dims on
    which anything is not replicated), bytes = local input + output sizes."""
    if is_free(call.op):
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
    return device.roofline_s(flops / split, nbytes, compute_dtype(call))


def compute_dtype(call: OpCall):
    """The dtype an op computes in: its first floating-point input's (a matmul's operands)."""
    for t in call.in_vals:
        if t is not None and t.is_floating_point():
            return t.dtype
    return None


class ComputePricer:
    """Modeled compute seconds per rank of each strategy of a node, on `device` and a mesh of
    `mesh_shape`. Cached per op signature in this object: the identical layers of a transformer
    are priced once."""

    def __init__(self, device: DeviceProfile, mesh_shape: Sequence[int], network: NetworkProfile | None = None):
        self.device = device
        self.mesh_shape = tuple(mesh_shape)
        self.network = network  # prices the exchanges inside an op (expert parallelism); None: not
        self._by_signature: dict[tuple, tuple[Sequence[Strategy], tuple[float, ...]]] = {}
        # The tuple a StrategyCatalog returns is the same object for every node of one signature:
        # by its identity, a repeated node skips computing its signature. Entries keep the tuple
        # alive, so an id is never reused while it is a key.
        self._by_tuple: dict[int, tuple[tuple[Strategy, ...], tuple[float, ...]]] = {}

    def node_compute_s(self, node: fx.Node, strategies: Sequence[Strategy]) -> tuple[float, ...]:
        """Compute seconds of each of `strategies` (the node's, e.g. as its catalog gave them), in
        order."""
        hit = self._by_tuple.get(id(strategies))
        if hit is not None and hit[0] is strategies:
            return hit[1]
        key = signature(node)
        hit = self._by_signature.get(key)
        # Equal signatures have equal strategies when they come from one catalog (the same tuple):
        # identity is the fast check, equality the safe one for strategies from elsewhere.
        if hit is not None and (hit[0] is strategies or tuple(hit[0]) == tuple(strategies)):
            costs = hit[1]
        else:
            with cs.no_dispatch_modes():
                call = OpCall(node, self.mesh_shape)
                flops = global_flops(call)
                overhead = self.device.op_overhead_s
                costs = tuple(
                    overhead
                    + roofline_s(call, s.outputs, s.inputs, flops, self.device)
                    + (0.0 if self.network is None else exchange_s(call, s.inputs, self.network))
                    for s in strategies
                )
            self._by_signature[key] = (strategies, costs)
        if isinstance(strategies, tuple):  # immutable: safe to recognize by identity
            self._by_tuple[id(strategies)] = (strategies, costs)
        return costs


@dataclass(frozen=True)
class GraphWork:
    """What the roofline counts in a whole graph run on one device (`autoshard calibrate` times
    such a run): the ops that dispatch, the flops of those with a flop formula (matmuls,
    attention), and the count and input + output bytes of the others, the memory-bound ones."""

    ops: int
    flops: float
    memory_ops: int
    memory_bytes: float


def op_class(node: fx.Node) -> str | None:
    """How the roofline prices an op node: "flop" (a flop formula: matmuls, attention), "memory"
    (input + output bytes), "free" (a view: its dispatch only); None for what is not an op."""
    return _classified(node)[0]


def _classified(node: fx.Node) -> tuple[str | None, float]:
    """`op_class` and the op's flops on global shapes (0 unless "flop")."""
    if node.op != "call_function" or not cs.is_op_overload(node.target):
        return None, 0.0
    if is_free(node.target):
        return "free", 0.0
    with cs.no_dispatch_modes():
        flops = global_flops(OpCall(node, (1,)))
    return ("flop" if flops else "memory"), flops


def graph_work(graph: fx.Graph) -> GraphWork:
    """The roofline's inputs summed over `graph`'s ops, on global shapes (a mesh of one device)."""
    ops, flops, memory_ops, memory = 0, 0.0, 0, 0.0
    with cs.no_dispatch_modes():
        for node in graph.nodes:
            kind, node_flops = _classified(node)
            if kind is None:
                continue
            ops += 1
            flops += node_flops
            if kind == "memory":
                call = OpCall(node, (1,))
                memory_ops += 1
                memory += sum(
                    math.prod(t.shape) * t.element_size() for t in call.in_vals + call.out_vals if t is not None
                )
    return GraphWork(ops, flops, memory_ops, memory)
