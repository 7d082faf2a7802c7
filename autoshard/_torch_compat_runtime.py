"""The private torch APIs `runtime/` needs: DTensors built from local shards, the dry run's fake
tensors and memory tracker, and what tells whether torch.compile traced a program as one graph.

Split out of `_torch_compat` to keep each file short; only `_torch_compat` imports this module and
re-exports every name here, so callers keep writing `tc.<name>` (and the torch 2.11/2.12 shims in
`_torch_compat` still rebind `tc.mem_tracker`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement
from torch.utils._python_dispatch import TorchDispatchMode


# ---------------------------------------------------------------- parallel module (runtime/module.py)
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


# ---------------------------------------------------------------- dry run (runtime/dryrun.py)
DispatchMode = TorchDispatchMode  # base class of a mode that sees every aten op with its outputs

WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default  # returns its input (eager) or a fake copy


def fake_mode_of(t: torch.Tensor) -> FakeTensorMode | None:
    """The fake mode `t` belongs to (None: a real tensor)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return t.fake_mode if isinstance(t, FakeTensor) else None


def make_fake_tensors(
    mode: FakeTensorMode,
    new_storages: Sequence[tuple[int, torch.dtype]],
    views: Sequence[tuple[Any, tuple[int, ...], tuple[int, ...], int, torch.dtype, Any]],
) -> list[torch.Tensor]:
    """Fake tensors of `mode` made directly, as its dispatch cache makes a hit's outputs, without
    dispatching an op (a dispatch costs ~0.25 ms on a CPU core): `new_storages` (elements, dtype)
    are made here; each view (storage, shape, stride, offset, dtype, device) looks at an existing
    untyped storage or, given an int, at that new storage."""
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    out = []
    with in_kernel_invocation_manager(mode):
        made = [torch.empty(n, dtype=dtype, device="meta").untyped_storage() for n, dtype in new_storages]
        for storage, shape, stride, offset, dtype, device in views:
            meta = torch.empty(0, dtype=dtype, device="meta")
            meta.set_(made[storage] if isinstance(storage, int) else storage, offset, shape, stride)
            out.append((meta, device))
    return [FakeTensor(mode, meta, device) for meta, device in out]


def mem_tracker() -> Any:
    """torch's own live-memory tracker (a dispatch mode; `get_tracker_snapshot("peak")`): the
    independent measurement a dry run's accounting is checked against."""
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker()


def tracker_total(snapshot: dict) -> int:
    """Total bytes over all devices of a MemTracker snapshot."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    return sum(dev[_TOTAL_KEY] for dev in snapshot.values())


# ---------------------------------------------------------------- compiled program (runtime/module.py)
def dispatch_mode_blocks_compile() -> bool:
    """Whether torch.compile would run a frame eagerly right now: dynamo skips frames under a
    non-infra dispatch mode (LocalTensorMode, WireMeter, MemTracker); dynamo's own test."""
    from torch._dynamo import config
    from torch.utils import _python_dispatch as pd

    if config.inline_torch_dispatch_torch_compile:
        return pd.any_torch_dispatch_mode_on_stack()
    return pd.is_in_any_mode_without_ignore_compile_internals()


def dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process, from dynamo's own counters: how to
    tell that a program traced as one graph (torch has no public API for them)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def inductor_unavailable(device_type: str) -> str | None:
    """Why inductor cannot build kernels for `device_type` here (no C++ compiler for CPU, no
    triton for CUDA), or None: inductor itself would only fail at the first compiled call."""
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "inductor needs triton for CUDA kernels, and it is not installed"
    from torch._inductor import exc
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except exc.InvalidCxxCompiler as err:
        return f"inductor needs a C++ compiler for CPU kernels: {err} (install g++ or set CXX)"
    return None


# ---------------------------------------------------------------- attention on a GPU (program/attention.py)
def sdpa_backend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool, scale: Any
) -> str | None:
    """The kernel `scaled_dot_product_attention` picks for these CUDA inputs in training (no mask,
    no dropout, inputs that require grad): 'cudnn', 'flash', 'efficient' or 'math'; None without a
    CUDA runtime to ask (fake CUDA tensors on a machine without one)."""
    from torch.nn.attention import SDPBackend

    if not torch.cuda.is_available():
        return None

    q, k, v = (t.detach().requires_grad_() for t in (query, key, value))
    choice = torch._fused_sdp_choice(q, k, v, None, 0.0, is_causal, scale=scale)
    return {
        SDPBackend.CUDNN_ATTENTION: "cudnn",
        SDPBackend.FLASH_ATTENTION: "flash",
        SDPBackend.EFFICIENT_ATTENTION: "efficient",
    }.get(SDPBackend(choice), "math")
