"""What `plan` and `train` need to know about a model: a `Workload` (like torchtitan's ModelSpec).

    workload = get_workload("llama3-8b", seq=8192)
    model = workload.build("meta")                       # meta: planning, no weights
    inputs = workload.example_inputs(8, 8192, "meta")     # GLOBAL shapes: (tokens, targets)
    loss = workload.loss_fn(model(*inputs[:workload.n_model_inputs]), *inputs[workload.n_model_inputs:])
    data = workload.data(seed)                            # training data: data.batch(step, batch, seq)

The pieces every family shares: the type, token data and inputs. Imports torch and `models`,
never a stage package.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
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
class HFFormat:
    """How a model is written as a Hugging Face model directory: its files besides the weights
    (config.json, generation_config.json: name -> text) and each parameter's name there."""

    files: dict[str, str]
    name: Callable[[str], str]
    # tensors transformers stores as one: (checkpoint tensors: FQN -> DCP metadata, reader) -> the
    # same with those joined under a name of their own, and a reader that joins them (None: none)
    join: Callable[[dict[str, Any], Callable], tuple[dict[str, Any], Callable]] | None = None


@dataclass(frozen=True)
class Workload:
    """A model and its training step, as `plan` and `train` use them.

    The step is `loss_fn(model(*inputs[:n_model_inputs]), *inputs[n_model_inputs:])` (`loss_fn` None:
    the model returns the loss itself), `inputs = example_inputs(batch, seq, device)`.
    `adapt_state_dict` maps a checkpoint's state dict (e.g. Hugging Face or torchtitan names) to
    this model's parameter names; `hf_format` says how `export --hf` writes it for transformers.
    `initial_state(seed)` is the full value of every parameter and buffer of a freshly initialized
    model (what training starts from; a checkpoint leaves the buffers to it); `initial_values(seed,
    want)` the same values one tensor at a time (only the names in `want`, None: all), so that
    a rank keeps its shard of each and never holds the whole model (None: `initial_state`'s).
    """

    name: str
    build: Callable[[str | torch.device], nn.Module]
    # GLOBAL shapes, in order; a dict passes them to the model by keyword (in the dict's order)
    example_inputs: Callable[[int, int, str | torch.device], tuple[torch.Tensor, ...] | dict[str, torch.Tensor]]
    loss_fn: Callable[..., torch.Tensor] | None
    data: Callable[[int], DataSource]  # seed -> source
    initial_state: Callable[[int], dict[str, torch.Tensor]]  # seed -> full values
    n_model_inputs: int = 1
    adapt_state_dict: Callable[[dict[str, Any]], dict[str, Any]] = identity_state_dict
    hf_format: Callable[[], HFFormat] | None = None  # None: no Hugging Face form (export refuses)
    vocab_size: int | None = None  # the tokens it embeds (None: not a token model); data must fit in it
    # the same model with another vocabulary (a tokenizer's, `--vocab-size`); None: the config's is fixed
    resize_vocab: Callable[[int], Workload] | None = None
    initial_values: Callable[[int, Collection[str] | None], Iterator[tuple[str, torch.Tensor]]] | None = None
    # parameters only the init gives (LoRA adapters): a checkpoint of the base model lacks them
    init_only: frozenset[str] = frozenset()
    tune: Any = None  # the fine-tune applied (`finetune.FineTune`), None: the model as it is
    # the same model set up to be given each token's position in its example (`position_ids`) and
    # keep packed examples apart; None: no such setup (our llama takes positions as it is)
    packed: Callable[[], Workload] | None = None


def initial_stream(
    workload: Workload, seed: int, want: Collection[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The workload's initial values one tensor at a time (from `initial_state`, all at once, for a
    workload with no stream of its own), only those named in `want` (None: all)."""
    if workload.initial_values is not None:
        yield from workload.initial_values(seed, want)
        return
    state = workload.initial_state(seed)
    for name in list(state):
        value = state.pop(name)
        if want is None or name in want:
            yield name, value


def sized_config(configs: dict[str, Any], name: str, seq: int) -> Any:
    """Config `name` of a family's `configs` (None when it has none of that name), its rope
    tables long enough for sequences of `seq`."""
    cfg = configs.get(name)
    if cfg is not None and seq > cfg.max_seq_len:
        cfg = cfg.with_(max_seq_len=seq)
    return cfg


def token_model(
    name: str,
    cfg: Any,
    build: Callable[..., nn.Module],
    resized: Callable[[str, Any], Workload],
    loss_fn: Callable[..., torch.Tensor],
    **family: Any,
) -> Workload:
    """The workload of one of our token models (`models/`): config `cfg`, built by
    `build(cfg, device, seed)`, trained on `loss_fn` over Markov-chain tokens, its initial values
    drawn one tensor at a time from a model on meta; `resized(name, cfg)` is the workload of
    another config (another vocabulary); `family`: the Workload fields a family sets itself."""
    return Workload(
        name=name,
        build=lambda device: build(cfg, device=device),
        example_inputs=token_inputs,
        loss_fn=loss_fn,
        data=lambda seed: token_batches(cfg.vocab_size, seed),
        initial_state=lambda seed: full_state(build(cfg, device="cpu", seed=seed)),
        initial_values=lambda seed, want=None: _meta_values(build(cfg, device="meta"), seed, want),
        vocab_size=cfg.vocab_size,
        resize_vocab=lambda n: resized(name, cfg.with_(vocab_size=n)),
        **family,
    )


def _meta_values(model: Any, seed: int, want: Collection[str] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """`model.initial_values(seed)` (a model of ours, on meta), only those named in `want` (None: all)."""
    for name, value in model.initial_values(seed):
        if want is None or name in want:
            yield name, value


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (tied ones once) and buffer of a model, by FQN."""
    return dict(model.named_parameters()) | dict(model.named_buffers())


class _TokenBatches:
    """`models.MarkovTokens` as a DataSource: (tokens, targets)."""

    def __init__(self, vocab_size: int, seed: int):
        from autoshard_models import MarkovTokens

        self.tokens = MarkovTokens(vocab_size, seed=seed)

    def batch(self, step: int, batch_size: int, seq: int) -> tuple[torch.Tensor, ...]:
        b = self.tokens.batch(step, batch_size, seq)
        return b.inputs, b.targets


def token_batches(vocab_size: int, seed: int) -> DataSource:
    """Markov-chain (tokens, targets) batches over `vocab_size` tokens."""
    return _TokenBatches(vocab_size, seed)


def token_inputs(batch: int, seq: int, device: str | torch.device = "meta") -> tuple[torch.Tensor, ...]:
    """(tokens, targets): int64 [batch, seq]."""
    return (torch.empty(batch, seq, dtype=torch.int64, device=device),) * 2
