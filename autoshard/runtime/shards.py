"""Which part of a full tensor each rank holds, as slices: so that a checkpoint is read by slices
(`ParallelModule.load_slices`) and no rank reads a tensor it does not keep.

A layout splits each sharded tensor dim evenly over its mesh dims, in its device order
(`Layout.shard_of`): every split keeps one contiguous block, so a rank's shard is one box, one
slice per dim, whatever the order (`S(0)S(0)[1,0]` only picks another block than `S(0)S(0)`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from autoshard import _torch_compat as tc
from autoshard.layout import Layout

# fqn, box -> the full value's part in the box (any dtype, on the host)
SliceReader = Callable[[str, tuple[slice, ...]], torch.Tensor]


def shard_box(
    layout: Layout, shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int]
) -> tuple[slice, ...]:
    """The slices of a tensor of global `shape` that the rank at mesh coordinate `coord` holds in
    `layout`: the same rows `Layout.shard_of` narrows to. Partial layouts hold sums, not slices."""
    if any(p.kind == "P" for p in layout.placements):
        raise ValueError(f"layout {layout} is partial: its shards are partial sums, not slices of one value")
    layout.local_shape(shape, mesh_shape)  # refuses uneven splits, as the parallel module does
    box = [slice(0, n) for n in shape]
    for td, mds in layout.order:
        start, size = 0, shape[td]
        for m in mds:
            size //= mesh_shape[m]
            start += coord[m] * size
        box[td] = slice(start, start + size)
    return tuple(box)


def _coordinate(mesh: Any, rank: int) -> list[int]:
    """Mesh coordinate of global `rank` (a simulated one: the mesh's rank grid, read outside modes)."""
    with tc.no_dispatch_modes():
        return [int(i) for i in (mesh.mesh == rank).nonzero()[0]]


def read_local(
    read: SliceReader, fqn: str, layout: Layout, shape: Sequence[int], mesh: Any, local: torch.Tensor
) -> torch.Tensor:
    """This rank's shard of `fqn`, read by `read` in `local`'s dtype, shape and device: under
    LocalTensorMode one read per simulated rank, assembled as the LocalTensor `local` is."""
    mesh_shape = tuple(mesh.shape)

    def one(coord: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        box = shard_box(layout, shape, mesh_shape, coord)
        with tc.no_dispatch_modes():  # host reads: plain tensors, not one per simulated rank
            part = read(fqn, box)
            if tuple(part.shape) != tuple(like.shape):
                raise ValueError(f"{fqn}: read {tuple(part.shape)} for the box {box}, the shard is {tuple(like.shape)}")
            return part.to(device=like.device, dtype=like.dtype)

    if isinstance(local, tc.LocalTensor):
        with tc.no_dispatch_modes():
            ranks = tc.rank_values(local)
        return tc.local_tensor({r: one(_coordinate(mesh, r), like) for r, like in ranks.items()})
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError(f"{fqn}: this rank is not in the mesh")
    return one(coord, local)
