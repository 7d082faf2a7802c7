"""Measure what a profile describes, on the machines themselves: collectives on every process
group the planner uses, matmul throughput and memory bandwidth per dtype (`autoshard calibrate`).

Collectives are issued exactly as the executor issues them (`program/collectives.py`): functional
collectives on dim 0 of a contiguous buffer, over `(mesh, dim)` for one mesh dim and over the
flattened mesh (`_torch_compat.flattened_mesh`) for several. Every rank times its own group
concurrently with the other groups of the same mesh dims, as a training step runs them. Calls run
back to back after a barrier, so each call's time is the group's, not a straggler's wait; the
sample is the median over calls, then over ranks.

Device timings run on every rank at once as well: four CPU ranks sharing two cores each get the
share of the machine a training step gets, which is what the planner should price.

The fits live in `pricing.fit` (they need the ring formulas); this module only measures.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any

import torch
import torch.distributed as dist

from autoshard import _torch_compat as tc
from autoshard.profiles.device import _physical_memory as physical_memory

KIB, MIB = 2**10, 2**20
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class CalibrationSettings:
    """What to time. Collective sizes are local input bytes per rank; the largest sizes get fewer
    calls (same counts on every rank: a collective must be called alike everywhere)."""

    sizes: tuple[int, ...] = tuple(4 * KIB * 4**i for i in range(7)) + (32 * MIB,)  # 4 KiB .. 32 MiB
    warmup: int = 2
    repeats: int = 7
    big: int = 4 * MIB  # sizes above this get `big_repeats` calls
    big_repeats: int = 3
    kinds: tuple[str, ...] = KINDS
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    matmul_sizes: tuple[int, ...] = (64, 128, 256, 512)  # n of an n x n @ n x n product
    memory_sizes: tuple[int, ...] = tuple(64 * KIB * 4**i for i in range(5))  # bytes per operand
    optimizer_sizes: tuple[int, ...] = (2**16, 2**18, 2**20, 2**22)  # fp32 parameter elements of one AdamW step
    op_chains: tuple[int, ...] = (1, 8, 64)  # tiny ops called back to back: the slope is one op's dispatch
    between_matmul: int = 256  # n of the matmuls (4 per call) a collective is issued between
    between_calls: int = 40  # calls per timed window of work alone and of work then a collective
    between_rounds: int = 3  # windows of each, alternated
    min_seconds: float = 0.2  # a device timing repeats until this much time (and `repeats` calls)

    def __post_init__(self) -> None:
        if (
            not self.sizes
            or min(self.sizes) < 1
            or self.warmup < 0
            or self.repeats < 1
            or self.big_repeats < 1
            or self.between_calls < 1
            or self.between_rounds < 1
        ):
            raise ValueError(f"bad calibration settings: {self}")
        unknown = set(self.kinds) - set(KINDS) | set(self.dtypes) - set(DTYPES)
        if unknown:
            raise ValueError(f"unknown collective kind or dtype {sorted(unknown)}; known {KINDS}, {sorted(DTYPES)}")


def planner_groups(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """The process groups the planner prices collectives on: every mesh dim of size > 1 alone,
    then every set of 2+ of them flattened (ascending, as the executor builds them)."""
    active = [m for m, s in enumerate(mesh_shape) if s > 1]
    return [g for k in range(1, len(active) + 1) for g in combinations(active, k)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _collective(kind: str, group: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    f = tc.funcol
    ops = {
        "all_gather": lambda x: tc.all_gather_single(x, 0, group),
        "reduce_scatter": lambda x: tc.reduce_scatter_single(x, "sum", 0, group),
        "all_reduce": lambda x: f.all_reduce(x, "sum", group),
        "all_to_all": lambda x: f.all_to_all_single(x, None, None, group),
    }
    op = ops[kind]
    return lambda x: tc.wait(op(x))


def _group(mesh: Any, dims: tuple[int, ...]) -> Any:
    return (mesh, dims[0]) if len(dims) == 1 else tc.flattened_mesh(mesh, dims)


def _mesh_device(mesh: Any) -> torch.device:
    """The device this rank's part of `mesh` lives on."""
    return (
        torch.device(mesh.device_type, torch.cuda.current_device())
        if mesh.device_type == "cuda"
        else torch.device(mesh.device_type)
    )


def _buffer(nbytes: int, group_size: int, device: torch.device) -> torch.Tensor:
    """A collective's fp32 input of about `nbytes`, its length divisible by the group size."""
    return torch.ones(max(group_size, nbytes // 4 // group_size * group_size), dtype=torch.float32, device=device)


def time_collectives(
    mesh: Any,
    settings: CalibrationSettings,
    progress: Callable[[str], None] = lambda line: None,
    only: Sequence[tuple[int, ...]] | None = None,
) -> list[dict]:
    """Every rank calls this at once. Returns one row per (kind, group, size) — kind, mesh_dims,
    group_size, in_bytes, seconds (median over calls, then over ranks) — on every rank; of the
    groups in `only` when given (to time those again)."""
    device = _mesh_device(mesh)
    shape = tuple(mesh.shape)
    groups = planner_groups(shape)
    for dims in groups:  # every flattened group is made now, in one order, on every rank
        _group(mesh, dims)
    mine: list[float] = []
    keys: list[tuple[str, tuple[int, ...], int, int]] = []
    for dims in groups if only is None else [g for g in groups if g in set(only)]:
        n = math.prod(shape[m] for m in dims)
        group = _group(mesh, dims)
        start = time.perf_counter()
        for kind in settings.kinds:
            run = _collective(kind, group)
            for size in settings.sizes:
                x = _buffer(size, n, device)
                calls = settings.big_repeats if size > settings.big else settings.repeats
                for _ in range(settings.warmup):
                    run(x)
                _sync(device)
                dist.barrier()
                times = []
                t0 = time.perf_counter()
                for _ in range(calls):
                    run(x)
                    _sync(device)
                    t1 = time.perf_counter()
                    times.append(t1 - t0)
                    t0 = t1
                mine.append(statistics.median(times))
                keys.append((kind, dims, n, x.numel() * 4))
        progress(
            f"collectives on mesh dims {list(dims)} ({n} ranks): {', '.join(settings.kinds)} x "
            f"{len(settings.sizes)} sizes {_size(settings.sizes[0])}..{_size(settings.sizes[-1])} in "
            f"{time.perf_counter() - start:.1f} s"
        )
    everyone: list[list[float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [
        {
            "kind": kind,
            "mesh_dims": list(dims),
            "group_size": n,
            "in_bytes": nbytes,
            "seconds": statistics.median(rank[i] for rank in everyone),
        }
        for i, (kind, dims, n, nbytes) in enumerate(keys)
    ]


def time_collectives_between_compute(
    mesh: Any, settings: CalibrationSettings, progress: Callable[[str], None] = lambda line: None
) -> list[dict]:
    """Every rank calls this at once. A step issues its collectives between ops, not back to back
    as `time_collectives` times them: each one has to meet its peers again after computing, and
    where ranks share cores a peer may be descheduled then. Per planner group, windows of a few
    milliseconds of matmuls (`work`) alone and of `work` then the smallest all-reduce, alternated;
    returns one row per group (kind, mesh_dims, group_size, in_bytes, work_s, both_s: mean seconds
    per call, median over windows, then over ranks) on every rank; `pricing.fit` turns the
    difference into what a collective costs a step beyond its back-to-back time."""
    device = _mesh_device(mesh)
    shape = tuple(mesh.shape)
    n = settings.between_matmul
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    c = torch.empty(n, n, device=device)

    def work() -> None:
        for _ in range(4):
            torch.mm(a, b, out=c)

    def window(fn: Callable[[], Any]) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(settings.between_calls):
            fn()
            _sync(device)
        return (time.perf_counter() - t0) / settings.between_calls

    start = time.perf_counter()
    mine, keys = [], []
    for dims in planner_groups(shape):
        size = math.prod(shape[m] for m in dims)
        x = _buffer(settings.sizes[0], size, device)
        collective = _collective("all_reduce", _group(mesh, dims))

        def both() -> None:
            work()
            collective(x)

        for _ in range(max(1, settings.warmup)):
            both()
        alone, paired = [], []
        for _ in range(settings.between_rounds):
            alone.append(window(work))
            paired.append(window(both))
        mine.append((statistics.median(alone), statistics.median(paired)))
        keys.append((dims, size, x.numel() * 4))
    everyone: list[list[tuple[float, float]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    progress(
        f"collectives between compute: the smallest all_reduce after {n}x{n} matmuls on "
        f"{len(keys)} group(s) in {time.perf_counter() - start:.1f} s"
    )
    return [
        {
            "kind": "all_reduce",
            "mesh_dims": list(dims),
            "group_size": size,
            "in_bytes": nbytes,
            "work_s": statistics.median(rank[i][0] for rank in everyone),
            "both_s": statistics.median(rank[i][1] for rank in everyone),
        }
        for i, (dims, size, nbytes) in enumerate(keys)
    ]


def _timed(fn: Callable[[], Any], device: torch.device, settings: CalibrationSettings) -> float:
    """Mean seconds of one call over a window of `repeats` calls and at least `min_seconds`,
    after warm-up. The mean, not the median: ranks sharing cores are descheduled part of the
    window, and a training step pays for that too."""
    for _ in range(max(1, settings.warmup)):
        fn()
    _sync(device)
    calls = 0
    t0 = time.perf_counter()
    while calls < settings.repeats or time.perf_counter() - t0 < settings.min_seconds:
        fn()
        _sync(device)
        calls += 1
    return (time.perf_counter() - t0) / calls


def time_step_parts(
    device: torch.device, settings: CalibrationSettings, progress: Callable[[str], None] = lambda line: None
) -> dict[str, list[dict]]:
    """What a training step pays besides its ops' work, on this rank: {"dispatch": [{ops,
    seconds}]}, chains of that many tiny ops called as the lowered program calls them
    (`torch.ops.aten` from Python: the slope is the per-op overhead), and {"optimizer":
    [{elements, seconds}]}, torch's fused AdamW step over fp32 parameters of that many elements in
    all (16 tensors, as a model has many)."""
    start = time.perf_counter()
    a, b = torch.ones(8, device=device), torch.ones(8, device=device)
    add = torch.ops.aten.add.Tensor

    def chain(n: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(n):
                add(a, b)

        return run

    dispatch = [{"ops": float(n), "seconds": _timed(chain(n), device, settings)} for n in settings.op_chains]
    optimizer = []
    for elements in settings.optimizer_sizes:
        params = [torch.zeros(max(1, elements // 16), device=device, requires_grad=True) for _ in range(16)]
        for p in params:
            p.grad = torch.ones_like(p)
        optim = torch.optim.AdamW(params, lr=1e-3, fused=True)
        optimizer.append(
            {"elements": float(sum(p.numel() for p in params)), "seconds": _timed(optim.step, device, settings)}
        )
    progress(
        f"device {device.type}: op dispatch, fused AdamW over {settings.optimizer_sizes[0]:,}.."
        f"{settings.optimizer_sizes[-1]:,} elements in {time.perf_counter() - start:.1f} s"
    )
    return {"dispatch": dispatch, "optimizer": optimizer}


def time_device(
    device: torch.device, settings: CalibrationSettings, progress: Callable[[str], None] = lambda line: None
) -> dict[str, dict[str, list[dict]]]:
    """{dtype: {"matmul": [{flops, seconds}], "memory": [{bytes, seconds}]}} on this rank:
    n x n matmuls (2 n^3 flops) and an elementwise add (two operands read, one written: the bytes
    the roofline counts for a node are its inputs' plus its outputs')."""
    out: dict[str, dict[str, list[dict]]] = {}
    for name in settings.dtypes:
        dtype = DTYPES[name]
        start = time.perf_counter()
        matmul = []
        for n in settings.matmul_sizes:
            a = torch.randn(n, n, device=device).to(dtype)
            b = torch.randn(n, n, device=device).to(dtype)
            c = torch.empty(n, n, device=device, dtype=dtype)
            matmul.append(
                {"n": n, "flops": 2.0 * n**3, "seconds": _timed(lambda: torch.mm(a, b, out=c), device, settings)}
            )
        memory = []
        for size in settings.memory_sizes:
            numel = max(1, size // dtype.itemsize)
            a, b = torch.ones(numel, device=device, dtype=dtype), torch.ones(numel, device=device, dtype=dtype)
            c = torch.empty_like(a)
            memory.append(
                {
                    "bytes": 3.0 * numel * dtype.itemsize,
                    "seconds": _timed(lambda: torch.add(a, b, out=c), device, settings),
                }
            )
        out[name] = {"matmul": matmul, "memory": memory}
        progress(
            f"device {device.type} {name}: matmul n={','.join(map(str, settings.matmul_sizes))}, elementwise "
            f"{_size(settings.memory_sizes[0])}..{_size(settings.memory_sizes[-1])} in "
            f"{time.perf_counter() - start:.1f} s"
        )
    return out


def memory_capacity(device: torch.device) -> float:
    """Bytes of memory one device has: the GPU's, or this machine's RAM for CPU ranks."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return physical_memory()


def _size(nbytes: float) -> str:
    return f"{nbytes / MIB:g} MiB" if nbytes >= MIB else f"{nbytes / KIB:g} KiB"
