"""Hugging Face models initialized a few tensors at a time, with exactly the values
`hf.build(config, "cpu", seed)` gives them: the `initial_values` of `hf:` workloads.

transformers draws every weight from the global RNG in an order no tensor knows alone: building
the model draws torch's default init (kaiming for each Linear, ...), then each `post_init` (an
inner model's runs before the outer model's later modules exist) redraws module by module
(`_init_weights`). So the values are found in two passes:

1. record: build on meta as on CPU. Every random op on a meta tensor also draws the same numbers
   into scratch CPU memory of its shape (the RNG advances as it would on CPU), `_init_weights`
   runs on meta too, and each call records the RNG state it starts from and the tensors it writes.
2. replay: each call that writes a wanted tensor runs again from its recorded RNG state, the
   tensors it writes put on CPU; a tensor is handed out after the last call that writes it.

Host memory: the tensors one call writes (a weight and its bias), and scratch of one tensor. A
model this does not fit (custom code, a tensor no `_init_weights` call writes) is built whole on
CPU instead, with a warning; `strict=True` raises instead (tests).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoshard import _torch_compat as tc


class Unsupported(Exception):
    """The model's init does not fit the record-and-replay scheme."""


def _is_meta(x: Any) -> bool:
    return (isinstance(x, torch.Tensor) and x.is_meta) or (isinstance(x, torch.device) and x.type == "meta")


def _on_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_meta:
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")
    if isinstance(x, torch.device) and x.type == "meta":
        return torch.device("cpu")
    return x


class _DrawOnCpu(tc.TorchDispatchMode):
    """Random ops on meta tensors also draw their numbers on CPU, into scratch memory of the same
    shape and strides: the global RNG advances exactly as for a model built on CPU. The scratch is
    one buffer, reused: a fresh one per draw would leave the heap as large as the whole model."""

    def __init__(self) -> None:
        super().__init__()
        self.scratch = torch.empty(0, dtype=torch.uint8)

    def _scratch(self, t: torch.Tensor) -> torch.Tensor:
        extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0
        nbytes = extent * t.element_size()
        if self.scratch.numel() < nbytes:
            self.scratch = torch.empty(0, dtype=torch.uint8)  # drop the old one first
            self.scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self.scratch[:nbytes].view(t.dtype).as_strided(t.shape, t.stride())

    def _cpu(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_meta:
            return self._scratch(x)
        return _on_cpu(x)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            leaves, spec = tc.tree_flatten((args, kwargs))
            if any(_is_meta(x) for x in leaves):
                cpu_args, cpu_kwargs = tc.tree_unflatten([self._cpu(x) for x in leaves], spec)
                func(*cpu_args, **cpu_kwargs)
        return func(*args, **kwargs)


@dataclass(frozen=True)
class _Slot:
    """Where a tensor sat when an `_init_weights` call wrote it."""

    module: nn.Module
    name: str
    tensor: torch.Tensor


@dataclass
class _Call:
    """One `_init_weights(module)` call of phase 1."""

    owner: Any  # the PreTrainedModel whose `_init_weights` it is
    module: nn.Module
    rng: torch.Tensor  # the CPU RNG state it started from
    wrote: list[_Slot] = field(default_factory=list)


def _slots(model: nn.Module) -> list[tuple[_Slot, int]]:
    """Every parameter and buffer slot of `model` with its tensor's version counter now."""
    out = []
    for module in model.modules():
        for name, t in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)):
            out.append((_Slot(module, name, t), t._version))
    return out


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


def _record(cls: type, config: Any, seed: int) -> tuple[nn.Module, list[_Call]]:
    """Phase 1: the model built on meta with the RNG advancing as on CPU, and every
    `_init_weights` call it makes, in order."""
    from transformers import modeling_utils

    base = modeling_utils.PreTrainedModel
    calls: list[_Call] = []

    def initialize(owner: Any, module: nn.Module, is_custom_code: bool = False) -> None:
        # transformers' own `_initialize_weights`, less the custom-code case, recording the call
        if getattr(module, "_is_hf_initialized", False):
            return
        if is_custom_code:
            raise Unsupported("the model is custom code")
        call = _Call(owner, module, torch.get_rng_state())
        before = _slots(owner)
        owner._init_weights(module)
        call.wrote = [slot for slot, version in before if slot.tensor._version != version]
        calls.append(call)
        setattr(module, "_is_hf_initialized", True)

    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))
        torch.manual_seed(seed)
        stack.enter_context(_patched(base, "_initialize_weights", initialize))
        # post_init skips the init on meta: run it there, as on CPU
        cpu = torch.device("cpu")
        stack.enter_context(_patched(modeling_utils, "get_torch_context_manager_or_global_device", lambda: cpu))
        stack.enter_context(_DrawOnCpu())
        stack.enter_context(torch.device("meta"))
        model = cls(config)
    return model.train(), calls


@contextlib.contextmanager
def _installed(slots: list[_Slot], values: dict[int, torch.Tensor]) -> Iterator[None]:
    """Put the CPU tensors in `values` (by id of the meta tensor they stand for) in their slots."""
    saved = [(s, getattr(s.module, s.name)) for s in slots]
    for s in slots:
        value = values[id(s.tensor)]
        if isinstance(s.tensor, nn.Parameter):
            value = nn.Parameter(value, requires_grad=s.tensor.requires_grad)
        if hasattr(s.tensor, "_is_hf_initialized"):  # transformers' flag: an init that skips it
            setattr(value, "_is_hf_initialized", getattr(s.tensor, "_is_hf_initialized"))
        setattr(s.module, s.name, value)
    try:
        yield
    finally:
        for s, old in saved:
            setattr(s.module, s.name, old)


def _replay(model: nn.Module, calls: list[_Call], want: Collection[str] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Phase 2: each wanted tensor, by its FQN, after the last call that writes it."""
    from transformers import initialization

    names = {id(t): n for n, t in (*model.named_parameters(), *model.named_buffers())}
    wanted = {i for i, n in names.items() if want is None or n in want}
    last = {id(s.tensor): k for k, call in enumerate(calls) for s in call.wrote if id(s.tensor) in wanted}
    unwritten = sorted(names[i] for i in wanted - set(last))
    if unwritten:
        raise Unsupported(f"no _init_weights call writes {unwritten[0]}")
    live: dict[int, torch.Tensor] = {}
    for k, call in enumerate(calls):
        slots = [s for s in call.wrote if id(s.tensor) in last]
        if not slots:
            continue
        for s in slots:
            if id(s.tensor) not in live:  # its first writer: the values before it are overwritten
                live[id(s.tensor)] = _on_cpu(s.tensor)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=[]))
            torch.set_rng_state(call.rng)
            stack.enter_context(_installed(slots, live))
            stack.enter_context(initialization.guard_torch_init_functions())
            stack.enter_context(torch.no_grad())
            stack.enter_context(_DrawOnCpu())  # tensors left on meta still advance the RNG
            call.owner._init_weights(call.module)
        for s in slots:
            if last[id(s.tensor)] == k and id(s.tensor) in live:
                yield names[id(s.tensor)], live.pop(id(s.tensor))


def initial_values(
    config: Any, cls: type, seed: int, want: Collection[str] | None = None, *, strict: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """`cls(config)` built on CPU after `manual_seed(seed)`: each parameter's and buffer's value
    (named as in `named_parameters`/`named_buffers`, only those in `want`; None: all), a few
    tensors alive at a time. Falls back to the whole model built on CPU (`strict`: raises)."""
    try:
        model, calls = _record(cls, config, seed)
        yield from _replay(model, calls, want)
        return
    except Exception as err:
        if strict:
            raise
        why = f"{type(err).__name__}: {err}"
    warnings.warn(f"{cls.__name__}: its init is built whole on every rank ({why})", stacklevel=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device("cpu"):
            model = cls(config)
    for name, value in (*model.named_parameters(), *model.named_buffers()):
        if want is None or name in want:
            yield name, value.detach()
