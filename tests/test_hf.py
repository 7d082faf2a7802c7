"""Hugging Face causal LMs (tiny configs built here, nothing downloaded): traced by dynamo capture,
planned, and run on every rank under LocalTensorMode, they reproduce the single-device loss and
every gradient through 3 AdamW steps; their weights load from an HF state dict."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from autoshard import _torch_compat as tc
from autoshard.driver.api import AutoShard
from autoshard.runtime.module import parallelize
from autoshard.workloads import hf
from autoshard.workloads.base import full_state
from autoshard_models import MarkovTokens, cross_entropy_loss
from autoshard_models.train_single import TrainSettings, make_optimizer
from plan_audit import CPU_PRICED, assert_shards, budget_bytes, sharded_plan
from simulation import simulated_mesh

BATCH, SEQ, VOCAB, STEPS = 4, 8, 128, 3
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    use_cache=False,
)
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
@pytest.mark.parametrize(
    "kind, mesh_shape, keywords",
    [
        ("llama", (2, 2), False),
        ("llama", (4,), True),
        ("qwen2", (2, 2), True),
        ("qwen2", (4,), False),
        ("qwen3", (2, 2), False),
        ("qwen3", (4,), True),
    ],
)
def test_hf_causal_lm_trains_like_single_device(kind, mesh_shape, keywords, caplog):
    config = CONFIGS[kind]()
    initial, ref = single_device(config, keywords)  # transformers' own sdpa, its causal mask made
    meta = hf.build(hf.training_config(config), "meta")  # is_causal SDPA, no mask
    if keywords:  # HF's own convention: keyword inputs, the loss from `.loss`
        example = lambda: {  # noqa: E731
            "input_ids": torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),
            "labels": torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),
        }
        loss_fn = None
    else:  # a loss function of one's own gets `.logits`
        example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
        loss_fn = logits_loss
    with caplog.at_level(logging.INFO, logger="autoshard"):
        plan = sharded_plan(AutoShard(meta, example, mesh_shape, loss_fn=loss_fn, **CPU_PRICED))
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
                        torch.testing.assert_close(
                            got, want_grads[fqn], rtol=1e-5, atol=atol, msg=lambda m: f"{fqn} step {step}: {m}"
                        )
            optim.step()
            optim.zero_grad()


def sdpa_calls(graph) -> list[dict]:
    """The arguments, by name, of every forward SDPA op of a traced graph."""
    return [
        dict(zip([a.name for a in n.target._schema.arguments], n.args)) | n.kwargs
        for n in graph.nodes
        if n.op == "call_function" and "scaled_dot_product" in str(n.target) and "backward" not in str(n.target)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_causal_mask_of_positions_leaves_the_graph(kind):
    """Tokens only: SDPA runs with is_causal=True and no [b, 1, s, s] mask is traced (transformers'
    own sdpa traces one); models with sliding windows keep transformers' implementation."""
    config = CONFIGS[kind]()
    example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    graphs = {}
    for name, cfg in (("ours", hf.training_config(config)), ("transformers", config)):
        plan = AutoShard(hf.build(cfg, "meta"), example, (2, 2), loss_fn=logits_loss).optimize()
        graphs[name] = plan.graph
    masks = {
        name: [n for n in g.nodes if getattr(n.meta.get("val"), "shape", None) == (BATCH, 1, SEQ, SEQ)]
        for name, g in graphs.items()
    }
    assert masks["transformers"] and not masks["ours"]
    ours = sdpa_calls(graphs["ours"])
    assert len(ours) == config.num_hidden_layers
    assert all(call["is_causal"] is True and call.get("attn_mask") is None for call in ours), ours
    windowed = transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert (
        not hf.full_causal_attention(windowed) and hf.training_config(windowed)._attn_implementation != hf.CAUSAL_SDPA
    )


@pytest.mark.slow
def test_a_padding_mask_is_kept_and_numerics_stay_exact():
    """An attention mask passed (left padding in two rows): the mask is traced as transformers makes
    it and (2,2) computes the single device's loss and gradients."""
    config = CONFIGS["llama"]()
    model = hf.build(config, "cpu", seed=0)
    batch = batches()[0]
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    mask[0, :3] = 0
    mask[2, :5] = 0
    loss = model(input_ids=batch.inputs, attention_mask=mask, labels=batch.targets).loss
    loss.backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    example = lambda: {  # noqa: E731
        "input_ids": torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),
        "attention_mask": torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),
        "labels": torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),
    }
    meta = hf.build(hf.training_config(config), "meta")
    plan = sharded_plan(AutoShard(meta, example, (2, 2), **CPU_PRICED))
    assert all(call.get("attn_mask") is not None for call in sdpa_calls(plan.graph))  # the mask is traced
    with simulated_mesh((2, 2)) as (mesh, mode):
        pmodel = parallelize(plan, mesh, meta)
        pmodel.load_full(full_state(model))
        got = pmodel(*pmodel.shard_inputs(batch.inputs, mask, batch.targets))
        got.backward()
        with mode.disable():
            for value in tc.rank_values(got).values():
                assert abs(value.item() - loss.item()) <= 1e-5 * loss.item()
        for fqn, p in pmodel.named_parameters():
            full = p.grad.full_tensor()
            with mode.disable():
                for value in tc.rank_values(full).values():
                    torch.testing.assert_close(value, want[fqn], rtol=1e-5, atol=1e-6, msg=fqn)


# ------------------------------------------------------------------------------------ CLI
def save_tiny(directory, seed=7, **config):
    """A tiny Llama saved as HF does (config.json, model.safetensors): the model, its directory."""
    model = hf.build(transformers.LlamaConfig(**(SMALL | config)), "cpu", seed=seed)
    model.save_pretrained(directory)
    return model, directory


def test_hf_workload_builds_from_a_local_config_and_seeds_its_init(tmp_path):
    from autoshard.workloads import get_workload

    _, directory = save_tiny(tmp_path / "m")
    for path in (directory, directory / "config.json"):
        w = get_workload(f"hf:{path}", seq=16)
        model = w.build("meta")
        assert type(model) is transformers.LlamaForCausalLM and not model.config.use_cache
        assert model.config._attn_implementation == hf.CAUSAL_SDPA  # no [b, 1, s, s] mask in the graph
    first, again, other = w.initial_state(3), w.initial_state(3), w.initial_state(4)
    want = hf.build(model.config, "cpu", seed=3)
    assert set(first) == {n for n, _ in want.named_parameters()} | {n for n, _ in want.named_buffers()}
    assert all(torch.equal(first[k], again[k]) and torch.equal(first[k], v) for k, v in want.state_dict().items())
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_hf_workload_builds_the_class_its_config_names_with_attention_only_where_it_has_some(tmp_path):
    """BART has a causal-LM and a sequence-to-sequence class: `architectures` picks; without it, the
    causal LM. A Mamba config builds (it has no attention for SDPA to run)."""
    from autoshard.workloads import get_workload

    bart = dict(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4)
    bart |= dict(decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
    cases = {
        "bart-causal": (transformers.BartConfig(**bart), transformers.BartForCausalLM),
        "bart-seq2seq": (
            transformers.BartConfig(**bart, architectures=["BartForConditionalGeneration"]),
            transformers.BartForConditionalGeneration,
        ),
        "mamba": (
            transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1),
            transformers.MambaForCausalLM,
        ),
    }
    for name, (config, cls) in cases.items():
        config.save_pretrained(tmp_path / name)
        w = get_workload(f"hf:{tmp_path / name}", seq=16)
        assert type(w.build("meta")) is cls, name
        inputs = w.example_inputs(2, 16, "meta")
        if name == "bart-seq2seq":  # its own .loss of labels=, by keyword
            assert w.loss_fn is None and w.n_model_inputs == 2 and list(inputs) == ["input_ids", "labels"]
        else:
            assert w.loss_fn is hf.logits_loss and len(inputs) == 2
    assert get_workload(f"hf:{tmp_path / 'mamba'}", seq=16).build("meta").config._attn_implementation != "sdpa"


def test_checkpoint_values_take_weights_from_safetensors_and_buffers_from_init(tmp_path):
    from autoshard.workloads import checkpoint_values, get_workload

    saved, directory = save_tiny(tmp_path / "m", seed=11)
    w = get_workload(f"hf:{directory}", seq=16)
    values = checkpoint_values(w, directory, seed=0)
    for name, p in saved.named_parameters():
        assert torch.equal(values[name], p), name
    assert torch.equal(values["model.rotary_emb.inv_freq"], saved.model.rotary_emb.inv_freq)


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "hf:{tmp}/nope: no such file or directory"),
        ("empty-dir", "the directory has no config.json"),
        ("vit", "model_type 'vit' has no causal-LM or sequence-to-sequence LM class in transformers"),
        ("unknown-type", "knows no model_type 'not-a-model'"),
        ("bad-json", "bad-json.json: not JSON"),
        ("init-shapes", "weight has shape (256, 32) in the checkpoint, (128, 32) in hf:{tmp}/m"),
        ("init-missing", "--init-from {tmp}/m/config.json: not a safetensors file"),
    ],
)
@pytest.mark.parametrize("command", ["plan", "train"])
def test_bad_hf_input_is_one_error_line(tmp_path, capsys, case, message, command):
    from autoshard.cli.plan import plan_main
    from autoshard.cli.train import main as train_main

    save_tiny(tmp_path / "m")
    save_tiny(tmp_path / "other", vocab_size=256)
    (tmp_path / "empty-dir").mkdir()
    (tmp_path / "vit").mkdir()
    (tmp_path / "vit" / "config.json").write_text('{"model_type": "vit"}')
    (tmp_path / "unknown-type.json").write_text('{"model_type": "not-a-model"}')
    (tmp_path / "bad-json.json").write_text("{nope")
    model = {
        "missing": "nope",
        "empty-dir": "empty-dir",
        "vit": "vit",
        "unknown-type": "unknown-type.json",
        "bad-json": "bad-json.json",
    }.get(case, "m")
    args = ["--model", f"hf:{tmp_path / model}", "--mesh", "1", "--batch", "2", "--seq", "8", "--out", tmp_path / "o"]
    if case == "init-shapes":
        args += ["--init-from", tmp_path / "other"]
    if case == "init-missing":
        args += ["--init-from", tmp_path / "m" / "config.json"]
    args = [str(a) for a in args]
    if command == "plan":
        with pytest.raises(SystemExit) as exit_:
            plan_main(args)
        code = exit_.value.code
    else:
        code = train_main(args)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, err
    assert message.replace("{tmp}", str(tmp_path)) in lines[0], lines
    assert "Traceback" not in err and not (tmp_path / "o").exists()


@pytest.mark.slow
@pytest.mark.ranks
def test_torchrun_trains_an_hf_model_from_its_safetensors_like_single_device(tmp_path, executed_plans):
    """4 gloo ranks on (2,2), `--model hf:DIR --init-from DIR` (a tiny Llama saved by
    save_pretrained), parameters sharded by a budget: the 5 losses equal the single-device run
    from the same weights."""
    from autoshard.workloads import get_workload
    from test_train import torchrun

    model, directory = save_tiny(tmp_path / "m", seed=5, tie_word_embeddings=True)
    torchrun(
        "--model",
        f"hf:{directory}",
        "--init-from",
        str(directory),
        "--mesh",
        "2x2",
        "--batch",
        "8",
        "--seq",
        "16",
        "--steps",
        "5",
        "--memory-budget",
        str(budget_bytes(model, (2, 2))),
        "--out",
        str(tmp_path / "run"),
    )
    (facts,) = executed_plans()
    assert_shards(facts, batch_split=False)
    data = get_workload(f"hf:{directory}", seq=16).data(0)
    matches_single_device(tmp_path / "run", model, data, lambda x, y: cross_entropy_loss(model(x).logits, y))


def matches_single_device(run, model, data, loss_of) -> None:
    """The run's 5 losses (batch 8, seq 16) are those of AdamW on one device from `model`."""
    from test_train import metrics

    optim = make_optimizer(model.parameters(), TrainSettings())
    want = []
    for step in range(5):
        loss = loss_of(*data.batch(step, 8, 16))
        loss.backward()
        optim.step()
        optim.zero_grad()
        want.append(loss.item())
    got = [row["loss"] for row in metrics(run)]
    assert len(got) == 5 and all(abs(a - b) <= 1e-5 for a, b in zip(got, want)), (got, want)


@pytest.mark.slow
@pytest.mark.ranks
def test_torchrun_trains_an_hf_encoder_decoder_on_its_own_loss_like_single_device(tmp_path, executed_plans):
    """4 gloo ranks on (2,2), `--model hf:DIR --init-from DIR` with a tiny T5 saved by
    save_pretrained: the workload is its sequence-to-sequence class, called with `labels=` and
    trained on its own `.loss` (no loss function of ours), parameters sharded by a budget. The 5
    losses equal the single-device run from the same weights."""
    from autoshard.workloads import get_workload
    from test_train import torchrun

    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0
    )
    config.decoder_start_token_id = config.pad_token_id = 0  # transformers 5 sets neither by default
    model = hf.build(config, "cpu", seed=5)
    directory = tmp_path / "t5"
    model.save_pretrained(directory)
    workload = get_workload(f"hf:{directory}", seq=16)
    assert workload.loss_fn is None and type(workload.build("meta")) is transformers.T5ForConditionalGeneration
    torchrun(
        *("--model", f"hf:{directory}", "--init-from", str(directory), "--mesh", "2x2", "--batch", "8"),
        *("--seq", "16", "--steps", "5", "--memory-budget", str(budget_bytes(model, (2, 2))), "--out"),
        str(tmp_path / "run"),
    )
    (facts,) = executed_plans()
    assert_shards(facts, batch_split=False)
    matches_single_device(tmp_path / "run", model, workload.data(0), lambda x, y: model(input_ids=x, labels=y).loss)
