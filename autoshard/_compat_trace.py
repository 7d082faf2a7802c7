"""(to be merged into _torch_compat.py) private torch APIs used by tracing."""

from __future__ import annotations

from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._functorch._aot_autograd import descriptors as _desc
from torch._subclasses.fake_tensor import FakeTensorMode


def new_fake_mode() -> FakeTensorMode:
    return FakeTensorMode(allow_non_fake_inputs=False)


def export_joint(stack, module, args):
    """torch's joint forward+backward export with input/output descriptors."""
    return aot_export_joint_with_descriptors(stack, module, args)


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
