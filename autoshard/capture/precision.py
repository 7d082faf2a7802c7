"""Mixed precision in the traced step, with FSDP2's meaning of `MixedPrecisionPolicy`.

The parameters stay in their own dtype (fp32 master weights: what the optimizer updates and the
checkpoint keeps). While the step is traced, each module casts its parameters to `param_dtype`
as its forward starts (FSDP2 casts per unit at pre-forward; `cast_parameters` says which), so the
joint graph carries one cast node per parameter, tagged with the casting module's path. The cast's backward
turns the gradient into `reduce_dtype` before autograd hands it back in the parameter's dtype.

Because the casts are graph nodes, every later stage sees the real dtype of every tensor: the
planner prices a gather of the cast value in bf16 bytes (so casting the local shard before the
all-gather is simply the cheaper plan), compute is priced at the dtype's rate, the dry run
measures bf16 activations. Where a gradient may be reduced is a constraint of the ILP (see
`gradient_tail`): only on edges that carry `reduce_dtype`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import fx, nn
from torch.distributed.fsdp import MixedPrecisionPolicy

aten = torch.ops.aten
prims = torch.ops.prims

_DTYPE_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp64": torch.float64,
    "float64": torch.float64,
}


def parse_dtype(name: str) -> torch.dtype:
    """'bf16' / 'bfloat16' / 'fp32' ... -> torch dtype (ValueError listing the names otherwise)."""
    dtype = _DTYPE_NAMES.get(name.strip().lower())
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(sorted(_DTYPE_NAMES))}")
    return dtype


def dtype_name(dtype: torch.dtype | None) -> str:
    """Short name for logs: bf16, fp32, ...; 'param' for None (the parameter's own dtype)."""
    if dtype is None:
        return "param"
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
    return names.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class Precision:
    """The dtypes a traced step uses, resolved from a `MixedPrecisionPolicy` (None = no cast)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None  # None: reduce in param_dtype (FSDP2's default)
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    @classmethod
    def of(cls, policy: MixedPrecisionPolicy | None) -> Precision:
        if policy is None:
            return cls()
        if not isinstance(policy, MixedPrecisionPolicy):
            raise TypeError(
                f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got {type(policy).__name__}"
            )
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(policy, field)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(f"mp_policy.{field} must be a floating-point dtype, got {dtype}")
        return cls(policy.param_dtype, policy.reduce_dtype, policy.output_dtype, policy.cast_forward_inputs)

    @property
    def casts(self) -> bool:
        """Whether parameters pass through a cast node at all."""
        return self.param_dtype is not None or self.reduce_dtype is not None

    def gradient_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype a gradient of a `param_dtype` parameter is reduced in."""
        return self.reduce_dtype or self.param_dtype or param_dtype

    def describe(self) -> str:
        if not self.casts and self.output_dtype is None:
            return "off (every tensor in its own dtype)"
        return f"param {dtype_name(self.param_dtype)}, reduce {dtype_name(self.reduce_dtype or self.param_dtype)}" + (
            f", output {dtype_name(self.output_dtype)}" if self.output_dtype is not None else ""
        )


class _CastForCompute(torch.autograd.Function):
    """param -> param_dtype; its gradient -> reduce_dtype (autograd then casts it to the param's dtype)."""

    @staticmethod
    def forward(ctx, param: torch.Tensor, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None):
        ctx.reduce_dtype = reduce_dtype
        return param.view_as(param) if param_dtype in (None, param.dtype) else param.to(param_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad if ctx.reduce_dtype is None else grad.to(ctx.reduce_dtype)), None, None


def _cast(param: torch.Tensor, precision: Precision) -> torch.Tensor:
    """param in `param_dtype`, its gradient through `reduce_dtype`. A plain `.to` where its own
    backward does that (the gradient comes back in the parameter's dtype: reducing in either of
    the two dtypes is then the ILP's edge constraint); the autograd function only for a reduce
    dtype that is neither (dynamo tags its nodes with no module path, so such a model is traced
    whole rather than three blocks)."""
    param_dtype = precision.param_dtype or param.dtype
    if precision.reduce_dtype in (None, param_dtype, param.dtype) and param_dtype != param.dtype:
        return param.to(param_dtype)
    return _CastForCompute.apply(param, precision.param_dtype, precision.reduce_dtype)


@contextlib.contextmanager
def cast_parameters(model: nn.Module, precision: Precision) -> Iterator[None]:
    """For the duration of one traced step, each module's forward first swaps floating parameters
    for their casts (`_cast`; one per parameter, made at the first forward that reaches it: a tied
    weight is one cast), then runs. A module casts its own parameters, and a module with no
    container of several modules below it (a transformer block, a peft LoRA layer) those of its
    whole subtree, as FSDP2 casts a unit's: code that reads a child's weight dtype before calling
    it (peft casts its input to `lora_A.weight.dtype`) sees the compute dtype. Nothing happens when
    `precision` casts nothing. Casts are keyed by FQN strings (no object identities), so dynamo
    traces this too."""
    if not precision.casts:
        yield
        return
    first_name: dict[int, str] = {}  # id(parameter) -> its first FQN: tied weights share a cast
    paths = {module: path for path, module in model.named_modules()}  # a shared module at its first path
    own: dict[nn.Module, list[tuple[str, str]]] = {}  # module -> (name, key) of its own parameters
    for module, module_name in paths.items():
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            if param.is_floating_point():
                key = first_name.setdefault(id(param), f"{module_name}.{name}")
                own.setdefault(module, []).append((name, key))
    # module -> (path of the owner below it, name, key) of each parameter it casts
    owned: dict[nn.Module, list[tuple[str, str, str]]] = {}
    for module, path in paths.items():
        subtree = module.named_modules(prefix=path) if _is_unit(module) else [(path, module)]
        items = [(p.removeprefix(path).lstrip("."), name, key) for p, m in subtree for name, key in own.get(m, ())]
        if items:
            owned[module] = items
    casts: dict[str, torch.Tensor] = {}  # FQN -> its cast, for this step
    originals = [
        (module._parameters, name, module._parameters[name]) for module, items in own.items() for name, _ in items
    ]

    def casting(module: nn.Module, forward, items: list[tuple[str, str, str]]):
        # the cast runs inside the module's forward, so both tracers tag it with the module's path
        def forward_in_compute_dtype(*args, **kwargs):
            for sub, name, key in items:
                owner = module.get_submodule(sub) if sub else module
                if key not in casts:
                    casts[key] = _cast(owner._parameters[name], precision)
                owner._parameters[name] = casts[key]
            return forward(*args, **kwargs)

        return forward_in_compute_dtype

    patched = [module for module in owned if "forward" not in module.__dict__]
    for module in patched:
        module.forward = casting(module, module.forward, owned[module])
    try:
        yield
    finally:
        for module in patched:
            del module.forward
        for table, name, param in originals:
            table[name] = param


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _is_unit(module: nn.Module) -> bool:
    """Whether `module` casts its whole subtree: no container of two or more modules (a list of
    blocks, of experts) at or below it."""
    return not any(isinstance(m, _CONTAINERS) and len(m) > 1 for m in module.modules())


def cast_floating(value, dtype: torch.dtype | None):
    """`value` with its floating tensors cast to `dtype` (others, and dtype None, untouched)."""
    if dtype is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, Mapping):  # a dict or a ModelOutput (a dataclass taking its fields by name)
        return type(value)(**{k: cast_floating(v, dtype) for k, v in value.items()})
    return value


# ---------------------------------------------------------------------------------- gradient tails
_CASTS = frozenset({prims.convert_element_type.default, aten._to_copy.default})
_LINEAR_PASSES = frozenset(
    {
        aten.t.default,
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten.permute.default,
        aten.transpose.int,
        aten.squeeze.dim,
        aten.unsqueeze.default,
        aten.alias.default,
        aten.detach.default,
        aten.add.Tensor,
    }
)


def is_cast(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _CASTS


def gradient_tail(grad: fx.Node) -> list[fx.Node]:
    """The nodes between the ops that produce a parameter's gradient and the gradient output:
    casts, views and accumulating adds that only feed the gradient. A partial (unreduced)
    gradient can be reduced on any edge into them or into the gradient sink; mixed precision
    allows it only where the edge carries the reduce dtype."""
    tail, stack, seen = [], [grad], set()
    while stack:
        node = stack.pop()
        if (
            node in seen
            or node.op != "call_function"
            or (node.target not in _CASTS and node.target not in _LINEAR_PASSES)
        ):
            continue
        if node is not grad and not all(u in seen for u in node.users):
            continue  # also feeds something else: not only the gradient
        seen.add(node)
        tail.append(node)
        stack.extend(node.all_input_nodes)
    return tail
