"""What the GPU check measures with: timers on the device, one profiled step, the two steps it
compares (autoshard's and plain torch's), the attention check, and rank 0's program run forward and
backward on real tensors of its local shapes. Modules of the repository are imported inside the
functions: on a GPU machine `driver.importable()` registers them first."""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path
from typing import Any

import torch

DATASHEET_BF16 = {"H100": 989.4e12, "H200": 989.4e12}  # dense bf16 peak of the SXM parts, flop/s


def say(line: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {line}", flush=True)


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    """Seconds `fn()` took: CUDA events on a GPU, the wall clock on CPU."""
    if device != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def profile_once(fn, device: str, out: Path | None, title: str) -> float | None:
    """With --profile: one more call of `fn` under torch's profiler, its ops by the device's self
    time and by the host's appended to `out`, where a missed goal's cause is read. Returns the
    seconds the device's kernels and copies took (None on CPU): beside the call's wall time, how
    much of it the device was busy."""
    if out is None:
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    busy = sum(e.self_device_time_total for e in kernels)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        for key in (["self_cuda_time_total"] if device == "cuda" else []) + ["self_cpu_time_total"]:
            f.write(f"## {title}, by {key}\n\n{events.table(sort_by=key, row_limit=30)}\n\n")
    return busy / 1e6 if device == "cuda" else None


def initial_state(cfg: Any, device: str, seed: int = 0) -> dict:
    """Values both runs load, drawn on the device and kept on the host: speed does not depend on
    them, and the model's own init draws 1.5B values on one CPU core (~30 s)."""
    from autoshard_models import build_model
    from autoshard_models.llama import rope_tables

    model = build_model(cfg, device="meta").to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02, generator=gen)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        model.rope_cos.copy_(cos)
        model.rope_sin.copy_(sin)
    state = {k: v.detach().to("cpu") for k, v in (dict(model.named_parameters()) | dict(model.named_buffers())).items()}
    del model
    free(device)
    return state


def attention_check(device: str) -> dict:
    """The program's attention (the kernel torch picks on this device) against fp32 math, beside
    torch's own bf16 `scaled_dot_product_attention`: max |error| of the output and the gradients."""
    import torch.nn.functional as F

    from autoshard.program.attention import _kernel, attention_backward, attention_forward

    gen = torch.Generator(device=device).manual_seed(2)
    shape = (1, 1024, 8, 64)  # [b, s, h, d], viewed [b, h, s, d] as the traced program has it
    q, k, v, grad = (torch.randn(shape, device=device, generator=gen).transpose(1, 2) for _ in range(4))
    low = [t.to(torch.bfloat16) for t in (q, k, v)]

    def reference(inputs, g):
        inputs = [t.detach().requires_grad_() for t in inputs]
        out = F.scaled_dot_product_attention(*inputs, is_causal=True)
        return out, torch.autograd.grad(out, inputs, g.to(out.dtype))

    want, want_grads = reference((q, k, v), grad)
    out, lse = attention_forward(*low, 0.0, True)
    grads = attention_backward(grad.to(torch.bfloat16), *low, out, lse, 0.0, True)
    theirs, their_grads = reference(low, grad)

    def err(a, b):
        return float((a.float() - b).abs().max())

    return {
        "kernel": _kernel(*low, 0.0, None, True, None),
        "out_err": err(out, want),
        "grad_err": max(err(a, b) for a, b in zip(grads, want_grads)),
        "torch_out_err": err(theirs, want),
        "torch_grad_err": max(err(a, b) for a, b in zip(their_grads, want_grads)),
    }


class CastStep:
    """Plain torch's step under FSDP2's MixedPrecisionPolicy(bf16, fp32) on one device: the fp32
    parameters cast to bf16 for the forward (autograd casts each gradient back to fp32), the loss
    in fp32; compiled whole (forward and backward) with torch.compile."""

    def __init__(self, model: Any, dtype: Any, compiled: bool):
        from autoshard_models import cross_entropy_loss

        def loss(tokens, targets):
            cast = {name: p.to(dtype) for name, p in model.named_parameters()}
            return cross_entropy_loss(torch.func.functional_call(model, cast, (tokens,)), targets)

        self.loss = torch.compile(loss) if compiled else loss

    def __call__(self, tokens, targets):
        return self.loss(tokens, targets)


def run_steps(
    step, optim, warm: int, steps: int, device: str, profile_to: Path | None = None, title: str = ""
) -> tuple[float, list[float]]:
    """Median seconds of `steps` timed steps after `warm` (the first of which compiles), losses;
    then, with a profile target, one profiled step."""
    losses: list[float] = []

    def one():
        loss = step()
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    for _ in range(warm):
        one()
    sync(device)
    times = [timed(one, device) for _ in range(steps)]
    if profile_to is not None:
        profile_once(one, device, profile_to, title)
    return statistics.median(times), [float(v) for v in losses[: warm + steps]]


def peak_flops(device: str, profile: Any) -> tuple[float, str]:
    """The peak MFU divides by: the datasheet's dense bf16 rate of the GPU, else the preset's."""
    if device == "cuda":
        name = torch.cuda.get_device_name()
        for key, rate in DATASHEET_BF16.items():
            if key in name:
                return rate, f"{key} datasheet, dense bf16"
    return profile.peak_for(torch.bfloat16), f"the {profile.name} preset's bf16 rate"


def figures(seconds: float, losses: list[float], tokens: int, flops: float, peak: float) -> dict:
    return {
        "step_s": seconds,
        "tokens_per_s": tokens / seconds,
        "mfu": flops / seconds / peak if flops and peak else None,
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }


def local_values(gm: Any, device: str, vocab: int) -> list:
    """Real tensors of each placeholder's local shape and traced dtype: token ids in the vocabulary,
    small floats elsewhere (the values a step's speed does not depend on)."""
    from autoshard.program.lower import LOCAL_SHAPE

    values = []
    for node in (n for n in gm.graph.nodes if n.op == "placeholder"):
        traced = node.meta["autoshard_source"].meta["val"]
        shape = node.meta.get(LOCAL_SHAPE) or tuple(traced.shape)
        if traced.dtype.is_floating_point:
            values.append((torch.randn(shape, device=device) * 0.02).to(traced.dtype))
        else:
            values.append(torch.randint(0, vocab, shape, device=device, dtype=traced.dtype))
    return values


def measure_program(
    program: Any, vocab: int, device: str, warm: int, steps: int, which: str, profile_to: Path | None = None
) -> dict:
    """Forward and backward of `program` on real local tensors, then fused AdamW on the gradients:
    the median forward + backward time and the optimizer's, and the allocator's peak over one
    steady step (AdamW states allocated in a warm step, as the dry run models)."""
    from autoshard.program.lower import CheckedRun

    forward_args = local_values(program.forward, device, vocab)
    n_params = len(program.param_names)
    params = forward_args[:n_params]
    optim = torch.optim.AdamW(params, lr=1e-4, fused=True)
    tangent = torch.ones((), device=device)
    checked = [False]

    def fwd_bwd() -> None:
        run = (lambda gm: CheckedRun(gm).run) if not checked[0] else (lambda gm: gm)
        loss, *saved = run(program.forward)(*forward_args)
        grads = run(program.backward)(*saved, tangent)
        del saved
        checked[0] = True
        for p, g in zip(params, grads):
            p.grad = g

    def adamw() -> None:
        optim.step()
        optim.zero_grad(set_to_none=True)

    compute, update = [], []
    for i in range(warm + steps):
        seconds = timed(fwd_bwd, device)
        opt_seconds = timed(adamw, device)
        if i >= warm:
            compute.append(seconds)
            update.append(opt_seconds)
        fb, opt = seconds * 1e3, opt_seconds * 1e3
        say(f"{which}: step {i + 1}/{warm + steps}: forward + backward {fb:.1f} ms, AdamW {opt:.1f} ms")
    out = {"compute_measured_s": statistics.median(compute), "optimizer_measured_s": statistics.median(update)}
    out["compute_times_s"] = compute
    if device == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd()
        adamw()
        sync(device)
        out["memory_measured_bytes"] = torch.cuda.max_memory_allocated()
    busy = profile_once(fwd_bwd, device, profile_to, f"rank 0's forward + backward ({which})")
    if busy is not None:
        out["compute_device_busy_s"] = busy
    return out
