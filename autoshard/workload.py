"""What `plan` and `train` need to know about a model: one `Workload` per name (like torchtitan's ModelSpec).

    workload = get_workload("llama3-8b", seq=8192)
    model = workload.build("meta")                       # meta: planning, no weights
    inputs = workload.example_inputs(8, 8192, "meta")     # GLOBAL shapes: (tokens, targets)
    loss = workload.loss_fn(model(*inputs[:workload.n_model_inputs]), *inputs[workload.n_model_inputs:])
    data = workload.data(seed)                            # training data: data.batch(step, batch, seq)

Sits at the bottom of the stack beside layout.py: it imports `models` and torch, never a stage package.
Adding a model family is one resolver in `_RESOLVERS`; Hugging Face models (`hf:PATH`) live in
`autoshard.hf`. `checkpoint_values` reads a safetensors checkpoint for any workload (`--init-from`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
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
    model's parameter names; our own models need none. `initial_state(seed)` is the full value of
    every parameter and buffer of a freshly initialized model (what training starts from; a
    checkpoint leaves the buffers to it).
    """

    name: str
    build: Callable[[str | torch.device], nn.Module]
    example_inputs: Callable[[int, int, str | torch.device], tuple[torch.Tensor, ...]]
    loss_fn: Callable[..., torch.Tensor] | None
    data: Callable[[int], DataSource]  # seed -> source
    initial_state: Callable[[int], dict[str, torch.Tensor]]  # seed -> full values
    n_model_inputs: int = 1
    adapt_state_dict: Callable[[dict[str, Any]], dict[str, Any]] = identity_state_dict


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (tied ones once) and buffer of a model, by FQN."""
    return dict(model.named_parameters()) | dict(model.named_buffers())


# ------------------------------------------------------------------------------------ llama (models/)
class _TokenBatches:
    """`models.MarkovTokens` as a DataSource: (tokens, targets)."""

    def __init__(self, vocab_size: int, seed: int):
        from models import MarkovTokens

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
        example_inputs=token_inputs,
        loss_fn=cross_entropy_loss,
        data=lambda seed: token_batches(cfg.vocab_size, seed),
        initial_state=lambda seed: full_state(build_model(cfg, device="cpu", seed=seed)),
    )


def _hugging_face(name: str, seq: int) -> Workload | None:
    """`hf:PATH`: the causal LM a local transformers config describes (autoshard.hf)."""
    if not name.startswith("hf:"):
        return None
    from autoshard import hf

    return hf.workload(name[len("hf:"):], seq)


# name, seq -> Workload, or None when the name is not this family's. Add a family here.
_RESOLVERS: tuple[Callable[[str, int], Workload | None], ...] = (_llama, _hugging_face)


def known_names() -> list[str]:
    from models import CONFIGS

    return list(CONFIGS) + ["hf:PATH (a local transformers config.json or model directory)"]


def get_workload(name: str, seq: int) -> Workload:
    """The workload called `name`, able to run sequences of length `seq`; unknown names raise
    ValueError listing the known ones."""
    for resolve in _RESOLVERS:
        workload = resolve(name, seq)
        if workload is not None:
            return workload
    raise ValueError(f"unknown model config {name!r}; valid names: {', '.join(known_names())}")


# ------------------------------------------------------------------------------------ checkpoints
def _safetensors_files(path: str | Path) -> list[Path]:
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory")
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"{path}: no .safetensors files in the directory")
    return files


def read_safetensors(path: str | Path, *, shapes_only: bool = False) -> dict[str, Any]:
    """Every tensor (on CPU), or only its shape, of a .safetensors file or of all such files in a
    directory (a sharded checkpoint). ValueError when there are none or two files hold a name."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise ValueError(f"reading {path} needs safetensors: pip install 'autoshard[hf]'") from None
    values: dict[str, Any] = {}
    for file in _safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                names = list(f.keys())
                twice = sorted(set(names) & set(values))
                if twice:
                    raise ValueError(f"{path}: {twice[0]} is in more than one file")
                for name in names:
                    values[name] = tuple(f.get_slice(name).get_shape()) if shapes_only else f.get_tensor(name)
        except ValueError:
            raise
        except Exception as err:  # safetensors raises its own error type for a bad header
            raise ValueError(f"{file}: not a safetensors file ({err})") from None
    return values


def check_checkpoint(workload: Workload, shapes: dict[str, tuple[int, ...]], path: str | Path) -> list[str]:
    """The model's parameter names, once `shapes` (checkpoint name -> shape, names adapted) is
    known to hold every one of them with its shape and nothing the model lacks (another
    architecture's checkpoint); ValueError otherwise. Costs a meta build, no weights."""
    model = workload.build("meta")
    params = dict(model.named_parameters())
    known = dict(model.state_dict(keep_vars=True)) | params  # tied names (lm_head.weight) too
    missing = [name for name in params if name not in shapes]
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks {len(missing)} of the model's {len(params)} parameters, "
                         f"e.g. {', '.join(missing[:3])}")
    unknown = [name for name in shapes if name not in known]
    if unknown:
        raise ValueError(f"{path}: the checkpoint holds {len(unknown)} tensors {workload.name} lacks, "
                         f"e.g. {', '.join(unknown[:3])}")
    for name, shape in shapes.items():
        if tuple(shape) != tuple(known[name].shape):
            raise ValueError(f"{path}: {name} has shape {tuple(shape)} in the checkpoint, "
                             f"{tuple(known[name].shape)} in {workload.name}")
    return list(params)


def checkpoint_values(workload: Workload, path: str | Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full values to start training from: the checkpoint at `path` (safetensors, names adapted
    by the workload) for every parameter, the seed's initial values for buffers a checkpoint does
    not hold (rotary tables). ValueError as `check_checkpoint` says."""
    loaded = workload.adapt_state_dict(read_safetensors(path))
    params = check_checkpoint(workload, {name: tuple(t.shape) for name, t in loaded.items()}, path)
    return {**workload.initial_state(seed), **{name: loaded[name] for name in params}}
