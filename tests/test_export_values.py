"""`export` never writes weights that are silently wrong: an fp16 export whose values overflow
fp16 and a checkpoint with NaN or inf weights are one error line naming the tensors, before
anything is written; the same checkpoint exports in a dtype that holds it."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch

from autoshard.__main__ import main as autoshard_main
from autoshard.cli.train import main as train_main
from autoshard.train.export import export_hf
from test_export import ONE_PROCESS, TINY, checkpoint_tensors

STEP = "step-000001"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A one-step llama3-tiny run with its checkpoint, made once; each test poisons a copy."""
    run = tmp_path_factory.mktemp("export") / "run"
    assert train_main([*TINY, "--steps", "1", "--checkpoint-every", "1", "--out", str(run)]) == 0
    return run


def poisoned(run: Path, tmp_path: Path, **changes: float) -> Path:
    """A copy of `run` whose checkpoint has one value of each named tensor (ours) set to a value."""
    import torch.distributed.checkpoint as dcp

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    ckpt = copy / "checkpoints" / STEP
    model = checkpoint_tensors(ckpt)
    for name, value in changes.items():
        model[name].view(-1)[: model[name].numel() // 2 + 1 : 7] = value  # spread over the tensor
    for f in ckpt.iterdir():
        if f.name != "step.json":
            f.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model}, checkpoint_id=str(ckpt), no_dist=True)
    return copy


def export_error(capsys, run: Path, out: Path, *args: str) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        autoshard_main(["export", str(run), "--hf", str(out), *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.*")), "something was written"
    return err


@ONE_PROCESS
def test_an_fp16_export_that_overflows_is_refused_and_bf16_holds_it(tmp_path, capsys, trained):
    run = poisoned(trained, tmp_path, **{"layers.1.feed_forward.w2.weight": 1.0e5})
    err = export_error(capsys, run, tmp_path / "hf", "--dtype", "fp16")
    assert "--dtype fp16: 1 tensor(s) overflow fp16 (values up to 1e+05, its largest is 6.55e+04)" in err, err
    assert "model.layers.1.mlp.down_proj.weight (" in err and "export as --dtype bf16 or fp32" in err, err
    done = export_hf(run, tmp_path / "bf16", dtype="bf16")
    assert done.dtype == "bf16" and (tmp_path / "bf16" / "model.safetensors").is_file()


@ONE_PROCESS
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_weights_are_refused_in_any_dtype(tmp_path, capsys, trained, dtype, bad):
    changes = {"tok_embeddings.weight": bad, "layers.0.attention.wq.weight": bad}
    run = poisoned(trained, tmp_path, **changes)
    err = export_error(capsys, run, tmp_path / "hf", "--dtype", dtype)
    count = torch.Size([256, 64]).numel() // 2 // 7 + 1  # llama3-tiny's embedding, every 7th of its first half
    assert "the weights are not finite (NaN or inf) in 2 tensor(s)" in err, err
    assert f"model.embed_tokens.weight ({count} values)" in err and "model.layers.0.self_attn.q_proj.weight" in err
    assert "the run diverged by step 1" in err, err
