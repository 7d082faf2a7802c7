"""Run a RedistributePlan on one rank's local tensor with torch functional collectives.

A collective waited on where it runs is issued as the raw functional op on its process group's name,
resolved when the plan is lowered (`group_names`): funcol's Python wrappers cost ~40 us a call on a
CPU core. Every step is built from differentiable pieces (the functional collective ops carry their
own autograd, and the local reshapes/narrows are ordinary ops), so the backward of each step is its
dual, the gradient of a replicated value being a partial sum (R <-> P): all-gather <->
reduce-scatter, all-to-all <-> all-to-all, permute <-> inverse permute, all-reduce <-> all-reduce,
and the local chunk / R->P steps <-> local zero-fill / mask (a partial gradient needs no
communication).

Collectives always run on dim 0 of a contiguous buffer: gathering or scattering another tensor dim
is one split (views) and one cat around that, one op each, since every op is host work on a GPU. A
step over several mesh dims runs on the flattened mesh of those dims (ascending, as torch builds
it); when the step's split order is not ascending, its chunks are reordered as a Python list
(chunk index = row-major over the split order), not as a tensor. The result is made dense in the
dim order the caller names (row-major by default): a traced `view` downstream needs the strides the
traced value had.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoshard import _torch_compat as tc
from autoshard.layout import split_digits
from autoshard.pricing.planner import RedistributePlan, Step
from autoshard.pricing.ring import COLLECTIVE_KINDS


def group_names(plan: RedistributePlan, mesh: Any) -> tuple[str | None, ...]:
    """The process group each step of `plan` runs on, by name (None for a local step): resolved
    once, where the plan is lowered, not per call (nor inside compiled code, which cannot)."""
    return tuple(
        tc.group_name(mesh_group(mesh, group_dims(step))) if step.kind in COLLECTIVE_KINDS else None
        for step in plan.steps
    )


def execute(
    plan: RedistributePlan,
    local_tensor: torch.Tensor,
    mesh: Any,
    dim_order: Sequence[int] | None = None,
    names: Sequence[str | None] | None = None,
) -> torch.Tensor:
    """Apply `plan` to this rank's shard of a tensor in layout `plan.src` on `mesh`
    (a DeviceMesh of the plan's mesh shape); return the shard in layout `plan.dst`, dense in
    `dim_order` (outermost dim first; None = row-major, i.e. contiguous). `names`: the steps'
    process groups (`group_names`; resolved here when not given)."""
    if tuple(mesh.shape) != plan.mesh_shape:
        raise ValueError(f"plan was made for mesh shape {plan.mesh_shape}, got a mesh of shape {tuple(mesh.shape)}")
    expected = plan.src.local_shape(plan.shape, plan.mesh_shape)
    if tuple(local_tensor.shape) != expected:
        raise ValueError(
            f"local tensor has shape {tuple(local_tensor.shape)}, but a {plan.shape} tensor in "
            f"layout {plan.src} on mesh {plan.mesh_shape} has local shape {expected}"
        )
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("this rank is not part of the mesh; it has no shard to redistribute")
    x = local_tensor
    for step, name in zip(plan.steps, names if names is not None else group_names(plan, mesh)):
        x = _RUN[step.kind](step, x, mesh, coord, name)
    return in_dim_order(x, dim_order)


@dataclass
class PendingBucket:
    """A bucket's collective in flight (`launch_bucket`): `finish_bucket` waits for it, splits the
    result per member and runs the rest of each plan. Between the two the rank computes on."""

    plans: list[RedistributePlan]
    result: torch.Tensor  # the collective's output; asynchronous until waited on
    parts: list[tuple[int, ...]]  # per member, the shape of its part of the buffer
    mesh: Any
    dim_orders: list[Sequence[int] | None]
    names: list[Sequence[str | None]]  # per member, its steps' process groups (`group_names`)


def launch_bucket(
    plans: Sequence[RedistributePlan],
    local_tensors: Sequence[torch.Tensor],
    mesh: Any,
    dim_orders: Sequence[Sequence[int] | None] | None = None,
    names: Sequence[Sequence[str | None]] | None = None,
) -> PendingBucket:
    """Start the first steps of several plans (all all-gathers, all reduce-scatters or all
    all-reduces, over the same mesh dims) as ONE collective on the concatenated buffers: what FSDP
    and DDP call a bucket, one launch and one synchronisation instead of one per tensor. Returns
    without waiting."""
    firsts = [plan.steps[0] for plan in plans]
    kind, phys = firsts[0].kind, group_dims(firsts[0])
    if kind not in _BUCKETED or any(f.kind != kind or group_dims(f) != phys for f in firsts):
        raise ValueError(f"a bucket needs one collective kind on one set of mesh dims, got {[str(f) for f in firsts]}")
    shape = tuple(mesh.shape)
    n = _group_size(shape, phys)
    names = list(names) if names is not None else [group_names(plan, mesh) for plan in plans]
    group = names[0][0]  # every member's first step runs on it
    if kind == "reduce_scatter":
        parts = [_chunk_shape(x.shape, f.tensor_dims[0], n) for f, x in zip(firsts, local_tensors)]
        result = tc.reduce_scatter_launch(_scattered_buffer(firsts, local_tensors, shape, n), "sum", n, group)
    else:
        parts = [tuple(x.shape) for x in local_tensors]
        flat = _flat_buffer(local_tensors)
        result = (
            tc.all_gather_launch(flat, n, group) if kind == "all_gather" else tc.all_reduce_owned(flat, "sum", group)
        )  # `flat` is ours: reduced in place
    orders = list(dim_orders) if dim_orders is not None else [None] * len(plans)
    return PendingBucket(list(plans), result, parts, mesh, orders, names)


def _flat_buffer(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """[1, total]: the tensors flattened and concatenated, in one op where `chunk_cat` takes them."""
    if all(x.dim() > 0 and x.numel() > 0 for x in xs):
        return tc.chunk_cat(list(xs), 0, 1)
    return torch.cat([x.reshape(-1) for x in xs]).view(1, -1)


def _scattered_buffer(
    firsts: Sequence[Step], xs: Sequence[torch.Tensor], mesh_shape: tuple[int, ...], n: int
) -> torch.Tensor:
    """[n, total] for a bucketed reduce-scatter: row i holds every member's chunk for group rank i.
    One `chunk_cat` when every member is cut along dim 0 in the group's own rank order (FSDP's
    gradients); otherwise each member's chunks stacked in rank order first."""
    phys = group_dims(firsts[0])
    if all(f.tensor_dims[0] == 0 and tuple(f.mesh_dims) == phys and x.numel() > 0 for f, x in zip(firsts, xs)):
        return tc.chunk_cat(list(xs), 0, n)
    stacked = [
        _stacked_chunks(x, f.tensor_dims[0], n, mesh_shape, f.mesh_dims, phys).view(n, -1) for f, x in zip(firsts, xs)
    ]
    return torch.cat(stacked, dim=1)


def finish_bucket(pending: PendingBucket) -> list[torch.Tensor]:
    """Wait for a launched bucket; each member's result, as `execute` gives it (values and strides)."""
    mesh, firsts = pending.mesh, [plan.steps[0] for plan in pending.plans]
    phys, shape = group_dims(firsts[0]), tuple(mesh.shape)
    n = _group_size(shape, phys)
    out = tc.wait_launched(pending.result)  # [n, total] gathered, [1, total] reduced
    sizes = [math.prod(part_shape) for part_shape in pending.parts]
    if firsts[0].kind == "all_gather":
        outs = _gathered_members(out, firsts, pending.parts, sizes, shape, n)
    else:
        outs = []
        for step, part_shape, part in zip(firsts, pending.parts, out.split(sizes, dim=1)):
            part = part.view(part_shape)
            outs.append(part / n if _reduce_op(step) == "avg" else part)
    coord = mesh.get_coordinate()
    for i, plan in enumerate(pending.plans):
        for step, name in zip(plan.steps[1:], pending.names[i][1:]):
            outs[i] = _RUN[step.kind](step, outs[i], mesh, coord, name)
        outs[i] = in_dim_order(outs[i], pending.dim_orders[i])
    return outs


def _gathered_members(
    out: torch.Tensor,
    firsts: Sequence[Step],
    parts: Sequence[tuple[int, ...]],
    sizes: list[int],
    mesh_shape: tuple[int, ...],
    n: int,
) -> list[torch.Tensor]:
    """Each member's n parts lie apart in the gathered [n, total] buffer: one copy kernel moves
    them all (FSDP2's copy-out), each member's into its n parts stacked on dim 0, a tensor that is
    already its result where it gathers dim 0 in the group's rank order (`_joined` leaves it)."""
    phys = group_dims(firsts[0])
    stacked, rows_of_parts = [], []
    for part, size in zip(parts, sizes):
        stacked.append(out.new_empty([n * part[0], *part[1:]]))
        rows_of_parts.append(stacked[-1].view(n, size))  # the same memory, as the copy writes it
    torch.split_with_sizes_copy(out, sizes, dim=1, out=rows_of_parts)
    return [
        _joined(s, part[0], mesh_shape, phys, step.mesh_dims, step.tensor_dims[0])
        for s, part, step in zip(stacked, parts, firsts)
    ]


def dim_order(t: torch.Tensor) -> tuple[int, ...]:
    """The tensor's dims from outermost (largest stride) to innermost: the order in which it is
    laid out in memory. A contiguous tensor gives (0, 1, ..., n-1)."""
    if t.is_contiguous():
        return tuple(range(t.dim()))
    return tuple(sorted(range(t.dim()), key=lambda d: -t.stride(d)))


def in_dim_order(x: torch.Tensor, order: Sequence[int] | None = None) -> torch.Tensor:
    """`x` itself if it is dense in `order` (outermost first; None = row-major), else a dense copy
    laid out in that order."""
    if order is None or tuple(order) == tuple(range(x.dim())):
        return x.contiguous()
    if _dense_in(x, order):
        return x
    dense = torch.empty_permuted(x.shape, list(order), dtype=x.dtype, device=x.device)
    return dense.copy_(x)  # two ops, not a permute, a copy and a permute back


def _dense_in(x: torch.Tensor, order: Sequence[int]) -> bool:
    """`x.permute(*order).is_contiguous()`, read off the strides (no op dispatched)."""
    if x.numel() == 0:
        return True
    expected = 1
    for d in reversed(order):
        if x.shape[d] != 1 and x.stride(d) != expected:
            return False
        expected *= x.shape[d]
    return True


# ---------------------------------------------------------------------------- helpers
def mesh_group(mesh: Any, dims: tuple[int, ...]) -> Any:
    """The group over mesh `dims` as functional collectives take it: (mesh, dim), or the flattened mesh."""
    return (mesh, dims[0]) if len(dims) == 1 else tc.flattened_mesh(mesh, dims)


def _group_size(mesh_shape: Sequence[int], dims: Sequence[int]) -> int:
    """Ranks in the group over mesh `dims` (a list for math.prod: dynamo cannot pass it a generator)."""
    return math.prod([mesh_shape[m] for m in dims])


def group_dims(step: Step) -> tuple[int, ...]:
    """The mesh dims of the process group a collective step runs on: ascending (the flattened
    mesh torch builds), except a permute, whose exchange is indexed in the step's own order."""
    return step.mesh_dims if step.kind == "permute" else tuple(sorted(step.mesh_dims))


def prepare_groups(plans: Sequence[RedistributePlan], mesh: Any) -> None:
    """Make every flattened process group the plans' steps will use, now and in one order, so that
    no step creates one mid-run: creating a group is a collective every rank must join at the same
    point, and a mesh cannot be flattened under fake tensors (a dry run)."""
    needed = {
        group_dims(step)
        for plan in plans
        for step in plan.steps
        if step.kind in COLLECTIVE_KINDS and len(step.mesh_dims) > 1
    }
    for dims in sorted(needed):
        mesh_group(mesh, dims)


def _reordered(chunks: list[torch.Tensor], mesh_shape: Sequence[int], src: Sequence[int], dst: Sequence[int]) -> list:
    """`chunks` indexed row-major over mesh dims `src`, indexed row-major over the same mesh dims in
    order `dst`: a permutation of the list, no op."""
    if tuple(src) == tuple(dst):
        return chunks
    src_sizes, dst_sizes = [mesh_shape[m] for m in src], [mesh_shape[m] for m in dst]
    out = []
    for j in range(len(chunks)):
        at = dict(zip(dst, split_digits(j, dst_sizes)))
        out.append(chunks[_ravel([at[m] for m in src], src_sizes)])
    return out


def _chunk_shape(shape: Sequence[int], dim: int, n: int) -> tuple[int, ...]:
    return tuple(s // n if i == dim else s for i, s in enumerate(shape))


def _stacked_chunks(
    x: torch.Tensor, dim: int, n: int, mesh_shape: Sequence[int], src: Sequence[int], dst: Sequence[int]
) -> torch.Tensor:
    """The n chunks of `x` along `dim` (indexed over mesh dims `src`), indexed over `dst` and
    stacked on dim 0 of one contiguous buffer: a collective's input. `x` itself (or a view of it)
    where its chunks already lie one after another in that order; otherwise one split (views) and
    one cat."""
    if tuple(src) == tuple(dst) and math.prod(x.shape[:dim]) == 1:  # the chunks lie one after another
        return x.contiguous() if dim == 0 else x.contiguous().view([n, *_chunk_shape(x.shape, dim, n)[1:]])
    return torch.cat(_reordered(list(x.split(x.shape[dim] // n, dim)), mesh_shape, src, dst))


def _joined(
    stacked: torch.Tensor, rows: int, mesh_shape: Sequence[int], src: Sequence[int], dst: Sequence[int], dim: int
) -> torch.Tensor:
    """Inverse of `_stacked_chunks`: `stacked` holds chunks of `rows` rows on dim 0, indexed over
    mesh dims `src`; they are concatenated along `dim` in their order over `dst`."""
    chunk, n = [rows, *stacked.shape[1:]], len(stacked) // rows
    if tuple(src) == tuple(dst) and math.prod(chunk[:dim]) == 1:  # the chunks lie one after another
        return stacked if dim == 0 else stacked.view(chunk[:dim] + [chunk[dim] * n] + chunk[dim + 1 :])
    return torch.cat(_reordered(list(stacked.split(rows)), mesh_shape, src, dst), dim)


def _reduce_op(step: Step) -> str:
    return step.src.placements[step.mesh_dims[0]].op


# ---------------------------------------------------------------------------- steps
def _all_gather(step: Step, x: torch.Tensor, mesh: Any, coord: Any, group: str | None) -> torch.Tensor:
    (d,) = step.tensor_dims
    phys = group_dims(step)
    gathered = tc.all_gather_now(x.contiguous(), _group_size(mesh.shape, phys), group)
    return _joined(gathered, x.shape[0], mesh.shape, phys, step.mesh_dims, d)


def _reduce_scatter(step: Step, x: torch.Tensor, mesh: Any, coord: Any, group: str | None) -> torch.Tensor:
    (d,) = step.tensor_dims
    phys = group_dims(step)
    n = _group_size(mesh.shape, phys)
    out = tc.reduce_scatter_now(_stacked_chunks(x, d, n, mesh.shape, step.mesh_dims, phys), "sum", n, group)
    return out / n if _reduce_op(step) == "avg" else out


def _all_reduce(step: Step, x: torch.Tensor, mesh: Any, coord: Any, group: str | None) -> torch.Tensor:
    phys = group_dims(step)
    n = _group_size(mesh.shape, phys)
    out = tc.all_reduce_now(x.contiguous(), "sum", group)
    return out / n if _reduce_op(step) == "avg" else out


def _all_to_all(step: Step, x: torch.Tensor, mesh: Any, coord: Any, group: str | None) -> torch.Tensor:
    a, b = step.tensor_dims
    phys = group_dims(step)
    n = _group_size(mesh.shape, phys)
    send = _stacked_chunks(x, b, n, mesh.shape, step.mesh_dims, phys)
    even = [send.shape[0] // n] * n
    recv = tc.all_to_all_now(send, even, even, group)
    return _joined(recv, send.shape[0] // n, mesh.shape, phys, step.mesh_dims, a)


def _permute(step: Step, x: torch.Tensor, mesh: Any, coord: Any, group: str | None) -> torch.Tensor:
    (d,) = step.tensor_dims
    phys = group_dims(step)
    n = _group_size(mesh.shape, phys)
    src_order, dst_order = dict(step.src.order)[d], dict(step.dst.order)[d]
    splits = _permute_splits(
        tuple(coord[m] for m in phys), tuple(mesh.shape), phys, src_order, dst_order, x.shape[0]
    )  # whole rows: the shard goes to one rank, in one piece
    return tc.all_to_all_now(x.contiguous(), splits[n:], splits[:n], group)


@tc.per_rank
def _permute_splits(
    coords: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    phys: tuple[int, ...],
    src_order: tuple[int, ...],
    dst_order: tuple[int, ...],
    rows: int,
) -> list[int]:
    """all_to_all split sizes (input splits, then output splits) for this rank's permute: send the
    whole shard to the rank that holds the same chunk in the destination order, receive from the
    rank that holds our destination chunk in the source order."""
    mine = dict(zip(phys, coords))

    def index(order: tuple[int, ...], c: dict[int, int]) -> int:
        return _ravel([c[m] for m in order], [mesh_shape[m] for m in order])

    def rank_with(order: tuple[int, ...], chunk: int) -> int:
        c = dict(zip(order, split_digits(chunk, [mesh_shape[m] for m in order])))
        return _ravel([c[m] for m in phys], [mesh_shape[m] for m in phys])

    n = math.prod([mesh_shape[m] for m in phys])
    send, recv = [0] * n, [0] * n
    send[rank_with(dst_order, index(src_order, mine))] = rows
    recv[rank_with(src_order, index(dst_order, mine))] = rows
    return send + recv


def _ravel(coords: Sequence[int], sizes: Sequence[int]) -> int:
    i = 0
    for c, s in zip(coords, sizes):
        i = i * s + c
    return i


def _chunk(step: Step, x: torch.Tensor, mesh: Any, coord: Any, group: str | None) -> torch.Tensor:
    (d,), (m,) = step.tensor_dims, step.mesh_dims
    size = x.shape[d] // mesh.shape[m]
    if not isinstance(coord[m], int):  # simulated ranks (LocalTensorMode): narrow takes no per-rank start
        return x.index_select(d, torch.arange(size, device=x.device) + coord[m] * size)
    return torch.narrow(x, d, coord[m] * size, size).contiguous()


def _to_partial(step: Step, x: torch.Tensor, mesh: Any, coord: Any, group: str | None) -> torch.Tensor:
    """R -> P: sum keeps the value on coordinate 0 and zeros elsewhere (exact, unlike v/n);
    avg keeps the value everywhere."""
    (m,) = step.mesh_dims
    if step.dst.placements[m].op == "avg":
        return x
    keep = (torch.arange(mesh.shape[m], device=x.device) == 0).to(x.dtype)
    return x * torch.narrow(keep, 0, coord[m], 1).reshape(())


def _reorder(step: Step, x: torch.Tensor, mesh: Any, coord: Any, group: str | None) -> torch.Tensor:
    return x


_RUN = {
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_reduce": _all_reduce,
    "all_to_all": _all_to_all,
    "permute": _permute,
    "chunk": _chunk,
    "to_partial": _to_partial,
    "reorder": _reorder,
}

_BUCKETED = ("all_gather", "reduce_scatter", "all_reduce")
