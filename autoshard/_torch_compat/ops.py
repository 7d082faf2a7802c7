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


# -------------------------------------------------------------------------------- grouped GEMM
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_fits(*operands: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` (private, in torch since 2.8; CPU kernels since 2.9) takes these
    operands: this torch has it, their dtype is fp32, bf16 or fp16, and every stride but the unit
    one is a multiple of 16 bytes (the kernel refuses others)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    for t in operands:
        if t.dtype not in _GROUPED_DTYPES or t.dtype != operands[0].dtype:
            return False
        if any(stride != 1 and stride * t.element_size() % 16 for stride in t.stride()):
            return False
    return True


def _offsets(counts: Sequence[int], device: torch.device) -> torch.Tensor:
    """Where each group's rows end, as the kernel takes them (int32 cumulative counts)."""
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Rows of `x` [n, k] grouped by `counts`, group e times `w[e]` ([E, k, m]): one kernel."""
    return torch._grouped_mm(x, w, offs=_offsets(counts, x.device))


def grouped_outer(x: torch.Tensor, y: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """[E, k, m]: for each group e of rows, `x_e.T @ y_e` (x [n, k], y [n, m]): one kernel."""
    return torch._grouped_mm(x.t(), y, offs=_offsets(counts, x.device))
