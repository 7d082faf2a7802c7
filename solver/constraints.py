"""The constraints a problem can carry beside its costs: pins (`Fixed`, `Allowed`), ties
(`SameChoice`, `RepeatedRegion`: repeated blocks share one set of variables) and memory budgets
(`MemoryBudget`, with `EdgeMemory` for what only a pair of choices holds), and how each is checked
against the problem's nodes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Union

import numpy as np


@dataclass
class Fixed:
    node: str
    choice_index: int

    def describe(self) -> str:
        return f"Fixed({self.node!r}, {self.choice_index})"


@dataclass
class Allowed:
    node: str
    indices: list[int]

    def describe(self) -> str:
        return f"Allowed({self.node!r}, {list(self.indices)})"


@dataclass
class SameChoice:
    """Nodes that must take the same choice index (their choice lists are aligned)."""

    nodes: list[str]
    name: str = ""

    def describe(self) -> str:
        return f"SameChoice({self.name or '-'!s}: {', '.join(map(repr, self.nodes))})"


@dataclass
class EdgeMemory:
    """Bytes a budget counts for a pair of choices of `src` and `dst`: memory[src choice][dst
    choice]. What exists only for some pairs, e.g. a copy that the edge's redistribution makes
    and the step then holds (none when both ends agree)."""

    src: str
    dst: str
    memory: list[list[float]]


@dataclass
class MemoryBudget:
    """Sum of the chosen `memory` over `nodes`, plus the chosen entries of `edges`, must not
    exceed `limit`. `memory` (node -> bytes per choice) gives this budget its own figures;
    without it, each choice's `Choice.memory` counts."""

    nodes: list[str]
    limit: float
    name: str = ""
    memory: dict[str, list[float]] | None = None
    edges: list[EdgeMemory] = field(default_factory=list)

    def describe(self) -> str:
        pairs = f" and {len(self.edges)} edges" if self.edges else ""
        return f"MemoryBudget({self.name or '-'!s}: {len(self.nodes)} nodes{pairs} <= {self.limit:g})"


@dataclass
class RepeatedRegion:
    """Positionally isomorphic copies of one region (e.g. transformer blocks).

    copies[c][i] is the i-th node of copy c; all copies take the same choice position by position,
    which lets the solver keep one set of variables for all copies.
    """

    copies: list[list[str]]

    def describe(self) -> str:
        n = len(self.copies[0]) if self.copies else 0
        return f"RepeatedRegion({len(self.copies)} copies x {n} nodes)"


Constraint = Union[Fixed, Allowed, SameChoice, MemoryBudget]


def validate_constraint(con: Constraint, known: Callable[[str, str], int]) -> None:
    """A constraint's nodes exist and its choice indices, sizes and memory figures fit them."""
    what = con.describe()
    if isinstance(con, (Fixed, Allowed)):
        k = known(con.node, what)
        ids = [con.choice_index] if isinstance(con, Fixed) else con.indices
        if any(not 0 <= i < k for i in ids):
            raise ValueError(f"{what}: choice index out of range 0..{k - 1}")
    elif isinstance(con, SameChoice):
        sizes = {known(n, what) for n in con.nodes}
        if len(sizes) > 1:
            raise ValueError(f"{what}: nodes have different numbers of choices {sizes}")
    elif isinstance(con, MemoryBudget):
        for n in con.nodes:
            k = known(n, what)
            row = con.memory.get(n) if con.memory is not None else None
            if con.memory is not None and (row is None or len(row) != k or not all(0 <= m < math.inf for m in row)):
                raise ValueError(f"{what}: node {n!r} needs {k} finite memory figures >= 0")
        for pair in con.edges:
            rows, cols = known(pair.src, what), known(pair.dst, what)
            m = np.asarray(pair.memory, dtype=float)
            if m.shape != (rows, cols) or not (np.isfinite(m) & (m >= 0)).all():
                raise ValueError(
                    f"{what}: edge {pair.src!r}->{pair.dst!r} needs a {rows}x{cols} matrix of "
                    f"finite memory figures >= 0"
                )
        if math.isnan(con.limit):
            raise ValueError(f"{what}: limit is NaN")
    else:
        raise ValueError(f"unknown constraint type {type(con).__name__}")


def check_cost(v: float, what: str) -> None:
    """ValueError naming `what` unless the cost `v` is >= 0 (or inf)."""
    if math.isnan(v) or v < 0:
        raise ValueError(f"{what} must be >= 0 (or inf), got {v!r}")
