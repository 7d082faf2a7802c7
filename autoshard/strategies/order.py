"""Device order as a strategy choice: the non-default shard orders of a default-order strategy.

DTensor reasons in default shard order (ascending mesh dims). The catalog adds these variants to
each strategy, so the ILP chooses order like placements.
"""

from __future__ import annotations

import itertools

from autoshard.layout import Layout
from autoshard.strategies.strategy import Found, Layouts


def order_variants(outs: Layouts, ins: Layouts, mesh_ndim: int) -> list[Found]:
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
            return Layout(
                lay.placements, tuple((td, tuple(sorted(mds, key=rank.__getitem__))) for td, mds in lay.order)
            )

        found.append((tuple(map(reorder, outs)), tuple(map(reorder, ins))))
    return found
