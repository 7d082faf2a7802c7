"""torchrun script for tests/test_random.py: HF GPT-2 (tiny, dropout 0.1) on a (2,2) gloo mesh, each
rank's generator seeded differently (as for a per-rank data order); 3 AdamW steps. Reports per rank
the losses and a digest of each parameter's local shard with the shard it is (its coordinates on
the mesh dims that split it); then the same with dropout 0 beside the single-device losses."""

from __future__ import annotations

import hashlib
import os
import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from autoshard import auto_shard  # noqa: E402
from autoshard.workloads import hf  # noqa: E402
from autoshard.workloads.base import full_state  # noqa: E402
from autoshard_models import MarkovTokens, cross_entropy_loss  # noqa: E402
from autoshard_models.train_single import TrainSettings, make_optimizer  # noqa: E402
from plan_audit import batch_on_dp, budget_bytes  # noqa: E402
from torchrun import report_ranks  # noqa: E402

BATCH, SEQ, VOCAB, STEPS = 4, 16, 128, 3


def config(p: float):
    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=p,
        embd_pdrop=p,
        attn_pdrop=p,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
        attn_implementation="sdpa",
    )


def loss_fn(outputs, targets):  # AutoShard hands it the logits; the single device its outputs
    return cross_entropy_loss(getattr(outputs, "logits", outputs), targets)


def single_device(cfg) -> list[float]:
    model = hf.build(cfg, "cpu", seed=0)
    optim = make_optimizer(model.parameters(), TrainSettings())
    losses = []
    for step in range(STEPS):
        batch = MarkovTokens(VOCAB, seed=0).batch(step, BATCH, SEQ)
        loss = loss_fn(model(batch.inputs), batch.targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def train(mesh, cfg, rank: int) -> tuple[list[float], dict[str, list]]:
    example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    meta = hf.build(cfg, "meta")
    pmodel = auto_shard(
        meta,
        example,
        mesh,
        loss_fn=loss_fn,
        seed=5,
        memory_budget=budget_bytes(meta, (2, 2)),
        input_layouts=(batch_on_dp(2),) * 2,
    )
    pmodel.load_full(full_state(hf.build(cfg, "cpu", seed=0)))
    optim = make_optimizer(pmodel.parameters(), TrainSettings())
    torch.manual_seed(1000 + rank)  # every rank's own generator state
    losses = []
    for step in range(STEPS):
        batch = MarkovTokens(VOCAB, seed=0).batch(step, BATCH, SEQ)
        loss = pmodel(*pmodel.shard_inputs(batch.inputs, batch.targets))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    coord = mesh.get_coordinate()
    shards = {}
    for name, p in pmodel.named_parameters():
        split = [coord[d] for d, pl in enumerate(p.placements) if not pl.is_replicate()]
        digest = hashlib.sha256(p.to_local().detach().contiguous().numpy().tobytes()).hexdigest()[:16]
        shards[name] = [split, digest]
    return losses, shards


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    losses, shards = train(mesh, config(0.1), rank)
    exact, _ = train(mesh, config(0.0), rank)
    report_ranks(
        {
            "rank": rank,
            "losses": losses,
            "shards": shards,
            "no_dropout": exact,
            "single_device": single_device(config(0.0)) if rank == 0 else None,
        }
    )


if __name__ == "__main__":
    main()
