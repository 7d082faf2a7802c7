"""The GPU check (`python -m benchmarks.gpu.check`) at toy sizes on CPU, so that a session lent a GPU runs
it as one command; and the CUDA path of a lowered program, checked without a GPU: a CUDA mesh
under torch's fake process group lowers and dry-runs as a GPU rank would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from autoshard import _torch_compat as tc
from autoshard.driver.api import AutoShard
from autoshard.driver.config import PlanConfig
from autoshard.program.attention import attention_backward, attention_forward
from autoshard.program.lower import lower
from autoshard.runtime.dryrun import estimate
from autoshard.workloads import get_workload
from benchmarks.gpu.check import driver as gpu_check
from benchmarks.gpu.check.report import table

ROOT = Path(__file__).resolve().parents[1]


# The step part applies autoshard's plan on mesh (1,) in a process group of one: one GPU's step
# beside plain torch's, with no mesh dim to shard over by design (rank0 parts run no ParallelModule).
@pytest.mark.replicated_plan
def test_tiny_check_runs_every_part_and_writes_its_table(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu.check",
            "--tiny",
            "--no-compile",
            "--budget",
            "600",
            "--profile",
            str(tmp_path),
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "[gpu_check" in run.stdout  # progress lines
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["meta"]["tiny"] and result["meta"]["device"] == "cpu"
    parts = result["parts"]
    assert list(parts) == ["step-eager", "rank0", "rank0-big"]
    assert all(p["status"] == "ok" for p in parts.values()), {k: p.get("notes") for k, p in parts.items()}

    step = parts["step-eager"]
    ours, torch_ = step["variants"]["autoshard"], step["variants"]["torch"]
    for v in (ours, torch_):
        assert v["tokens_per_s"] > 0 and 0 < v["mfu"] < 1
    assert step["ratio"] == pytest.approx(ours["tokens_per_s"] / torch_["tokens_per_s"])
    assert step["met"] == (step["ratio"] >= 0.97)
    assert step["first_loss_rel_diff"] < 1e-3  # the same step on the same values: the same loss
    assert not step["recompute"] and step["mesh"] == [1]
    # on CPU the program's attention is torch's own op: the same error against fp32 as torch's
    assert step["attention"]["kernel"] == "sdpa" and step["attention"]["out_err"] == step["attention"]["torch_out_err"]
    profiles = {name: (tmp_path / f"profile-{name}.txt").read_text() for name in parts}
    assert profiles["step-eager"].count("by self_cpu_time_total") == 2  # autoshard's step, torch's
    assert "## rank 0's forward + backward (rank0), by self_cpu_time_total" in profiles["rank0"]

    for name in ("rank0", "rank0-big"):
        part = parts[name]
        assert part["compute_measured_s"] > 0 and part["compute_modeled_s"] > 0
        assert part["compute_ratio"] == pytest.approx(part["compute_measured_s"] / part["compute_modeled_s"])
        assert part["dry_run_peak_bytes"] > 0 and "memory_measured_bytes" not in part
        assert any("max_memory_allocated" in note for note in part["notes"])
    assert parts["rank0-big"]["mesh"] == [4, 2]

    md = (tmp_path / "gpu_check.md").read_text()
    assert md == table(result)
    assert "| part | case | figure | autoshard / measured | reference | ratio | goal | met |" in md
    assert "| step-eager | llama3-tiny (1), batch 2, seq 32, bf16 / fp32, eager | tokens/s |" in md
    assert md.count("| forward + backward |") == 2 and md.count("skipped (no allocator peak on CPU)") == 2


@pytest.mark.slow  # inductor compiles both steps on CPU: minutes
@pytest.mark.replicated_plan  # as above: mesh (1,) by design
def test_tiny_check_with_torch_compile(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu.check", "--tiny", "--parts", "step-compiled", "--budget", "900"]
        + ["--out", str(tmp_path)],  # the other parts run uncompiled in the test above
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    part = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]["step-compiled"]
    if part["status"] == "skipped":  # no C++ compiler for inductor here: said so
        assert part["notes"][0].startswith("torch.compile:")
        return
    assert part["status"] == "ok" and part["compiled"], part.get("notes")
    assert part["first_loss_rel_diff"] < 1e-2 and part["variants"]["torch"]["tokens_per_s"] > 0


def test_a_spent_budget_skips_each_part_with_a_note(tmp_path, capsys):
    assert gpu_check.main(["--tiny", "--budget", "0", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [p["status"] for p in result["parts"].values()] == ["skipped"] * 4
    assert all("time budget" in p["notes"][0] for p in result["parts"].values())
    assert (
        "| rank0-big | llama3-tiny (4, 2), batch 8, seq 32, bf16 / fp32, rank 0 | skipped |" in capsys.readouterr().out
    )


def test_parts_picks_parts_in_their_order_and_an_unknown_one_is_one_error_line(tmp_path, capsys):
    assert gpu_check.main(["--tiny", "--parts", "rank0,nope", "--out", str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err == "error: --parts: no part nope (parts: step-eager, rank0, rank0-big, step-compiled)\n"
    )
    assert not (tmp_path / "gpu_check.json").exists()
    assert gpu_check.main(["--tiny", "--parts", "step-compiled,rank0", "--budget", "0", "--out", str(tmp_path)]) == 0
    assert list(json.loads((tmp_path / "gpu_check.json").read_text())["parts"]) == ["rank0", "step-compiled"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_the_full_check_without_a_gpu_is_one_error_line(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no CUDA device") and err.count("\n") == 1
    assert not (tmp_path / "gpu_check.json").exists()


def test_a_cuda_mesh_lowers_onto_cuda_and_dry_runs():
    """The step is traced on CPU fake tensors, so its casts carry `device=cpu` and its attention is
    CPU flash attention (no CUDA kernel): lowered on a CUDA mesh, both become CUDA's (else each cast
    copies to the host and attention fails), and the dry run of that program (what `train` runs on
    rank 0 on GPUs) runs it on fake CUDA tensors: CUDA flash attention's own signatures, checked
    without a GPU; its peak differs from the CPU program's by what the kernels allocate."""
    workload = get_workload("llama3-tiny", 32)
    config = PlanConfig(param_dtype="bf16", reduce_dtype="fp32", network="cpu-gloo", device_profile="cpu")
    with tc.fake_process_group(4):
        auto = AutoShard(
            workload.build("meta"),
            lambda: workload.example_inputs(4, 32, "meta"),
            (2, 2),
            config=config,
            loss_fn=workload.loss_fn,
            n_model_inputs=workload.n_model_inputs,
        )
        plan = auto.optimize(dry_run=False)
        peaks = {}
        for device in ("cpu", "cuda"):  # the fake backend makes a CUDA mesh without a GPU
            program = lower(plan, init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp")))
            assert program.device_type == device
            devices = {
                v.type
                for gm in (program.forward, program.backward)
                for n in gm.graph.nodes
                for v in (*n.args, *n.kwargs.values())
                if isinstance(v, torch.device)
            }
            assert devices == {device}  # the bf16 casts carry one
            calls = {n.target for gm in (program.forward, program.backward) for n in gm.graph.nodes}
            assert (attention_forward in calls and attention_backward in calls) == (device == "cuda")
            peaks[device] = estimate(program).peak_bytes
    assert peaks["cuda"] == pytest.approx(peaks["cpu"], rel=0.1)


def test_the_device_attention_fallback_matches_the_cpu_op():
    """Off the flash path (fp32 here) the device's attention is `scaled_dot_product_attention` with
    a recomputing backward: the CPU op's values, gradients and memory layout ([b, h, s, d] laid
    out as [b, s, h, d]), which the traced views after it rely on."""
    aten = torch.ops.aten
    q, k, v = (torch.randn(2, 8, 4, 16).transpose(1, 2) for _ in range(3))
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, True)
    mine, _ = attention_forward(q, k, v, 0.0, True)
    assert torch.allclose(mine, out, atol=1e-5) and mine.stride() == out.stride()
    grad = torch.randn_like(out)
    want = aten._scaled_dot_product_flash_attention_for_cpu_backward.default(grad, q, k, v, out, lse, 0.0, True)
    got = attention_backward(grad, q, k, v, out, lse, 0.0, True)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5) and a.stride() == b.stride()
    with pytest.raises(NotImplementedError, match="dropout"):
        attention_forward(q, k, v, 0.1, True)


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_the_fused_kernels_take_the_cpu_op_s_arguments_and_give_its_shapes(monkeypatch, kernel):
    """Whichever kernel torch would pick on the GPU (cuDNN's on Hopper, flash attention's), the
    program's attention hands over the CPU op's outputs: the output [b, h, s, d] laid out as
    [b, s, h, d] and the logsumexp [b, h, s] in fp32, which the backward takes back. Checked on
    fake CUDA tensors (the kernels' meta functions), the GPU's choice stubbed."""
    from autoshard.program import attention

    monkeypatch.setattr(tc, "sdpa_backend", lambda *args: kernel)
    with tc.new_fake_mode():
        q, k, v = (torch.empty(2, 16, 4, 8, dtype=torch.bfloat16, device="cuda").transpose(1, 2) for _ in range(3))
        out, lse = attention_forward(q, k, v, 0.0, True)
        assert out.shape == (2, 4, 16, 8) and out.transpose(1, 2).is_contiguous()
        assert lse.shape == (2, 4, 16) and lse.dtype == torch.float32
        grads = attention_backward(torch.empty_like(out), q, k, v, out, lse, 0.0, True)
        assert [g.shape for g in grads] == [(2, 4, 16, 8)] * 3 and all(g.transpose(1, 2).is_contiguous() for g in grads)
    monkeypatch.setattr(tc, "sdpa_backend", lambda *args: pytest.fail("asked without a GPU kernel to choose"))
    assert attention._kernel(q, k, v, 0.1, None, True, None) == "sdpa"  # dropout: torch's own op
