"""Run under `torchrun --standalone --nproc_per_node=4`: real gloo processes on a (2,2) mesh execute
a handful of plans (order change, one-shot gather / reduce-scatter / all-to-all, ...) and check
values and gradients against the full tensor chunked by hand. Prints ALL OK on rank 0."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autoshard.pricing.planner import Planner
from autoshard.program.collectives import execute
from torchrun import leave  # tests/, this script's own folder

CASES = [  # (src, dst, step kinds the plan must contain)
    ("S(0)S(0)[0,1]", "S(0)S(0)[1,0]", ["permute"]),
    ("S(0)S(0)[0,1]", "RR", ["all_gather"]),
    ("S(0)S(0)[1,0]", "RR", ["all_gather"]),
    ("S(0)S(0)[1,0]", "RS(0)", ["all_gather"]),
    ("PP", "S(0)S(0)[1,0]", ["reduce_scatter"]),
    ("PP", "RR", ["all_reduce"]),
    ("S(0)R", "S(1)R", ["all_to_all"]),
    ("S(0)S(0)[1,0]", "S(1)S(1)[1,0]", ["all_to_all"]),
    ("RS(1)", "S(1)S(0)", None),
    ("RR", "PS(1)", None),
]


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    coord = mesh.get_coordinate()
    planner = Planner((2, 2), "cpu-gloo")
    torch.manual_seed(0)  # the same full tensors on every rank
    full, cot = torch.randn(8, 12, dtype=torch.float64), torch.randn(8, 12, dtype=torch.float64)
    weight = (coord[0] * 2 + coord[1] + 1) / 10  # partial split: weights sum to 1 over the mesh
    for src_text, dst_text, kinds in CASES:
        plan = planner.plan(src_text, dst_text, full.shape, torch.float64)
        if kinds is not None:
            assert [s.kind for s in plan.steps] == kinds and len(plan.steps[0].mesh_dims) >= 1, str(plan)
        src, dst = plan.src, plan.dst
        x = src.shard_of(full, mesh.shape, coord).clone()
        if any(p.kind == "P" for p in src.placements):  # only fully partial sources here
            x = x * weight
        x.requires_grad_()
        y = execute(plan, x, mesh)
        want = dst.shard_of(full, mesh.shape, coord)
        if any(p.kind == "P" for p in dst.placements):
            total = y.detach().clone()
            for m, p in enumerate(dst.placements):
                if p.kind == "P":
                    dist.all_reduce(total, group=mesh.get_group(m))
            y_check = total
        else:
            y_check = y
        torch.testing.assert_close(y_check, want, msg=lambda m: f"{plan}: value {m}")
        # cotangent: replicated over dst P dims (dual R), split evenly over dst R dims (dual P)
        replicas = 1
        for m, p in enumerate(dst.placements):
            replicas *= mesh.shape[m] if p.kind == "R" else 1
        (y * (dst.shard_of(cot, mesh.shape, coord) / replicas)).sum().backward()
        grad = x.grad.clone()
        for m, p in enumerate(src.placements):
            if p.kind == "R":  # dual of R is a partial sum over that mesh dim
                dist.all_reduce(grad, group=mesh.get_group(m))
        torch.testing.assert_close(grad, src.shard_of(cot, mesh.shape, coord), msg=lambda m: f"{plan}: grad {m}")
        if dist.get_rank() == 0:
            print("ok", plan, flush=True)
    dist.barrier()
    if dist.get_rank() == 0:
        print("ALL OK", flush=True)
    dist.destroy_process_group()
    leave(0)


if __name__ == "__main__":
    main()
