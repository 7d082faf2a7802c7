"""The dry run's memory accounting: `LiveBytes`, a dispatch mode that counts the bytes of every
live storage by what it is for, and `Replay`, one op's or redistribution's effect on memory,
recorded once and replayed on the next repeated block without dispatching the op.

Apart from `dryrun`, which walks the program node by node and tells this accounting what each
value is for (saved for the backward, a gathered parameter, a gradient).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from autoshard import _torch_compat as tc
from autoshard.program.collectives import PendingBucket

# ops that read a tensor's metadata (no kernel, no dispatch of the program's own): not counted as ops
METADATA = frozenset({"device", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim", "is_contiguous"})


@dataclass
class Replay:
    """What one op or redistribution did to memory: its outputs (new storages or views of an
    input), and how far above the bytes it keeps it peaked while running. On fake tensors a
    replay makes its outputs directly, without dispatching an op."""

    storages: list[tuple[int, torch.dtype]]  # new storages: (elements, dtype)
    outputs: list[tuple[str, int, tuple, tuple, int, torch.dtype, Any]]
    # ("new"|"input", index, shape, stride, offset, dtype, device) per output
    form: type | None  # how the outputs came: None (one tensor), tuple or list
    excess: int  # peak while running minus bytes it kept
    pending: PendingBucket | None = None  # a bucket's launch, less its buffer: replayed with a new one
    fake: Any = None  # the fake mode the outputs belong to (None: real tensors)
    ops: int = 0  # ops it dispatched: a replay counts them as dispatched again

    @staticmethod
    def record(live: "LiveBytes", run, args) -> tuple["Replay | None", Any]:
        """Run `run` (reading the tensors `args`) and record it; None if its outputs cannot be
        replayed (not all tensors, or of symbolic shape)."""
        start, ops = live.total, live.ops
        live.window = start
        result = run()
        ops = live.ops - ops
        kept, excess = live.total - start, live.window - start
        live.window = None
        pending = result if isinstance(result, PendingBucket) else None
        outs = [result] if isinstance(result, torch.Tensor) else [pending.result] if pending else result
        if not isinstance(outs, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in outs):
            return None, result
        inputs = {id(a.untyped_storage()): i for i, a in enumerate(args)}
        storages: dict[int, int] = {}
        store: list[tuple[int, torch.dtype]] = []
        outputs = []
        for t in outs:
            meta = (tuple(t.shape), t.stride(), t.storage_offset())
            if not all(type(v) is int for v in (*meta[0], *meta[1], meta[2])):
                return None, result  # symbolic sizes: each run may differ
            st = t.untyped_storage()
            if id(st) in inputs:
                outputs.append(("input", inputs[id(st)], *meta, t.dtype, t.device))
                continue
            if id(st) not in storages:
                storages[id(st)] = len(store)
                store.append((st.nbytes() // t.element_size(), t.dtype))
            outputs.append(("new", storages[id(st)], *meta, t.dtype, t.device))
        form = None if isinstance(result, torch.Tensor) or pending else type(result)
        fake = tc.fake_mode_of(outs[0]) if outs else None
        launch = pending and dataclasses.replace(pending, result=None)
        return Replay(store, outputs, form, max(0, excess - kept), launch, fake, ops), result

    def replay(self, live: "LiveBytes", args) -> Any:
        if self.fake is not None:
            outs = tc.make_fake_tensors(
                self.fake,
                self.storages,
                [
                    (i if kind == "new" else args[i].untyped_storage(), shape, stride, offset, dtype, device)
                    for kind, i, shape, stride, offset, dtype, device in self.outputs
                ],
            )
            live.add(outs, "transient")
        else:
            on = {i: device for kind, i, *_, device in self.outputs if kind == "new"}  # a GPU value's storage too
            bufs = [torch.empty(n, dtype=dtype, device=on.get(i)) for i, (n, dtype) in enumerate(self.storages)]
            outs = [
                (bufs[i] if kind == "new" else args[i]).as_strided(shape, stride, offset)
                for kind, i, shape, stride, offset, _, _ in self.outputs
            ]
        live.update_peak(extra=self.excess)
        live.ops += self.ops
        if self.pending is not None:
            return dataclasses.replace(self.pending, result=outs[0])
        return outs[0] if self.form is None else self.form(outs)


class LiveBytes(tc.DispatchMode):
    """Bytes of every live storage by category. A storage is counted once however many views
    share it, from the op that creates it until it is freed; new storages start as `transient`
    and are re-filed by the interpreter once it knows what the value is for. `fixed` bytes (the
    optimizer states) are live throughout."""

    def __init__(self):
        super().__init__()
        self.kind: dict[int, str] = {}  # id(storage) -> category
        self.size: dict[int, int] = {}
        self.live: Counter = Counter()
        self.total = 0
        self.fixed = 0
        self.peak = 0  # per phase, fixed bytes included
        self.overall = -1
        self.at_peak: dict[str, int] = {}
        self.peak_phase = ""
        self.phase = ""
        self.param_storages: set[int] = set()
        self.window: int | None = None  # highest total since a redistribution started
        self.replays: dict[tuple, Replay] = {}
        self.ops = 0  # dispatched (replays count what they stand for): each is host work on a GPU

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += func.overloadpacket.__name__ not in METADATA
        out = func(*args, **(kwargs or {}))
        if func is tc.WAIT_TENSOR:  # eager returns its input; fake mode a copy, which is not memory
            return args[0]
        for t in tensors_in(out):
            self._new(t)
        self.update_peak()
        return out

    def add(self, value: Any, kind: str) -> None:
        for t in tensors_in(value):
            self._new(t, kind)
        self.update_peak()

    def _new(self, t: torch.Tensor, kind: str = "transient") -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self.kind:
            return
        nbytes = st.nbytes()
        self.kind[key], self.size[key] = kind, nbytes
        self.live[kind] += nbytes
        self.total += nbytes
        weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        kind, nbytes = self.kind.pop(key, None), self.size.pop(key, 0)
        if kind is not None:
            self.live[kind] -= nbytes
            self.total -= nbytes
        self.param_storages.discard(key)

    def tag(self, value: Any, kind: str) -> int:
        """File the value's storages that are still `transient` under `kind`; their bytes."""
        moved = 0
        for t in tensors_in(value):
            key = id(t.untyped_storage())
            if self.kind.get(key) == "transient":
                self.kind[key] = kind
                self.live["transient"] -= self.size[key]
                self.live[kind] += self.size[key]
                moved += self.size[key]
        return moved

    def mark_param_storage(self, value: Any) -> None:
        self.param_storages.update(id(t.untyped_storage()) for t in tensors_in(value))

    def tag_saved(self, value: Any) -> int:
        moved = 0
        for t in tensors_in(value):
            key = id(t.untyped_storage())
            moved += self.tag(t, "gathered_params" if key in self.param_storages else "activations")
        return moved

    def update_peak(self, extra: int = 0) -> None:
        if self.window is not None:
            self.window = max(self.window, self.total + extra)
        now = self.total + self.fixed + extra
        if now > self.peak:
            self.peak = now
        if now > self.overall:
            self.overall = now
            self.at_peak = dict(self.live)
            self.at_peak["transient"] = self.at_peak.get("transient", 0) + extra
            self.peak_phase = self.phase


def tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    return []
