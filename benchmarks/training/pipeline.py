"""Pipeline stages on gloo CPU ranks: autoshard's pipeline (`plan_pipeline` then
`apply_pipeline`) against what a user writes by hand with `torch.distributed.pipelining`, an even
cut of whole blocks under `Schedule1F1B` with DDP over the dp dim and fused AdamW.

Same model (llama3-debug with 8 blocks), init, data, micro-batches and AdamW settings; a
(pp 2, dp 2) mesh of 4 processes under torchrun (OMP_NUM_THREADS=1); each trainer `repeats`
times (3) interleaved round by round, a trainer's figure that of its median run (tokens/s over
the steps after the first 3). autoshard's modeled step (the cpu and cpu-gloo presets) is set
beside its measured one. Trainers: `autoshard` (the planner's choice), `autoshard-1F1B` (the
best 1F1B pipeline the search priced; likewise `autoshard-InterleavedZeroBubble`, and with
`x1` appended its best with one stage per rank), `autoshard-even` (torchtitan's even cut under
the chosen schedule, planned and run by autoshard) and `torch`; each is set beside the last named.
`--vocab 32768` gives the model a head that outweighs a block, where the planner's cut should
beat the even one. `--dp 1` runs pp 2 alone on 2 processes, a core each.

    python -m benchmarks.training.pipeline                     # ~8 min
    python -m benchmarks.training.pipeline --trainers autoshard,autoshard-1F1B,torch
    python -m benchmarks.training.pipeline --vocab 32768 --trainers autoshard,autoshard-even
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.launch import ROOT, rank_env, torchrun

TRAINERS = ("autoshard", "torch")
WORKERS = (
    "autoshard",
    "autoshard-even",
    "autoshard-1F1B",
    "autoshard-InterleavedZeroBubble",
    "autoshard-InterleavedZeroBubblex1",
    "torch",
)
WARMUP = 3


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard_models import get_config

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    cfg = get_config("llama3-debug").with_(n_layers=args.layers, vocab_size=args.vocab)
    mesh = init_device_mesh("cpu", (2, args.dp), mesh_dim_names=("pp", "dp"))
    rows = args.batch // args.dp  # this dp rank's
    start = time.perf_counter()
    if args.worker == "torch":
        step, params, modeled = _by_hand(cfg, mesh, args)
    else:
        step, params, modeled = _autoshard(cfg, mesh, args, args.worker.partition("-")[2])
    setup_s = time.perf_counter() - start
    optimizer = torch.optim.AdamW(params, lr=3e-3, fused=True)
    g = torch.Generator().manual_seed(1)
    at = mesh.get_local_rank(1) * rows
    times, losses = [], []
    for _ in range(args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
        targets = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        loss = step(tokens[at : at + rows], targets[at : at + rows])
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"times": times, "losses": losses})
    if dist.get_rank() == 0:
        step_times = [max(r["times"][i] for r in every) for i in range(args.steps)]
        # the last stage's ranks: each dp rank's loss of its rows (torch) or all the same (autoshard)
        last = [r["losses"] for r in every if r["losses"][0] is not None]
        last = [statistics.fmean(step) for step in zip(*last)]
        measured = statistics.median(step_times[WARMUP:])
        Path(args.out).write_text(
            json.dumps(
                {
                    "step_s": measured,
                    "tokens_per_s": args.batch * args.seq / measured,
                    "losses": last,
                    "modeled_step_s": modeled.get("step_s"),
                    "chosen": modeled.get("chosen"),
                    "setup_s": setup_s,
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()


def _by_hand(cfg, mesh, args):
    """torchtitan's way: the model cut evenly into whole blocks, each stage in DDP over dp."""
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.nn.parallel import DistributedDataParallel

    from autoshard_models import build_model

    model = build_model(cfg, seed=0)
    pp = mesh.get_local_rank(0)
    half = cfg.n_layers // 2
    stage = model.pipeline_stage(pp * half, (pp + 1) * half)
    micro = args.batch // args.dp // args.micro_batches
    x = (
        torch.zeros(micro, args.seq, dtype=torch.long)
        if pp == 0
        else torch.empty(micro, args.seq, cfg.dim, requires_grad=True)
    )
    out = torch.empty((), requires_grad=True) if pp == 1 else torch.empty(micro, args.seq, cfg.dim, requires_grad=True)
    ddp = DistributedDataParallel(stage, process_group=mesh.get_group(1))
    runner = PipelineStage(ddp, pp, 2, torch.device("cpu"), input_args=(x,), output_args=out, group=mesh.get_group(0))
    schedule = Schedule1F1B(runner, args.micro_batches, loss_fn=lambda loss, _: loss)

    def step(tokens, targets):
        losses = []
        schedule.step(
            *((tokens,) if pp == 0 else ()), target=targets, losses=losses, return_outputs=False, targets=targets
        )
        return torch.stack(losses).mean().item() if losses else None

    return step, list(stage.parameters()), {}


def _autoshard(cfg, mesh, args, which: str):
    """`which`: "" the planner's choice, "even" torchtitan's even cut under the same schedule,
    a schedule's name ("1F1B", "InterleavedZeroBubble", or "InterleavedZeroBubblex1" with that
    many stages per rank) the best pipeline the search priced under it."""
    import torch

    from autoshard.driver.config import PlanConfig
    from autoshard.driver.pipeline import plan_pipeline
    from autoshard.driver.stages import apply_pipeline
    from autoshard_models import build_model
    from autoshard_models.llama import cross_entropy_loss

    config = PlanConfig(mesh=(2, args.dp), mesh_names=("pp", "dp"), device_profile="cpu", network="cpu-gloo")
    model = build_model(cfg, device="meta")

    def inputs(rows):
        return torch.zeros(rows, args.seq, dtype=torch.long), torch.zeros(rows, args.seq, dtype=torch.long)

    result = plan_pipeline(
        model, inputs, config, batch=args.batch, loss_fn=cross_entropy_loss, micro_batches=[args.micro_batches]
    )
    ranked = [result.best, *result.others]
    name, _, virtual = which.partition("x")  # e.g. InterleavedZeroBubblex1: that schedule with 1 stage per rank
    chosen = {"": result.best, "even": result.even}.get(which) or next(
        p for p in ranked if p.schedule.name == name and (not virtual or p.schedule.virtual == int(virtual))
    )
    run = apply_pipeline(model, result, mesh, inputs, pipeline=chosen)
    run.load_each(build_model(cfg, seed=0).initial_values(0))

    def step(tokens, targets):
        loss = run.step(tokens, targets)
        return None if loss is None else loss.item()

    facts = {
        "blocks": chosen.blocks,
        "schedule": chosen.schedule.name,
        "families": [s.family for s in chosen.stages],
    }
    return step, list(run.parameters()), {"step_s": chosen.step_time_s, "chosen": facts}


def run(args: argparse.Namespace) -> dict:
    trainers = args.trainers.split(",")
    unknown = [t for t in trainers if t not in WORKERS]
    if unknown or len(trainers) < 2:
        sys.exit(f"error: --trainers takes two or more of {', '.join(WORKERS)}, got {args.trainers}")
    runs: dict[str, list[dict]] = {t: [] for t in trainers}
    passed = ["--layers", str(args.layers), "--vocab", str(args.vocab), "--batch", str(args.batch)]
    passed += [
        "--dp",
        str(args.dp),
        "--seq",
        str(args.seq),
        "--steps",
        str(args.steps),
        "--micro-batches",
        str(args.micro_batches),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name in trainers:
                out = Path(tmp) / f"{name}-{repeat}.json"
                cmd = [
                    *torchrun(),
                    "--standalone",
                    f"--nproc_per_node={2 * args.dp}",
                    "-m",
                    "benchmarks.training.pipeline",
                ]
                cmd += ["--worker", name, "--out", str(out), *passed]
                done = subprocess.run(cmd, cwd=ROOT, env=rank_env(), capture_output=True, text=True)
                if done.returncode:
                    sys.exit(f"error: {name} failed:\n{done.stderr[-3000:]}")
                runs[name].append(json.loads(out.read_text()))
                print(f"round {repeat + 1} {name}: {runs[name][-1]['tokens_per_s']:.0f} tok/s", flush=True)
    median = {name: sorted(r, key=lambda x: x["tokens_per_s"])[len(r) // 2] for name, r in runs.items()}
    result = {
        "workload": vars(args) | {"mesh": f"pp2 x dp{args.dp}"},
        "tokens_per_s": {n: m["tokens_per_s"] for n, m in median.items()},
        "runs_tokens_per_s": {n: [x["tokens_per_s"] for x in r] for n, r in runs.items()},
        "modeled_over_measured": {
            n: m["modeled_step_s"] / m["step_s"] for n, m in median.items() if m["modeled_step_s"] is not None
        },
        "chosen": {n: m["chosen"] for n, m in median.items() if m["chosen"] is not None},
        "losses": {n: m["losses"] for n, m in median.items()},
    }
    base = trainers[-1]  # each trainer beside the last one named
    for name in trainers[:-1]:
        result[f"{name}_over_{base}"] = median[name]["tokens_per_s"] / median[base]["tokens_per_s"]
        result[f"max_rel_loss_dev_{name}"] = max(
            abs(x - y) / abs(y) for x, y in zip(median[name]["losses"], median[base]["losses"])
        )
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help="the JSON result (default: print it)")
    parser.add_argument("--trainers", default=",".join(TRAINERS), help=f"two or more of {', '.join(WORKERS)}")
    parser.add_argument("--dp", type=int, default=2, help="the dp dim's size: the mesh is (pp 2, dp DP)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=13)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    result = run(args)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
