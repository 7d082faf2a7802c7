"""Safetensors checkpoints for any workload (`--init-from`): read them, check them against the
model, turn them into the values training starts from: whole (`checkpoint_values`) or by slices,
each rank reading only its own part of each tensor (`CheckpointSlices`, `Start`).

A checkpoint is one .safetensors file, or a directory: the files its `model.safetensors.index.json`
names (as `save_pretrained` shards a model), else every .safetensors file in it."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autoshard.workloads.base import Workload, initial_stream

INDEX = "model.safetensors.index.json"


def _safe_open() -> Any:
    try:
        from safetensors import safe_open
    except ImportError:
        raise ValueError("reading safetensors needs safetensors: pip install 'autoshard[hf]'") from None
    return safe_open


def _safetensors_files(path: str | Path) -> list[Path]:
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory")
    if path.is_file() and path.name == INDEX:
        path = path.parent
    if path.is_dir() and (path / INDEX).is_file():
        return _indexed_files(path / INDEX)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"{path}: no .safetensors files in the directory")
    return files


def _indexed_files(index: Path) -> list[Path]:
    """The files a sharded checkpoint's index names (its `weight_map`: tensor -> file)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{index}: not a safetensors index ({type(err).__name__}: {err})") from None
    files = [index.parent / name for name in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"{index}: names {missing[0]}, which is not in the directory")
    return files


def _headers(path: str | Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Stored name -> (its file, its shape), from the files' headers alone (no tensor is read)."""
    safe_open = _safe_open()
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in _safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name in found:
                        raise ValueError(f"{path}: {name} is in more than one file")
                    found[name] = (file, tuple(f.get_slice(name).get_shape()))
        except ValueError:
            raise
        except Exception as err:  # safetensors raises its own error type for a bad header
            raise ValueError(f"{file}: not a safetensors file ({err})") from None
    return found


def read_safetensors(path: str | Path, *, shapes_only: bool = False) -> dict[str, Any]:
    """Every tensor (on CPU), or only its shape, of a checkpoint (a file, or a directory's files).
    ValueError when there are none or two files hold a name."""
    headers = _headers(path)
    if shapes_only:
        return {name: shape for name, (_, shape) in headers.items()}
    safe_open = _safe_open()
    values: dict[str, Any] = {}
    for file in dict.fromkeys(file for file, _ in headers.values()):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            values.update({name: f.get_tensor(name) for name in f.keys()})
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


class CheckpointSlices:
    """A checkpoint whose tensors are read a slice at a time: `read(name, box)` opens the tensor's
    file, reads the box (`safe_open(...).get_slice`) and closes it, so the host holds the slice
    and no more of the file. Built from the headers alone; ValueError as `check_checkpoint` says."""

    def __init__(self, workload: Workload, path: str | Path):
        headers = _headers(path)
        stored = workload.adapt_state_dict({name: name for name in headers})  # our name -> stored name
        shapes = {ours: headers[name][1] for ours, name in stored.items()}
        self.path = path
        self.params = check_checkpoint(workload, shapes, path)
        self._where = {ours: (headers[name][0], name) for ours, name in stored.items()}

    def read(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        """The part of tensor `name` (the model's name) inside `box` (a slice per dim)."""
        file, stored = self._where[name]
        with _safe_open()(str(file), framework="pt", device="cpu") as f:
            if not box:  # a 0-dim tensor
                return f.get_tensor(stored)
            return f.get_slice(stored)[box]


@dataclass(frozen=True)
class Start:
    """What a run starts from: the seed's init, or a checkpoint's parameters with the seed's
    buffers. `load_into(pmodel)` gives a parallel module (`load_each`, `load_slices`) its values,
    each rank keeping only its shards: the init one tensor at a time, the checkpoint by slices."""

    workload: Workload
    seed: int
    checkpoint: CheckpointSlices | None = None

    def load_into(self, pmodel: Any) -> None:
        if self.checkpoint is None:
            pmodel.load_each(initial_stream(self.workload, self.seed))
            return
        params = set(self.checkpoint.params)
        # buffers first: the init may draw (scratch of one tensor) before any shard is written
        pmodel.load_each(self._buffers(params), exclude=params)
        pmodel.load_slices(self.checkpoint.read)

    def _buffers(self, params: Collection[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The seed's init of everything that is not a checkpoint parameter (buffers)."""
        model = self.workload.build("meta")
        want = {name for name, _ in model.named_buffers()} - set(params)
        return initial_stream(self.workload, self.seed, want)
