"""A workload made a fine-tune: parameters frozen by pattern (`--freeze GLOB`), and peft's LoRA
adapters over a frozen base (`--lora RANK[,alpha=A,targets=q_proj,v_proj,...]`).

The model is the base workload's, wrapped by `peft.get_peft_model` (its parameters renamed as peft
names them: `base_model.model.<name>`, a wrapped linear's weight under `.base_layer.`), then
frozen where a pattern says. A frozen parameter is planned like any other but gets no gradient,
no reduction and no optimizer state. Checkpoints of the base (`--init-from`) load as they are: their
names are mapped to peft's, and the adapters, which no base checkpoint holds, start from their own
init (A as `nn.Linear`'s default, B zero, as peft does: the fine-tune starts at the base model).
Needs `pip install 'autoshard[lora]'` for `--lora`. Imports torch and peft, never a stage package.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import zlib
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoshard.workloads.base import Workload, initial_stream

INSTALL = "pip install 'autoshard[lora]'"
PEFT_PREFIX = "base_model.model."
ADAPTER_MARK = ".lora_"  # in the name of every LoRA adapter parameter (lora_A, lora_B, lora_embedding_A...)


@dataclass(frozen=True)
class Lora:
    """LoRA's settings: rank, alpha (scale alpha / rank; default 2 x rank) and the modules it wraps
    (None: peft's default for the model type; ("all-linear",): every linear but the output head)."""

    rank: int
    alpha: float
    targets: tuple[str, ...] | None = None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def peft_config(self) -> Any:
        peft = _peft()
        targets: Any = list(self.targets) if self.targets else None
        if self.targets == ("all-linear",):
            targets = "all-linear"
        return peft.LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=targets, lora_dropout=0.0)


def parse_lora(text: str) -> Lora:
    """'16' or '16,alpha=32,targets=q_proj,v_proj' -> Lora (every name after `targets=` is a target)."""
    rank_text, *rest = [part.strip() for part in text.split(",")]
    try:
        rank = int(rank_text)
    except ValueError:
        rank = 0
    if rank <= 0:
        raise ValueError(f"--lora {text}: starts with the rank, a positive integer (e.g. --lora 16,alpha=32)")
    alpha, targets = None, None
    for part in rest:
        key, sep, value = part.partition("=")
        if targets is not None and not sep:
            targets.append(part)
        elif key == "alpha":
            try:
                alpha = float(value)
            except ValueError:
                raise ValueError(f"--lora {text}: alpha={value} is not a number") from None
            if not 0 < alpha < math.inf:
                raise ValueError(f"--lora {text}: alpha must be positive")
        elif key == "targets" and value:
            targets = [value]
        else:
            raise ValueError(f"--lora {text}: unknown part {part!r} (expected alpha=A or targets=NAME,NAME,...)")
    return Lora(rank, alpha if alpha is not None else 2.0 * rank, tuple(targets) if targets else None)


@dataclass(frozen=True)
class FineTune:
    """What `--lora` and `--freeze` ask of a workload (both empty: train everything).

    `frozen_dtype` (`--param-dtype`'s): the frozen parameters are held in it. They never change,
    and under mixed precision every forward reads them cast to it anyway, so the values computed
    with are the same; what it saves is the fp32 copy, half of a LoRA run's parameter memory."""

    lora: Lora | None = None
    freeze: tuple[str, ...] = ()
    frozen_dtype: torch.dtype | None = None

    def __bool__(self) -> bool:
        return self.lora is not None or bool(self.freeze)

    @classmethod
    def from_flags(cls, lora: str | None, freeze: Any, param_dtype: torch.dtype | None = None) -> FineTune:
        """From `--lora`'s text (None: no LoRA), `--freeze`'s patterns (None: none) and the
        compute dtype (`--param-dtype`; None: the parameters' own)."""
        return cls(parse_lora(lora) if lora else None, tuple(freeze or ()), param_dtype)


def fine_tuned(base: Workload, tune: FineTune) -> Workload:
    """`base` with `tune` applied (`base` itself when `tune` asks nothing). ValueError for a
    pattern that freezes nothing, a tune that leaves nothing to train, or targets peft cannot wrap."""
    if not tune:
        return base
    model = _wrapped(base, tune, "meta")  # checks the tune once, now
    names = _base_names(model)
    adapters = frozenset(n for n, _ in model.named_parameters() if ADAPTER_MARK in n)
    peft_name = {b: p for p, b in names.items()}

    def initial_values(seed: int, want: Collection[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        base_want = None if want is None else {names[n] for n in want if n in names}
        for name, value in initial_stream(base, seed, base_want):
            if name in peft_name:
                yield peft_name[name], value
        yield from _adapter_init(model, seed, adapters if want is None else adapters & set(want))

    def adapt_state_dict(state: dict[str, Any]) -> dict[str, Any]:
        return {peft_name.get(k, k): v for k, v in base.adapt_state_dict(state).items()}

    resize, packed = base.resize_vocab, base.packed
    return dataclasses.replace(
        base,
        build=lambda device: _wrapped(base, tune, device),
        initial_state=lambda seed: dict(initial_values(seed)),
        initial_values=initial_values,
        adapt_state_dict=adapt_state_dict,
        resize_vocab=(lambda vocab: fine_tuned(resize(vocab), tune)) if resize is not None else None,
        packed=(lambda: fine_tuned(packed(), tune)) if packed is not None else None,
        init_only=adapters,
        tune=tune,
    )


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ValueError(f"--lora needs peft: {INSTALL}") from None
    return peft


def _wrapped(base: Workload, tune: FineTune, device: str | torch.device) -> nn.Module:
    model = base.build(device)
    if tune.lora is not None:
        peft = _peft()
        try:
            model = peft.get_peft_model(model, tune.lora.peft_config())
        except ValueError as err:  # no default targets for the model, or targets it does not have
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"--lora: peft cannot wrap {base.name}: {first} (name them: targets=NAME,...)") from None
    params = dict(model.named_parameters())
    for pattern in tune.freeze:
        matched = [n for n in params if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            shown = ", ".join(list(params)[:3])
            raise ValueError(f"--freeze {pattern}: matches no parameter of {base.name} (its names: {shown}, ...)")
        for name in matched:
            params[name].requires_grad_(False)
    if not any(p.requires_grad for p in params.values()):
        raise ValueError(f"--freeze {' '.join(tune.freeze)}: leaves no parameter of {base.name} to train")
    if tune.frozen_dtype is not None:
        for param in params.values():
            if not param.requires_grad and param.is_floating_point():
                param.data = param.data.to(tune.frozen_dtype)
    return model


def _base_names(model: nn.Module) -> dict[str, str]:
    """Each parameter's and buffer's name in the wrapped model -> its name in the base model
    (adapters left out)."""
    out = {}
    for name in [*dict(model.named_parameters()), *dict(model.named_buffers())]:
        if ADAPTER_MARK not in name:
            out[name] = name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
    return out


def _adapter_init(model: nn.Module, seed: int, names: Collection[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """peft's LoRA init, seeded per name: A (and an embedding's B) as `nn.Linear`'s weights are
    drawn (kaiming uniform, a = sqrt(5)), B (an embedding's A) zero, so the adapted model starts
    equal to the base."""
    params = dict(model.named_parameters())
    for name in sorted(names):
        like = params[name]
        value = torch.zeros(like.shape, dtype=like.dtype)
        if ".lora_A." in name or ".lora_embedding_B." in name:
            generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
        yield name, value
