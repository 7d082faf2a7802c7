"""Getting the joint graph: fake tensors, dynamo's capture, AOT autograd's joint export and its
input/output descriptors, lazily written FX modules, torch's pytree, and the private state of
`nn.Module` that tracing and loading read or bend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._functorch._aot_autograd import descriptors as _desc
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._subclasses.fake_tensor import FakeTensorMode

# torch has no public pytree module; its private one is what every torch API flattens with.
from torch.utils._pytree import (
    tree_flatten as tree_flatten,
)
from torch.utils._pytree import (
    tree_leaves as tree_leaves,
)
from torch.utils._pytree import (
    tree_unflatten as tree_unflatten,
)

from autoshard._torch_compat import legacy


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


if legacy.TORCH < (2, 13):  # dynamo's config log would try to sort the Logger methods set above
    legacy.config_logging_without_functions()


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
    """('output'|'grad'|'input_grad'|'other', name or index) for an output descriptor."""
    if isinstance(desc, _desc.PlainAOTOutput):
        return "output", desc.idx
    if isinstance(desc, _desc.GradAOTOutput):
        inner = desc.grad_of
        if isinstance(inner, _desc.ParamAOTInput):
            return "grad", inner.target
        if isinstance(inner, _desc.PlainAOTInput):
            return "input_grad", inner.idx
        return "other", None
    return "other", None


# ---------------------------------------------------------------- nn.Module's private state
def non_persistent_buffer_names(module: torch.nn.Module) -> set[str]:
    """FQNs of the buffers `module` (or a submodule) registered with persistent=False: only the
    private per-module set records it."""
    return {
        f"{prefix}.{b}" if prefix else b for prefix, m in module.named_modules() for b in m._non_persistent_buffers_set
    }


@contextlib.contextmanager
def truncated_module_list(blocks: torch.nn.Module, keep: int) -> Iterator[None]:
    """Temporarily keep only the first `keep` entries of `blocks` (a ModuleList or ModuleDict),
    the same objects (no copies)."""
    saved = blocks._modules
    blocks._modules = dict(list(saved.items())[:keep])
    try:
        yield
    finally:
        blocks._modules = saved
