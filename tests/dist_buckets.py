"""torchrun script for tests/test_overlap.py: llama3-tiny on a (2,2) gloo mesh with every parameter
replicated (DDP's layouts), gradient all-reduces bucketed at 128 KiB. Reports per rank the order in
which the program launched and waited on each bucket (with its members and input bytes), the
losses of 3 AdamW steps and the first step's gradients, beside the single device's."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from autoshard.capture.precision import gradient_tail  # noqa: E402
from autoshard.driver.api import AutoShard  # noqa: E402
from autoshard.problem.build import grad_sink  # noqa: E402
from autoshard.program.modules import AwaitBucket, Bucket  # noqa: E402
from autoshard_models import MarkovTokens, build_model, cross_entropy_loss, get_config  # noqa: E402
from autoshard_models.train_single import TrainSettings, make_optimizer  # noqa: E402
from torchrun import report_ranks  # noqa: E402

CFG = get_config("llama3-tiny")
BATCH, SEQ, STEPS, CAP = 8, 64, 3, 128 * 2**10  # as tests/test_overlap.py plans it


def single_device() -> tuple[list[float], dict[str, list[float]]]:
    model = build_model(CFG, seed=0)
    optim = make_optimizer(model.parameters(), TrainSettings())
    losses, grads = [], {}
    for step in range(STEPS):
        batch = MarkovTokens(CFG.vocab_size, seed=0).batch(step, BATCH, SEQ)
        loss = cross_entropy_loss(model(batch.inputs), batch.targets)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.flatten()[:8].tolist() for n, p in model.named_parameters()}
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, grads


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    with AutoShard(
        build_model(CFG, device="meta"), example, mesh, loss_fn=cross_entropy_loss, network="cpu-gloo", device="cpu"
    ) as auto:
        auto.pin({"*": "RR"})
        auto.constrain_inputs("S(0)S(0)", "S(0)S(0)")  # the batch over all 4 ranks, as DDP splits it
        plan = auto.optimize()
        pmodel = auto.apply(plan, bucket_bytes=CAP)
    pmodel.init_weights(0)

    events: list[list] = []  # ("launch", bucket, members, bytes) / ("wait", bucket), as they run
    launch, wait = Bucket.forward, AwaitBucket.forward
    in_flight: dict[int, str] = {}  # id of a launched bucket's pending collective -> the bucket

    owner = {grad_sink(fqn): fqn for fqn in plan.graph.grads}  # a reduction's consumer -> its parameter
    owner |= {node.name: fqn for fqn, grad in plan.graph.grads.items() for node in gradient_tail(grad)}

    def launched(self, *xs):
        pending = launch(self, *xs)
        if self.kind == "all_reduce":
            events.append(["launch", self.name, [owner[m.consumer] for m in self.members], sum(x.nbytes for x in xs)])
            in_flight[id(pending)] = self.name
        return pending

    def waited(self, pending):
        if id(pending) in in_flight:
            events.append(["wait", in_flight.pop(id(pending))])
        return wait(self, pending)

    Bucket.forward, AwaitBucket.forward = launched, waited
    optim = make_optimizer(pmodel.parameters(), TrainSettings())
    losses, grads, first = [], {}, []
    for step in range(STEPS):
        events.clear()
        batch = MarkovTokens(CFG.vocab_size, seed=0).batch(step, BATCH, SEQ)
        loss = pmodel(*pmodel.shard_inputs(batch.inputs, batch.targets))
        loss.backward()
        if step == 0:
            grads = {n: p.grad.to_local().flatten()[:8].tolist() for n, p in pmodel.named_parameters()}
        if step == 1:  # the first step runs checked, node by node: the second is the steady one
            first = list(events)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    want_losses, want_grads = single_device()
    layouts = sorted({str(lay) for lay in plan.param_layouts.values()})
    report_ranks(
        {
            "losses": losses,
            "want_losses": want_losses,
            "grads": grads,
            "want_grads": want_grads,
            "events": first,
            "layouts": layouts,
            "cap": CAP,
        }
    )


if __name__ == "__main__":
    main()
