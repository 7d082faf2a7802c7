"""The ops rank 0's program dispatches in one forward + backward, counted on fake tensors (no
memory and no compute, so any size runs here): by where they come from (the traced graph's own
ops, single redistributions, bucket launches, bucket awaits) and by kind (kernels, views and
other metadata-only ops, waits). On a GPU each dispatch is host work and each kernel a launch:
where a program is host-bound (docs/benchmarks.md#gpu-check), these are what the host does.

    python -m benchmarks.executor.op_counts                  # llama3-8b (8, 8), batch 8, seq 8192, bf16 / fp32
    python -m benchmarks.executor.op_counts --model llama3-70b --mesh 64x8 --batch 64 [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard import _torch_compat as tc
from autoshard.program.modules import AwaitBucket, Bucket, Redistribute
from autoshard.runtime.live_bytes import METADATA
from benchmarks.gpu.check.measure import local_values
from benchmarks.gpu.check.parts import auto_shard

WHERE = {Redistribute: "redistributions", Bucket: "bucket launches", AwaitBucket: "bucket awaits"}
# no kernel of their own: views, and allocations (their memory comes from the caching allocator)
VIEWS = set(
    "view _unsafe_view reshape t transpose permute slice narrow expand as_strided unsqueeze squeeze split "
    "split_with_sizes chunk detach alias select unbind movedim view_as _reshape_alias unflatten flatten "
    "empty new_empty empty_strided empty_permuted".split()
)


class Counter(TorchDispatchMode):
    """Counts each dispatched op under the module kind running it (`where`), by kind and by name."""

    def __init__(self) -> None:
        super().__init__()
        self.where = "graph"
        self.kinds: collections.Counter = collections.Counter()
        self.names: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name not in METADATA:
            kind = "waits" if name == "wait_tensor" else "views and allocations" if name in VIEWS else "kernels"
            self.kinds[(self.where, kind)] += 1
            self.names[(self.where, name)] += 1
        return func(*args, **(kwargs or {}))


def _counted(forward: Any, counter: Counter, where: str) -> Any:
    def counted(self: Any, *args: Any) -> Any:
        outer, counter.where = counter.where, where
        try:
            return forward(self, *args)
        finally:
            counter.where = outer

    return counted


def count(model: str, mesh: tuple[int, ...], batch: int, seq: int, network: str, device: str) -> dict:
    """Plan `model` as `plan` does (bf16 / fp32), lower rank 0's program and run it once forward
    and backward on fake tensors under the counter."""
    from autoshard.driver.config import PlanConfig
    from autoshard.program.lower import lower
    from autoshard.workloads import get_workload

    workload = get_workload(model, seq)
    config = PlanConfig(mesh=mesh, param_dtype="bf16", reduce_dtype="fp32", network=network, device_profile=device)
    counter = Counter()
    with tc.fake_process_group(math.prod(mesh)):
        auto = auto_shard(workload, config, batch, seq)
        plan = auto.optimize(dry_run=False)
        program = lower(plan, init_device_mesh("cpu", mesh, mesh_dim_names=auto.config.mesh_names))
        originals = {cls: cls.forward for cls in WHERE}
        for cls, where in WHERE.items():  # the counter files each op under the module running it
            setattr(cls, "forward", _counted(originals[cls], counter, where))
        try:
            with tc.new_fake_mode():
                values = local_values(program.forward, "cpu", workload.vocab_size)
                with counter:
                    loss, *saved = program.forward(*values)
                    program.backward(*saved, torch.ones((), dtype=loss.dtype))
        finally:
            for cls, forward in originals.items():
                setattr(cls, "forward", forward)
    wheres = ["graph", *WHERE.values()]
    kinds = ["kernels", "views and allocations", "waits"]
    return {
        "case": f"{model} {mesh}, batch {batch}, seq {seq}, bf16 / fp32",
        "plan": plan.summary(),
        "counts": {w: {k: counter.kinds[(w, k)] for k in kinds} for w in wheres},
        "ops": {
            w: dict(sorted(((n, c) for (x, n), c in counter.names.items() if x == w), key=lambda i: -i[1]))
            for w in wheres
        },  # fmt: skip  # fmt: skip
    }


def markdown(result: dict) -> str:
    lines = [
        f"rank 0's program, one forward + backward: {result['case']}",
        "",
        "| where | kernels | views and allocations | waits | all | most dispatched |",
        "|---|---|---|---|---|---|",
    ]
    total = collections.Counter()
    for where, kinds in result["counts"].items():
        total.update(kinds)
        top = ", ".join(f"{n} {c}" for n, c in list(result["ops"][where].items())[:8])
        lines.append(f"| {where} | {' | '.join(f'{v:,}' for v in kinds.values())} | {sum(kinds.values()):,} | {top} |")
    lines.append(f"| all | {' | '.join(f'{v:,}' for v in total.values())} | {sum(total.values()):,} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--mesh", default="8x8", help="e.g. 8x8")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--network", default="h100-node")
    parser.add_argument("--device-profile", default="h200")
    parser.add_argument("--json", type=Path, default=None)
    a = parser.parse_args(argv)
    mesh = tuple(int(v) for v in a.mesh.split("x"))
    result = count(a.model, mesh, a.batch, a.seq, a.network, a.device_profile)
    print(markdown(result))
    if a.json is not None:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
