"""The `Strategy` value: one way to run a node, in layouts only (what it costs is priced elsewhere)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch import fx

from autoshard.layout import Layout

# Layouts of a node's outputs or of its input slots: None where the value is not a tensor.
Layouts = tuple[Layout | None, ...]
# (output layouts, input slot layouts): a strategy before it becomes a `Strategy`.
Found = tuple[Layouts, Layouts]


@dataclass(frozen=True)
class Strategy:
    """One way to run a node: the layout of each output (None for non-tensor outputs) and the
    layout each input slot must arrive in (None for non-tensor slots)."""

    outputs: Layouts
    inputs: Layouts

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
