"""Random ops (dropout's masks, `rand_like`...) with DTensor's semantics on every rank.

A random op draws from the generator of the rank that runs it, so ranks holding the same value
(a replicated dropout mask) would draw different values as soon as their generators differ, e.g.
when each rank seeds its own data order. The lowered program runs each random op (an op torch
tags `nondeterministic_seeded`) under a generator seeded from (the run's seed, the step, the op,
the shard this rank holds): ranks holding the same shard of its output draw the same values
whatever their generators' states, ranks holding different shards draw independently, a block
recomputed in the backward draws its forward's values again, and the rank's own generator is
left as it was. On CPU and GPU alike the draw is not the slice of one global draw (DTensor's
offset-based generator on CUDA): a plan's numerics with dropout match the single device's in
distribution, not value by value.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from autoshard import _torch_compat as tc
from autoshard.layout import Layout


@dataclass
class RandomStream:
    """The run's seed and the step a program is in: every seeded random op of the program reads
    them (the parallel module counts the steps)."""

    seed: int = 0
    step: int = 0


def is_random(target: Any) -> bool:
    """Whether an op may draw from a generator (torch tags such ops nondeterministic_seeded)."""
    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


def draws(node: fx.Node) -> bool:
    """Whether this call of a random op draws: not SDPA without dropout (tagged for its
    `dropout_p`), nor a dropout of probability 0 or outside training."""
    if not is_random(node.target):
        return False
    values = tc.call_arguments(node.target, node.args, node.kwargs)
    return values.get("dropout_p", values.get("p")) != 0 and values.get("train") is not False


def shard_key(node: fx.Node, layout: Layout | None, coordinate: list[int] | None) -> str:
    """What the draw of `node` depends on besides seed and step: the op and, for each mesh dim
    that splits its output (a shard or a pending sum), this rank's coordinate on that dim."""
    if layout is None or coordinate is None:
        return node.name
    split = [f"{dim}:{coordinate[dim]}" for dim, p in enumerate(layout.placements) if p.kind != "R"]
    return node.name + ("@" + ",".join(split) if split else "")


class SeededOp:
    """A random op of the program, drawing from a generator seeded by (the stream's seed and step,
    `key`); the rank's default generator keeps its state. A call_function target (FX keeps the
    object itself in the generated code's globals)."""

    def __init__(self, op: Any, stream: RandomStream, key: str, device_type: str):
        self.op, self.stream, self.key, self.device_type = op, stream, key, device_type
        self.__name__ = f"seeded_{getattr(op, '__name__', 'op').replace('.', '_')}"
        self.__module__ = __name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        stream = self.stream
        digest = hashlib.blake2b(f"{stream.seed}/{stream.step}/{self.key}".encode(), digest_size=8).digest()
        seed = int.from_bytes(digest, "little") >> 1  # a non-negative 63-bit seed
        cuda = self.device_type == "cuda"
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else [], device_type=self.device_type):
            if cuda:
                torch.cuda.manual_seed(seed)
            torch.random.default_generator.manual_seed(seed)
            return self.op(*args, **kwargs)

    def __repr__(self) -> str:
        return f"SeededOp({self.op}, {self.key!r})"
