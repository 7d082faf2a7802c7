"""Per-mesh-dim rules expanded over the whole mesh (DTensor's own expansion, without its costs)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from autoshard.layout import Layout, Placement
from autoshard.strategies.strategy import Found

# Placements on ONE mesh dim: [outputs..., input slots...], None for non-tensors.
MeshDimRule = Sequence[Placement | None]


def expand(rules: Sequence[MeshDimRule], mesh_ndim: int, n_out: int) -> list[Found]:
    """Every combination of one rule per mesh dim, as (output layouts, input layouts)."""
    found = []
    for combo in itertools.product(rules, repeat=mesh_ndim):
        layouts = []
        for t in range(len(rules[0])):
            ps = tuple(rule[t] for rule in combo)
            layouts.append(None if any(p is None for p in ps) else Layout(ps))
        found.append((tuple(layouts[:n_out]), tuple(layouts[n_out:])))
    return found
