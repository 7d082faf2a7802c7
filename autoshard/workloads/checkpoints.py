"""Safetensors checkpoints for any workload (`--init-from`): read them, check them against the
model, turn them into the values training starts from: whole (`checkpoint_values`) or by slices,
each rank reading only its own part of each tensor (`CheckpointSlices`, `Start`).

A checkpoint is one .safetensors file, or a directory: the files its `model.safetensors.index.json`
names (as `save_pretrained` shards a model), else every .safetensors file in it. Values are checked
as well as names and shapes, because a wrong value trains silently: a floating parameter stored as
integers or bools is refused from the headers (its values were truncated when it was saved), and
every value read is converted to the parameter's dtype and must be finite (a rank checks the
slices it reads, so the check costs one pass over what it loads anyway)."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from autoshard.options import UsageError
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


class Header(NamedTuple):
    """Where a stored tensor is and what it is, from a file's header."""

    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, I64, BOOL...


def _headers(path: str | Path) -> dict[str, Header]:
    """Stored name -> its header, from the files' headers alone (no tensor is read)."""
    safe_open = _safe_open()
    found: dict[str, Header] = {}
    for file in _safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name in found:
                        raise ValueError(f"{path}: {name} is in more than one file")
                    part = f.get_slice(name)
                    found[name] = Header(file, tuple(part.get_shape()), str(part.get_dtype()))
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
        return {name: header.shape for name, header in headers.items()}
    safe_open = _safe_open()
    values: dict[str, Any] = {}
    for file in dict.fromkeys(header.file for header in headers.values()):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            values.update({name: f.get_tensor(name) for name in f.keys()})
    return values


def check_checkpoint(
    workload: Workload,
    shapes: dict[str, tuple[int, ...]],
    path: str | Path,
    dtypes: dict[str, str] | None = None,
) -> list[str]:
    """The model's parameter names, once `shapes` (checkpoint name -> shape, names adapted) is
    known to hold every one of them with its shape and nothing the model lacks (another
    architecture's checkpoint), and `dtypes` (safetensors' names), when given, a floating type
    for every floating parameter; ValueError otherwise. Costs a meta build, no weights."""
    return list(_checked_params(workload, shapes, path, dtypes or {}))


def _checked_params(
    workload: Workload, shapes: dict[str, tuple[int, ...]], path: str | Path, dtypes: dict[str, str]
) -> dict[str, torch.dtype]:
    """`check_checkpoint`'s checks; the model's parameters with their dtypes."""
    model = workload.build("meta")
    params = {n: p for n, p in model.named_parameters() if n not in workload.init_only}  # adapters: from the init
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
    for name, param in params.items():
        stored = dtypes.get(name)
        if stored is not None and param.is_floating_point() and not _is_float(stored):
            raise ValueError(
                f"{path}: {name} is stored as {stored}, not a floating type, for a {param.dtype} parameter "
                "of the model: its values were cut to integers when it was saved (save it as a float)"
            )
    return {name: param.dtype for name, param in params.items()}


def _is_float(dtype: str) -> bool:
    """Whether a safetensors dtype name is a floating type (F64, F32, F16, BF16, F8_E4M3...)."""
    return dtype.startswith(("F", "BF"))


def checked_value(value: torch.Tensor, dtype: torch.dtype, name: str, path: str | Path) -> torch.Tensor:
    """`value` (a stored tensor, or a slice of one) in the parameter's `dtype`, once every value is
    finite: a NaN or inf stored, or one made by narrowing, would train silently. UsageError."""
    out = value.to(dtype)
    if out.is_floating_point() and not bool(torch.isfinite(out).all()):
        bad = int((~torch.isfinite(out)).sum())
        how = "holds" if not bool(torch.isfinite(value).all()) else f"overflows {dtype} in"
        raise UsageError(
            f"--init-from {path}: {name} {how} {bad} non-finite value(s) (NaN or inf) of the {value.numel()} read; "
            "start from a checkpoint of finite weights"
        )
    return out


def checkpoint_values(workload: Workload, path: str | Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full values to start training from: the checkpoint at `path` (safetensors, names adapted
    by the workload) for every parameter, the seed's initial values for buffers a checkpoint does
    not hold (rotary tables). ValueError as `check_checkpoint` says."""
    loaded = workload.adapt_state_dict(read_safetensors(path))
    shapes = {name: tuple(t.shape) for name, t in loaded.items()}
    dtypes = {name: "F" if t.is_floating_point() else str(t.dtype).removeprefix("torch.") for name, t in loaded.items()}
    params = _checked_params(workload, shapes, path, dtypes)
    values = {name: checked_value(loaded[name], dtype, name, path) for name, dtype in params.items()}
    return {**workload.initial_state(seed), **values}


class CheckpointSlices:
    """A checkpoint whose tensors are read a slice at a time: `read(name, box)` opens the tensor's
    file, reads the box (`safe_open(...).get_slice`) and closes it, so the host holds the slice
    and no more of the file; the slice comes in the parameter's dtype, checked finite
    (`checked_value`: a rank checks what it reads, no more). Built from the headers alone;
    ValueError as `check_checkpoint` says."""

    def __init__(self, workload: Workload, path: str | Path):
        headers = _headers(path)
        stored = workload.adapt_state_dict({name: name for name in headers})  # our name -> stored name
        shapes = {ours: headers[name].shape for ours, name in stored.items()}
        dtypes = {ours: headers[name].dtype for ours, name in stored.items()}
        self.path = path
        self._dtypes = _checked_params(workload, shapes, path, dtypes)
        self.params = list(self._dtypes)
        self._where = {ours: (headers[name].file, name) for ours, name in stored.items()}

    def read(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        """The part of tensor `name` (the model's name) inside `box` (a slice per dim)."""
        file, stored = self._where[name]
        with _safe_open()(str(file), framework="pt", device="cpu") as f:
            value = f.get_tensor(stored) if not box else f.get_slice(stored)[box]  # no box: a 0-dim tensor
        shown = stored if stored == name else f"{stored} ({name})"
        return checked_value(value, self._dtypes.get(name, value.dtype), shown, self.path)


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
        pmodel.load_each(self._from_init(params), exclude=params)
        pmodel.load_slices(self.checkpoint.read, params)

    def _from_init(self, params: Collection[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The seed's init of everything that is not a checkpoint parameter: buffers, and the
        parameters only the init gives (LoRA adapters)."""
        model = self.workload.build("meta")
        want = ({name for name, _ in model.named_buffers()} | self.workload.init_only) - set(params)
        return initial_stream(self.workload, self.seed, want)
