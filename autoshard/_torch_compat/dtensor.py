"""DTensor's internals: specs and placements, the shard order and its `_StridedShard` encoding,
DTensors built from local shards, torch's own redistribute planner, and the strategy registry
(with the redistribution prices its strategy functions compute, switched off while we enumerate).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import (
    DTensorSpec as DTensorSpec,
)
from torch.distributed.tensor._dtensor_spec import (
    ShardOrderEntry as ShardOrderEntry,
)
from torch.distributed.tensor._dtensor_spec import (
    TensorMeta as TensorMeta,
)
from torch.distributed.tensor._op_schema import (
    OpSchema as OpSchema,
)
from torch.distributed.tensor._op_schema import (
    OpSpec as OpSpec,
)
from torch.distributed.tensor._op_schema import (
    OpStrategy as OpStrategy,
)
from torch.distributed.tensor._op_schema import (
    TupleStrategy as TupleStrategy,
)
from torch.distributed.tensor._ops import single_dim_strategy as _sds
from torch.distributed.tensor._ops import utils as _ops_utils
from torch.distributed.tensor.placement_types import (
    Partial as Partial,
)
from torch.distributed.tensor.placement_types import (
    Placement,
)
from torch.distributed.tensor.placement_types import (
    Replicate as Replicate,
)
from torch.distributed.tensor.placement_types import (
    Shard as Shard,
)
from torch.distributed.tensor.placement_types import (
    _StridedShard as _StridedShard,
)

from autoshard._torch_compat import legacy
from autoshard._torch_compat.runtime import no_dispatch_modes


# ---------------------------------------------------------------- shard order (layout.py)
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
    return DTensorSpec._convert_shard_order_to_StridedShard(shard_order, tuple(placements), _MeshSizes(mesh_shape))


def spec_to_order(spec: DTensorSpec) -> tuple[tuple[Placement, ...], tuple[tuple[int, tuple[int, ...]], ...]]:
    """(plain placements, shard order) of a spec, decoding `_StridedShard` if it carries the order."""
    if spec.use_strided_shard_as_shard_order:
        placements, shard_order = DTensorSpec._normalize_placements_into_shard_order(
            spec.placements, spec.mesh, use_strided_shard_as_shard_order=True
        )
    else:
        placements, shard_order = spec.placements, spec.shard_order
    return tuple(placements), tuple((e.tensor_dim, tuple(e.mesh_dims)) for e in shard_order)


def torch_redistribute_steps(
    src: DTensorSpec, dst: DTensorSpec, use_graph: bool
) -> list[tuple[tuple[int, ...], Placement, Placement]]:
    """(mesh dims, from, to) of each step torch's own redistribute would run: its greedy or graph
    planner, then its pass merging consecutive collectives onto existing flattened meshes."""
    from torch.distributed.tensor import _redistribute as rd

    infos = rd._gen_transform_infos_non_cached(src, dst, use_graph)
    infos = rd._optimize_transform_infos(infos, src.mesh, src.placements, dst.placements)
    return [(tuple(getattr(i, "original_mesh_dims", (i.mesh_dim,))), *i.src_dst_placements) for i in infos]


# ---------------------------------------------------------------- DTensors from local shards (runtime/)
def dtensor_from_local(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], global_shape: Sequence[int]
) -> DTensor:
    """Wrap this rank's shard as a DTensor without communication. The global shape and stride are
    given: torch cannot infer them for `_StridedShard` placements."""
    stride, acc = [], 1
    for size in reversed(global_shape):
        stride.append(acc)
        acc *= size
    return DTensor.from_local(
        local, mesh, tuple(placements), run_check=False, shape=torch.Size(global_shape), stride=tuple(reversed(stride))
    )


def local_of(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard as it is stored, outside autograd (`to_local` records a backward)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def dtensor_like(like: DTensor, local: torch.Tensor) -> DTensor:
    """`local` as a DTensor of `like`'s mesh, placements and global shape (a gradient in its
    parameter's layout), built directly: `from_local` is an autograd op with checks."""
    return DTensor(local, like._spec, requires_grad=False)


def distribute_local(full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """This rank's shard of `full` (which every rank holds): cut locally, no communication.
    `src_data_rank=None` also keeps `_StridedShard` rows right under LocalTensorMode."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, mesh, tuple(placements), src_data_rank=None).to_local()


# ---------------------------------------------------------------- the strategy registry (strategies/)
def strategy_mesh(mesh_shape: tuple[int, ...]) -> DeviceMesh:
    """A DeviceMesh of `mesh_shape` that needs no process group: strategy functions only ask a
    mesh for its shape, so planning can use any number of mesh shapes in one process."""
    with no_dispatch_modes():
        ranks = torch.arange(max(1, math.prod(mesh_shape)), dtype=torch.int).reshape(mesh_shape)
        return DeviceMesh("cpu", ranks, _init_backend=False, _rank=0)


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(t.shape, t.stride(), t.dtype)


def registry_entry(op: Any) -> tuple[str, Any, Any]:
    """("single" | "multi" | "none", strategy, RuntimeSchemaInfo) for an aten overload. DTensor
    prefers the single-dim registration when an op has both; so do we."""
    prop = DTensor._op_dispatcher.sharding_propagator
    info = prop.op_single_dim_strategy_funcs.get(op)
    if info is not None:
        return "single", info, prop.op_to_schema_info_for_single_dim_strategy.get(op)
    func = prop.op_strategy_funcs.get(op)
    if func is not None:
        return "multi", func, prop.op_to_schema_info.get(op)
    return "none", None, None


def single_dim_rules(info: Any, schema: OpSchema, out_meta: Any) -> list[list[Any]]:
    """torch's own per-mesh-dim rule list ([outputs..., inputs...] placements, placeholders
    filled, the all-Replicate rule inserted) for one op call. Placeholders are filled from the
    input placements in `schema`, so give at least one input a `Shard` placement."""
    return _sds._PreparedSingleDimStrategy(info, schema, out_meta).expanded_strategies


if not hasattr(_sds, "_PreparedSingleDimStrategy"):  # torch 2.11
    single_dim_rules = legacy.single_dim_rules_2_11

if legacy.TORCH < (2, 13):  # torch's reduction rule, as 2.13 judges each input candidate
    legacy.reductions_per_candidate()


# DTensor's redistribute price, switched off per thread while autoshard enumerates strategies.
_no_cost = threading.local()  # .depth: how many no_redistribute_costs() blocks this thread is in
_patch_lock = threading.Lock()
_patch = {"users": 0, "saved": None}  # guarded by _patch_lock: open blocks (any thread), torch's function


def _redistribute_cost(src: DTensorSpec, dst: DTensorSpec) -> float:
    if getattr(_no_cost, "depth", 0):
        return 0.0
    return _patch["saved"](src, dst)


@contextlib.contextmanager
def no_redistribute_costs() -> Iterator[None]:
    """Inside this block, in this thread, DTensor's strategy functions price redistributions at 0.

    Multi-dim strategy functions price every (candidate -> required) redistribution of their
    inputs with `_ops.utils.redistribute_cost`, quadratic in the candidate count. autoshard
    ignores those prices (its planner prices edges), and computing them makes the 8B (8,8) build
    ~1 s (50%) slower. torch 2.13 has no argument or flag to skip them: strategy functions call
    `generate_redistribute_costs`, which looks the module global `redistribute_cost` up at call
    time, so replacing that global is the only way. (Its cheapest exit, a mesh this rank is not
    part of, still costs ~5 µs a call and would change what `get_coordinate` tells torch.)

    To keep the replacement safe, it is installed only while some thread is inside such a block
    (the last one out restores torch's function), and it returns 0 only to threads inside one:
    every other caller, meanwhile, gets torch's price. Blocks nest."""
    with _patch_lock:
        if _patch["users"] == 0:
            _patch["saved"] = _ops_utils.redistribute_cost
            _ops_utils.redistribute_cost = _redistribute_cost
        _patch["users"] += 1
    _no_cost.depth = getattr(_no_cost, "depth", 0) + 1
    try:
        yield
    finally:
        _no_cost.depth -= 1
        with _patch_lock:
            _patch["users"] -= 1
            if _patch["users"] == 0:
                if _ops_utils.redistribute_cost is _redistribute_cost:
                    _ops_utils.redistribute_cost = _patch["saved"]
                # "saved" stays: a thread that looked the wrapper up just before the restore still
                # reaches torch's function through it
