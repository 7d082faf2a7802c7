"""Instruction data packed for transformers causal LMs: the rows hand the model `position_ids`
restarting at each example, and transformers' masking keeps the examples apart. The goal, as for
our llama: a packed batch's loss and gradients equal its examples' trained alone, on one device
and on a sharded (2, 2) plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from autoshard.data import with_layout
from autoshard.data.examples import packed_workload, positions_input
from autoshard.driver.api import AutoShard
from autoshard.runtime.module import parallelize
from autoshard.workloads import get_workload, hf
from plan_audit import CPU_PRICED, collectives_by_mesh_dim, sharded_plan
from simulation import simulated_mesh
from test_instruction_data import WORDS, config, data_file, every_rank_has, make_tokenizer, opened
from test_instruction_data import alone as examples_alone

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=len(WORDS),
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=8, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def saved(tmp_path, kind: str) -> str:
    """A tiny transformers config of `kind` saved as a model directory: the `hf:` workload's name."""
    CONFIGS[kind]().save_pretrained(tmp_path / kind)
    return f"hf:{tmp_path / kind}"


def packed_model(kind: str):
    """The model as the packed workload builds it (transformers' own SDPA: the default
    implementation takes positions to be 0..s-1), at a seeded init."""
    config = hf.training_config(CONFIGS[kind]())
    assert config._attn_implementation == hf.CAUSAL_SDPA
    config._attn_implementation = "sdpa"
    return hf.build(config, "cpu", seed=0)


def alone(model, data, rows) -> tuple[torch.Tensor, dict]:
    """The examples' loss and gradients, each example run alone (no positions, no mask)."""
    return examples_alone(model, data, rows, logits=lambda model, x: model(input_ids=x).logits)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_an_hf_causal_lm_packs_by_default_and_a_packed_batch_trains_like_its_examples_alone(
    tmp_path, tokenizer_dir, kind
):
    name = saved(tmp_path, kind)
    workload = get_workload(name, 24)
    assert positions_input(workload) == "position_ids"
    assert with_layout(config(data_file(tmp_path), tokenizer_dir), workload).instruction_layout == "pack"
    packed = packed_workload(workload)
    assert list(packed.example_inputs(2, 24)) == ["input_ids", "position_ids", "targets"]
    assert packed.build("meta").config._attn_implementation == "sdpa"  # not CAUSAL_SDPA: it assumes no packing
    data = opened(data_file(tmp_path), tokenizer_dir, seq=24)
    assert (np.diff(data.train.bounds) > 1).any()  # some rows hold several examples
    model = packed_model(kind)
    rows = np.arange(data.train.count)
    want, grads = alone(model, data, rows)
    model.zero_grad()
    tokens, positions, targets = data.inputs(data.train, rows)
    loss = hf.logits_loss(model(input_ids=tokens, position_ids=positions), targets)
    loss.backward()
    torch.testing.assert_close(loss.detach(), want, rtol=1e-6, atol=1e-6)
    for fqn, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[fqn], rtol=1e-4, atol=1e-6, msg=fqn)
    with torch.no_grad():  # without positions, later examples attend to earlier ones: other logits
        apart = model(input_ids=tokens, position_ids=positions).logits
        assert (model(input_ids=tokens).logits - apart).abs().max() > 1e-2


@pytest.mark.slow  # planning a tiny HF Llama on (2, 2) with a budget
def test_a_packed_batch_trains_an_hf_llama_like_its_examples_alone_on_a_sharded_plan(tmp_path, tokenizer_dir):
    """(2, 2) mesh, batch split and parameters sharded (asserted, collectives on both mesh dims):
    the mask transformers makes from the positions is in the traced step, and every rank's loss
    and every gradient equal the examples' alone on one device."""
    batch, seq = 4, 40
    packed = packed_workload(get_workload(saved(tmp_path, "llama"), seq))
    data = opened(data_file(tmp_path), tokenizer_dir, seq=seq, batch=batch)
    rows = np.arange(batch)
    assert (np.diff(data.train.bounds)[rows] > 1).all()  # every row holds several examples
    want, grads = alone(packed_model("llama"), data, rows)
    meta = packed.build("meta")
    example = lambda: packed.example_inputs(batch, seq)  # noqa: E731
    auto = AutoShard(meta, example, (2, 2), loss_fn=hf.logits_loss, n_model_inputs=2, **CPU_PRICED)
    plan = sharded_plan(auto)
    collectives = collectives_by_mesh_dim(plan)
    assert all(collectives[d] for d in (0, 1)), collectives
    built = packed_model("llama")
    reference = built.state_dict() | dict(built.named_buffers())
    with simulated_mesh(plan.mesh_shape) as (mesh, mode):
        pmodel = parallelize(plan, mesh, meta)
        pmodel.load_full(reference)
        loss = pmodel(*pmodel.shard_inputs(*data.inputs(data.train, rows)))
        loss.backward()
        every_rank_has(pmodel, loss, mode, want, grads)
