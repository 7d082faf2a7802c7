"""A training run's checkpoint as a Hugging Face model directory (`export --hf OUT`); a LoRA run's
as its adapter in peft's format, or merged into the base model (`--merge`; `adapters`).

The weights of one checkpoint (the newest complete one, or a given step) go into safetensors files
under the names transformers expects (the workload's `hf_format`), in the run's compute dtype
(bf16 for a bf16 run, else fp32) or `--dtype`, beside the model's config.json (its `dtype` said),
generation_config.json, and the tokenizer's files and chat template: those of the run's
`--tokenizer`, else of the `hf:` model's own directory, so that AutoTokenizer loads from OUT too.
Past `max_shard_bytes` the weights are split into several files with a `model.safetensors.index.json`,
as `save_pretrained` writes them. Each file is written tensor by tensor: one tensor is read from the
DCP checkpoint (cast as it is copied), written out and dropped, so memory holds about one tensor,
never a file's worth or the model. The checkpoint's pickled metadata is read by `safe_metadata`
(a crafted one is refused, nothing of it run). Everything is written into a temporary directory
beside OUT and renamed to OUT at the end: OUT is complete or absent. Before anything is written,
every weight is read once and checked finite as stored and in the export's dtype (a diverged run's
NaN, or fp16's overflow past 65504, would otherwise export a model that computes NaN): one more
read of the checkpoint, a tensor at a time, for an export that is never silently wrong.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import struct
import tempfile
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

from autoshard import _torch_compat as tc
from autoshard.data.text import tokenizer_files
from autoshard.options import UsageError
from autoshard.train import adapters
from autoshard.train.checkpoints import Checkpoint, checkpoints
from autoshard.train.safe_metadata import load_value, read_metadata
from autoshard.workloads import Workload, get_workload
from autoshard.workloads.finetune import FineTune, fine_tuned

MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size, "5GB"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # --dtype
_HF_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}  # config.json's
_SAFETENSORS = {  # the safetensors format's dtype names
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
# what a Hugging Face model directory carries for its tokenizer and chat (save_pretrained's names)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
GENERATION = "generation_config.json"


@dataclass(frozen=True)
class Export:
    """What `export_hf` wrote: the directory, the checkpoint's step, the weight files, how many
    tensors and bytes they hold and in which dtype, and the files written beside them."""

    path: Path
    step: int
    files: list[str]
    tensors: int
    bytes: int
    dtype: str = "fp32"
    others: tuple[str, ...] = ()


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


def _metadata(ckpt: Checkpoint, run: Path) -> Any:
    """The checkpoint's DCP metadata (read safely: a crafted one raises UnsafeCheckpointError), once
    every file it names is there in full: a damaged checkpoint is one line naming the missing
    file, found before anything is written (DCP's loader would fail halfway, with a traceback)."""
    others = [str(c.step) for c in reversed(checkpoints(run)) if c.step != ckpt.step]
    hint = f" (export another with --step: {', '.join(others)})" if others else ""
    try:
        metadata = read_metadata(ckpt.path)
    except FileNotFoundError:
        raise UsageError(f"{ckpt.path}: damaged checkpoint: its .metadata is missing{hint}") from None
    except (OSError, pickle.UnpicklingError) as err:
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


def default_dtype(settings: dict) -> str:
    """bf16 for a run that computed in bf16 (`--param-dtype bf16`), else fp32: the precision the
    trained model was evaluated in, not more."""
    computed = str(settings.get("param_dtype") or "").strip().lower().removeprefix("torch.")
    return "bf16" if computed in ("bf16", "bfloat16") else "fp32"


KEPT_TOKENIZER = "tokenizer"  # under the run directory: the tokenizer the run trained with


def keep_tokenizer(out: Path, spec: str | None) -> None:
    """Copy the tokenizer of `--tokenizer` (its files, the tokenizer_config.json made for a bare
    tokenizer.json, chat template, generation_config.json) into RUN/tokenizer at the start of a run,
    so that export ships what the run trained with whatever happens to the path later."""
    if not spec:
        return
    kept = out / KEPT_TOKENIZER
    shutil.rmtree(kept, ignore_errors=True)
    kept.mkdir(parents=True)
    for name, text in tokenizer_files(spec).items():
        (kept / name).write_text(text)
    for name, file in _folder_files(Path(spec).expanduser()).items():
        if not (kept / name).exists():
            shutil.copyfile(file, kept / name)


def _tokenizer_of(run: Path, settings: dict) -> str | None:
    """Where the run's tokenizer is: its kept copy, else (a run from before copies were kept) the
    `--tokenizer` path, which must still be there."""
    if (run / KEPT_TOKENIZER / "tokenizer.json").is_file():
        return str(run / KEPT_TOKENIZER)
    spec = settings.get("tokenizer")
    if spec and not tokenizer_files(spec):
        raise ValueError(
            f"the run trained with --tokenizer {spec}, which is gone, and {run} keeps no copy of it: "
            "put it back to export with it"
        )
    return spec


def _folder_files(folder: Path) -> dict[str, Path]:
    """A model directory's tokenizer, chat and generation files (none for a bare tokenizer.json)."""
    return {name: folder / name for name in (*TOKENIZER_FILES, GENERATION) if (folder / name).is_file()}


def _source_files(settings: dict, tokenizer: str | None) -> dict[str, Path]:
    """The tokenizer's files, chat template and generation_config.json to copy (name -> file):
    from the run's tokenizer (`_tokenizer_of`), else from the `hf:` model's directory (its files
    are what it was trained with); none that are not there (any more)."""
    model = str(settings["model"])
    if tokenizer:
        return _folder_files(Path(tokenizer).expanduser())
    if model.startswith("hf:"):
        folder = Path(model[3:]).expanduser()
        return _folder_files(folder if folder.is_dir() else folder.parent)
    return {}


def _config(text: str, dtype: torch.dtype) -> str:
    """config.json saying the weights' dtype (transformers loads in it by default)."""
    config = {k: v for k, v in json.loads(text).items() if k != "torch_dtype"}
    return json.dumps(config | {"dtype": _HF_DTYPE[dtype]}, indent=2) + "\n"


def _write_safetensors(
    path: Path, entries: list[tuple[str, torch.Size, torch.dtype, Callable[[], torch.Tensor]]]
) -> None:
    """A safetensors file of `entries` (name, shape, dtype, values), each tensor's values read while
    it is written and dropped after: the file is streamed, never held. The format (an 8-byte
    little-endian header length, a JSON header padded with spaces to 8 bytes, then the tensors'
    bytes in header order) is what safetensors' own writer makes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype, _ in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape, dtype, values in entries:
            tensor = values()
            assert tensor.dtype == dtype and tensor.shape == shape, (name, tensor.dtype, tensor.shape)
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del tensor


def _tensor_reader(ckpt: Checkpoint, metadata: Any) -> Callable[[str, Any, torch.dtype], torch.Tensor]:
    """fqn -> that one tensor of the checkpoint, in `dtype`: DCP copies (and casts) each stored
    chunk into it, so memory holds it and one chunk."""
    import torch.distributed.checkpoint as dcp

    reader = tc.dcp_reader(ckpt.path, metadata)

    def read(fqn: str, meta: Any, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.empty(tuple(meta.size), dtype=dtype)
        planner = tc.dcp_planner(lambda value, file: load_value(value, str(ckpt.path / file)), allow_partial_load=True)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": {fqn: tensor}}, storage_reader=reader, planner=planner, no_dist=True)
        return tensor

    return read


@dataclass(frozen=True)
class _Weights:
    """The checkpoint's model tensors as they will be written: DCP metadata, exported dtype and
    name, and bytes by checkpoint FQN; grouped into the weight files `files`."""

    tensors: dict[str, Any]
    dtypes: dict[str, torch.dtype]
    names: dict[str, str]
    sizes: dict[str, int]
    groups: list[list[str]]
    files: list[str]


def _model_tensors(metadata: Any) -> dict[str, Any]:
    """The checkpoint's model tensors: FQN -> DCP metadata."""
    return {
        key.removeprefix("model."): meta
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and hasattr(meta, "size")
    }


def _weights(
    ckpt: Checkpoint,
    tensors: dict[str, Any],
    name: Callable[[str], str],
    dtype: torch.dtype,
    max_shard_bytes: int,
    single: str = WEIGHTS,
) -> _Weights:
    """What each of `tensors` becomes: floating ones in `dtype`, the rest kept, under `name(fqn)`,
    in `single` or, past `max_shard_bytes`, several numbered files."""
    stored = {fqn: meta.properties.dtype for fqn, meta in tensors.items()}
    dtypes = {fqn: dtype if d.is_floating_point else d for fqn, d in stored.items()}
    if unknown := sorted({str(d) for d in dtypes.values() if d not in _SAFETENSORS}):
        raise ValueError(f"{ckpt.path}: holds tensors of dtype {', '.join(unknown)}, which safetensors cannot hold")
    sizes = {fqn: math.prod(meta.size) * dtypes[fqn].itemsize for fqn, meta in tensors.items()}
    groups = _shards(sizes, max_shard_bytes)
    files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    files = files if len(files) > 1 else [single]
    return _Weights(tensors, dtypes, {fqn: name(fqn) for fqn in tensors}, sizes, groups, files)


def _check_values(weights: _Weights, read: Callable, ckpt: Checkpoint, run: Path, dtype: str) -> None:
    """Every weight is finite, in the checkpoint and in `dtype`: a diverged run's NaN, or an fp16
    cast past 65504, would export a model that only computes NaN, under the usual success line.
    Reads each tensor once, in its stored dtype (one tensor in memory); ValueError names them."""
    broken: dict[str, int] = {}  # exported name -> non-finite values stored
    overflow: dict[str, int] = {}  # exported name -> values finite as stored, inf in `dtype`
    largest = 0.0
    for fqn, meta in weights.tensors.items():
        if not meta.properties.dtype.is_floating_point:
            continue
        bad, over, top = _bad_values(read(fqn, meta, meta.properties.dtype), weights.dtypes[fqn])
        if bad:
            broken[weights.names[fqn]] = bad
        if over:
            overflow[weights.names[fqn]], largest = over, max(largest, top)
    if broken:
        others = [str(c.step) for c in reversed(checkpoints(run)) if c.step < ckpt.step]
        hint = f"; export an earlier one with --step ({', '.join(others)})" if others else ""
        raise ValueError(
            f"{ckpt.path}: the weights are not finite (NaN or inf) in {len(broken)} tensor(s): {_counts(broken)}: "
            f"the run diverged by step {ckpt.step}{hint}"
        )
    if overflow:
        wider = " or ".join(d for d in ("bf16", "fp32") if d != dtype)
        raise ValueError(
            f"--dtype {dtype}: {len(overflow)} tensor(s) overflow {dtype} (values up to {largest:.4g}, "
            f"its largest is {torch.finfo(DTYPES[dtype]).max:.4g}): {_counts(overflow)}; export as --dtype {wider}"
        )


def _bad_values(value: torch.Tensor, dtype: torch.dtype) -> tuple[int, int, float]:
    """(non-finite values, finite values that `dtype` turns into inf, the largest of those) of
    `value`. One min-max pass decides the common case (NaN propagates through it; torch's
    isfinite is an order of magnitude slower); the counts are taken only when something is wrong."""
    if not value.numel():
        return 0, 0, 0.0
    lo, hi = (float(v) for v in value.aminmax())
    if math.isfinite(lo) and math.isfinite(hi) and max(-lo, hi) <= torch.finfo(dtype).max:
        return 0, 0, 0.0
    finite = torch.isfinite(value)
    cast = torch.isinf(value.to(dtype)) & finite
    top = float(value[cast].abs().max()) if bool(cast.any()) else 0.0
    return int((~finite).sum()), int(cast.sum()), top


def _counts(found: dict[str, int], most: int = 5) -> str:
    """'a (3 values), b (1 value)' for the first `most`, and how many more."""
    shown = [f"{name} ({n} value{'s' if n != 1 else ''})" for name, n in list(found.items())[:most]]
    return ", ".join(shown) + (f" and {len(found) - most} more" if len(found) > most else "")


def _write(tmp: Path, weights: _Weights, read: Callable, texts: dict[str, str], copies: dict[str, Path]) -> None:
    """The model directory's files into `tmp`: the weights a file at a time (widest tensors first:
    stable and aligned), the index when there are several, the texts, the copied files."""
    for file, group in zip(weights.files, weights.groups):
        entries = []
        for fqn in sorted(group, key=lambda fqn: -weights.dtypes[fqn].itemsize):
            meta, dtype = weights.tensors[fqn], weights.dtypes[fqn]
            entries.append((weights.names[fqn], torch.Size(meta.size), dtype, partial(read, fqn, meta, dtype)))
        _write_safetensors(tmp / file, entries)
    if len(weights.files) > 1:
        weight_map = {weights.names[fqn]: file for file, group in zip(weights.files, weights.groups) for fqn in group}
        total = sum(weights.sizes.values())
        (tmp / INDEX).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
        )
    for name, text in texts.items():
        (tmp / name).write_text(text)
    for name, source in copies.items():
        shutil.copyfile(source, tmp / name)


def _publish(out: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` into a temporary directory beside `out`, renamed to `out` when it is done: `out`
    is complete or absent (an empty `out`, checked by the caller, is replaced)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as err:
        raise ValueError(f"cannot write {out}: {err}") from None
    try:
        write(tmp)
        if out.exists():
            out.rmdir()  # empty, checked by the caller
        os.replace(tmp, out)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"cannot write {out}: {err}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_hf(
    run: str | os.PathLike,
    out: str | os.PathLike,
    *,
    step: int | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    dtype: str | None = None,
    merge: bool = False,
) -> Export:
    """Write checkpoint `step` (default: the newest complete one) of training run `run` as a
    Hugging Face model directory `out` (it must not exist, or be empty), its floating tensors in
    `dtype` (bf16, fp16, fp32; default `default_dtype`). ValueError names what is wrong (weights
    that are not finite, or not in `dtype`, included); nothing is left half-written. A LoRA run
    exports its adapter in peft's format, or with `merge` the base model with the adapter merged."""
    run, out = Path(run), Path(out)
    if max_shard_bytes < 1:
        raise ValueError(f"the largest file must hold at least one byte, got {max_shard_bytes}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory")
    settings = _run_settings(run)
    ckpt = _checkpoint(run, step)
    workload = _workload(settings)
    if workload.hf_format is None:
        raise ValueError(f"{workload.name} has no Hugging Face form to export to")
    form = workload.hf_format()
    lora = workload.tune.lora if workload.tune is not None else None
    if merge and lora is None:
        raise ValueError(f"--merge: {run} is not a LoRA run (trained with --lora): its export is the whole model")
    dtype = dtype or default_dtype(settings)
    metadata = _metadata(ckpt, run)
    tensors, read = _model_tensors(metadata), _tensor_reader(ckpt, metadata)
    tokenizer = _tokenizer_of(run, settings)
    texts = tokenizer_files(tokenizer)  # the tokenizer's, or made for it
    if lora is None or merge:  # the whole model, as the base model's own directory
        name = form.name
        if form.join is not None:
            tensors, read = form.join(tensors, read)
        if lora is not None:
            tensors, read = adapters.merged(tensors, read, lora.scale)
            name = lambda fqn: form.name(adapters.base_name(fqn))  # noqa: E731
        weights = _weights(ckpt, tensors, name, DTYPES[dtype], max_shard_bytes)
        texts = dict(form.files) | texts
        texts["config.json"] = _config(texts["config.json"], DTYPES[dtype])
    else:  # the adapter alone, in peft's format
        tensors = {fqn: meta for fqn, meta in tensors.items() if adapters.is_adapter(fqn)}
        weights = _weights(ckpt, tensors, adapters.adapter_name, DTYPES[dtype], 2**63, adapters.ADAPTER_WEIGHTS)
        base = settings["model"].removeprefix("hf:") if settings["model"].startswith("hf:") else None
        texts[adapters.ADAPTER_CONFIG] = adapters.adapter_config(workload.build("meta"), base)
    copies = {name: file for name, file in _source_files(settings, tokenizer).items() if name not in texts}
    if lora is not None and not merge:
        copies = {name: file for name, file in copies.items() if name != "generation_config.json"}
    _check_values(weights, read, ckpt, run, dtype)  # before anything is written
    _publish(out, lambda tmp: _write(tmp, weights, read, texts, copies))
    others = tuple(sorted(set(texts) | set(copies)))
    return Export(out, ckpt.step, weights.files, len(weights.tensors), sum(weights.sizes.values()), dtype, others)


def _workload(settings: dict) -> Workload:
    """The run's model as it trained: its vocabulary, and --lora and --freeze applied."""
    workload = get_workload(settings["model"], int(settings.get("seq", 1)))
    if settings.get("vocab_size") and workload.resize_vocab is not None:  # trained with a tokenizer's vocabulary
        workload = workload.resize_vocab(int(settings["vocab_size"]))
    return fine_tuned(workload, FineTune.from_flags(settings.get("lora"), settings.get("freeze")))
