"""Safetensors checkpoints for any workload (`--init-from`): read them, check them against the
model, turn them into the full values training starts from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from autoshard.workloads.base import Workload


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
        raise ValueError(
            f"{path}: the checkpoint lacks {len(missing)} of the model's {len(params)} parameters, "
            f"e.g. {', '.join(missing[:3])}"
        )
    unknown = [name for name in shapes if name not in known]
    if unknown:
        raise ValueError(
            f"{path}: the checkpoint holds {len(unknown)} tensors {workload.name} lacks, e.g. {', '.join(unknown[:3])}"
        )
    for name, shape in shapes.items():
        if tuple(shape) != tuple(known[name].shape):
            raise ValueError(
                f"{path}: {name} has shape {tuple(shape)} in the checkpoint, "
                f"{tuple(known[name].shape)} in {workload.name}"
            )
    return list(params)


def checkpoint_values(workload: Workload, path: str | Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full values to start training from: the checkpoint at `path` (safetensors, names adapted
    by the workload) for every parameter, the seed's initial values for buffers a checkpoint does
    not hold (rotary tables). ValueError as `check_checkpoint` says."""
    loaded = workload.adapt_state_dict(read_safetensors(path))
    params = check_checkpoint(workload, {name: tuple(t.shape) for name, t in loaded.items()}, path)
    return {**workload.initial_state(seed), **{name: loaded[name] for name in params}}
