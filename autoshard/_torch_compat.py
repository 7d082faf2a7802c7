"""The one place autoshard touches private torch APIs (torch 2.11 through 2.14).

Everything here may move between torch releases; keeping it in one place means one place to fix.
Two sibling modules hold parts of it, and only this module imports them: `_torch_compat_runtime`
(what `runtime/` needs, re-exported here) and `_torch_compat_legacy` (the torch 2.11 and 2.12
shims); a third, `_torch_compat_checkpoint`, holds DCP's reader and planner without their
unrestricted unpicklers (re-exported here). Every caller imports this module alone
(`from autoshard import _torch_compat as tc`).
The code reads as for torch 2.13 and 2.14; what 2.11 and 2.12 lack or do differently is made up
for in the last section (and by the `*_single` collectives' fallback).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._functorch._aot_autograd import descriptors as _desc
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._op_schema import OpSchema
from torch.distributed.tensor._op_schema import (
    OpSpec as OpSpec,
    OpStrategy as OpStrategy,
    TupleStrategy as TupleStrategy,
)
from torch.distributed.tensor._ops import utils as _ops_utils
from torch.distributed.tensor._ops import single_dim_strategy as _sds
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode, _disable_current_modes
from torch.distributed._local_tensor import (
    LocalTensor,
    LocalTensorMode,
    maybe_run_for_local_tensor,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta
from torch.distributed.tensor.placement_types import (
    Partial as Partial,
    Placement,
    Replicate as Replicate,
    Shard as Shard,
    _StridedShard as _StridedShard,
)

from autoshard import _torch_compat_legacy as _legacy

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


def op_call(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(name without namespace, {schema argument name: value}) of one dispatched op call."""
    schema = func._schema
    return schema.name.split("::")[-1], dict(zip((a.name for a in schema.arguments), args)) | kwargs


def call_arguments(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """{schema argument name: value} of one op call, defaults filled in."""
    schema = op._schema
    defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    return defaults | dict(zip((a.name for a in schema.arguments), args)) | kwargs


# Collectives the executor waits on at once, as the raw functional ops on a process group's name
# (`group_name`, resolved once, outside any compiled code): funcol's wrappers add an async-tensor
# wrapper through a custom autograd op (~40 us of Python per call on a CPU core) that a collective
# waited on where it runs does not need (the program's backward is its own).
_F = torch.ops._c10d_functional


def group_name(group: Any) -> str:
    """The name of the process group funcol would use for `group` ((mesh, dim) or a mesh)."""
    return str(funcol._resolve_group_name(group))


def all_gather_now(x: torch.Tensor, group_size: int, name: str) -> torch.Tensor:
    return _F.wait_tensor(_F.all_gather_into_tensor(x, group_size, name))


def reduce_scatter_now(x: torch.Tensor, op: str, group_size: int, name: str) -> torch.Tensor:
    return _F.wait_tensor(_F.reduce_scatter_tensor(x, op, group_size, name))


def all_reduce_now(x: torch.Tensor, op: str, name: str) -> torch.Tensor:
    return _F.wait_tensor(_F.all_reduce(x, op, name))


def all_to_all_now(x: torch.Tensor, out_splits: list[int], in_splits: list[int], name: str) -> torch.Tensor:
    return _F.wait_tensor(_F.all_to_all_single(x, out_splits, in_splits, name))


# funcol's one-tensor gather and reduce-scatter (async until `wait`): `*_single` since torch 2.13,
# where the older `*_tensor` names still work but warn; 2.11 and 2.12 have only those.
all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
reduce_scatter_single = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def all_gather_launch(x: torch.Tensor, group_size: int, name: str) -> torch.Tensor:
    """`all_gather_single` on dim 0 of the group named `name`, without funcol's group lookup and
    wrapper (a bucket's launch); waited on by `wait`."""
    return funcol._maybe_wrap_tensor(_F.all_gather_into_tensor(x, group_size, name))


def reduce_scatter_launch(x: torch.Tensor, op: str, group_size: int, name: str) -> torch.Tensor:
    """`reduce_scatter_single` on dim 0 of the group named `name`, as `all_gather_launch`."""
    return funcol._maybe_wrap_tensor(_F.reduce_scatter_tensor(x, op, group_size, name))


def all_reduce_owned(t: torch.Tensor, op: str, name: str) -> torch.Tensor:
    """`funcol.all_reduce` of a buffer the caller owns, reduced in place on the group named `name`:
    the functional op copies its input first (a 25 MiB gradient bucket: 5-15 ms on a CPU rank).
    Waited on by `wait`."""
    return funcol._maybe_wrap_tensor(_F.all_reduce_(t, op, name))


def wait(t: torch.Tensor) -> torch.Tensor:
    """Functional collectives may return an async wrapper; the executor wants the data."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """A fake default process group of `world_size` ranks in this process, seen from `rank` (for
    LocalTensorMode simulation, planning at scale, or one rank's dry run); destroyed on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def local_tensor_mode(world_size: int) -> LocalTensorMode:
    """Simulate `world_size` ranks in this process: tensors made inside hold one value per rank
    (`mode.disable()` for code that must compute one global value)."""
    return LocalTensorMode(world_size)


def local_tensor(per_rank_values: dict[int, torch.Tensor]) -> torch.Tensor:
    """Build a LocalTensor (one value per simulated rank)."""
    return LocalTensor(per_rank_values)


def rank_values(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """Per-rank values of a LocalTensor."""
    return dict(t._local_tensors)


def torch_redistribute_steps(
    src: DTensorSpec, dst: DTensorSpec, use_graph: bool
) -> list[tuple[tuple[int, ...], Placement, Placement]]:
    """(mesh dims, from, to) of each step torch's own redistribute would run: its greedy or graph
    planner, then its pass merging consecutive collectives onto existing flattened meshes."""
    from torch.distributed.tensor import _redistribute as rd

    infos = rd._gen_transform_infos_non_cached(src, dst, use_graph)
    infos = rd._optimize_transform_infos(infos, src.mesh, src.placements, dst.placements)
    return [(tuple(getattr(i, "original_mesh_dims", (i.mesh_dim,))), *i.src_dst_placements) for i in infos]


# ---------------------------------------------------------------- tracing (capture/trace.py)
def new_fake_mode(*, allow_non_fake_inputs: bool = False) -> FakeTensorMode:
    return FakeTensorMode(allow_non_fake_inputs=allow_non_fake_inputs)


def lazy_graph_module(
    root: torch.nn.Module | dict[str, Any], graph: torch.fx.Graph, class_name: str = "GraphModule"
) -> torch.fx.GraphModule:
    """A GraphModule that writes its Python code on first use: planning and dry runs only walk
    the graph, and generating code for llama3-8b's 7,400 nodes costs ~0.4 s (70B's program
    ~1.5 s per dry run)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(root, graph, class_name)


def write_code(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` with its Python code written now: a lazy GraphModule writes it on its first call, and
    torch.compile would trace that call as a graph break."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    _LazyGraphModule.force_recompile(gm)
    return gm


def export_joint(stack, module, args):
    """torch's joint forward+backward export with input/output descriptors."""
    return aot_export_joint_with_descriptors(stack, module, args)


def dynamo_capture(module, args) -> torch.fx.GraphModule:
    """Dynamo's whole-graph capture of `module(*args)` for export (torch 2.13 has no public name
    for it). Code that checks for dynamo tracing (transformers' masks) takes its traced branch.
    Dynamo's note about side effects it does not replay (transformers' output collectors) is
    silenced: the captured graph is only traced further, never run in their place. So are the
    forward's log calls (transformers' `logger.warning_once` in GPT-2's loss): dynamo stops at a
    Logger method it is not told to skip, and nothing logged belongs in the graph."""
    import logging
    import warnings

    from torch._dynamo.functional_export import dynamo_graph_capture_for_export

    emits = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}
    loggers = {
        fn
        for name, fn in vars(logging.Logger).items()
        if callable(fn) and (name in emits or "once" in name or "advice" in name)  # transformers adds the last two
    }
    with (
        warnings.catch_warnings(),
        torch._dynamo.config.patch(ignore_logging_functions=torch._dynamo.config.ignore_logging_functions | loggers),
    ):
        warnings.filterwarnings("ignore", message="While compiling, we found certain side effects")
        return dynamo_graph_capture_for_export(module)(*args)


def observed_user_error(err: BaseException) -> str | None:
    """'ValueError(...)' when dynamo's capture failed because the user's code raised it (dynamo
    reports it as 'Observed exception', the original only as its cause's text); else None."""
    import re

    from torch._dynamo.exc import ObservedException

    cause = err.__cause__
    if not isinstance(cause, ObservedException):
        return None
    match = re.fullmatch(r"raised exception (.*)", str(cause), flags=re.S)
    return match[1] if match else str(cause)


def describe_input(desc) -> tuple[str, str | int | None]:
    """('param'|'buffer'|'input'|'tangent'|'other', name or index) for a placeholder descriptor."""
    if isinstance(desc, _desc.ParamAOTInput):
        return "param", desc.target
    if isinstance(desc, _desc.BufferAOTInput):
        return "buffer", desc.target
    if isinstance(desc, _desc.PlainAOTInput):
        return "input", desc.idx
    if isinstance(desc, _desc.TangentAOTInput):
        return "tangent", None
    return "other", None


def describe_output(desc) -> tuple[str, str | int | None]:
    """('output'|'grad'|'other', name or index) for an output descriptor."""
    if isinstance(desc, _desc.PlainAOTOutput):
        return "output", desc.idx
    if isinstance(desc, _desc.GradAOTOutput):
        inner = desc.grad_of
        if isinstance(inner, _desc.ParamAOTInput):
            return "grad", inner.target
        return "other", None
    return "other", None


# ---------------------------------------------------------------- DTensor's strategy registry (strategies/)
def strategy_mesh(mesh_shape: tuple[int, ...]) -> DeviceMesh:
    """A DeviceMesh of `mesh_shape` that needs no process group: strategy functions only ask a
    mesh for its shape, so planning can use any number of mesh shapes in one process."""
    with no_dispatch_modes():
        ranks = torch.arange(max(1, math.prod(mesh_shape)), dtype=torch.int).reshape(mesh_shape)
        return DeviceMesh("cpu", ranks, _init_backend=False, _rank=0)


def no_dispatch_modes() -> contextlib.AbstractContextManager:
    """Leave any active fake/local tensor mode (a traced graph's fake mode stays active while its
    ExitStack is open): strategy functions and meshes need plain tensors."""
    return _disable_current_modes()


# torch has no public pytree module; its private one is what every torch API flattens with.
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten  # noqa: E402,F401


def non_persistent_buffer_names(module: torch.nn.Module) -> set[str]:
    """FQNs of the buffers `module` (or a submodule) registered with persistent=False: only the
    private per-module set records it."""
    return {
        f"{prefix}.{b}" if prefix else b for prefix, m in module.named_modules() for b in m._non_persistent_buffers_set
    }


@contextlib.contextmanager
def truncated_module_list(blocks: torch.nn.ModuleList, keep: int) -> Iterator[None]:
    """Temporarily keep only the first `keep` entries of `blocks`, the same objects (no copies)."""
    saved = blocks._modules
    blocks._modules = dict(list(saved.items())[:keep])
    try:
        yield
    finally:
        blocks._modules = saved


def is_op_overload(op: Any) -> bool:
    """Whether a graph node's target is an op overload (`aten.mm.default`, a custom library op),
    the only kind of target DTensor's registries know."""
    return isinstance(op, torch._ops.OpOverload)


def returns_alias(op: Any) -> bool:
    """Whether an op overload's first return aliases an input (a view): no kernel runs."""
    schema = getattr(op, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def shares_input_storage(op: Any) -> bool:
    """Whether an op's output is its (first) input's storage: views by their schema, and
    `_unsafe_view`, whose schema does not say so (it relabels the fresh output of the op before it)."""
    return op is torch.ops.aten._unsafe_view.default or returns_alias(op)


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
    if not hasattr(_sds, "_PreparedSingleDimStrategy"):  # torch 2.11
        return _legacy.single_dim_rules_2_11(info, schema, out_meta)
    return _sds._PreparedSingleDimStrategy(info, schema, out_meta).expanded_strategies


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


# ---------------------------------------------------------------- parallel module, dry run, compiled program
# (runtime/, and program/attention.py's kernel): defined in _torch_compat_runtime, re-exported as `tc.<name>`
from autoshard._torch_compat_runtime import (  # noqa: E402
    dtensor_from_local as dtensor_from_local,
    local_of as local_of,
    dtensor_like as dtensor_like,
    distribute_local as distribute_local,
    DispatchMode as DispatchMode,
    WAIT_TENSOR as WAIT_TENSOR,
    fake_mode_of as fake_mode_of,
    make_fake_tensors as make_fake_tensors,
    mem_tracker as mem_tracker,
    tracker_total as tracker_total,
    dispatch_mode_blocks_compile as dispatch_mode_blocks_compile,
    dynamo_counts as dynamo_counts,
    inductor_unavailable as inductor_unavailable,
    sdpa_backend as sdpa_backend,
)


# ---------------------------------------------------------------- checkpoints read without running their pickles
# (train/): defined in _torch_compat_checkpoint, re-exported here as `tc.<name>`
from autoshard._torch_compat_checkpoint import (  # noqa: E402
    dcp_reader as dcp_reader,
    dcp_planner as dcp_planner,
)

# ---------------------------------------------------------------- torch 2.11 and 2.12 (drop with their support)
# the shims live in _torch_compat_legacy; applied here, where the names they replace are bound
if _legacy.TORCH < (2, 13):
    _legacy.reductions_per_candidate()
    _legacy.config_logging_without_functions()
    mem_tracker = _legacy.mem_tracker_2_12
if _legacy.TORCH < (2, 12):
    _legacy.teach_dynamo_mesh_shape()
    all_gather_now, reduce_scatter_now, all_to_all_now = map(
        _legacy.dense_input, (all_gather_now, reduce_scatter_now, all_to_all_now)
    )
