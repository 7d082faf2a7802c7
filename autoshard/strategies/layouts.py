"""Even layouts of a tensor on a mesh: the candidate layouts every strategy is built from.

Only layouts that split every sharded tensor dim evenly are kept: even splits make the executor's
local shapes and the cost model exact.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from autoshard.layout import Layout, P, Placement, R, S


def is_even(layout: Layout, shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
    """Whether `layout` splits every sharded dim of `shape` evenly on a mesh of `mesh_shape`."""
    for td, mds in layout.order:
        if td >= len(shape):
            return False
        n = math.prod(mesh_shape[m] for m in mds)
        if shape[td] == 0 or shape[td] % n:
            return False
    return True


def even_layouts(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], allow_partial: bool, all_orders: bool
) -> tuple[Layout, ...]:
    """Every even layout: R / S(d) (/ P(sum)) per mesh dim; with `all_orders`, every shard order of
    each tensor dim sharded over 2+ mesh dims, else the default (ascending) order only."""
    choices: list[Placement] = [R] + [S(d) for d in range(len(shape))] + ([P()] if allow_partial else [])
    out = []
    for placements in itertools.product(choices, repeat=len(mesh_shape)):
        base = Layout(placements)
        if not is_even(base, shape, mesh_shape):
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
    return list(even_layouts(tuple(shape), tuple(mesh_shape), allow_partial, True))


class LayoutCache:
    """`even_layouts` on one mesh, memoized: a model has few distinct tensor shapes. Owned by a
    `StrategyCatalog`, so it lives as long as one planning run."""

    def __init__(self, mesh_shape: Sequence[int]):
        self.mesh_shape = tuple(mesh_shape)
        self._cache: dict[tuple, tuple[Layout, ...]] = {}

    def __call__(self, shape: Sequence[int], *, allow_partial: bool, all_orders: bool = True) -> tuple[Layout, ...]:
        key = (tuple(shape), allow_partial, all_orders)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = even_layouts(key[0], self.mesh_shape, allow_partial, all_orders)
        return hit
