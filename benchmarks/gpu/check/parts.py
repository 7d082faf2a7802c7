"""The GPU check's parts: one GPU's training step, autoshard's beside plain torch's; and rank 0's
program of a cluster plan run forward and backward on the device, against the cost model and the
dry run. Modules of the repository are imported inside the functions: on a GPU machine
`driver.importable()` registers them first."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.gpu.check.measure import (
    CastStep,
    attention_check,
    device_type,
    figures,
    free,
    initial_state,
    measure_program,
    peak_flops,
    run_steps,
    say,
)
from benchmarks.gpu.check.report import FULL, GOALS, TINY


# ---------------------------------------------------------------------------------- helpers
def profiles(device: str) -> tuple[str, str]:
    """(network, device) presets to plan with: the GPU's own, or the CPU's."""
    if device == "cpu":
        return "cpu-gloo", "cpu"
    return "h100-node", "h200" if "H200" in torch.cuda.get_device_name() else "h100"


def profile_path(a: argparse.Namespace, part: str) -> Path | None:
    """Where --profile puts a part's tables (None without it)."""
    return a.profile / f"profile-{part}.txt" if a.profile else None


def one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: " + (str(err).strip().splitlines() or [""])[0][:300]


# ---------------------------------------------------------------------------------- a. the step
def step_part(a: argparse.Namespace, compiled: bool) -> dict:
    """autoshard's plan on mesh (1,) and plain torch, the same step, the same values."""
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard import _torch_compat as tc
    from autoshard.driver.api import AutoShard
    from autoshard.driver.config import PlanConfig
    from autoshard.pricing.compute import graph_work
    from autoshard.profiles.files import device_profile
    from autoshard.workloads import get_workload
    from autoshard_models import build_model, get_config

    device = device_type()
    model_name, batch, seq = (TINY if a.tiny else FULL)["step"]
    warm, steps = (2, 3) if a.tiny else (3, 10)
    part: dict[str, Any] = {"model": model_name, "batch": batch, "seq": seq, "mesh": [1], "compiled": compiled}
    profile_to = profile_path(a, a.part)
    part.update(param_dtype="bf16", reduce_dtype="fp32", warm_steps=warm, timed_steps=steps, variants={}, notes=[])
    why = tc.inductor_unavailable(device) if compiled else None
    if why is not None:
        return {**part, "status": "skipped", "notes": [f"torch.compile: {why}"]}
    workload = get_workload(model_name, seq)
    cfg = get_config(model_name)
    cfg = cfg.with_(max_seq_len=max(seq, cfg.max_seq_len))
    say(f"step ({'compiled' if compiled else 'eager'}): {model_name}, batch {batch}, seq {seq}: initial values")
    state = initial_state(cfg, device)
    gen = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen).to(device) for _ in range(2))
    network, preset = profiles(device)
    flops, peak = 0.0, 0.0
    if device == "cuda":
        torch.cuda.set_device(0)
    part["attention"] = attention_check(device)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:  # a failure here (out of memory, a kernel missing) leaves plain torch's figures to measure
        mesh = init_device_mesh(device, (1,), mesh_dim_names=("dp",))
        config = PlanConfig(param_dtype="bf16", reduce_dtype="fp32", network=network, device_profile=preset)
        auto = AutoShard(
            build_model(cfg, device="meta"),
            lambda: workload.example_inputs(batch, seq, "meta"),
            mesh,
            config=config,
            loss_fn=workload.loss_fn,
            n_model_inputs=workload.n_model_inputs,
            compile=compiled,
        )
        plan = auto.optimize()
        flops = graph_work(plan.graph.gm.graph).flops
        peak, peak_source = peak_flops(device, device_profile(preset))
        part.update(flops_per_step=flops, peak_flops=peak, peak_source=peak_source, plan=plan.summary())
        part["recompute"] = bool(plan.recompute_blocks)
        part["notes"].append(
            f"MFU: the step's {flops:.3g} flops (matmuls, attention: as `train` counts) over {peak_source}"
        )
        say(f"step: planned ({plan.summary()}); autoshard's steps")
        pmodel = auto.apply(plan)
        pmodel.load_full(state)
        optim = torch.optim.AdamW(pmodel.parameters(), lr=1e-4, fused=True)
        inputs = pmodel.shard_inputs(tokens, targets)
        seconds, losses = run_steps(
            lambda m=pmodel, x=inputs: m(*x), optim, warm, steps, device, profile_to, "autoshard's step"
        )
        part["variants"]["autoshard"] = figures(seconds, losses, batch * seq, flops, peak)
        say(f"step: autoshard {part['variants']['autoshard']['tokens_per_s']:,.0f} tokens/s")
        del pmodel, optim, inputs, auto, plan
    except Exception as err:  # noqa: BLE001 - said in the report, in one line
        part["notes"].append(f"autoshard failed: {one_line(err)}")
        say(f"step: autoshard failed: {one_line(err)}")
    finally:
        dist.destroy_process_group()
        free(device)
    say("step: plain torch's steps")
    model = build_model(cfg, device="meta").to_empty(device=device)
    model.load_state_dict(state, strict=False)
    for name, buf in model.named_buffers():
        buf.copy_(state[name])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    step = CastStep(model, torch.bfloat16, compiled)
    seconds, losses = run_steps(
        lambda: step(tokens, targets), optim, warm, steps, device, profile_to, "plain torch's step"
    )
    part["variants"]["torch"] = figures(seconds, losses, batch * seq, flops, peak)
    say(f"step: plain torch {part['variants']['torch']['tokens_per_s']:,.0f} tokens/s")
    if "autoshard" not in part["variants"]:
        return {**part, "status": "failed"}
    part["ratio"] = part["variants"]["autoshard"]["tokens_per_s"] / part["variants"]["torch"]["tokens_per_s"]
    first = part["variants"]["autoshard"]["loss_first"], part["variants"]["torch"]["loss_first"]
    part["first_loss_rel_diff"] = abs(first[0] - first[1]) / abs(first[1])
    last = part["variants"]["autoshard"]["loss_last"], part["variants"]["torch"]["loss_last"]
    part["last_loss_rel_diff"] = abs(last[0] - last[1]) / abs(last[1])
    part["met"] = part["ratio"] >= GOALS["step"]
    return {**part, "status": "ok"}


# ---------------------------------------------------------------------------------- b, c. rank 0
def rank0_part(a: argparse.Namespace, which: str) -> dict:
    """Plan as `plan` does, then run rank 0's program on the device under a fake process group."""
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard import _torch_compat as tc
    from autoshard.driver.config import PlanConfig
    from autoshard.program.lower import lower
    from autoshard.runtime.dryrun import dry_run
    from autoshard.workloads import get_workload

    device = device_type()
    model_name, shape, batch, seq = (TINY if a.tiny else FULL)[which]
    warm, steps = (1, 2) if a.tiny else (2, 5)
    part: dict[str, Any] = {"model": model_name, "mesh": list(shape), "batch": batch, "seq": seq, "notes": []}
    part.update(param_dtype="bf16", reduce_dtype="fp32", warm_steps=warm, timed_steps=steps)
    network, preset = profiles(device)
    workload = get_workload(model_name, seq)
    config = PlanConfig(mesh=shape, param_dtype="bf16", reduce_dtype="fp32", network=network, device_profile=preset)
    say(f"{which}: planning {model_name} on {shape}, batch {batch}, seq {seq} ({network}, {preset})")
    with tc.fake_process_group(math.prod(shape), 0):
        auto = auto_shard(workload, config, batch, seq)
        plan = auto.optimize()
        memory = auto.fit_dry_run or dry_run(plan, mesh_dim_names=auto.config.mesh_names)
        peak = memory.ranks[0].peak_bytes
        part.update(plan=plan.summary(), dry_run_peak_bytes=peak, recompute=bool(plan.recompute_blocks))
        if device == "cuda":
            total = torch.cuda.mem_get_info()[1]
            part["device_memory_bytes"] = total
            if peak > 0.95 * total:
                note = f"the dry run's peak {peak / 2**30:.1f} GiB does not fit this device's {total / 2**30:.1f} GiB"
                return {**part, "status": "skipped", "notes": [note]}
        say(f"{which}: planned ({plan.summary()}); dry-run peak {peak / 2**30:.2f} GiB; lowering on {device}")
        program = lower(plan, init_device_mesh(device, shape, mesh_dim_names=auto.config.mesh_names))
        part["compute_modeled_s"], part["optimizer_modeled_s"] = program.step.compute_s, program.step.optimizer_s
        part["plan_compute_s"] = plan.compute_s
        profile_to = profile_path(a, which)
        part.update(measure_program(program, workload.vocab_size, device, warm, steps, which, profile_to))
    part["compute_ratio"] = part["compute_measured_s"] / part["compute_modeled_s"]
    part["met_compute"] = abs(part["compute_ratio"] - 1) <= GOALS["compute"]
    if part.get("memory_measured_bytes") is not None:
        part["memory_ratio"] = part["memory_measured_bytes"] / peak
        part["met_memory"] = abs(part["memory_ratio"] - 1) <= GOALS["memory"]
    else:
        part["notes"].append("no max_memory_allocated on CPU: the memory comparison is skipped")
    return {**part, "status": "ok"}


def auto_shard(workload: Any, config: Any, batch: int, seq: int) -> Any:
    """The planner of `workload` built on meta with its example inputs, as `plan` builds it."""
    from autoshard.driver.api import AutoShard

    return AutoShard(
        workload.build("meta"),
        lambda: workload.example_inputs(batch, seq, "meta"),
        config=config,
        loss_fn=workload.loss_fn,
        n_model_inputs=workload.n_model_inputs,
    )
