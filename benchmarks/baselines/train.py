"""The hand-written baseline: torchtitan's llama3 FSDP+TP recipe, built with torch's own APIs.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 -m benchmarks.baselines.train \\
        --model llama3-debug --mesh 2x2 --batch 8 --seq 256 --steps 12 --out runs/recipe

Same model, init, data, optimizer and `metrics.jsonl` rows as `python -m autoshard train`, so
the two can be compared step by step (benchmarks.training.throughput does). The parallelization is
torchtitan's llama3 recipe: `parallelize_module` on the "tp" mesh dim (sequence parallel norms, column-wise
wq/wk/wv/w1/w3, row-wise wo/w2 reduce-scattering to sequence shards, row-wise embedding, column-wise
output with loss parallel), then `fully_shard` on the "dp" mesh dim per block and on the root.
With `--mesh Nx1` there is no TP: pure FSDP2, `fully_shard` per block and root over all N ranks.
With `--ddp` (mesh Nx1): torch's `DistributedDataParallel` over all N ranks, its default buckets
(25 MiB, the first 1 MiB) all-reduced while the backward runs: a user's first choice for a model
that fits one device.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from autoshard.driver.config import mp_policy
from autoshard.runtime.wire import WireMeter, wire_row
from autoshard_models import MarkovTokens, build_any, named_config, training_loss
from autoshard_models.train_single import TrainSettings, make_optimizer


def apply_tp(model, tp_mesh) -> None:
    """torchtitan's llama3 TP plan. The residual stream between blocks is sequence-sharded
    (local [b, s/tp, d] tensors); the logits stay a DTensor sharded on the vocab for loss parallel."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                # Attention.forward(x, cos, sin, mask): only x changes layout; the rope tables (and
                # the packed documents' mask, None here) stay plain.
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )


def apply_fsdp(model, dp_mesh, mp_policy: MixedPrecisionPolicy | None = None) -> None:
    """FSDP2 on dp: one unit per block, then the root (embedding, final norm, output)."""
    policy = mp_policy or MixedPrecisionPolicy()
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)


def lora_model(model, name: str, spec: str, seed: int, seq: int):
    """peft's LoRA over `model` as a user writes it (`get_peft_model`), the adapters starting from
    the values `autoshard train --lora` starts them from, so the loss curves compare."""
    import peft

    from autoshard.workloads import get_workload
    from autoshard.workloads.finetune import FineTune, fine_tuned, parse_lora

    lora = parse_lora(spec)
    wrapped = peft.get_peft_model(model, lora.peft_config())
    workload = fine_tuned(get_workload(name, seq), FineTune(lora))
    wrapped.load_state_dict(dict(workload.initial_values(seed, workload.init_only)), strict=False)
    return wrapped


def baseline_model(name: str, seq: int, seed: int, lora: str | None):
    """(config, model): the named model with full weights from `seed` as the single-device trainer
    builds them (its rope table long enough for `seq`), under peft's LoRA when `lora` is a spec."""
    cfg = named_config(name)
    if seq > cfg.max_seq_len:
        cfg = cfg.with_(max_seq_len=seq)
    model = build_any(cfg, seed=seed)
    return cfg, lora_model(model, name, lora, seed, seq) if lora else model


def layouts(model) -> dict[str, str]:
    """Parameter FQN -> its placements on (dp, tp), for the log (DDP: replicated everywhere)."""
    if isinstance(model, DistributedDataParallel):
        return {n: "RR (DDP)" for n, _ in model.module.named_parameters()}
    return {
        n: "".join(map(repr, p.placements)) if isinstance(p, DTensor) else "plain" for n, p in model.named_parameters()
    }


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def train(args) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh_shape = tuple(int(x) for x in args.mesh.split("x"))
    if len(mesh_shape) != 2 or mesh_shape[0] * mesh_shape[1] != world:
        raise SystemExit(f"error: --mesh {args.mesh} must be DPxTP with DP*TP = world size {world}")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
    dp, dp_rank = mesh_shape[0], mesh["dp"].get_local_rank()
    if args.batch % dp:
        raise SystemExit(f"error: --batch {args.batch} is not divisible by dp {dp}")

    cfg, model = baseline_model(args.model, args.seq, args.seed, args.lora)  # every rank: one device's weights
    loss_fn = training_loss(cfg)  # a mixture of experts adds its load-balancing loss
    tp = mesh_shape[1] > 1
    if args.ddp:
        if tp or args.param_dtype:
            raise SystemExit("error: --ddp runs plain DistributedDataParallel: mesh Nx1, no --param-dtype")
        model = DistributedDataParallel(model)  # every rank; gradients averaged over the world
    else:
        if tp:  # Nx1: pure FSDP2 over every rank
            apply_tp(model, mesh["tp"])
        apply_fsdp(model, mesh["dp"], mp_policy(args.param_dtype, args.reduce_dtype))
    optim = make_optimizer([p for p in model.parameters() if p.requires_grad], TrainSettings(lr=args.lr))

    out = Path(args.out)
    metrics_path = out / "metrics.jsonl"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "layouts.json").write_text(json.dumps(layouts(model), indent=1))
        metrics_path.write_text("")
    data = MarkovTokens(cfg.vocab_size, seed=args.data_seed)
    tokens, local = args.batch * args.seq, args.batch // dp
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        batch = data.batch(step - 1, args.batch, args.seq)
        inputs = batch.inputs[dp_rank * local : (dp_rank + 1) * local]
        targets = batch.targets[dp_rank * local : (dp_rank + 1) * local]
        meter = WireMeter() if step == args.wire_step else None
        with contextlib.nullcontext() if meter is None else meter, loss_parallel() if tp else contextlib.nullcontext():
            loss = loss_fn(model(inputs), targets)  # mean over this dp rank's rows
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            # the global mean, for the log: gloo has no AVG, so sum and divide
            total = (loss.detach().to_local() if isinstance(loss, DTensor) else loss.detach()).clone()
            dist.all_reduce(total, group=mesh["dp"].get_group())
            value = total.item() / dp
        elapsed = time.perf_counter() - t0
        peaks = [None] * world
        dist.all_gather_object(peaks, round(_peak_rss_mb(), 1))
        row = {
            "step": step,
            "loss": value,
            "step_s": elapsed,
            "tokens_per_s": tokens / elapsed,
            "peak_rss_mb_per_rank": peaks,
        }
        if meter is not None:
            row |= wire_row(meter.stats)
        if rank == 0:
            with metrics_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(
                f"step {step:4d}/{args.steps}  loss {value:.4f}  {tokens / elapsed:8.0f} tok/s  "
                f"peak rss {max(peaks):.0f} MiB",
                flush=True,
            )
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-debug")
    p.add_argument("--mesh", default="2x2", help="DPxTP")
    p.add_argument("--batch", type=int, default=8, help="global batch size")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0, help="weight init seed")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--wire-step", type=int, default=0, help="meter this step's collectives (0: none)")
    p.add_argument("--param-dtype", default=None, help="FSDP2 MixedPrecisionPolicy.param_dtype (bf16, ...)")
    p.add_argument("--reduce-dtype", default=None, help="FSDP2 MixedPrecisionPolicy.reduce_dtype (fp32, ...)")
    p.add_argument("--ddp", action="store_true", help="torch's DistributedDataParallel instead (mesh Nx1)")
    p.add_argument("--lora", default=None, metavar="SPEC", help="peft's LoRA over the model (`train --lora`'s SPEC)")
    p.add_argument("--out", default="runs/recipe")
    try:
        train(p.parse_args(argv))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()  # then leave without finalizing the interpreter: gloo's worker threads can
    sys.stderr.flush()  # outlive the process group and now and then abort a finished rank's teardown
    os._exit(code)
