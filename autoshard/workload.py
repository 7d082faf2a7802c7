"""What `plan` and `train` need to know about a model: one `Workload` per name (like torchtitan's ModelSpec).

    workload = get_workload("llama3-8b", seq=8192)
    model = workload.build("meta")                       # meta: planning, no weights
    inputs = workload.example_inputs(8, 8192, "meta")     # GLOBAL shapes: (tokens, targets)
    loss = workload.loss_fn(model(*inputs[:workload.n_model_inputs]), *inputs[workload.n_model_inputs:])
    data = workload.data(seed)                            # training data: data.batch(step, batch, seq)

Sits at the bottom of the stack beside layout.py: it imports `models` and torch, never a stage package.
Adding a model family (Hugging Face, torchtitan) is one resolver in `_RESOLVERS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch import nn


class DataSource(Protocol):
    """Training data: the GLOBAL batch of `step`, in `example_inputs` order, a pure function of
    (seed, step) so any rank can make any step's batch and a resumed run sees the same data."""

    def batch(self, step: int, batch_size: int, seq: int) -> tuple[torch.Tensor, ...]: ...


def identity_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    return state_dict


@dataclass(frozen=True)
class Workload:
    """A model and its training step, as `plan` and `train` use them.

    The step is `loss_fn(model(*inputs[:n_model_inputs]), *inputs[n_model_inputs:])` (`loss_fn` None:
    the model returns the loss itself), `inputs = example_inputs(batch, seq, device)`.
    `adapt_state_dict` maps a checkpoint's state dict (e.g. Hugging Face or torchtitan names) to this
    model's parameter names; our own models need none.
    """

    name: str
    build: Callable[[str | torch.device], nn.Module]
    example_inputs: Callable[[int, int, str | torch.device], tuple[torch.Tensor, ...]]
    loss_fn: Callable[..., torch.Tensor] | None
    data: Callable[[int], DataSource]  # seed -> source
    n_model_inputs: int = 1
    adapt_state_dict: Callable[[dict[str, Any]], dict[str, Any]] = identity_state_dict


# ------------------------------------------------------------------------------------ llama (models/)
class _TokenBatches:
    """`models.MarkovTokens` as a DataSource: (tokens, targets)."""

    def __init__(self, vocab_size: int, seed: int):
        from models import MarkovTokens

        self.tokens = MarkovTokens(vocab_size, seed=seed)

    def batch(self, step: int, batch_size: int, seq: int) -> tuple[torch.Tensor, ...]:
        b = self.tokens.batch(step, batch_size, seq)
        return b.inputs, b.targets


def _token_inputs(batch: int, seq: int, device: str | torch.device = "meta") -> tuple[torch.Tensor, ...]:
    """(tokens, targets): int64 [batch, seq]."""
    return (torch.empty(batch, seq, dtype=torch.int64, device=device),) * 2


def _llama(name: str, seq: int) -> Workload | None:
    from models import CONFIGS, build_model, cross_entropy_loss

    cfg = CONFIGS.get(name)
    if cfg is None:
        return None
    if seq > cfg.max_seq_len:  # rope tables long enough for the asked sequence
        cfg = cfg.with_(max_seq_len=seq)
    return Workload(
        name=name,
        build=lambda device: build_model(cfg, device=device),
        example_inputs=_token_inputs,
        loss_fn=cross_entropy_loss,
        data=lambda seed: _TokenBatches(cfg.vocab_size, seed),
    )


# name, seq -> Workload, or None when the name is not this family's. Add a family here.
_RESOLVERS: tuple[Callable[[str, int], Workload | None], ...] = (_llama,)


def known_names() -> list[str]:
    from models import CONFIGS

    return list(CONFIGS)


def get_workload(name: str, seq: int) -> Workload:
    """The workload called `name`, able to run sequences of length `seq`; unknown names raise
    ValueError listing the known ones."""
    for resolve in _RESOLVERS:
        workload = resolve(name, seq)
        if workload is not None:
            return workload
    raise ValueError(f"unknown model config {name!r}; valid names: {', '.join(known_names())}")
