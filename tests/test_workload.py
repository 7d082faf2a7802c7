"""The workload description plan and train share, and the argument pieces they share (cli/args)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autoshard.cli.train import Settings, _parse
from autoshard.driver.config import mesh_names
from autoshard.workloads import get_workload
from autoshard_models import MarkovTokens, get_config


def test_llama_workload_builds_inputs_loss_and_data():
    w = get_workload("llama3-tiny", seq=16)
    model = w.build("meta")
    tokens, targets = w.example_inputs(4, 16, "meta")
    assert tokens.shape == targets.shape == (4, 16) and tokens.dtype == torch.int64
    assert model(*(tokens, targets)[: w.n_model_inputs]).shape == (4, 16, get_config("llama3-tiny").vocab_size)
    want = MarkovTokens(get_config("llama3-tiny").vocab_size, seed=3).batch(5, 2, 8)
    got = w.data(3).batch(5, 2, 8)
    assert torch.equal(got[0], want.inputs) and torch.equal(got[1], want.targets)
    assert w.adapt_state_dict({"a": 1}) == {"a": 1}


def test_seq_longer_than_the_config_bumps_max_seq_len():
    assert get_config("llama3-tiny").max_seq_len == 256
    assert get_workload("llama3-tiny", seq=512).build("meta").cfg.max_seq_len == 512
    assert get_workload("llama3-tiny", seq=16).build("meta").cfg.max_seq_len == 256


def test_unknown_workload_names_the_known_ones():
    with pytest.raises(ValueError) as err:
        get_workload("nope", seq=16)
    with pytest.raises(ValueError) as want:
        get_config("nope")
    moe = ", moe-tiny, moe-debug, qwen3-30b-a3b, qwen3-235b-a22b"  # our mixture-of-experts family
    assert str(err.value) == str(want.value) + moe + ", hf:PATH (a local transformers config.json or model directory)"


def test_mesh_names():
    assert mesh_names(None, (2, 2)) == ("dp", "tp") and mesh_names(None, (4,)) == ("dp",)
    assert mesh_names(" dp_replicate , tp ", (2, 2)) == ("dp_replicate", "tp")
    for bad in ("dp", "dp,dp", "dp,", "a,b,c"):
        with pytest.raises(ValueError, match="must give 2 distinct names"):
            mesh_names(bad, (2, 2))


def test_every_setting_is_an_option():
    s = _parse(
        [
            "--mesh",
            "4",
            "--batch",
            "4",
            "--memory-budget",
            "1GiB",
            "--resume",
            "--device",
            "cpu",
            "--checkpoint-every",
            "2",
            "--out",
            "x",
        ]
    )
    assert (s.mesh, s.mesh_names, s.memory_budget, s.resume, s.device_profile) == ((4,), ("dp",), 2**30, "yes", "cpu")
    assert _parse(["--device-profile", "h200"]).device_profile == "h200"
    assert {f.name for f in dataclasses.fields(Settings)} == set(vars(_parse([])).keys())
    assert _parse([]) == Settings()


def test_defaults_name_the_run_by_model_and_mesh_and_fit_the_world(monkeypatch):
    """Without --mesh, one data-parallel dim over the world torchrun launched (1 without it);
    without --out, runs/<model>-<mesh>, an hf: path by its folder's name, one safe name."""
    from autoshard.options import run_name

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    alone = _parse(["--model", "llama3-tiny"])
    assert (alone.mesh, alone.mesh_names, alone.out) == ((1,), ("dp",), "runs/llama3-tiny-1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert (_parse([]).mesh, _parse([]).out) == ((4,), "runs/llama3-debug-4")
    assert _parse(["--mesh", "2x2"]).out == "runs/llama3-debug-2x2"
    assert run_name("hf:/home/u/Llama-3-8B", (2, 8)) == "Llama-3-8B-2x8"
    assert run_name("hf:/home/u/my model:v2/", (4,)) == "my_model_v2-4"
