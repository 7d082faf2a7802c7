"""Hand-written parallel plans expressed as parameter pins, to compare autoshard's plans against.

Pins fix parameter layouts only; the solver still picks the best activation layouts around them, so
a pinned recipe's modeled cost is a lower bound on that recipe as hand-written frameworks run it.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Sequence

from torch import nn

from autoshard.layout import Layout

# torchtitan's llama3 FSDP+TP recipe on a (dp, tp) mesh: column-wise
# weights, embedding and output are sharded on dim 0 by tp first, then by FSDP on dp; row-wise wo/w2
# have dim 1 on tp and dim 0 on dp; norms are sharded by FSDP only.
FSDP_TP_2D = {
    "tok_embeddings.weight": "S(0)S(0)[1,0]",
    "output.weight": "S(0)S(0)[1,0]",
    "layers.*.attention.w[qkv].weight": "S(0)S(0)[1,0]",
    "layers.*.feed_forward.w[13].weight": "S(0)S(0)[1,0]",
    "layers.*.attention.wo.weight": "S(0)S(1)",
    "layers.*.feed_forward.w2.weight": "S(0)S(1)",
    "*norm.weight": "S(0)R",
}

RECIPES = ("fsdp-tp", "fsdp", "ddp")


def recipe_pins(name: str, mesh_ndim: int) -> dict[str, str]:
    """Parameter pattern -> layout text of recipe `name` on a mesh of `mesh_ndim` dims. DDP
    replicates every parameter; pure FSDP splits each on dim 0 over every mesh dim, the first dim
    outermost; the FSDP+TP recipe needs a (dp, tp) mesh."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known: {', '.join(RECIPES)}")
    if name == "ddp":
        return {"*": "R" * mesh_ndim}
    if name == "fsdp":
        order = f"[{','.join(map(str, range(mesh_ndim)))}]" if mesh_ndim > 1 else ""
        return {"*": "S(0)" * mesh_ndim + order}
    if mesh_ndim != 2:
        raise ValueError(f"recipe {name!r} needs a 2-D (dp, tp) mesh; this mesh has {mesh_ndim} dim(s)")
    return dict(FSDP_TP_2D)


def recipe_layouts(model: nn.Module, name: str, mesh_ndim: int) -> dict[str, Layout]:
    """Parameter FQN -> the layout recipe `name` gives it (its first matching pattern)."""
    pins = recipe_pins(name, mesh_ndim)
    layouts = {}
    for fqn, _ in model.named_parameters():
        pattern = next((p for p in pins if fnmatch.fnmatchcase(fqn, p)), None)
        if pattern is None:
            raise ValueError(f"recipe {name!r} has no layout for parameter {fqn}")
        layouts[fqn] = Layout.parse(pins[pattern])
    return layouts


def param_bytes_per_rank(model: nn.Module, layouts: dict[str, Layout], mesh_shape: Sequence[int]) -> float:
    """Parameter bytes each rank holds when every parameter is in its given layout."""
    return float(
        sum(
            math.prod(layouts[fqn].local_shape(tuple(p.shape), mesh_shape)) * p.element_size()
            for fqn, p in model.named_parameters()
        )
    )
