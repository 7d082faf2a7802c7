"""A training run's checkpoint as a Hugging Face model directory (`export --hf OUT`).

The weights of one checkpoint (the newest complete one, or a given step) go into safetensors files
under the names transformers expects (the workload's `hf_format`), beside the model's config.json
(and the run's `--tokenizer` files, so that AutoTokenizer loads from OUT too);
past `max_shard_bytes` they are split into several files with a `model.safetensors.index.json`, as
`save_pretrained` writes them. Tensors are read from the DCP checkpoint one file's worth at a
time, so the whole model is never in memory at once. Everything is written into a temporary
directory beside OUT and renamed to OUT at the end: OUT is complete or absent.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autoshard.data.text import tokenizer_files
from autoshard.options import UsageError
from autoshard.train.checkpoints import Checkpoint, checkpoints
from autoshard.workloads import get_workload

MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size, "5GB"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Export:
    """What `export_hf` wrote: the directory, the checkpoint's step, the weight files, and how
    many tensors and bytes they hold."""

    path: Path
    step: int
    files: list[str]
    tensors: int
    bytes: int


def _run_settings(run: Path) -> dict:
    try:
        settings = json.loads((run / "plan.json").read_text()).get("settings")
    except FileNotFoundError:
        raise ValueError(f"{run}: not a training run directory (no plan.json)") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"{run}/plan.json: unreadable ({err})") from None
    if not isinstance(settings, dict) or "model" not in settings:
        raise ValueError(f"{run}/plan.json: no run settings (written by `plan`, not by a training run)")
    return settings


def _checkpoint(run: Path, step: int | None) -> Checkpoint:
    found = checkpoints(run)
    if not found:
        raise ValueError(f"{run}: no complete checkpoint (train with --checkpoint-every)")
    if step is None:
        return found[0]
    for ckpt in found:
        if ckpt.step == step:
            return ckpt
    raise ValueError(
        f"{run}: no complete checkpoint of step {step} (there are: {', '.join(str(c.step) for c in reversed(found))})"
    )


def _metadata(ckpt: Checkpoint, reader: Any, run: Path) -> Any:
    """The checkpoint's DCP metadata, once every file it names is there in full: a damaged
    checkpoint is one line naming the missing file, found before anything is written (DCP's
    loader would fail halfway, with a traceback per rank)."""
    others = [str(c.step) for c in reversed(checkpoints(run)) if c.step != ckpt.step]
    hint = f" (export another with --step: {', '.join(others)})" if others else ""
    try:
        metadata = reader.read_metadata()
    except FileNotFoundError:
        raise UsageError(f"{ckpt.path}: damaged checkpoint: its .metadata is missing{hint}") from None
    except (OSError, EOFError, pickle.UnpicklingError) as err:
        raise UsageError(f"{ckpt.path}: damaged checkpoint: its .metadata cannot be read ({err}){hint}") from None
    needed: dict[str, int] = {}  # file -> the bytes the metadata says it holds
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = ckpt.path / name
        if not file.is_file():
            raise UsageError(f"{ckpt.path}: damaged checkpoint: {name} is missing{hint}")
        if (has := file.stat().st_size) < size:
            raise UsageError(f"{ckpt.path}: damaged checkpoint: {name} is truncated to {has} of its {size} bytes{hint}")
    return metadata


def _shards(sizes: dict[str, int], limit: int) -> list[list[str]]:
    """Tensor names in checkpoint order, grouped into files of at most `limit` bytes (a larger
    tensor alone)."""
    groups: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if groups[-1] and used + size > limit:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    return groups


def export_hf(
    run: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None, max_shard_bytes: int = MAX_SHARD_BYTES
) -> Export:
    """Write checkpoint `step` (default: the newest complete one) of training run `run` as a
    Hugging Face model directory `out` (it must not exist, or be empty). ValueError names what
    is wrong; nothing is left half-written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ValueError("export needs safetensors: pip install 'autoshard[hf]'") from None
    run, out = Path(run), Path(out)
    if max_shard_bytes < 1:
        raise ValueError(f"the largest file must hold at least one byte, got {max_shard_bytes}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory")
    settings = _run_settings(run)
    ckpt = _checkpoint(run, step)
    workload = get_workload(settings["model"], int(settings.get("seq", 1)))
    if settings.get("vocab_size") and workload.resize_vocab is not None:  # trained with a tokenizer's vocabulary
        workload = workload.resize_vocab(int(settings["vocab_size"]))
    if workload.hf_format is None:
        raise ValueError(f"{workload.name} has no Hugging Face form to export to")
    form = workload.hf_format()
    reader = FileSystemReader(str(ckpt.path))
    tensors = {
        key.removeprefix("model."): meta
        for key, meta in _metadata(ckpt, reader, run).state_dict_metadata.items()
        if key.startswith("model.") and hasattr(meta, "size")
    }
    names = {fqn: form.name(fqn) for fqn in tensors}
    sizes = {fqn: math.prod(meta.size) * meta.properties.dtype.itemsize for fqn, meta in tensors.items()}
    groups = _shards(sizes, max_shard_bytes)
    files = (
        [WEIGHTS]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as err:
        raise ValueError(f"cannot write {out}: {err}") from None
    try:
        for file, group in zip(files, groups):  # one file's tensors in memory at a time
            state = {fqn: torch.empty(tuple(tensors[fqn].size), dtype=tensors[fqn].properties.dtype) for fqn in group}
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(
                    {"model": state},
                    storage_reader=reader,
                    planner=DefaultLoadPlanner(allow_partial_load=True),
                    no_dist=True,
                )
            save_file({names[fqn]: t for fqn, t in state.items()}, str(tmp / file), metadata={"format": "pt"})
            del state
        if len(files) > 1:
            weight_map = {names[fqn]: file for file, group in zip(files, groups) for fqn in group}
            (tmp / INDEX).write_text(
                json.dumps({"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, indent=2) + "\n"
            )
        for name, text in (form.files | tokenizer_files(settings.get("tokenizer"))).items():
            (tmp / name).write_text(text)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"cannot write {out}: {err}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Export(out, ckpt.step, files, len(tensors), sum(sizes.values()))
