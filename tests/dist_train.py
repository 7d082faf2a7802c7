"""Run under `torchrun --standalone --nproc_per_node=4`: real gloo processes on a (2,2) mesh plan
llama3-tiny, build the parallel module and train 5 AdamW steps; every rank checks its losses
against the single-device run. Prints ALL OK on rank 0."""

import hashlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autoshard.api import AutoShard
from autoshard.apply import parallelize
from models import MarkovTokens, build_model, cross_entropy_loss, get_config
from models.train_single import TrainSettings, train_single, make_optimizer

STEPS, BATCH, SEQ = 5, 8, 16


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cfg = get_config("llama3-tiny")
    example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    with AutoShard(build_model(cfg, device="meta"), example, mesh, loss_fn=cross_entropy_loss) as auto:
        auto.constrain_inputs("S(0)R", "S(0)R")
        plan = auto.optimize()
    digest = hashlib.sha256(repr(sorted((k, str(s)) for k, s in plan.strategies.items())).encode()).hexdigest()
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    assert len(set(digests)) == 1, "ranks planned differently"

    settings = TrainSettings(model="llama3-tiny", steps=STEPS, batch=BATCH, seq=SEQ)
    want = train_single(settings).losses
    pmodel = parallelize(plan, mesh, build_model(cfg, device="meta"))
    pmodel.init_weights(settings.seed)
    optim = make_optimizer(pmodel.parameters(), settings)
    data = MarkovTokens(cfg.vocab_size, seed=settings.data_seed)
    for step in range(STEPS):
        batch = data.batch(step, BATCH, SEQ)
        loss = pmodel(*pmodel.shard_inputs(batch.inputs, batch.targets))
        loss.backward()
        optim.step()
        optim.zero_grad()
        assert abs(loss.item() - want[step]) <= 1e-5, (dist.get_rank(), step, loss.item(), want[step])
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"losses {[round(x, 5) for x in want]}; collectives {dict(pmodel.comm.total_count())}")
        print("ALL OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
