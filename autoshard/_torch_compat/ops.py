"""Op overloads and their schemas: what a graph node's or a dispatched call's op is, its arguments
by name, and whether its output is a view of an input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def is_op_overload(op: Any) -> bool:
    """Whether a graph node's target is an op overload (`aten.mm.default`, a custom library op),
    the only kind of target DTensor's registries know."""
    return isinstance(op, torch._ops.OpOverload)


def op_call(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(name without namespace, {schema argument name: value}) of one dispatched op call."""
    schema = func._schema
    return schema.name.split("::")[-1], dict(zip((a.name for a in schema.arguments), args)) | kwargs


def call_arguments(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """{schema argument name: value} of one op call, defaults filled in."""
    schema = op._schema
    defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    return defaults | dict(zip((a.name for a in schema.arguments), args)) | kwargs


def returns_alias(op: Any) -> bool:
    """Whether an op overload's first return aliases an input (a view): no kernel runs."""
    schema = getattr(op, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def shares_input_storage(op: Any) -> bool:
    """Whether an op's output is its (first) input's storage: views by their schema, and
    `_unsafe_view`, whose schema does not say so (it relabels the fresh output of the op before it)."""
    return op is torch.ops.aten._unsafe_view.default or returns_alias(op)
