"""Hugging Face causal LMs (tiny configs built here, nothing downloaded): traced by dynamo capture,
planned, and run on every rank under LocalTensorMode, they reproduce the single-device loss and
every gradient through 3 AdamW steps; their weights load from an HF state dict."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from autoshard import _torch_compat as tc
from autoshard.api import AutoShard
from autoshard import hf
from autoshard.runtime.module import parallelize
from models import MarkovTokens, cross_entropy_loss
from models.train_single import TrainSettings, make_optimizer
from simulation import simulated_mesh

BATCH, SEQ, VOCAB, STEPS = 4, 8, 128, 3
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, use_cache=False)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),  # q/k/v biases
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=8, tie_word_embeddings=True),  # q/k norms, tied
}


def batches():
    data = MarkovTokens(VOCAB, seed=0)
    return [data.batch(step, BATCH, SEQ) for step in range(STEPS)]


def logits_loss(logits, targets):
    return cross_entropy_loss(logits, targets)


def single_device(config, keywords: bool):
    """Initial state dict, and per step (loss, gradients), of AdamW on one device."""
    model = hf.build(config, "cpu", seed=0)
    initial = {k: v.clone() for k, v in (model.state_dict() | dict(model.named_buffers())).items()}
    optim = make_optimizer(model.parameters(), TrainSettings())
    steps = []
    for batch in batches():
        if keywords:
            loss = model(input_ids=batch.inputs, labels=batch.targets).loss
        else:
            loss = logits_loss(model(batch.inputs).logits, batch.targets)
        loss.backward()
        steps.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        optim.step()
        optim.zero_grad()
    return initial, steps


@pytest.mark.slow
@pytest.mark.parametrize("kind, mesh_shape, keywords", [
    ("llama", (2, 2), False), ("llama", (4,), True),
    ("qwen2", (2, 2), True), ("qwen2", (4,), False),
    ("qwen3", (2, 2), False), ("qwen3", (4,), True),
])
def test_hf_causal_lm_trains_like_single_device(kind, mesh_shape, keywords, caplog):
    config = CONFIGS[kind]()
    initial, ref = single_device(config, keywords)
    meta = hf.build(config, "meta")
    if keywords:  # HF's own convention: keyword inputs, the loss from `.loss`
        example = lambda: {"input_ids": torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),  # noqa: E731
                           "labels": torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta")}
        loss_fn = None
    else:  # a loss function of one's own gets `.logits`
        example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
        loss_fn = logits_loss
    with caplog.at_level(logging.INFO, logger="autoshard"):
        plan = AutoShard(meta, example, mesh_shape, loss_fn=loss_fn).optimize()
    assert "traced by dynamo graph capture" in caplog.text
    assert "will run replicated" not in caplog.text  # no op without a strategy
    names = [n for n, _ in meta.named_parameters()]
    assert sorted(plan.param_layouts) == sorted(names)
    if config.tie_word_embeddings:  # one parameter, one gradient, one layout
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    data = batches()  # one global value, made outside LocalTensorMode
    with simulated_mesh(mesh_shape) as (mesh, mode):
        pmodel = parallelize(plan, mesh, meta)
        state = {k: v for k, v in initial.items() if "rotary_emb" not in k}  # an HF state dict as it is
        with pytest.raises(KeyError, match="lack 2 buffers.*rotary_emb.inv_freq"):  # not garbage rotary tables
            pmodel.load_full(state)
        pmodel.load_full(initial)  # the state dict (tied lm_head.weight included) and the buffers
        optim = make_optimizer(pmodel.parameters(), TrainSettings())
        for step, batch in enumerate(data):
            loss = pmodel(*pmodel.shard_inputs(batch.inputs, batch.targets))
            loss.backward()
            want_loss, want_grads = ref[step]
            with mode.disable():
                for got in tc.rank_values(loss).values():
                    assert abs(got.item() - want_loss) <= 1e-5 * max(1.0, abs(want_loss)), (step, got, want_loss)
            # AdamW's normalized steps turn reduction-order ulps (batch-sharded sums) into ~1e-7
            # weight differences: later steps' gradients get a 1e-5 floor instead of 1e-6
            atol = 1e-6 if step == 0 else 1e-5
            for fqn, p in pmodel.named_parameters():
                assert p.grad.placements == p.placements, fqn
                full = p.grad.full_tensor()
                with mode.disable():
                    for got in tc.rank_values(full).values():
                        torch.testing.assert_close(got, want_grads[fqn], rtol=1e-5, atol=atol,
                                                   msg=lambda m: f"{fqn} step {step}: {m}")
            optim.step()
            optim.zero_grad()
