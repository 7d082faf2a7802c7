"""A user's own data source for `autoshard.train`: any iterable of global batches.

Each item is one step's batch as the model takes it on one device, e.g. `(tokens, targets)` of
`[batch, seq]` each; every rank iterates its own copy alike and keeps the shards its layout
holds (`pmodel.shard_inputs`). The position (batches taken) is checkpointed; on resume an
iterable with its own `state_dict`/`load_state_dict` (torchdata's StatefulDataLoader) is
restored by them, any other is iterated past the batches already trained on.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from autoshard.options import UsageError


class BatchesFeed:
    """A `Feed` over an iterable of global batches (micro-batches are row slices of each)."""

    def __init__(self, batches: Iterable, pmodel: Any, micro_batches: int = 1):
        self.batches, self.pmodel, self.micro_batches = batches, pmodel, micro_batches
        self._iter: Iterator | None = None
        self._current: tuple[torch.Tensor, ...] = ()
        self.taken = 0

    def inputs(self, step: int, micro: int) -> tuple[torch.Tensor, ...]:
        if micro == 0:
            self._current = self._next(step)
        rows = self._current[0].shape[0] // self.micro_batches
        return self.pmodel.shard_inputs(*(x[micro * rows : (micro + 1) * rows] for x in self._current))

    def _next(self, step: int) -> tuple[torch.Tensor, ...]:
        if self._iter is None:
            self._iter = iter(self.batches)
        try:
            batch = next(self._iter)
        except StopIteration:
            raise UsageError(f"the data ran out at step {step} ({self.taken} batches)") from None
        self.taken += 1
        return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)

    def evaluate(self, step: int) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        own = getattr(self.batches, "state_dict", None)
        return {"batches": self.taken} | ({"source": own()} if callable(own) else {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.taken = int(state.get("batches", 0))
        restore = getattr(self.batches, "load_state_dict", None)
        if callable(restore) and "source" in state:
            restore(state["source"])
            return
        self._iter = iter(self.batches)
        for _ in range(self.taken):
            if next(self._iter, None) is None:
                raise UsageError(f"the data holds fewer than the {self.taken} batches the checkpoint trained on")
