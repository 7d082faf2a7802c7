"""The executor's own host work: what a lowered program's redistributions cost the CPU beyond the
collectives they issue.

One process, a fake process group of 4 ranks on a (2,2) mesh: collectives return at once and move
nothing, so a call's time is host work alone (Python, dispatch, the local reshapes and copies of
a small tensor). For each redistribution kind, the `Redistribute` module's call against the raw
collectives it issues, called on buffers of its input's size; for each bucketed kind, a `Bucket` of 1 and of 8 members
launched and awaited, whose difference gives the cost of one more member. Times are the best of
5 repeats of N calls.

Then a whole program: `make train`'s plan (llama3-debug on 2x2, batch 8, seq 64, the CPU presets),
and the same model pinned to the FSDP+TP recipe, lowered for rank 0 and run forward and backward on
real local tensors under the fake group: the time its redistribution modules take per step (their
host work and local copies, the buckets' concatenation included) beside the whole step's.

    python -m benchmarks.executor.host_work [--calls 2000] [--steps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard import _torch_compat as tc
from autoshard.pricing.planner import Planner
from autoshard.program.modules import AwaitBucket, Bucket, Redistribute
from benchmarks.gpu.check.measure import local_values
from benchmarks.gpu.check.parts import auto_shard

MESH, SHAPE = (2, 2), (8, 8)
SINGLE = [  # (source, destination) of one redistribution each
    ("RR", "S(0)R"),
    ("S(0)R", "RR"),
    ("S(1)R", "RR"),
    ("PR", "RR"),
    ("PR", "S(0)R"),
    ("PR", "S(1)R"),
    ("S(0)S(0)[1,0]", "RR"),
    ("S(0)S(0)", "S(0)S(0)[1,0]"),
    ("S(0)S(1)", "S(1)S(0)"),
]
BUCKETED = [("PR", "RR"), ("S(0)R", "RR"), ("S(1)R", "RR"), ("PR", "S(0)R")]


def best_us(fn: Callable[[], object], calls: int, repeats: int = 5) -> float:
    """Microseconds per call, the best of `repeats` runs of `calls` calls (after a warm-up)."""
    for _ in range(max(1, calls // 20)):
        fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return min(runs)


def raw_collectives(module: Redistribute, x: torch.Tensor) -> Callable[[], None]:
    """The collectives `module` issues, called directly on a buffer of its input's size."""
    n = x.numel()
    calls = []
    for step, name in zip(module.plan.steps, module.names):
        size = math.prod(MESH[m] for m in step.mesh_dims)
        if step.kind == "all_gather":
            calls.append(lambda name=name, size=size: tc.all_gather_now(torch.empty(n), size, name))
        elif step.kind == "reduce_scatter":
            calls.append(lambda name=name, size=size: tc.reduce_scatter_now(torch.empty(n), "sum", size, name))
        elif step.kind == "all_reduce":
            calls.append(lambda name=name: tc.all_reduce_now(torch.empty(n), "sum", name))
        elif step.kind in ("all_to_all", "permute"):
            calls.append(
                lambda name=name, size=size: tc.all_to_all_now(
                    torch.empty(n), [n // size] * size, [n // size] * size, name
                )
            )

    def run() -> None:
        for call in calls:
            call()

    return run


def measure(calls: int) -> dict:
    rows, buckets = [], []
    with tc.fake_process_group(MESH[0] * MESH[1]):
        mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("a", "b"))
        planner = Planner(MESH, "cpu-gloo")
        for src, dst in SINGLE:
            plan = planner.plan(src, dst, SHAPE, torch.float32)
            module = Redistribute(plan, mesh, "p", "c")
            x = torch.randn(plan.src.local_shape(SHAPE, MESH))
            executor = best_us(lambda: module(x), calls)
            raw = best_us(raw_collectives(module, x), calls)
            steps = " ".join(s.kind for s in plan.steps)
            rows.append({"redistribution": f"{src} -> {dst}", "steps": steps, "executor_us": executor, "raw_us": raw})
        wait = AwaitBucket()
        for src, dst in BUCKETED:
            plan = planner.plan(src, dst, SHAPE, torch.float32)
            x = torch.randn(plan.src.local_shape(SHAPE, MESH))
            times = {}
            for k in (1, 8):
                bucket = Bucket("b", [Redistribute(plan, mesh, f"p{i}", f"c{i}") for i in range(k)], mesh)
                xs = [x.clone() for _ in range(k)]
                times[k] = best_us(lambda: wait(bucket(*xs)), max(1, calls // 4))
            kind = plan.steps[0].kind
            buckets.append(
                {
                    "members": f"{src} -> {dst} ({kind})",
                    "one_us": times[1],
                    "eight_us": times[8],
                    "per_member_us": (times[8] - times[1]) / 7,
                }
            )
    return {"mesh": list(MESH), "shape": list(SHAPE), "calls": calls, "single": rows, "buckets": buckets}


def measure_program(recipe: str | None, steps: int) -> dict:
    """Rank 0's program of `make train`'s plan (or the recipe pinned), `steps` steps after a
    warm-up: seconds per step inside its redistribution modules, and of the whole forward and
    backward."""
    from autoshard.driver.config import PlanConfig
    from autoshard.problem.recipes import recipe_pins
    from autoshard.program.lower import CheckedRun, lower
    from autoshard.workloads import get_workload

    model, batch, seq = "llama3-debug", 8, 64
    workload = get_workload(model, seq)
    config = PlanConfig(mesh=MESH, network="cpu-gloo", device_profile="cpu")
    with tc.fake_process_group(MESH[0] * MESH[1]):
        auto = auto_shard(workload, config, batch, seq)
        if recipe is not None:
            auto.pin(recipe_pins(recipe, len(MESH)))
        plan = auto.optimize()
        program = lower(plan, init_device_mesh("cpu", MESH, mesh_dim_names=auto.config.mesh_names))
        spent = [0.0]
        counts = {"redistributions": 0, "buckets": 0, "members": 0}
        wrapped: set[int] = set()  # a module both programs call (the await, a recomputed one): timed once

        def timed(module: torch.nn.Module) -> None:
            call = module.forward

            def forward(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return call(*args, **kwargs)
                finally:
                    spent[0] += time.perf_counter() - start

            module.forward = forward

        for gm in (program.forward, program.backward):
            for node in (n for n in gm.graph.nodes if n.op == "call_module"):
                module = gm.get_submodule(node.target)
                if isinstance(module, Redistribute):
                    counts["redistributions"] += 1
                elif isinstance(module, Bucket):
                    counts["buckets"] += 1
                    counts["members"] += len(module.members)
                if isinstance(module, (Redistribute, Bucket, AwaitBucket)) and id(module) not in wrapped:
                    wrapped.add(id(module))
                    timed(module)
        args = local_values(program.forward, "cpu", workload.vocab_size)
        tangent = torch.ones(())
        with HostReads() as reads:  # one step apart, untimed: what waits for the device on a GPU
            _, *saved = program.forward(*args)
            program.backward(*saved, tangent)
            del saved
        figures = []
        for step in range(steps + 1):
            spent[0] = 0.0
            start = time.perf_counter()
            first = step == 0  # the warm-up, checked as a run's first step is
            forward = CheckedRun(program.forward).run if first else program.forward
            backward = CheckedRun(program.backward).run if first else program.backward
            _, *saved = forward(*args)
            backward(*saved, tangent)
            del saved
            if step:
                figures.append((spent[0], time.perf_counter() - start))
    return {
        "plan": recipe or "default",
        "summary": plan.summary(),
        **counts,
        "host_reads": reads.ops,
        "executor_s": statistics.median(f[0] for f in figures),
        "step_s": statistics.median(f[1] for f in figures),
    }


class HostReads(TorchDispatchMode):
    """The ops that hand a tensor's value to the host (`item`, `bool`, `equal`, data-dependent
    shapes): each makes a GPU's host wait for the device. (`tolist` of a CPU tensor reads its
    memory without dispatching an op, so it is not seen here.)"""

    READS = {"_local_scalar_dense", "equal", "is_nonzero", "nonzero", "masked_select", "unique_dim", "_unique2"}

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ in self.READS:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def markdown(result: dict) -> str:
    lines = [
        "| redistribution | steps | executor, us a call | its raw collectives, us | executor's own, us |",
        "|---|---|---|---|---|",
    ]
    for r in result["single"]:
        own = r["executor_us"] - r["raw_us"]
        lines.append(
            f"| `{r['redistribution']}` | {r['steps']} | {r['executor_us']:.1f} | {r['raw_us']:.1f} | {own:.1f} |"
        )
    lines += ["", "| bucket of | 1 member, us | 8 members, us | one more member, us |", "|---|---|---|---|"]
    for b in result["buckets"]:
        lines.append(f"| `{b['members']}` | {b['one_us']:.1f} | {b['eight_us']:.1f} | {b['per_member_us']:.1f} |")
    lines += [
        "",
        "| program (rank 0, llama3-debug 2x2, batch 8, seq 64) | redistributions | buckets (members) "
        "| in them, ms a step | forward + backward, ms |",
        "|---|---|---|---|---|",
    ]
    for r in result.get("programs", []):
        lines.append(
            f"| {r['plan']} | {r['redistributions']} | {r['buckets']} ({r['members']}) | "
            f"{r['executor_s'] * 1e3:.2f} | {r['step_s'] * 1e3:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per timing (default 2000)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each program (default 5)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = measure(args.calls)
    result["programs"] = [measure_program(recipe, args.steps) for recipe in (None, "fsdp-tp")]
    print(markdown(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
