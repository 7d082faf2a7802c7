"""`train` on a mesh with a pp dim: the pipeline the search chose trains the losses a run without
pp trains (clipping over every stage's gradients), its checkpoints hold the whole model under its
own names (`export --hf`, a resume on a mesh without pp, a resume after SIGKILL exact), and what
it does not take is one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from autoshard.__main__ import main as autoshard_main
from autoshard.cli.train import main
from benchmarks.training.fault import survive
from test_train import metrics, torchrun

DEBUG = ["--model", "llama3-debug", "--batch", "8", "--seq", "32", "--steps", "4", "--grad-clip", "0.5"]


@pytest.mark.slow
@pytest.mark.ranks
def test_a_pipeline_trains_what_one_stage_mesh_trains_and_exports_the_whole_model(tmp_path):
    """llama3-debug on pp2 x dp2, 4 steps clipped to a norm under the gradients' (so the norm over
    every stage decides the update), checkpoints at steps 2 and 4; its step-2 checkpoint resumed
    on dp4 (no pp) trains steps 3 and 4 with the pipeline's losses (1e-5) and gradient norms (to
    fp32's summation error); plan.json names the stages, each pp rank running some of the 6
    blocks; `export --hf` of both runs gives the same tensors under the same names."""
    pp, dp = tmp_path / "pp", tmp_path / "dp"
    out = torchrun(*DEBUG, "--mesh", "2x2", "--mesh-names", "pp,dp", "--checkpoint-every", "2", "--out", str(pp))
    assert "autoshard train: pipeline " in out.stderr + out.stdout
    shutil.copytree(pp, dp)
    shutil.rmtree(dp / "checkpoints" / "step-000004")
    out = torchrun(*DEBUG, "--mesh", "4", "--checkpoint-every", "2", "--out", str(dp))
    assert f"resumed from {dp / 'checkpoints' / 'step-000002'} (step 2)" in out.stderr + out.stdout
    rows, reference = metrics(pp), metrics(dp)
    assert [r["step"] for r in rows] == [r["step"] for r in reference] == [1, 2, 3, 4]
    for row, ref in zip(rows[2:], reference[2:]):
        assert row["grad_norm"] > 0.5  # clipped
        assert row["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        # torch's fp32 norm of a whole tensor and the norms of its shards summed differ by ~1e-4
        assert row["grad_norm"] == pytest.approx(ref["grad_norm"], rel=2e-4)
    plan = json.loads((pp / "plan.json").read_text())
    stages = plan["pipeline"]["stages"]
    assert sum(s["n_blocks"] for s in stages) == 6 and {s["rank"] for s in stages} == {0, 1}
    assert plan["settings"]["grad_accum"] == plan["pipeline"]["micro_batches"]
    exported = {}
    for run in (pp, dp):
        assert autoshard_main(["export", str(run), "--hf", str(run / "hf")]) == 0
        exported[run] = {k: v for f in (run / "hf").glob("*.safetensors") for k, v in load_file(f).items()}
    assert exported[pp].keys() == exported[dp].keys() and len(exported[pp]) == 57
    for name, value in exported[dp].items():
        assert (exported[pp][name] - value).abs().max() <= 1e-3 * value.abs().max(), name


@pytest.mark.slow
@pytest.mark.ranks
def test_a_pipelined_run_killed_by_sigkill_resumes_with_the_same_losses():
    """pp2 x dp2, llama3-tiny, 8 steps, checkpoints every 2 written in the background: a random
    rank SIGKILLed after step 4 under --max-restarts 1; torchrun exits 0 and every step's loss
    equals the uninterrupted run's."""
    figures = survive(
        steps=8, checkpoint_every=2, kills=1, seed=1, extra=("--mesh-names", "pp,dp", "--checkpoint-writes", "async")
    )
    assert figures["clean_returncode"] == 0 and figures["returncode"] == 0, figures["stderr_tail"]
    assert len(figures["killed_at"]) == 1 and figures["rows"] == 8
    assert figures["differing_steps"] == []


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--compile"], "--compile"),
        (["--recompute", "--prefetch", "2"], "--recompute, --prefetch"),
        (["--lora", "4"], "--lora"),
    ],
)
def test_what_a_pipeline_does_not_take_is_one_error_line(tmp_path: Path, capsys, flags, named):
    assert main(["--mesh", "2x2", "--mesh-names", "pp,dp", *flags, "--out", str(tmp_path / "run")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: a mesh with a pp dim does not take ") and f"take {named} yet:" in line
    assert not (tmp_path / "run").exists()
