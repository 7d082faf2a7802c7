"""Many ranks in one process: LocalTensorMode (one real value per simulated rank) and the fake
process group (planning at scale, one rank's dry run), both private to torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed._local_tensor import (
    LocalTensor as LocalTensor,
)
from torch.distributed._local_tensor import (
    LocalTensorMode,
    maybe_run_for_local_tensor,
)

# Rank-specific helper code: run once per simulated rank under LocalTensorMode (returning
# per-rank ints as SymInts), and plainly in a real process.
per_rank = maybe_run_for_local_tensor


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """A fake default process group of `world_size` ranks in this process, seen from `rank` (for
    LocalTensorMode simulation, planning at scale, or one rank's dry run); destroyed on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def local_tensor_mode(world_size: int) -> LocalTensorMode:
    """Simulate `world_size` ranks in this process: tensors made inside hold one value per rank
    (`mode.disable()` for code that must compute one global value)."""
    return LocalTensorMode(world_size)


def local_tensor(per_rank_values: dict[int, torch.Tensor]) -> torch.Tensor:
    """Build a LocalTensor (one value per simulated rank)."""
    return LocalTensor(per_rank_values)


def rank_values(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """Per-rank values of a LocalTensor."""
    return dict(t._local_tensors)
