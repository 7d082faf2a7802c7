"""autoshard's training step against DDP's, step by step in one torchrun job.

Separate runs (`throughput.py`, `lora.py`) compare whole processes one after another, and a
shared CPU machine's speed drifts by 10-15% over tens of seconds: more than the few percent in
question. Here every rank runs both trainers in turns. `autoshard train`'s own loop (default
flags, through the API's `autoshard.train.train`) plans and steps; after each of its steps a
logger (the trainer's `Parts.loggers` seam, called outside the timed step) runs one step of
torch's DistributedDataParallel over the same model, init, batch and fused AdamW, timed as the
baseline trainer times it (`benchmarks.baselines.train`: forward, backward, optimizer step, the
loss all-reduce read back). Both share the process, so whatever planning leaves behind weighs on
both; what differs is the step. The figure is the median over steps of DDP's step time over
autoshard's (above 1: autoshard faster), each step's pair a second apart.

    python -m benchmarks.training.paired                   # llama3-debug 2x2, batch 8, seq 256, 40 steps
    python -m benchmarks.training.paired --seq 64          # make train's configuration
    python -m benchmarks.training.paired --lora 8,targets=wq,wk,wv,wo,w1,w2,w3 --mesh 4x1   # as lora.py
    python -m benchmarks.training.paired --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.launch import ROOT
from benchmarks.training.runs import Workload, launch

WARMUP = 3  # steps left out of the medians (allocations, first calls)
LOSS_RTOL = 1e-4


class DdpAlongside:
    """A trainer logger that runs one DDP step after each of autoshard's and records the pair."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.ddp, self.rows = args, None, []

    def _build(self) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from autoshard_models import MarkovTokens, training_loss
        from autoshard_models.train_single import TrainSettings, make_optimizer
        from benchmarks.baselines.train import baseline_model

        a = self.args
        cfg, model = baseline_model(a.model, a.seq, a.seed, a.lora)
        self.ddp = DistributedDataParallel(model)
        self.optim = make_optimizer([p for p in model.parameters() if p.requires_grad], TrainSettings(lr=a.lr))
        self.loss_fn, self.data = training_loss(cfg), MarkovTokens(cfg.vocab_size, seed=a.data_seed)
        self.world, self.rank = dist.get_world_size(), dist.get_rank()

    def _ddp_step(self, step: int) -> tuple[float, float]:
        import torch.distributed as dist

        a, local = self.args, self.args.batch // self.world
        t0 = time.perf_counter()
        batch = self.data.batch(step - 1, a.batch, a.seq)
        rows = slice(self.rank * local, (self.rank + 1) * local)
        loss = self.loss_fn(self.ddp(batch.inputs[rows]), batch.targets[rows])
        loss.backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        value = total.item() / self.world
        return time.perf_counter() - t0, value

    def log(self, row: dict) -> None:
        if self.ddp is None:
            self._build()
        ddp_s, ddp_loss = self._ddp_step(row["step"])
        self.rows.append(
            {
                "step": row["step"],
                "autoshard_s": row["step_s"],
                "ddp_s": ddp_s,
                "autoshard_loss": row["loss"],
                "ddp_loss": ddp_loss,
            }
        )

    def close(self) -> None:
        if self.ddp is not None and self.rank == 0:
            path = Path(self.args.out) / "paired.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))


def worker(args: argparse.Namespace) -> None:
    from autoshard.train import Parts, Settings, train

    mesh = tuple(int(x) for x in args.mesh.split("x"))
    settings = Settings(
        model=args.model,
        mesh=mesh,
        batch=args.batch,
        seq=args.seq,
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        data_seed=args.data_seed,
        lora=args.lora,
        wire_step=args.wire_step,
        out=args.out,
        overwrite=True,
    )
    train(settings, Parts(loggers=[DdpAlongside(args)]))


def summarize(rows: list[dict]) -> dict:
    timed = rows[WARMUP:]
    ratios = [r["ddp_s"] / r["autoshard_s"] for r in timed]
    deviation = max(abs(r["autoshard_loss"] - r["ddp_loss"]) / abs(r["ddp_loss"]) for r in rows)
    return {
        "steps_timed": len(timed),
        "autoshard_step_s_median": statistics.median(r["autoshard_s"] for r in timed),
        "ddp_step_s_median": statistics.median(r["ddp_s"] for r in timed),
        "ddp_over_autoshard_median": statistics.median(ratios),
        "ddp_over_autoshard_quartiles": statistics.quantiles(ratios, n=4),
        "max_rel_loss_dev": deviation,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-debug")
    p.add_argument("--mesh", default="2x2", help="autoshard's mesh (DDP runs over every rank)")
    p.add_argument("--batch", type=int, default=8, help="global batch size")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=0.003)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--lora", default=None, help="train --lora's spec: LoRA on both sides (DDP over peft's model)")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench-paired"))
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--wire-step", type=int, default=0, help=argparse.SUPPRESS)  # launch's: 0, no metered step
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.steps <= WARMUP + 4:
        p.error(f"--steps must be above {WARMUP + 4}: the first {WARMUP} are left out of the medians")
    work = Workload(
        args.model, args.batch, args.seq, args.steps, args.mesh, args.lr, args.seed, args.data_seed, wire_step=0
    )
    target = ["-m", "benchmarks.training.paired", "--worker", *(["--lora", args.lora] if args.lora else [])]
    try:
        launch("paired", target, work, Path(args.out))
    except RuntimeError as failed:  # the ranks' console tail is in the message
        print(failed, file=sys.stderr)
        print("error: the paired run failed", file=sys.stderr)
        return 1
    rows = [json.loads(line) for line in (Path(args.out) / "paired.jsonl").read_text().splitlines()]
    summary = {"workload": {k: getattr(args, k) for k in ("model", "mesh", "batch", "seq", "steps", "lora")}}
    summary |= summarize(rows)
    q = summary["ddp_over_autoshard_quartiles"]
    print(
        f"{args.model} {args.mesh} batch {args.batch} seq {args.seq}{' lora ' + args.lora if args.lora else ''}: "
        f"step medians autoshard {summary['autoshard_step_s_median'] * 1e3:.1f} ms, "
        f"DDP {summary['ddp_step_s_median'] * 1e3:.1f} ms; DDP / autoshard per step: median "
        f"{summary['ddp_over_autoshard_median']:.3f} (quartiles {q[0]:.3f}, {q[2]:.3f}) over "
        f"{summary['steps_timed']} steps; losses within {summary['max_rel_loss_dev']:.1e}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    if summary["max_rel_loss_dev"] > LOSS_RTOL:
        print(
            f"error: the two trainers' losses differ by {summary['max_rel_loss_dev']:.1e} (> {LOSS_RTOL:g})",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
