"""Run under `torchrun --standalone --nproc_per_node=4`: real gloo processes on a (2,2) mesh check
what `compile=True` changes (LocalTensorMode cannot: dynamo runs frames eagerly under a dispatch mode).

1. Every kind of redistribution step (the plans of dist_redistribute.py) traces under
   `torch.compile(fullgraph=True)`, functional collectives included, and gives the executor's values.
2. A collective launched early and waited late (prefetch: a launch node, compute, a wait node)
   keeps its wait after the compute once compiled with the runtime's inductor options.
3. llama3-tiny trained by two parallel modules of one plan, uncompiled and `compile=True`: per-step
   losses, the last step's gradients and the parameters after the AdamW steps.

Rank 0 prints one line `RESULT [json per rank]` with every rank's figures; the test asserts on them.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from torch import fx, nn  # noqa: E402
from torch._inductor.utils import run_and_get_code  # noqa: E402

from autoshard import _torch_compat as tc  # noqa: E402
from autoshard.driver.api import AutoShard  # noqa: E402
from autoshard.pricing.planner import Planner  # noqa: E402
from autoshard.program.collectives import execute, group_names, prepare_groups  # noqa: E402
from autoshard.runtime.module import INDUCTOR_OPTIONS, parallelize  # noqa: E402
from autoshard_models import MarkovTokens, build_model, cross_entropy_loss, get_config  # noqa: E402
from autoshard_models.train_single import TrainSettings, make_optimizer  # noqa: E402
from dist_redistribute import CASES  # noqa: E402
from torchrun import report_ranks  # noqa: E402

TINY = get_config("llama3-tiny")
BATCH, SEQ, STEPS = 8, 16, 4
PINS = {"layers.*.feed_forward.w1.weight": "S(0)S(0)[1,0]", "layers.*.attention.wo.weight": "S(1)S(1)[1,0]"}


def redistributions(mesh) -> list[dict]:
    """Each plan of CASES compiled as one graph (dynamo only: the codegen is checked by training)."""
    planner = Planner((2, 2), "cpu-gloo")
    torch.manual_seed(0)
    full = torch.randn(8, 12)
    plans = [planner.plan(src, dst, full.shape, torch.float32) for src, dst, _ in CASES]
    prepare_groups(plans, mesh)  # as lower() does: flattened groups exist before anything runs
    out = []
    for plan in plans:
        x = plan.src.shard_of(full, mesh.shape, mesh.get_coordinate()).clone()
        torch._dynamo.reset()
        names = group_names(plan, mesh)  # resolved outside compiled code, as a Redistribute module does
        got = torch.compile(
            lambda t, plan=plan, names=names: execute(plan, t, mesh, None, names), backend="eager", fullgraph=True
        )(x)
        want = execute(plan, x, mesh)
        out.append(
            {
                "plan": f"{plan.src} -> {plan.dst}",
                "kinds": [s.kind for s in plan.steps],
                "equal": torch.equal(got, want) and got.stride() == want.stride(),
            }
        )
    torch._dynamo.reset()
    return out


class _Launch(nn.Module):
    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh

    def forward(self, x):
        return {"pending": tc.funcol.all_gather_tensor(x, 0, (self.mesh, 0))}  # the executor's call


class _Wait(nn.Module):
    def forward(self, handle):
        return tc.wait(handle["pending"])


def late_wait(mesh) -> list[str]:
    """The compiled code's order of the all-gather, its wait and two matmuls of a GraphModule that
    launches the gather, multiplies, then waits (the prefetch shape)."""
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    handle = g.call_module("launch", (x,))
    mm = g.call_function(torch.mm, (g.call_function(torch.mm, (y, y)), y))
    gathered = g.call_module("wait", (handle,))
    g.output((g.call_function(torch.add, (gathered, 1.0)), mm))
    gm = fx.GraphModule({"launch": _Launch(mesh), "wait": _Wait()}, g)
    torch._dynamo.reset()
    _, (code, *_) = run_and_get_code(
        torch.compile(gm, fullgraph=True, options=INDUCTOR_OPTIONS), torch.ones(2, 3), torch.randn(16, 16)
    )
    torch._dynamo.reset()
    order = []
    for line in code.splitlines():
        for key in ("all_gather_into_tensor.default(", "wait_tensor.default(", "mm("):
            if key in line and not line.lstrip().startswith(("#", "assert")):
                order.append(key.split(".")[0].rstrip("("))
    return order


def train(pmodel, steps: int):
    """(losses, last step's local gradients, local parameters after the steps)."""
    optim = make_optimizer(pmodel.parameters(), TrainSettings())
    data = MarkovTokens(TINY.vocab_size, seed=0)
    losses = []
    for step in range(steps):
        batch = data.batch(step, BATCH, SEQ)
        loss = pmodel(*pmodel.shard_inputs(batch.inputs, batch.targets))
        loss.backward()
        grads = {n: p.grad.to_local().clone() for n, p in pmodel.named_parameters()}
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, grads, {n: p.to_local().detach() for n, p in pmodel.named_parameters()}


def fp32_tolerance_used(a: dict, b: dict) -> float:
    """Largest |a - b| / (atol + rtol |b|) over every entry, with torch.testing's fp32 tolerances
    (rtol 1.3e-6, atol 1e-5): at most 1 when every tensor passes `assert_close`."""
    return max(((a[k] - b[k]).abs() / (1e-5 + 1.3e-6 * b[k].abs())).max().item() for k in b)


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    result = {"redistributions": redistributions(mesh), "late_wait": late_wait(mesh)}
    example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    with AutoShard(
        build_model(TINY, device="meta"),
        example,
        mesh,
        loss_fn=cross_entropy_loss,
        network="cpu-gloo",
        device="cpu",
        compile=True,
    ) as auto:
        auto.constrain_inputs("S(0)R", "S(0)R")
        auto.pin(PINS)
        auto.memory_budget(sum(4 * p.numel() for p in build_model(TINY, device="meta").parameters()) / 4)  # FSDP+TP
        plan = auto.optimize()
        compiled = auto.apply(plan)
    eager = parallelize(plan, mesh, build_model(TINY, device="meta"))
    for pmodel in (compiled, eager):
        pmodel.init_weights(0)
    eager_losses, eager_grads, eager_params = train(eager, STEPS)
    losses, grads, params = train(compiled, STEPS)
    kinds = sorted({kind for phase in compiled.comm.count.values() for kind in phase})
    result |= {
        "eager_losses": eager_losses,
        "losses": losses,
        "collective_kinds": kinds,
        "grads": fp32_tolerance_used(grads, eager_grads),
        "params": fp32_tolerance_used(params, eager_params),
        "compiled": {"eager": eager.compiled, "compiled": compiled.compiled},
        "stats": {phase: vars(st) for phase, st in compiled.compile_stats.items()},
    }
    report_ranks(result)


if __name__ == "__main__":
    main()
