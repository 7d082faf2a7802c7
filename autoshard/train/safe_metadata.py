"""A checkpoint's pickled pieces, read without running code.

DCP pickles a checkpoint's `.metadata`, and `torch.save`s its non-tensor values (the optimizer's
param groups). torch reads the first with a bare `pickle.load` and the second with
`torch.load(weights_only=False)`, so a run directory received from elsewhere could run any code on
resume or export. Here `.metadata` is unpickled admitting only what DCP's metadata is made of
(the classes of `torch.distributed.checkpoint.metadata`, the file system's storage entries, torch
dtypes, layouts and `Size`, paths, plain builtins), and values go through torch's weights-only
unpickler. Anything else is an `UnsafeCheckpointError` naming the file, raised before the object
it asks for is built: nothing of the file runs.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from pathlib import Path
from typing import Any

import torch

from autoshard.options import UsageError

METADATA = ".metadata"
_DCP = "torch.distributed.checkpoint.metadata"
_PATHS = ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
# (module, name) of every global a genuine .metadata may name (listed with pickletools from what
# torch 2.11-2.14 write: StorageMeta.checkpoint_id is a path, TensorProperties a layout and an enum)
ADMITTED = frozenset(
    {
        (_DCP, name)
        for name in (
            "Metadata",
            "StorageMeta",
            "MetadataIndex",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
    | {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
    | {(module, name) for module in ("pathlib", "pathlib._local") for name in _PATHS}
    | {("builtins", name) for name in ("set", "frozenset", "bytearray", "complex", "slice")}
)


class UnsafeCheckpointError(UsageError):
    """A checkpoint file whose pickle asks for something no checkpoint holds (a function to call,
    a class of another module): it was crafted, or is not a checkpoint; refused, nothing run."""


def _admitted(module: str, name: str) -> bool:
    if (module, name) in ADMITTED:
        return True
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)  # torch.float32...


class _Unpickler(pickle.Unpickler):
    """pickle's documented way to restrict what a pickle may build: every global it names goes
    through `find_class` (the payload of a `__reduce__` is such a global)."""

    def __init__(self, file: Any, source: Path):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if _admitted(module, name):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.source}: refused: its pickle asks for {module}.{name}, which no checkpoint holds (unpickling "
            "it could run code); nothing of it was loaded"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self.source}: refused: its pickle refers to outside objects; nothing was loaded")


def read_metadata(checkpoint: Path) -> Any:
    """The DCP metadata of checkpoint directory `checkpoint`. UnsafeCheckpointError when its pickle
    asks for anything else; OSError when it cannot be read; pickle.UnpicklingError when it is
    damaged or not DCP metadata."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = checkpoint / METADATA
    data = path.read_bytes()
    try:
        _check_lengths(data)
        metadata = _Unpickler(io.BytesIO(data), path).load()
    except (UnsafeCheckpointError, OSError):
        raise
    except Exception as err:  # noqa: BLE001 - a damaged pickle raises almost anything
        raise pickle.UnpicklingError(f"{type(err).__name__}: {err}") from None
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP metadata")
    _check(metadata)
    return metadata


def _check_lengths(data: bytes) -> None:
    """ValueError for an opcode whose length runs past the end of the pickle: the C unpickler
    allocates that length before it finds the data missing (a 32-byte file could ask for 2 GiB).
    pickletools reads each argument from what is there."""
    for _ in pickletools.genops(data):
        pass


def _check(metadata: Any) -> None:
    """What torch's loaders rely on, checked before they use it: the pickle's objects are of the
    right classes (any of the admitted ones could stand anywhere), and every data file is a plain
    name in the checkpoint's directory, not a path out of it."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict) or not all(
        isinstance(k, str) and isinstance(v, (TensorStorageMetadata, BytesStorageMetadata)) for k, v in entries.items()
    ):
        raise pickle.UnpicklingError("its state_dict_metadata is not DCP's")
    for name, entry in entries.items():
        if isinstance(entry, TensorStorageMetadata) and not _tensor_entry(entry):
            raise pickle.UnpicklingError(f"its entry for {name} is not a tensor's (dtype, shape and chunks)")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise pickle.UnpicklingError("its storage_data is not DCP's")
    for index, info in storage.items():
        file = getattr(info, "relative_path", None)
        if not isinstance(index, MetadataIndex) or not isinstance(file, str):
            raise pickle.UnpicklingError("its storage_data is not DCP's")
        if file in ("", ".", "..") or Path(file).name != file or "\\" in file:
            raise pickle.UnpicklingError(f"it names a data file {file!r} outside the checkpoint's directory")
        if not (
            isinstance(info.offset, int) and isinstance(info.length, int) and info.offset >= 0 and info.length >= 0
        ):
            raise pickle.UnpicklingError(f"its entry for {file} has no valid offset and length")


def _tensor_entry(entry: Any) -> bool:
    """A tensor's entry: a dtype, a shape, and chunks of its rank lying inside it."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    size = entry.size
    if not isinstance(getattr(entry.properties, "dtype", None), torch.dtype) or not isinstance(size, torch.Size):
        return False
    return isinstance(entry.chunks, list) and all(
        isinstance(c, ChunkStorageMetadata)
        and isinstance(c.offsets, torch.Size)
        and isinstance(c.sizes, torch.Size)
        and len(c.offsets) == len(c.sizes) == len(size)
        and all(0 <= o and 0 <= n and o + n <= d for o, n, d in zip(c.offsets, c.sizes, size))
        for c in entry.chunks
    )


def load_value(value: io.BytesIO, source: str) -> Any:
    """A non-tensor value of a checkpoint (bytes DCP wrote with torch.save) through torch's
    weights-only unpickler; UnsafeCheckpointError naming `source` (its file) when refused."""
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as err:
        lines = [line for line in str(err).splitlines() if line.strip()]
        if not lines or not lines[0].startswith("Weights only load failed"):
            raise
        why = next((line for line in lines[1:] if "GLOBAL" in line or "nsupported" in line), lines[-1])
        why = why.split(". Please")[0].strip().rstrip(".")  # not torch's advice to allowlist it
        raise UnsafeCheckpointError(f"{source}: refused: a value in it is not plain data ({why})") from None
