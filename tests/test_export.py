"""`export --hf`: a training run's checkpoint as a Hugging Face model directory that transformers
loads with every tensor the checkpoint's, and that `--init-from` trains from again."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from autoshard.__main__ import main as autoshard_main
from autoshard.cli.train import main as train_main
from autoshard.train.export import export_hf
from autoshard.workloads import get_workload
from autoshard_models import cross_entropy_loss

TINY = ["--model", "llama3-tiny", "--batch", "8", "--seq", "16", "--mesh", "1"]
# Export's own checks (file layout, names, dtypes, errors) on a one-process run; exporting a sharded
# checkpoint is the 2x2 test's
ONE_PROCESS = pytest.mark.replicated_plan


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The model's tensors of a DCP checkpoint, read with torch's own converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(path.parent / "whole.pt"))
    state = torch.load(path.parent / "whole.pt", weights_only=True)
    (path.parent / "whole.pt").unlink()
    return state["model"]


def batch_loss(model, workload, step: int) -> float:
    tokens, targets = workload.data(0).batch(step, 8, 16)
    with torch.no_grad():
        out = model(tokens)
    return cross_entropy_loss(getattr(out, "logits", out), targets).item()


@ONE_PROCESS
def test_our_llama_exports_as_llama_for_causal_lm_with_the_same_logits(tmp_path, capsys):
    run, out = tmp_path / "run", tmp_path / "hf"
    assert train_main([*TINY, "--steps", "3", "--checkpoint-every", "3", "--out", str(run)]) == 0
    done = export_hf(run, out, max_shard_bytes=100_000)  # several files and an index
    assert done.step == 3 and len(done.files) > 1 and (out / "model.safetensors.index.json").is_file()
    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(hf_model) is transformers.LlamaForCausalLM
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["unexpected_keys"]
    workload = get_workload("llama3-tiny", 16)
    ours = workload.build("cpu")
    saved = checkpoint_tensors(run / "checkpoints" / "step-000003")
    ours.load_state_dict(saved, strict=False)
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)
    # and back: --init-from the exported directory (HF names mapped to ours) starts from these weights
    capsys.readouterr()
    again = tmp_path / "again"
    assert train_main([*TINY, "--steps", "1", "--init-from", str(out), "--out", str(again)]) == 0
    first = json.loads((again / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert abs(first - batch_loss(ours, workload, 0)) <= 1e-5 * first


@ONE_PROCESS
def test_our_mixture_of_experts_exports_as_mixtral_with_the_same_logits(tmp_path):
    """Each layer's w1 and w3 are joined into Mixtral's gate_up_proj, the router becomes its gate."""
    run, out = tmp_path / "run", tmp_path / "hf"
    args = ["--model", "moe-tiny", "--batch", "8", "--seq", "16", "--mesh", "1"]
    assert train_main([*args, "--steps", "2", "--checkpoint-every", "2", "--out", str(run)]) == 0
    done = export_hf(run, out)
    assert done.tensors == 3 + 2 * 9  # embedding, norm, head; per layer 4 attention, 2 norms, gate, 2 experts
    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(hf_model) is transformers.MixtralForCausalLM
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ours = get_workload("moe-tiny", 16).build("cpu")
    ours.load_state_dict(checkpoint_tensors(run / "checkpoints" / "step-000002"), strict=False)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, ours(tokens)[0], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory) -> Path:
    """A one-step training run with its checkpoint, made once; each test copies it."""
    run = tmp_path_factory.mktemp("export") / "run"
    assert train_main([*TINY, "--steps", "1", "--checkpoint-every", "1", "--out", str(run)]) == 0
    return run


@pytest.mark.parametrize(
    "args, message",
    [
        (["{tmp}/nowhere", "--hf", "{tmp}/o"], "not a training run directory (no plan.json)"),
        (["{run}", "--hf", "{tmp}/o", "--step", "2"], "no complete checkpoint of step 2 (there are: 1)"),
        (["{run}", "--hf", "{run}"], "exists and is not an empty directory"),
        (["{run}", "--hf", "/proc/autoshard-export"], "cannot write /proc/autoshard-export"),
    ],
)
@ONE_PROCESS
def test_bad_export_input_is_one_error_line_and_writes_nothing(tmp_path, capsys, one_step_run, args, message):
    run = tmp_path / "run"
    shutil.copytree(one_step_run, run)
    with pytest.raises(SystemExit) as exit_:
        autoshard_main(["export", *[a.replace("{tmp}", str(tmp_path)).replace("{run}", str(run)) for a in args]])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.splitlines() == [err.splitlines()[0]] and message in err, err
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*"))


@pytest.mark.slow
@pytest.mark.ranks
@ONE_PROCESS  # the `--init-from` check at the end; the (2,2) runs are asserted to shard
def test_an_hf_model_trained_on_2x2_exports_back_to_transformers(tmp_path, executed_plans):
    """`train --model hf:DIR` (a tiny Qwen3, tied embeddings) on 4 gloo ranks (2,2), parameters
    sharded, a checkpoint at step 2; `export --hf`: from_pretrained finds no missing or unexpected
    key and every tensor equals the checkpoint's; the exported model's loss on step 3's batch is the
    loss `--resume` computes at step 3, and `--init-from` the export starts from those weights."""
    from plan_audit import assert_shards, budget_bytes
    from test_train import metrics, torchrun

    model = transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            tie_word_embeddings=True,
            use_cache=False,
        )
    )
    model.save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7}))
    args = ["--model", f"hf:{tmp_path / 'm'}", "--mesh", "2x2", "--batch", "8", "--seq", "16"]
    sharded = ["--memory-budget", str(budget_bytes(model, (4,)))]
    run = tmp_path / "run"
    torchrun(
        *args,
        *sharded,
        "--init-from",
        str(tmp_path / "m"),
        "--steps",
        "2",
        "--checkpoint-every",
        "2",
        "--out",
        str(run),
    )
    (facts,) = executed_plans()
    assert_shards(facts, batch_split=False)
    out = tmp_path / "hf"
    assert autoshard_main(["export", str(run), "--hf", str(out)]) == 0
    assert json.loads((out / "generation_config.json").read_text()) == {"max_new_tokens": 7}
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    saved = checkpoint_tensors(run / "checkpoints" / "step-000002")
    state = exported.state_dict()
    assert set(saved) <= set(state)
    for name, value in saved.items():
        assert torch.equal(state[name], value), name
    torchrun(*args, *sharded, "--steps", "3", "--resume", "--out", str(run))
    assert executed_plans()[1] == facts
    resumed = metrics(run)[2]["loss"]
    workload = get_workload(f"hf:{tmp_path / 'm'}", 16)
    assert abs(batch_loss(exported, workload, 2) - resumed) <= 1e-5 * resumed
    again = tmp_path / "again"
    assert (
        train_main(
            [
                *args[:2],
                "--mesh",
                "1",
                "--batch",
                "8",
                "--seq",
                "16",
                "--steps",
                "1",
                "--init-from",
                str(out),
                "--out",
                str(again),
            ]
        )
        == 0
    )
    first = json.loads((again / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert abs(first - batch_loss(exported, workload, 0)) <= 1e-5 * first


def greedy(model, prompt: torch.Tensor, new: int) -> torch.Tensor:
    """`new` tokens appended by argmax, recomputing the whole sequence each time (no cache)."""
    tokens = prompt
    with torch.no_grad():
        for _ in range(new):
            out = model(tokens)
            tokens = torch.cat([tokens, getattr(out, "logits", out)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


@ONE_PROCESS
def test_a_bf16_export_is_the_fp32_one_cast_at_half_the_size(tmp_path, one_step_run):
    """An fp32 run exports in fp32 by default: transformers computes the trained model's logits
    within 1e-5 and generates its greedy tokens. `dtype="bf16"`: every tensor is the fp32 export's
    cast to bf16, config.json says bfloat16 (from_pretrained loads it so), the logits are within
    bf16 rounding of the fp32 ones, and the files are half the size."""
    fp32, bf16 = export_hf(one_step_run, tmp_path / "fp32"), export_hf(one_step_run, tmp_path / "bf16", dtype="bf16")
    assert (fp32.dtype, bf16.dtype, bf16.bytes * 2) == ("fp32", "bf16", fp32.bytes)
    ratio = (tmp_path / "bf16" / "model.safetensors").stat().st_size / (
        tmp_path / "fp32" / "model.safetensors"
    ).stat().st_size
    assert 0.5 <= ratio < 0.51, ratio
    full = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp32")
    half = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert {p.dtype for p in full.parameters()} == {torch.float32} and {p.dtype for p in half.parameters()} == {
        torch.bfloat16
    }
    halves = half.state_dict()
    for name, value in full.state_dict().items():
        assert torch.equal(halves[name], value.to(torch.bfloat16)), name
    ours = get_workload("llama3-tiny", 16).build("cpu")
    ours.load_state_dict(checkpoint_tensors(one_step_run / "checkpoints" / "step-000001"), strict=False)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = full(tokens).logits
        torch.testing.assert_close(logits, ours(tokens), rtol=1e-5, atol=1e-5)
        scale = logits.abs().max().item()
        torch.testing.assert_close(half(tokens).logits.float(), logits, rtol=0.02, atol=0.02 * scale)
    prompt = tokens[:, :8]
    generated = full.generate(prompt, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(generated, greedy(ours, prompt, 6))


@ONE_PROCESS
def test_an_hf_run_in_bf16_exports_bf16_with_its_tokenizer_and_chat_template(tmp_path, capsys):
    """`train --model hf:DIR --param-dtype bf16`: export defaults to bf16 and copies DIR's
    tokenizer files (binary ones too), chat template and generation_config.json byte for byte;
    AutoTokenizer loads OUT with that template."""
    from tokenizers import Tokenizer

    from test_data import make_tokenizer

    source = tmp_path / "m"
    transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=320,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            use_cache=False,
        )
    ).save_pretrained(source)
    make_tokenizer(source)
    Tokenizer.from_file(str(source / "tokenizer.json")).model.save(str(source))  # vocab.json, merges.txt
    eos = {"eos_token": "<|endoftext|>"}
    (source / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **eos}))
    (source / "special_tokens_map.json").write_text(json.dumps(eos))
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (source / "chat_template.jinja").write_text(template)
    (source / "tokenizer.model").write_bytes(bytes(range(256)))  # stands for a sentencepiece model
    run, out = tmp_path / "run", tmp_path / "hf"
    args = ["--model", f"hf:{source}", "--mesh", "1", "--batch", "8", "--seq", "16", "--param-dtype", "bf16"]
    assert train_main([*args, "--steps", "1", "--checkpoint-every", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    assert autoshard_main(["export", str(run), "--hf", str(out)]) == 0
    assert "of bf16 in 1 file(s)" in capsys.readouterr().out
    copied = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"]
    for name in [*copied, "chat_template.jinja", "tokenizer.model", "generation_config.json"]:
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.chat_template == template
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
