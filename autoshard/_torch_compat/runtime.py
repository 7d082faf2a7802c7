"""Running a program and watching it run: dispatch modes, the dry run's fake tensors and memory
tracker, what tells whether torch.compile traced a program as one graph (and whether inductor can
build kernels here), and the attention kernel torch would pick on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes

from autoshard._torch_compat import legacy

# ---------------------------------------------------------------- dispatch modes
DispatchMode = TorchDispatchMode  # base class of a mode that sees every aten op with its outputs


def no_dispatch_modes() -> contextlib.AbstractContextManager:
    """Leave any active fake/local tensor mode (a traced graph's fake mode stays active while its
    ExitStack is open): strategy functions and meshes need plain tensors."""
    return _disable_current_modes()


# ---------------------------------------------------------------- dry run (runtime/dryrun.py)
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


if legacy.TORCH < (2, 13):  # 2.11's and 2.12's tracker also counts DTensor's propagation tensors
    mem_tracker = legacy.mem_tracker_2_12


def tracker_total(snapshot: dict) -> int:
    """Total bytes over all devices of a MemTracker snapshot."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    return sum(dev[_TOTAL_KEY] for dev in snapshot.values())


# ---------------------------------------------------------------- compiled program (runtime/module.py)
if legacy.TORCH < (2, 12):  # the executor reads a mesh's shape inside compiled programs
    legacy.teach_dynamo_mesh_shape()


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
