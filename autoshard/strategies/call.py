"""What every source of strategies (and the compute pricer) reads off one graph node: its input
slots with their global tensor values, its output values, and its op signature."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from autoshard.layout import Layout
from autoshard.strategies.strategy import Found, input_slots


def tensor(v: Any) -> torch.Tensor | None:
    return v if isinstance(v, torch.Tensor) else None


def output_values(node: fx.Node) -> list[torch.Tensor | None]:
    """The node's output values (fake/meta tensors, None for non-tensors), one per output."""
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return [tensor(v) for v in val]
    return [tensor(val)]


class OpCall:
    """One op call with global tensor metadata, on a mesh of `mesh_shape`."""

    def __init__(self, node: fx.Node, mesh_shape: tuple[int, ...]):
        self.node, self.op, self.mesh_shape = node, node.target, tuple(mesh_shape)
        self.slots = input_slots(node)
        self.in_vals = [tensor(s.meta.get("val")) for s in self.slots]
        self.out_vals = output_values(node)

    @property
    def n_out(self) -> int:
        return len(self.out_vals)

    def replicated(self) -> Found:
        """The all-replicate strategy: valid for every op."""
        rep = Layout.replicate(len(self.mesh_shape))
        return (
            tuple(None if t is None else rep for t in self.out_vals),
            tuple(None if t is None else rep for t in self.in_vals),
        )


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


def signature(node: fx.Node) -> tuple:
    """(op, non-tensor args, input and output shapes and dtypes): nodes with equal signatures have
    the same strategies and costs, so the identical layers of a transformer are computed once."""
    outs = tuple(None if t is None else (tuple(t.shape), t.dtype) for t in output_values(node))
    return (node.target, _freeze(node.args), _freeze(node.kwargs), outs)
