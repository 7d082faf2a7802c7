"""Process groups and functional collectives: the groups of a mesh's dims (flattened when a
collective spans several), and the raw `_c10d_functional` ops the executor launches and waits on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from autoshard._torch_compat import legacy


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


def group_size(group: Any) -> int:
    """Size of the process group a collective op names: a ProcessGroup, or the registered group
    name functional collectives carry. c10d ops see the group boxed as a ScriptObject."""
    if isinstance(group, torch.ScriptObject):
        group = dist.ProcessGroup.unbox(group)
    if hasattr(group, "size"):
        return group.size()
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group).size()


def group_name(group: Any) -> str:
    """The name of the process group funcol would use for `group` ((mesh, dim) or a mesh)."""
    return str(funcol._resolve_group_name(group))


# Collectives the executor waits on at once, as the raw functional ops on a process group's name
# (`group_name`, resolved once, outside any compiled code): funcol's wrappers add an async-tensor
# wrapper through a custom autograd op (~40 us of Python per call on a CPU core) that a collective
# waited on where it runs does not need (the program's backward is its own).
_F = torch.ops._c10d_functional

WAIT_TENSOR = _F.wait_tensor.default  # returns its input (eager) or a fake copy


def all_gather_now(x: torch.Tensor, group_size: int, name: str) -> torch.Tensor:
    return _F.wait_tensor(_F.all_gather_into_tensor(x, group_size, name))


def reduce_scatter_now(x: torch.Tensor, op: str, group_size: int, name: str) -> torch.Tensor:
    return _F.wait_tensor(_F.reduce_scatter_tensor(x, op, group_size, name))


def all_reduce_now(x: torch.Tensor, op: str, name: str) -> torch.Tensor:
    return _F.wait_tensor(_F.all_reduce(x, op, name))


def all_to_all_now(x: torch.Tensor, out_splits: list[int], in_splits: list[int], name: str) -> torch.Tensor:
    return _F.wait_tensor(_F.all_to_all_single(x, out_splits, in_splits, name))


def chunk_cat(tensors: list[torch.Tensor], dim: int, chunks: int) -> torch.Tensor:
    """For `dim` 0, [chunks, total]: row i is chunk i of every tensor, flattened and concatenated (a
    bucket's buffer, FSDP2's reduce-scatter copy-in): one op and one kernel for the whole bucket,
    not a reshape per member and a cat. Every tensor non-empty. (Past dim 0 the chunk index goes
    inside the leading dims, which no bucket wants.)"""
    return torch._chunk_cat(tensors, dim, chunks)


if legacy.TORCH < (2, 12):  # 2.11's kernels refuse a non-contiguous input
    all_gather_now = legacy.dense_input(all_gather_now)
    reduce_scatter_now = legacy.dense_input(reduce_scatter_now)
    all_to_all_now = legacy.dense_input(all_to_all_now)

# funcol's one-tensor gather and reduce-scatter (async until `wait`): `*_single` since torch 2.13,
# where the older `*_tensor` names still work but warn; 2.11 and 2.12 have only those.
all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
reduce_scatter_single = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def all_gather_launch(x: torch.Tensor, group_size: int, name: str) -> torch.Tensor:
    """`all_gather_single` on dim 0 of the group named `name`, as the raw op: no group lookup and
    no async-tensor wrapper (a custom autograd op per call); in flight until `wait_launched`."""
    return _F.all_gather_into_tensor(x, group_size, name)


def reduce_scatter_launch(x: torch.Tensor, op: str, group_size: int, name: str) -> torch.Tensor:
    """`reduce_scatter_single` on dim 0 of the group named `name`, as `all_gather_launch`."""
    return _F.reduce_scatter_tensor(x, op, group_size, name)


def all_reduce_owned(t: torch.Tensor, op: str, name: str) -> torch.Tensor:
    """`funcol.all_reduce` of a buffer the caller owns, reduced in place on the group named `name`:
    the functional op copies its input first (a 25 MiB gradient bucket: 5-15 ms on a CPU rank).
    In flight until `wait_launched`."""
    return _F.all_reduce_(t, op, name)


def wait_launched(t: torch.Tensor) -> torch.Tensor:
    """The data of a collective launched above, once it has arrived."""
    return _F.wait_tensor(t)


def wait(t: torch.Tensor) -> torch.Tensor:
    """Functional collectives may return an async wrapper; the executor wants the data."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t
