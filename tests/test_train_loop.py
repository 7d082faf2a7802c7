"""The training loop's optimizer, schedule, clipping and logging: every step's lr is torch's own
schedulers' (a resumed run's too), the gradient norm and clipped losses are a single device's on
sharded meshes, weight decay skips norms and biases, TensorBoard and W&B get the rows, and bad
input is one error line."""

from __future__ import annotations

import importlib.util
import math
import platform
import shutil
import sys
import threading

import pytest
import torch
from torch.optim import lr_scheduler as sched

from autoshard.cli.train import main
from autoshard.train.optimizer import OptimizerConfig, ScheduleConfig
from autoshard.train.settings import Settings
from autoshard_models import build_model, get_config
from autoshard_models.data import MarkovTokens
from autoshard_models.train_single import step_loss
from plan_audit import assert_shards
from test_train import SHARDED_ON_4, TINY, metrics, torchrun

ONE_PROCESS = pytest.mark.replicated_plan  # a world of one: what is checked is the loop, not the plan


def settings(**changes) -> Settings:
    return Settings(**{"model": "llama3-tiny", "mesh": (1,), "batch": 8, "seq": 16, **changes})


def torch_lrs(s: Settings) -> list[float]:
    """The lr of steps 1..steps from torch's schedulers, built here as the docs describe them."""
    optim = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=s.lr)
    w, n, floor = s.warmup_steps, s.steps, s.min_lr / s.lr
    decay = max(1, round(s.decay_fraction * n)) if s.lr_schedule == "wsd" else n - w
    parts, starts = [], []
    if w:
        parts.append(sched.LinearLR(optim, 1 / (w + 1), 1.0, total_iters=w))
        starts.append(w)
    if s.lr_schedule == "cosine":
        parts.append(sched.CosineAnnealingLR(optim, T_max=max(decay - 1, 1), eta_min=s.min_lr))
    elif s.lr_schedule == "constant":
        parts.append(sched.ConstantLR(optim, 1.0, total_iters=0))
    else:
        if s.lr_schedule == "wsd" and n - w - decay:
            parts.append(sched.ConstantLR(optim, 1.0, total_iters=0))
            starts.append(n - decay)
        parts.append(sched.LinearLR(optim, 1.0, floor, total_iters=max(decay - 1, 1)))
    schedule = parts[0] if len(parts) == 1 else sched.SequentialLR(optim, parts, milestones=starts)
    lrs = []
    for _ in range(n):
        lrs.append(optim.param_groups[0]["lr"])
        optim.step()
        schedule.step()
    return lrs


def closed_form(s: Settings, step: int) -> float:
    """The same schedule written out: warm-up from lr/(W+1), then the decay to min_lr at the end."""
    w, n = s.warmup_steps, s.steps
    if step <= w:
        return s.lr * step / (w + 1)
    decay = max(1, round(s.decay_fraction * n)) if s.lr_schedule == "wsd" else n - w
    u, span = step - (n - decay) - 1, max(decay - 1, 1)  # index into the decay, its length
    if s.lr_schedule == "constant" or u < 0:
        return s.lr
    if s.lr_schedule == "cosine":
        return s.min_lr + (s.lr - s.min_lr) * (1 + math.cos(math.pi * u / span)) / 2
    return s.lr - (s.lr - s.min_lr) * u / span


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"warmup_steps": 3},
        {"lr_schedule": "cosine", "min_lr": 3e-4},
        {"lr_schedule": "cosine", "warmup_steps": 4, "min_lr": 1e-4},
        {"lr_schedule": "linear", "warmup_steps": 2},
        {"lr_schedule": "wsd", "warmup_steps": 2, "min_lr": 1e-4},
        {"lr_schedule": "wsd", "decay_fraction": 0.5},
        {"lr_schedule": "cosine", "warmup_steps": 11},  # one step after the warm-up
    ],
)
def test_schedules_are_torchs_schedulers(changes):
    s = settings(steps=12, **changes)
    optim = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=s.lr)
    schedule, got = ScheduleConfig.from_settings(s).build(optim), []
    for _ in range(s.steps):
        got.append(optim.param_groups[0]["lr"])
        optim.step()
        schedule.step()
    assert got == torch_lrs(s)
    for step, lr in enumerate(got, 1):
        assert lr == pytest.approx(closed_form(s, step), rel=1e-9, abs=1e-15), (step, got)
    if s.lr_schedule != "constant" and s.warmup_steps < s.steps - 1:  # a decay of 2+ steps ends at min_lr
        assert got[-1] == pytest.approx(s.min_lr, abs=1e-15)


def test_weight_decay_applies_to_matrices_only():
    model = build_model(get_config("llama3-tiny"), device="meta")
    optim = OptimizerConfig.from_settings(settings(weight_decay=0.1, betas=(0.9, 0.95))).build(model.parameters())
    decayed, kept = optim.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decayed["weight_decay"] == 0.1 and kept["weight_decay"] == 0.0
    assert all(g["betas"] == (0.9, 0.95) and g["fused"] for g in optim.param_groups)
    assert {names[id(p)] for p in kept["params"]} == {n for n, p in model.named_parameters() if p.ndim < 2}
    assert all("norm" in names[id(p)] for p in kept["params"]) and len(kept["params"]) == 5
    assert {names[id(p)] for p in decayed["params"]} == {n for n, p in model.named_parameters() if p.ndim >= 2}


def reference(
    steps: int,
    clip: float | None,
    lrs: list[float],
    weight_decay: float = 0.0,
    model: str = "llama3-tiny",
    batch: int = 8,
    seq: int = 16,
) -> tuple[list, list]:
    """One device: `model` (default llama3-tiny at TINY's batch and seq) with torch's AdamW (decay
    on matrices), `clip_grad_norm_` and the lrs given; (losses, gradient norms before clipping)."""
    cfg = get_config(model)
    net, data = build_model(cfg, seed=0), MarkovTokens(cfg.vocab_size, seed=0)
    params = list(net.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optim = torch.optim.AdamW(groups, lr=lrs[0], fused=True)
    losses, norms = [], []
    for step in range(steps):
        for g in optim.param_groups:
            g["lr"] = lrs[step]
        rows = data.batch(step, batch, seq)
        losses.append(step_loss(net, rows.inputs, rows.targets).item())
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip is not None else math.inf)
        norms.append(float(norm))
        optim.step()
        optim.zero_grad(set_to_none=True)
    return losses, norms


SCHEDULED = ["--lr-schedule", "cosine", "--warmup-steps", "2", "--min-lr", "3e-4", "--weight-decay", "0.1"]


@pytest.mark.slow
@ONE_PROCESS
def test_a_run_logs_lr_and_grad_norm_and_resumes_on_the_same_lrs(tmp_path):
    """One process: the lr of every row is torch's schedulers', grad_norm of step 1 is a single
    device's, clipping keeps the single device's losses, and a run resumed from step 3 has the lrs
    and losses of the uninterrupted one; resumed with another schedule, it uses that one from step
    4 on and records the change."""
    first = tmp_path / "first"
    args = [*TINY, "--steps", "6", *SCHEDULED, "--grad-clip", "0.5", "--checkpoint-every", "3"]
    assert main([*args, "--out", str(first)]) == 0
    rows = metrics(first)
    want = torch_lrs(settings(steps=6, lr_schedule="cosine", warmup_steps=2, min_lr=3e-4))
    assert [r["lr"] for r in rows] == want
    losses, norms = reference(6, 0.5, want, weight_decay=0.1)
    assert rows[0]["grad_norm"] == pytest.approx(norms[0], rel=1e-5) and norms[0] > 0.5  # so it clips
    for row, loss, norm in zip(rows, losses, norms, strict=True):
        assert abs(row["loss"] - loss) <= 1e-5 and row["grad_norm"] == pytest.approx(norm, rel=1e-4)
        assert row["tokens_per_s_per_device"] == row["tokens_per_s"] and 0 < row["mfu"] < 1

    second = tmp_path / "second"
    shutil.copytree(first, second)
    shutil.rmtree(second / "checkpoints" / "step-000006")
    assert main([*args, "--out", str(second)]) == 0
    resumed = metrics(second)
    assert [(r["lr"], r["loss"]) for r in resumed] == [(r["lr"], r["loss"]) for r in rows]

    shutil.rmtree(second / "checkpoints" / "step-000006")
    changed = [*args[:-2], "--lr-schedule", "linear", "--betas", "0.8,0.9", "--weight-decay", "0.2"]
    assert main([*changed, "--checkpoint-every", "3", "--out", str(second)]) == 0
    resumed = metrics(second)
    linear = torch_lrs(settings(steps=6, lr_schedule="linear", warmup_steps=2, min_lr=3e-4))
    assert [r["lr"] for r in resumed] == want[:3] + linear[3:]
    assert resumed[3]["changed_on_resume"] == {
        "betas": [[0.9, 0.999], [0.8, 0.9]],
        "weight_decay": [0.1, 0.2],
        "lr_schedule": ["cosine", "linear"],
    }


@ONE_PROCESS
def test_without_clipping_the_norm_is_logged_and_nothing_scaled(tmp_path):
    out = tmp_path / "run"
    assert main([*TINY, "--steps", "3", "--out", str(out)]) == 0
    rows = metrics(out)
    losses, norms = reference(3, None, [3e-3] * 3)
    for row, loss, norm in zip(rows, losses, norms, strict=True):
        assert abs(row["loss"] - loss) <= 1e-5 and row["grad_norm"] == pytest.approx(norm, rel=1e-4)
        assert row["lr"] == 3e-3
    assert rows[0]["grad_norm"] == pytest.approx(norms[0], rel=1e-5)


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.parametrize("mesh", ["4x1", "2x2", "2x2x2"])
def test_torchrun_clips_by_the_global_norm_like_one_device(tmp_path, executed_plans, mesh):
    """4 or 8 gloo ranks, parameters sharded: grad_norm of step 1 is a single device's
    `clip_grad_norm_`'s within 1e-5, and the clipped, scheduled, weight-decayed losses are its."""
    out, world = tmp_path / "run", math.prod(map(int, mesh.split("x")))
    args = [*TINY, *SHARDED_ON_4, "--mesh", mesh, "--steps", "5", *SCHEDULED, "--grad-clip", "0.5", "--out", str(out)]
    torchrun(*args, nproc=world)
    (facts,) = executed_plans()
    assert_shards(facts, batch_split=False)
    rows = metrics(out)
    lrs = torch_lrs(settings(steps=5, lr_schedule="cosine", warmup_steps=2, min_lr=3e-4))
    losses, norms = reference(5, 0.5, lrs, weight_decay=0.1)
    assert rows[0]["grad_norm"] == pytest.approx(norms[0], rel=1e-5) and norms[0] > 0.5
    assert [r["lr"] for r in rows] == lrs
    for row, loss in zip(rows, losses, strict=True):
        assert abs(row["loss"] - loss) <= 1e-5, (row, loss)
        assert row["tokens_per_s_per_device"] == pytest.approx(row["tokens_per_s"] / world)


@ONE_PROCESS
@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_tensorboard_reads_back_the_loss_per_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    assert main([*TINY, "--steps", "3", "--out", str(out)]) == 0
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    rows = metrics(out)
    assert {"loss", "lr", "grad_norm", "mfu", "tokens_per_s_per_device"} <= set(events.Tags()["scalars"])
    got = [(e.step, e.value) for e in events.Scalars("loss")]
    assert got == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]


@pytest.mark.slow
@ONE_PROCESS
@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_wandb_offline_writes_a_run_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    assert main([*TINY, "--steps", "2", "--wandb", "autoshard-test", "--out", str(out)]) == 0
    (run,) = (out / "wandb").glob("offline-run-*")
    assert list(run.glob("run-*.wandb")), sorted(p.name for p in run.iterdir())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--betas", "1.5,0.9"], "--betas must be two numbers in [0, 1), got (1.5, 0.9)"),
        (["--betas", "0.9"], "--betas: bad betas '0.9': expected two numbers B1,B2"),
        (["--warmup-steps", "5"], "--warmup-steps must be >= 0 and below --steps 5, got 5"),
        (["--min-lr", "0.01"], "--min-lr must be between 0 and --lr 0.003, got 0.01"),
        (["--grad-clip", "0"], "--grad-clip must be positive (leave it out to not clip), got 0"),
        (["--lr", "0"], "--lr must be positive, got 0"),
        (["--weight-decay", "-1"], "--weight-decay must be >= 0, got -1"),
        (["--lr-schedule", "step"], "--lr-schedule: invalid choice: 'step'"),
        (["--decay-fraction", "0"], "--decay-fraction must be in (0, 1], got 0"),
        (
            ["--lr-schedule", "wsd", "--warmup-steps", "4", "--decay-fraction", "0.4"],
            "--lr-schedule wsd: --warmup-steps 4 and the decay's 2 steps (--decay-fraction 0.4 of 5) exceed --steps 5",
        ),
    ],
)
def test_bad_optimizer_input_is_one_line(tmp_path, capsys, args, message):
    assert main([*TINY, "--steps", "5", *args, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_wandb_asked_for_but_not_installed_is_one_line(tmp_path, capsys, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    assert main([*TINY, "--wandb", "proj", "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --wandb proj: wandb is not installed (pip install -e '.[wandb]')"
    ]


def test_the_console_line_shows_progress_lr_mfu_and_eta(caplog):
    from autoshard.train.loggers import ConsoleLog, duration

    row = {
        "step": 3,
        "loss": 2.5,
        "lr": 1e-3,
        "grad_norm": 0.7,
        "step_s": 2.0,
        "tokens_per_s": 400.0,
        "tokens_per_s_per_device": 100.0,
        "mfu": 0.42,
        "peak_rss_mb_per_rank": [10.0, 12.0],
        "modeled_step_s": 1.0,
        "modeled_over_measured": 0.5,
    }
    with caplog.at_level("INFO", logger="autoshard"):
        ConsoleLog(total=100).log(row)
    line = caplog.messages[0]  # then the note that the model is off by 2x
    assert line.startswith("step    3/100  loss 2.5000  lr 0.001  grad norm 0.7")
    assert "400 tok/s (100/device)  mfu 42.0%" in line and line.endswith("eta 3m14s")  # 97 steps x 2 s
    assert [duration(s) for s in (5, 65, 3 * 3600 + 120)] == ["5s", "1m05s", "3h02m"]


def test_mfu_counts_the_traced_steps_flops():
    """The plan's model flops of llama3-tiny: 6 x its matmul parameters x tokens, plus attention."""
    from autoshard.driver.api import AutoShard
    from autoshard.profiles.device import DeviceProfile
    from autoshard.train.loggers import Throughput
    from autoshard_models import cross_entropy_loss

    cfg = get_config("llama3-tiny")
    model = build_model(cfg, device="meta")
    example = lambda: (torch.empty(8, 16, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    with AutoShard(model, example, (1,), loss_fn=cross_entropy_loss) as auto:
        plan = auto.optimize(dry_run=False)
    device = DeviceProfile(peak_flops=1e12, mem_bw=1e9)
    figures = Throughput.of_plan(128, plan, device, torch.float32)
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.ndim >= 2 and "tok_embeddings" not in n)
    attention = 2 * 3 * cfg.n_layers * 2 * 8 * 16 * 16 * cfg.dim  # QK^T and AV, forward + 2x backward
    assert figures.flops == pytest.approx(6 * matmul * 128 + attention, rel=0.02)
    assert figures.row(0.5)["mfu"] == pytest.approx(figures.flops / 0.5 / 1e12)


def test_a_model_off_by_more_than_1_5x_says_so_once_with_the_calibrate_command(caplog):
    from autoshard.train.loggers import ConsoleLog

    console = ConsoleLog(10, "cpu-gloo/cpu", "torchrun --nproc_per_node=4 -m autoshard calibrate --mesh 2x2")
    row = {
        "loss": 2.5,
        "lr": 1e-3,
        "grad_norm": 0.7,
        "step_s": 0.3,
        "tokens_per_s": 400.0,
        "tokens_per_s_per_device": 100.0,
        "peak_rss_mb_per_rank": [10.0],
        "modeled_step_s": 0.1,
    }
    with caplog.at_level("INFO", logger="autoshard"):
        for step, ratio in [(1, 0.2), (2, 0.2), (3, 1.2), (4, 0.33), (5, 0.3), (6, 4.0)]:
            console.log(row | {"step": step, "modeled_over_measured": ratio})
    notes = [m for m in caplog.messages if m.startswith("note:")]
    assert len(notes) == 1, notes  # once, and not during warm-up (steps 1-2)
    assert notes[0].startswith("note: the modeled step is 3.0x shorter than the measured one on this machine")
    assert "(profiles cpu-gloo/cpu)" in notes[0] and "autoshard calibrate --mesh 2x2" in notes[0]
    assert caplog.messages.index(notes[0]) == 4  # right after step 4's line


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS from /proc; glibc's malloc_trim")
def test_what_a_thread_freed_is_handed_back_before_loading():
    """Rank 0 solves on a thread: what that thread allocated and freed stays in its malloc arena,
    resident, until `release_free_heap` (called before the weights load) returns it to the OS
    (blocks it left alive between the freed ones keep the arena from shrinking by itself)."""
    from autoshard.train.host_heap import release_free_heap

    def rss() -> int:
        with open("/proc/self/status") as f:
            return int(f.read().split("VmRSS:")[1].split()[0]) * 1024

    kept: list[bytearray] = []

    def churn():  # 64 MiB in 64 KiB blocks (below mmap's threshold: from the thread's arena)
        blocks = [bytearray(64 * 1024) for _ in range(1024)]
        kept.extend(blocks[::16])  # a few stay alive, spread over the arena
        del blocks

    thread = threading.Thread(target=churn)
    thread.start()
    thread.join()
    before = rss()
    release_free_heap()
    assert before - rss() > 16 * 2**20, (before, rss())


STEP_FAULTS = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from autoshard.train.host_heap import keep_freed_for_next_step
    keep_freed_for_next_step()
faults = []
for step in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [torch.ones(2**20 // 4) for _ in range(24)]  # a step's 24 MiB, alive together, then freed
    del blocks
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults[0], faults[1])
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds and mallopt")
def test_a_step_reuses_the_memory_the_last_one_freed():
    """glibc's default hands a step's freed blocks back to the OS (mmap'd, or trimmed off the
    heap's top), so the next step page-faults them in again; after `keep_freed_for_next_step` (the
    trainer calls it before its first step) the second step reuses the first's pages."""
    import subprocess

    def faults(mode: str) -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", STEP_FAULTS, mode], capture_output=True, text=True, check=True)
        first, second = map(int, out.stdout.split())
        return first, second

    first, second = faults("default")
    assert second > 0.5 * first > 2000, (first, second)  # 24 MiB is 6,144 pages
    first, second = faults("keep")
    assert first > 2000 and second < 0.1 * first, (first, second)
