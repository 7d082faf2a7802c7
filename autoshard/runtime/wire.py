"""Bytes on the wire per rank, measured by watching the collectives a piece of code runs.

`WireMeter` is a dispatch mode that sees every collective reaching torch's dispatcher on this rank:
functional collectives (`_c10d_functional.*`, which autoshard's executor and DTensor call) and the
c10d ops behind `torch.distributed.*` (which FSDP2 calls). It prices each one with the
bandwidth-optimal ring model, so two programs measured with it compare like for like whatever
library issued their collectives:

    all-gather, reduce-scatter   (n-1)/n x the full (gathered / unreduced) tensor
    all-reduce                   2 (n-1)/n x the tensor
    all-to-all                   (n-1)/n x the tensor (uneven splits priced as even ones)
    permute                      1 x the tensor (an all-to-all sending all of it to one peer:
                                 how autoshard's executor exchanges shards between device orders)

    with WireMeter() as meter:
        loss = model(x); loss.backward(); optim.step()
    meter.stats.total_bytes

Collectives it does not price (broadcast, send/recv, barrier...) are counted in `unpriced`.
`wire_row` gathers every rank's figures into the `metrics.jsonl` fields both the autoshard trainer
and the hand-written recipe benchmark write, so their rows read alike.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from autoshard import _torch_compat as tc
from autoshard.pricing.ring import wire_bytes

_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d")

# op name (functional and c10d spellings) -> collective kind
_KIND = {
    **dict.fromkeys(
        (
            "all_gather_into_tensor",
            "all_gather_into_tensor_out",
            "all_gather_into_tensor_coalesced",
            "allgather_",
            "_allgather_base_",
            "allgather_coalesced_",
            "allgather_into_tensor_coalesced_",
        ),
        "all_gather",
    ),
    **dict.fromkeys(
        (
            "reduce_scatter_tensor",
            "reduce_scatter_tensor_out",
            "reduce_scatter_tensor_coalesced",
            "reduce_scatter_",
            "_reduce_scatter_base_",
            "reduce_scatter_tensor_coalesced_",
        ),
        "reduce_scatter",
    ),
    **dict.fromkeys(
        (
            "all_reduce",
            "all_reduce_",
            "all_reduce_coalesced",
            "all_reduce_coalesced_",
            "allreduce_",
            "allreduce_coalesced_",
        ),
        "all_reduce",
    ),
    **dict.fromkeys(("all_to_all_single", "alltoall_", "alltoall_base_"), "all_to_all"),
}
# Not communication: waits and autograd plumbing.
_LOCAL = {"wait_tensor", "_wrap_tensor_autograd", "check_for_nan"}
# The schema argument holding what this rank contributes, under its various spellings.
_INPUT_ARGS = ("input", "inputs", "input_tensor", "input_tensors", "input_list", "tensors")


def ring_bytes(kind: str, input_bytes: float, n: int) -> float:
    """Bytes one rank sends for a collective over `n` ranks whose per-rank input is `input_bytes`:
    the planner's own ring formulas (`pricing.ring`), so metered and priced bytes cannot drift."""
    if kind not in _METERED:
        raise ValueError(f"no ring model for collective kind {kind!r}")
    return wire_bytes(kind, n, input_bytes) if n > 1 else 0.0


_METERED = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "permute")


@dataclass
class WireStats:
    """What one rank sent while a `WireMeter` was active."""

    bytes: Counter = field(default_factory=Counter)  # kind -> ring-model bytes sent
    count: Counter = field(default_factory=Counter)  # kind -> collectives
    unpriced: Counter = field(default_factory=Counter)  # op name -> calls seen but not priced

    @property
    def total_bytes(self) -> int:
        return round(sum(self.bytes.values()))

    def to_json(self) -> dict[str, Any]:
        return {
            "total_bytes": self.total_bytes,
            "bytes": {k: round(v) for k, v in sorted(self.bytes.items())},
            "count": dict(sorted(self.count.items())),
            "unpriced": dict(sorted(self.unpriced.items())),
        }


class WireMeter(tc.TorchDispatchMode):
    """Counts the collectives run on this rank while active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.stats = WireStats()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Modes run before tensor subclasses. Let DTensor desugar its op first, so that the
        # collectives it issues on plain local tensors come back through this mode.
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        if func.namespace in _NAMESPACES:
            self._record(func, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, func, args, kwargs) -> None:
        name, bound = tc.op_call(func, args, kwargs)
        if name in _LOCAL:
            return
        kind = _KIND.get(name)
        if kind is None:
            self.stats.unpriced[name] += 1
            return
        given = next(bound[a] for a in _INPUT_ARGS if a in bound)
        if kind == "all_to_all" and sum(1 for size in bound.get("input_split_sizes") or () if size) == 1:
            kind = "permute"
        if "group_size" in bound:
            n = int(bound["group_size"])
        else:
            n = tc.group_size(bound["process_group"] if "process_group" in bound else bound["group_name"])
        self.stats.bytes[kind] += ring_bytes(kind, _nbytes(given), n)
        self.stats.count[kind] += 1


def _nbytes(x: torch.Tensor | Iterable) -> int:
    """Bytes of a tensor or of a (nested) list of tensors."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x)


def wire_row(stats: WireStats) -> dict[str, Any]:
    """Every rank calls this after a metered step: the metrics-row fields `wire_bytes_per_rank`
    (one total per rank), and rank 0's `wire_bytes_by_kind` and `wire_count_by_kind`."""
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, stats.to_json())
    return {
        "wire_bytes_per_rank": [w["total_bytes"] for w in everyone],
        "wire_bytes_by_kind": everyone[0]["bytes"],
        "wire_count_by_kind": everyone[0]["count"],
        "wire_unpriced": everyone[0]["unpriced"],
    }
