"""Run a RedistributePlan on one rank's local tensor with torch functional collectives.

A collective waited on where it runs is issued as the raw functional op on its process group's name,
resolved when the plan is lowered (`group_names`): funcol's Python wrappers cost ~40 us a call on a
CPU core. Every step is built from differentiable pieces (the functional collective ops carry their
own autograd, and the local reshapes/narrows are ordinary ops), so the backward of each step is its
dual, the gradient of a replicated value being a partial sum (R <-> P): all-gather <->
reduce-scatter, all-to-all <-> all-to-all, permute <-> inverse permute, all-reduce <-> all-reduce,
and the local chunk / R->P steps <-> local zero-fill / mask (a partial gradient needs no
communication).

Collectives always run on dim 0 of a contiguous buffer; gathering or scattering another tensor dim
is a reshape/movedim around that, which can leave a strided view. So the result is always made dense
in the dim order the caller names (row-major by default): a traced `view` downstream needs the
strides the traced value had, not whatever the last movedim left. A step over several mesh dims runs
on the flattened mesh of those dims (ascending, as torch builds it); when the step's split order is
not ascending, the chunks are permuted locally so that chunk index = row-major over the split order.
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
        tc.group_name(_group(mesh, group_dims(step))) if step.kind in COLLECTIVE_KINDS else None for step in plan.steps
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
        chunks = [
            _reindex(_split(x, f.tensor_dims[0], n), shape, f.mesh_dims, phys) for f, x in zip(firsts, local_tensors)
        ]
        parts = [tuple(c.shape[1:]) for c in chunks]
        flat = torch.cat([c.reshape(n, -1) for c in chunks], dim=1).reshape(-1)
        result = tc.reduce_scatter_launch(flat, "sum", n, group)
    else:
        parts = [tuple(x.shape) for x in local_tensors]
        flat = torch.cat([x.reshape(-1) for x in local_tensors])
        result = (
            tc.all_gather_launch(flat, n, group) if kind == "all_gather" else tc.all_reduce_owned(flat, "sum", group)
        )  # `flat` is ours: reduced in place
    orders = list(dim_orders) if dim_orders is not None else [None] * len(plans)
    return PendingBucket(list(plans), result, parts, mesh, orders, names)


def finish_bucket(pending: PendingBucket) -> list[torch.Tensor]:
    """Wait for a launched bucket; each member's result, as `execute` gives it (values and strides)."""
    mesh, firsts = pending.mesh, [plan.steps[0] for plan in pending.plans]
    phys, shape = group_dims(firsts[0]), tuple(mesh.shape)
    n = _group_size(shape, phys)
    out = tc.wait(pending.result)
    sizes = [math.prod(part_shape) for part_shape in pending.parts]
    outs: list[torch.Tensor] = []
    if firsts[0].kind == "all_gather":
        # each member's n parts lie apart in the gathered [n, total] buffer: one copy kernel moves
        # every member's into a dense [n, size] of its own (FSDP2's copy-out), not one per member
        pieces = [out.new_empty((n, size)) for size in sizes]
        torch.split_with_sizes_copy(out.view(n, -1), sizes, dim=1, out=pieces)
        for step, part_shape, piece in zip(firsts, pending.parts, pieces):
            part = piece.view([n, *part_shape])
            outs.append(_merge(_reindex(part, shape, phys, step.mesh_dims), step.tensor_dims[0]))
    else:
        for step, part_shape, part in zip(firsts, pending.parts, out.split(sizes)):
            part = part.view(part_shape)
            outs.append(part / n if _reduce_op(step) == "avg" else part)
    coord = mesh.get_coordinate()
    for i, plan in enumerate(pending.plans):
        for step, name in zip(plan.steps[1:], pending.names[i][1:]):
            outs[i] = _RUN[step.kind](step, outs[i], mesh, coord, name)
        outs[i] = in_dim_order(outs[i], pending.dim_orders[i])
    return outs


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
    inverse = sorted(range(len(order)), key=lambda i: order[i])
    return x.permute(*order).contiguous().permute(*inverse)


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
def _group(mesh: Any, dims: tuple[int, ...]) -> Any:
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
        _group(mesh, dims)


def _reindex(chunks: torch.Tensor, mesh_shape: Sequence[int], src: Sequence[int], dst: Sequence[int]) -> torch.Tensor:
    """`chunks` is [N, ...] indexed row-major over mesh dims `src`; return it indexed row-major
    over the same mesh dims in order `dst`."""
    if tuple(src) == tuple(dst):
        return chunks
    k = len(src)
    rest = list(chunks.shape[1:])
    grid = chunks.reshape([mesh_shape[m] for m in src] + rest)
    grid = grid.permute([list(src).index(m) for m in dst] + list(range(k, k + len(rest))))
    return grid.reshape([-1] + rest)


def _split(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """[n, ...]: the n chunks of `x` along `dim`."""
    shape = list(x.shape)
    chunks = x.reshape(shape[:dim] + [n, shape[dim] // n] + shape[dim + 1 :])
    return chunks if dim == 0 else chunks.movedim(dim, 0)  # (a no-op movedim still dispatches a permute)


def _merge(chunks: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of `_split`: concatenate the leading chunk axis into `dim`."""
    moved = chunks if dim == 0 else chunks.movedim(0, dim)
    shape = list(moved.shape)
    return moved.reshape(shape[:dim] + [shape[dim] * shape[dim + 1]] + shape[dim + 2 :])


def _stacked(x: torch.Tensor) -> torch.Tensor:
    """[N, a, b, ...] -> contiguous [N*a, b, ...], the dim-0 buffer collectives take."""
    return x.reshape([x.shape[0] * x.shape[1]] + list(x.shape[2:]))


def _reduce_op(step: Step) -> str:
    return step.src.placements[step.mesh_dims[0]].op


# ---------------------------------------------------------------------------- steps
def _all_gather(step: Step, x: torch.Tensor, mesh: Any, coord: Any, group: str | None) -> torch.Tensor:
    (d,) = step.tensor_dims
    phys = group_dims(step)
    n = _group_size(mesh.shape, phys)
    gathered = tc.all_gather_now(x.contiguous(), n, group)
    chunks = _reindex(gathered.reshape([n] + list(x.shape)), mesh.shape, phys, step.mesh_dims)
    return _merge(chunks, d)


def _reduce_scatter(step: Step, x: torch.Tensor, mesh: Any, coord: Any, group: str | None) -> torch.Tensor:
    (d,) = step.tensor_dims
    phys = group_dims(step)
    n = _group_size(mesh.shape, phys)
    chunks = _reindex(_split(x, d, n), mesh.shape, step.mesh_dims, phys)
    out = tc.reduce_scatter_now(_stacked(chunks), "sum", n, group)
    out = out.reshape(chunks.shape[1:])
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
    send = _reindex(_split(x, b, n), mesh.shape, step.mesh_dims, phys)
    stacked = _stacked(send)
    even = [stacked.shape[0] // n] * n
    recv = tc.all_to_all_now(stacked, even, even, group)
    recv = _reindex(recv.reshape(send.shape), mesh.shape, phys, step.mesh_dims)
    return _merge(recv, a)


def _permute(step: Step, x: torch.Tensor, mesh: Any, coord: Any, group: str | None) -> torch.Tensor:
    (d,) = step.tensor_dims
    phys = group_dims(step)
    n = _group_size(mesh.shape, phys)
    src_order, dst_order = dict(step.src.order)[d], dict(step.dst.order)[d]
    splits = _permute_splits(tuple(coord[m] for m in phys), tuple(mesh.shape), phys, src_order, dst_order, x.numel())
    return tc.all_to_all_now(x.contiguous().reshape(-1), splits[n:], splits[:n], group).reshape(x.shape)


@tc.per_rank
def _permute_splits(
    coords: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    phys: tuple[int, ...],
    src_order: tuple[int, ...],
    dst_order: tuple[int, ...],
    numel: int,
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
    send[rank_with(dst_order, index(src_order, mine))] = numel
    recv[rank_with(src_order, index(dst_order, mine))] = numel
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
