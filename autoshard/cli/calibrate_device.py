"""What `autoshard calibrate` makes of the device: one training step of a small llama timed op by op
(`time_reference_step`), and the DeviceProfile fitted from the device's timings (`fit_device_profile`):
the 16-bit matmul rate, the fp32 and memory rates the step's own ops ran at (or those timed alone),
one op's dispatch and the fused AdamW step's rate. `autoshard.cli.calibrate` runs the timings, fits
the network and writes the profile file.
"""

from __future__ import annotations

import sys
import time

REFERENCE = ("llama3-debug", 2, 2, 128)  # model, blocks, batch, seq: the training step calibrate times whole


def time_reference_step(device, settings, progress=lambda line: None) -> list[dict]:
    """[{seconds, ops, flops, memory_bytes, flop_ops_s, memory_ops, memory_ops_s}]: one training
    step (forward, loss, backward) of a small llama in fp32, traced as `plan` traces it and run op
    by op on this CPU, each op clocked: the seconds its flop ops (matmuls, attention) and its
    memory-bound ops took inside the step, beside the work the roofline counts in them. [] on
    other devices (their ops run asynchronously) or when it cannot run (a note says why): the
    profile then keeps the rates timed alone."""
    import dataclasses

    from autoshard.profiles.calibrate import _timed
    from autoshard_models import get_config

    if device.type != "cpu":
        return []
    name, blocks, batch, seq = REFERENCE
    start = time.perf_counter()
    config = dataclasses.replace(get_config(name), n_layers=blocks)
    clock = {"flop": 0.0, "memory": 0.0}
    calls = 0
    try:
        step, work, shapes = _clocked_step(config, batch, seq, clock)
        args = _step_inputs(shapes, config.vocab_size)

        def counted():
            nonlocal calls
            calls += 1
            return step(*args)

        seconds = _timed(counted, device, settings)  # every call clocked, its warm-up calls too
    except Exception as err:  # noqa: BLE001 - a step that cannot run here keeps the rates timed alone
        print(
            f"note: the reference training step did not run on {device.type}: {str(err).splitlines()[0]}; "
            "ops are priced at the rates timed alone",
            file=sys.stderr,
        )
        return []
    flop_s, memory_s = clock["flop"] / calls, clock["memory"] / calls
    progress(
        f"device {device.type}: a training step of {name} ({blocks} blocks, batch {batch}, seq {seq}) in "
        f"{seconds * 1e3:.1f} ms: matmuls and attention {flop_s * 1e3:.1f} ms, {work.memory_ops} memory-bound ops "
        f"{memory_s * 1e3:.1f} ms (timed in {time.perf_counter() - start:.1f} s)"
    )
    return [
        {
            "seconds": seconds,
            "ops": work.ops,
            "flops": work.flops,
            "memory_bytes": work.memory_bytes,
            "flop_ops_s": flop_s,
            "memory_ops": work.memory_ops,
            "memory_ops_s": memory_s,
        }
    ]


def _clocked_step(config, batch: int, seq: int, clock: dict[str, float]):
    """(the step as a GraphModule whose flop and memory-bound ops each add their seconds to
    `clock`, the roofline's work in it, (shape, dtype) of each of its inputs): the joint graph of
    the llama `config` on (batch, seq) tokens, traced as `plan` traces it."""
    import contextlib
    import copy

    import torch
    from torch import fx

    from autoshard.capture.trace import trace_joint
    from autoshard.pricing.compute import graph_work, op_class
    from autoshard_models import build_model, cross_entropy_loss

    with contextlib.ExitStack() as stack:
        joint = trace_joint(
            build_model(config, device="meta"),
            lambda m, x, y: cross_entropy_loss(m(x), y),
            (torch.empty(batch, seq, dtype=torch.int64),) * 2,
            stack,
        )
        graph = copy.deepcopy(joint.gm.graph)
        graph._codegen = fx.graph.CodeGen()  # positional placeholders, as the lowered program calls them
        work = graph_work(graph)
        for node in graph.nodes:
            kind = op_class(node)
            if kind in clock:
                node.target = _clocked(clock, kind, node.target)
        shapes = [(tuple(v.shape), v.dtype) for v in (n.meta["val"] for n in graph.nodes if n.op == "placeholder")]
        return fx.GraphModule(joint.gm, graph), work, shapes


def _clocked(clock: dict[str, float], kind: str, op):
    """`op`, adding the seconds each call takes to `clock[kind]`."""

    def run(*args, **kwargs):
        t0 = time.perf_counter()
        out = op(*args, **kwargs)
        clock[kind] += time.perf_counter() - t0
        return out

    return run


def _step_inputs(shapes, vocab_size: int) -> list:
    """Seeded inputs of those shapes: token ids below `vocab_size`, small normal floats. Made after
    the trace's context closed: inputs made inside it would be fake tensors."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, vocab_size, shape, generator=generator)
        if not dtype.is_floating_point
        else (torch.randn(shape, generator=generator) * 0.02).to(dtype)
        for shape, dtype in shapes
    ]


def fit_device_profile(timings: dict, step: dict, device, name: str):
    """DeviceProfile (the bf16 matmul rate as the 16-bit peak; the fp32 flop and memory rates that
    reproduce the reference training step's ops, or, without one, the fp32 matmul's and a streaming
    add's timed alone; one op's dispatch; the fused AdamW step's rate) and per-dtype details. Op
    dispatch and the optimizer step come from the preset of the device's kind when their timings
    do not grow with the work (noise on tiny sizes): a note, not a lost calibration."""
    from autoshard.pricing.fit import StepPartsFit, fit_rate, fit_step_parts, fit_step_rates
    from autoshard.profiles.calibrate import memory_capacity
    from autoshard.profiles.device import ADAMW_STEP_BYTES, DeviceProfile

    by_dtype = {}
    for dtype, parts in timings.items():
        mm = fit_rate([r["flops"] for r in parts["matmul"]], [r["seconds"] for r in parts["matmul"]])
        mem = fit_rate([r["bytes"] for r in parts["memory"]], [r["seconds"] for r in parts["memory"]])
        by_dtype[dtype] = {
            "matmul_flops": mm.rate,
            "matmul_overhead_s": mm.overhead_s,
            "matmul_fit_rel_rms": mm.rel_rms,
            "mem_bw": mem.rate,
            "mem_overhead_s": mem.overhead_s,
            "mem_fit_rel_rms": mem.rel_rms,
            "timings": parts,
        }
    fp32 = by_dtype.get("float32") or next(iter(by_dtype.values()))
    half = by_dtype.get("bfloat16") or fp32  # the 16-bit rate: what bf16 compute runs at
    fitted = True
    try:
        parts = fit_step_parts(
            [r["ops"] for r in step["dispatch"]],
            [r["seconds"] for r in step["dispatch"]],
            [r["elements"] for r in step["optimizer"]],
            [r["seconds"] for r in step["optimizer"]],
        )
    except ValueError as err:  # timings too noisy to fit (ranks sharing cores): the preset's figures stand
        preset = DeviceProfile.preset("cpu" if device.type == "cpu" else "h100")
        parts, fitted = StepPartsFit(preset.op_overhead_s, preset.mem_bw / ADAMW_STEP_BYTES, 0.0, 0.0, 0.0), False
        print(
            f"note: op dispatch and optimizer timings: {err}; the {preset.name} preset's figures are used",
            file=sys.stderr,
        )
    flop_rate, mem_bw, in_step = fp32["matmul_flops"], fp32["mem_bw"], None
    for ref in step.get("reference", []):
        try:
            flop_rate, mem_bw = in_step = fit_step_rates(
                ref["flops"],
                ref["flop_ops_s"],
                ref["memory_bytes"],
                ref["memory_ops"],
                ref["memory_ops_s"],
                parts.op_overhead_s,
            )
        except ValueError as err:  # noise: the rates timed alone stand
            print(f"note: reference training step: {err}; ops are priced at the rates timed alone", file=sys.stderr)
    step_details = {
        "op_dispatch_s": parts.op_overhead_s,
        "dispatch_fit_rel_rms": parts.dispatch_rel_rms,
        "optimizer_rate": parts.optimizer_rate,
        "optimizer_overhead_s": parts.optimizer_overhead_s,
        "optimizer_fit_rel_rms": parts.optimizer_rel_rms,
        "fitted": fitted,
        "alone": {"fp32_flops": fp32["matmul_flops"], "mem_bw": fp32["mem_bw"]},
        "in_step": None if in_step is None else {"fp32_flops": in_step[0], "mem_bw": in_step[1]},
        "timings": step,
    }
    profile = DeviceProfile(
        peak_flops=half["matmul_flops"],
        mem_bw=mem_bw,
        name=name,
        memory_bytes=memory_capacity(device),
        peak_flops_fp32=flop_rate,
        op_overhead_s=parts.op_overhead_s,
        optimizer_rate=parts.optimizer_rate,
        # not timed here (the lowered program's own dispatch would be): a GPU takes the preset's
        host_op_s=None if device.type == "cpu" else DeviceProfile.preset("h100").host_op_s,
    )
    return profile, by_dtype, step_details
