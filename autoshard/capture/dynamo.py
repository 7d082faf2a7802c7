"""Dynamo graph capture of a training step: the first of the two tracing routes.

Hugging Face decoders do not trace with a direct joint export: transformers' mask code has
data-dependent branches it skips only when it sees dynamo (or export) tracing. Dynamo's capture
runs that Python as dynamo, so those branches go the traced way; the joint export of the captured
GraphModule then gives the same kind of joint graph the direct route gives.

Module paths: forward hooks cannot run inside dynamo (their annotation scopes are context
managers dynamo does not trace), but dynamo records every node's `nn_module_stack`; the innermost
entry, with the step wrapper's own prefix removed, is the path the direct route's hooks would
have given, and the joint export copies it onto the aten nodes (backward ones included).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from torch import fx, nn

from autoshard import _torch_compat as tc

# dynamo's name for a module: "L['self'].model.layers.0", "L['self'].model.layers[0]" or
# "getattr(L['self'].model.layers, '0')"; the step wrapper holds the user's model as `.model`.
_ROOT = re.compile(r"^L\['self'\]\.model(?:\.|$)")
_INDEX = re.compile(r"\[(\d+)\]")
_GETATTR = re.compile(r"getattr\((.*), '([^']*)'\)")
# a module reached through its parent's module table (peft's wrappers forward attribute lookups):
# "L['self'].model.__dict__['_modules']['base_model']"
_TABLE = re.compile(r"\.__dict__\['_modules'\]\['([^']*)'\]")
# a module reached through a forward patched for mixed precision (`precision.cast_parameters`):
# "...attention.forward.__closure__[1].cell_contents.__self__.wo" is "...attention.wo"
_PATCHED = re.compile(r"\.forward\.__closure__\[\d+\]\.cell_contents(?:\.__self__)?")


def module_path(dynamo_name: str) -> str:
    """The model's own dotted path of a module dynamo names from the step wrapper ('' = the model)."""
    name = dynamo_name
    while True:  # getattr(getattr(x, 'a'), 'b') -> x.a.b
        unwrapped = _GETATTR.sub(r"\1.\2", name)
        if unwrapped == name:
            break
        name = unwrapped
    name = _TABLE.sub(r".\1", _INDEX.sub(r".\1", _PATCHED.sub("", name)))
    match = _ROOT.match(name)
    return name[match.end() :] if match else ""


def capture(wrapper: nn.Module, args: Sequence[Any], path_key: str) -> fx.GraphModule:
    """Dynamo's capture of `wrapper(*args)` (fake args, fake parameters), each node tagged under
    `path_key` in `meta['custom']` with the module path it came from. Raises whatever dynamo
    raises when the step does not capture as one graph."""
    gm = tc.dynamo_capture(wrapper, tuple(args))
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if not stack:
            continue
        path = module_path(list(stack.values())[-1][0])
        custom = dict(node.meta.get("custom") or {})
        custom.setdefault(path_key, path)
        node.meta["custom"] = custom
    return gm
