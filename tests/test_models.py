"""The model family, the synthetic data and the single-device reference trainer."""

import math

import pytest
import torch

from autoshard_models import CONFIGS, MarkovTokens, build_model, cross_entropy_loss, get_config
from autoshard_models.train_single import TrainSettings, main, train_single


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "name, expected, tolerance, n_params",
    [
        ("llama3-1b", 1.50e9, 0.01e9, 147),
        ("llama3-8b", 8.03e9, 0.01e9, 291),
        ("llama3-70b", 70.6e9, 0.1e9, 723),
        ("llama3-405b", 405.85e9, 0.01e9, 1137),
    ],
)
def test_published_sizes_on_meta(name, expected, tolerance, n_params):
    model = build_model(get_config(name), device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert abs(count_params(model) - expected) <= tolerance
    assert len(list(model.parameters())) == n_params


def test_debug_config_matches_the_recipe():
    cfg = get_config("llama3-debug")
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.vocab_size, cfg.ffn_hidden, cfg.rope_theta) == (
        256,
        6,
        16,
        2048,
        768,
        500000.0,
    )
    assert 6.0e6 <= count_params(build_model(cfg, device="meta")) <= 6.5e6


def test_tiny_forward_backward_shapes():
    cfg = get_config("llama3-tiny")
    model = build_model(cfg, seed=0)
    tokens = torch.randint(cfg.vocab_size, (3, 16))
    logits = model(tokens)
    assert logits.shape == (3, 16, cfg.vocab_size)
    loss = cross_entropy_loss(logits, tokens)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name
        assert torch.isfinite(p.grad).all(), name
    # A fresh model predicts roughly uniformly.
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 1.0


def test_attention_is_causal():
    cfg = get_config("llama3-tiny")
    model = build_model(cfg, seed=1)
    tokens = torch.randint(cfg.vocab_size, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % cfg.vocab_size
    assert torch.equal(model(tokens)[0, :8], model(changed)[0, :8])
    assert not torch.allclose(model(tokens)[0, 8:], model(changed)[0, 8:])


def test_init_is_deterministic_and_seeded():
    cfg = get_config("llama3-tiny")
    a = build_model(cfg, seed=7).state_dict()
    b = build_model(cfg, seed=7).state_dict()
    c = build_model(cfg, seed=8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])


def test_meta_model_materializes_to_the_same_weights():
    cfg = get_config("llama3-tiny")
    reference = build_model(cfg, seed=3)
    meta = build_model(cfg, device="meta")
    meta.to_empty(device="cpu")
    meta.init_weights(3)
    tokens = torch.randint(cfg.vocab_size, (2, 10))
    assert torch.equal(reference(tokens), meta(tokens))


def test_synthetic_stream_is_deterministic_and_learnable():
    data = MarkovTokens(256, seed=0)
    first, again, other = data.batch(5, 4, 32), data.batch(5, 4, 32), data.batch(6, 4, 32)
    assert torch.equal(first.inputs, again.inputs)
    assert not torch.equal(first.inputs, other.inputs)
    assert torch.equal(first.inputs[:, 1:], first.targets[:, :-1])
    # Every transition is one the chain allows.
    allowed = data.successors[first.inputs]  # [b, s, branching]
    assert (allowed == first.targets[..., None]).any(-1).all()
    assert data.entropy < 0.5 * math.log(256)


def test_single_device_training_learns():
    result = train_single(TrainSettings(model="llama3-tiny", steps=60, batch=8, seq=64, lr=3e-3))
    start = result.losses[0]
    end = sum(result.losses[-5:]) / 5
    assert end <= 0.7 * start, (start, end)


def test_unknown_config_lists_valid_names():
    with pytest.raises(ValueError) as err:
        get_config("llama3-9000b")
    for name in CONFIGS:
        assert name in str(err.value)


def test_cli_rejects_unknown_model_without_traceback(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "nope", "--steps", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown model config 'nope'" in err and "Traceback" not in err


@pytest.mark.parametrize("bad", [dict(dim=60, n_heads=8), dict(n_heads=4, n_kv_heads=3)])
def test_inconsistent_config_is_rejected(bad):
    with pytest.raises(ValueError):
        get_config("llama3-tiny").with_(**bad)
