"""DCP's file reader and load planner, minus their two unrestricted unpicklers.

torch 2.11 through 2.14 read a checkpoint's `.metadata` with a bare `pickle.load`
(`FileSystemReader.read_metadata`) and its non-tensor values with `torch.load(weights_only=False)`
(`DefaultLoadPlanner.load_bytes`), and offer no argument to change either. The subclasses here
take the metadata already read (by the caller, safely) and decode values with the caller's
function, keeping the rest of what those two methods do (the load id, the state dict's nesting:
private attributes and `_traverse.set_element`). torch.distributed.checkpoint is imported on first
use, not with autoshard (it costs ~0.5 s).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any


def dcp_reader(path: Path, metadata: Any) -> Any:
    """A FileSystemReader of checkpoint directory `path` whose `.metadata` is `metadata` (torch's
    would unpickle the file again, unrestricted)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id  # as torch's does
            return metadata

    return _Reader(str(path))


def dcp_planner(load_value: Callable[[io.BytesIO, str], Any], **kwargs: Any) -> Any:
    """A DefaultLoadPlanner (its `kwargs`) that decodes a non-tensor value with
    `load_value(bytes, file)`, `file` the data file's name in the checkpoint."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class _Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            info = self.metadata.storage_data.get(read_item.storage_index) if self.metadata else None
            obj = load_value(value, str(getattr(info, "relative_path", "?")))
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return _Planner(**kwargs)
