"""The one place autoshard touches private torch APIs (torch 2.13).

Everything here may move between torch releases; keeping it in one file means one file to fix.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed._local_tensor import (
    LocalTensor,
    LocalTensorMode,
    maybe_run_for_local_tensor,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta
from torch.distributed.tensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
)

__all__ = [
    "DTensorSpec",
    "LocalTensorMode",
    "Partial",
    "Replicate",
    "Shard",
    "ShardOrderEntry",
    "TensorMeta",
    "_StridedShard",
    "fake_process_group",
    "flattened_mesh",
    "funcol",
    "local_tensor",
    "per_rank",
    "rank_values",
    "spec_to_order",
    "strided_placements",
    "torch_redistribute_steps",
    "wait",
]

# Rank-specific helper code: run once per simulated rank under LocalTensorMode (returning
# per-rank ints as SymInts), and plainly in a real process.
per_rank = maybe_run_for_local_tensor


class _MeshSizes:
    """Duck-typed stand-in for DeviceMesh where torch only calls `.size(dim)`."""

    def __init__(self, mesh_shape: Sequence[int]):
        self._shape = tuple(mesh_shape)

    def size(self, mesh_dim: int) -> int:
        return self._shape[mesh_dim]


def strided_placements(
    order: Sequence[tuple[int, tuple[int, ...]]],
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
) -> tuple[Placement, ...]:
    """Physical `_StridedShard` encoding of a shard order, computed by torch itself."""
    shard_order = tuple(ShardOrderEntry(td, tuple(mds)) for td, mds in order)
    return DTensorSpec._convert_shard_order_to_StridedShard(
        shard_order, tuple(placements), _MeshSizes(mesh_shape)
    )


def spec_to_order(spec: DTensorSpec) -> tuple[tuple[Placement, ...], tuple[tuple[int, tuple[int, ...]], ...]]:
    """(plain placements, shard order) of a spec, decoding `_StridedShard` if it carries the order."""
    if spec.use_strided_shard_as_shard_order:
        placements, shard_order = DTensorSpec._normalize_placements_into_shard_order(
            spec.placements, spec.mesh, use_strided_shard_as_shard_order=True
        )
    else:
        placements, shard_order = spec.placements, spec.shard_order
    return tuple(placements), tuple((e.tensor_dim, tuple(e.mesh_dims)) for e in shard_order)


def flattened_mesh(mesh: DeviceMesh, mesh_dims: tuple[int, ...]) -> DeviceMesh:
    """1-D mesh over `mesh_dims` (ascending); group rank = row-major over those coordinates.

    `DeviceMesh._flatten` needs dim names; it caches the result on the root mesh, so asking twice
    is cheap. Every rank must call this at the same point (it may create a process group).
    """
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            f"a one-shot collective over mesh dims {mesh_dims} needs a DeviceMesh with "
            "mesh_dim_names (to flatten them); name the mesh dims or plan with one_shot=False"
        )
    picked = tuple(names[d] for d in mesh_dims)
    return mesh[picked]._flatten("autoshard_" + "_".join(picked))


def wait(t: torch.Tensor) -> torch.Tensor:
    """Functional collectives may return an async wrapper; the executor wants the data."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A fake default process group of `world_size` ranks in this process (for LocalTensorMode
    simulation or planning at scale); destroyed on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def local_tensor(per_rank_values: dict[int, torch.Tensor]) -> torch.Tensor:
    """Build a LocalTensor (one value per simulated rank)."""
    return LocalTensor(per_rank_values)


def rank_values(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """Per-rank values of a LocalTensor."""
    return dict(t._local_tensors)


def torch_redistribute_steps(src: DTensorSpec, dst: DTensorSpec, use_graph: bool) -> list[tuple[tuple[int, ...], Placement, Placement]]:
    """(mesh dims, from, to) of each step torch's own redistribute would run: its greedy or graph
    planner, then its pass merging consecutive collectives onto existing flattened meshes."""
    from torch.distributed.tensor import _redistribute as rd

    infos = rd._gen_transform_infos_non_cached(src, dst, use_graph)
    infos = rd._optimize_transform_infos(infos, src.mesh, src.placements, dst.placements)
    return [(tuple(getattr(i, "original_mesh_dims", (i.mesh_dim,))), *i.src_dst_placements) for i in infos]
