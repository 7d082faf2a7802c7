"""`train --lora` and `--freeze` from the command line, and a LoRA run's export: a tiny HF Llama
saved as transformers saves it is fine-tuned from its weights (`--init-from`); the losses are
one device's peft run's from the same start, the base stays bit-identical, and the adapter
exported in peft's format (or merged, `--merge`) gives the trained model's logits through
`PeftModel.from_pretrained` (or `AutoModelForCausalLM.from_pretrained`)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from autoshard.cli.train import main as train_main
from autoshard.train.adapters import base_name
from autoshard.train.export import export_hf
from autoshard.workloads import get_workload
from autoshard.workloads.finetune import FineTune, fine_tuned, parse_lora
from autoshard_models import cross_entropy_loss
from autoshard_models.train_single import TrainSettings, make_optimizer
from plan_audit import assert_shards, budget_bytes
from test_export import checkpoint_tensors
from test_hf import save_tiny

peft = pytest.importorskip("peft")

LORA = "4,alpha=8,targets=q_proj,v_proj"
RUN = ["--batch", "8", "--seq", "16", "--mesh", "1", "--steps", "3", "--checkpoint-every", "3"]
ONE_PROCESS = pytest.mark.replicated_plan  # the CLI's fine-tuning path; sharded numerics: test_frozen


def test_lora_flags_parse_and_refuse_what_they_cannot_mean():
    assert parse_lora("16") == parse_lora("16,alpha=32")  # alpha defaults to 2 x rank
    lora = parse_lora("8,alpha=4,targets=q_proj,v_proj,o_proj")
    assert (lora.rank, lora.scale, lora.targets) == (8, 0.5, ("q_proj", "v_proj", "o_proj"))
    for bad, message in [
        ("0", "starts with the rank"),
        ("x", "starts with the rank"),
        ("4,alpha=no", "alpha=no is not a number"),
        ("4,beta=2", "unknown part 'beta=2'"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_lora(bad)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--freeze", "nothing.*"], "--freeze nothing.*: matches no parameter of llama3-tiny"),
        (["--freeze", "*"], "--freeze *: leaves no parameter of llama3-tiny to train"),
        (["--lora", "4"], "--lora: peft cannot wrap llama3-tiny"),  # no default targets for our llama
        (["--lora", "4,targets=nope"], "--lora: peft cannot wrap llama3-tiny"),
    ],
)
def test_bad_fine_tuning_flags_are_one_error_line(tmp_path, capsys, args, message):
    code = train_main(["--model", "llama3-tiny", "--mesh", "1", *args, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "o").exists()


def reference(directory, workload):
    """One device: the saved model wrapped by peft, its adapters from the workload's init, 3 AdamW
    steps on the run's batches; the losses and the model."""
    base = transformers.AutoModelForCausalLM.from_pretrained(directory)
    model = peft.get_peft_model(base, parse_lora(LORA).peft_config())
    adapters = dict(workload.initial_values(0, workload.init_only))
    model.load_state_dict(adapters, strict=False)
    optim = make_optimizer([p for p in model.parameters() if p.requires_grad], TrainSettings())
    losses = []
    for step in range(3):
        tokens, targets = workload.data(0).batch(step, 8, 16)
        loss = cross_entropy_loss(model(tokens).logits, targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, model


def fine_tuned_like_peft(tmp_path, base_model, directory, run) -> None:
    """The run's losses are one device's peft run's, its base bit-identical, and its adapter (and
    its merged model) exported give the trained model's logits in transformers and peft."""
    workload = fine_tuned(get_workload(f"hf:{directory}", 16), FineTune(parse_lora(LORA)))
    want, trained = reference(directory, workload)
    got = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(got) == 3 and all(abs(a - b) <= 1e-5 * b for a, b in zip(got, want)), (got, want)
    saved = checkpoint_tensors(run / "checkpoints" / "step-000003")
    plan = json.loads((run / "plan.json").read_text())
    frozen = {p["fqn"] for p in plan["parameters"] if p["frozen"]}
    assert {base_name(n) for n in frozen} == set(dict(base_model.named_parameters()))  # the whole base
    for fqn in frozen:  # bit-identical after training
        assert torch.equal(saved[fqn], base_model.get_parameter(base_name(fqn))), fqn

    adapter = tmp_path / "adapter"
    done = export_hf(run, adapter)
    assert done.files == ["adapter_model.safetensors"] and done.tensors == 8  # A and B of q and v, 2 layers
    assert json.loads((adapter / "adapter_config.json").read_text())["target_modules"] == ["q_proj", "v_proj"]
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(directory), adapter)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want_logits = trained(tokens).logits
        torch.testing.assert_close(loaded(tokens).logits, want_logits, rtol=1e-5, atol=1e-5)

    merged = tmp_path / "merged"
    export_hf(run, merged, merge=True)
    plain = transformers.AutoModelForCausalLM.from_pretrained(merged)
    assert type(plain) is transformers.LlamaForCausalLM
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens).logits, want_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@ONE_PROCESS
def test_a_lora_run_trains_like_peft_on_one_device_and_exports_an_adapter_peft_loads(tmp_path):
    base_model, directory = save_tiny(tmp_path / "base", seed=3)
    run = tmp_path / "run"
    args = ["--model", f"hf:{directory}", "--init-from", str(directory), "--lora", LORA, *RUN]
    assert train_main([*args, "--out", str(run)]) == 0
    fine_tuned_like_peft(tmp_path, base_model, directory, run)


@pytest.mark.slow
@pytest.mark.ranks
def test_a_lora_run_on_2x2_shards_its_frozen_base_and_trains_like_peft(tmp_path, executed_plans):
    """4 gloo ranks on (2,2), the frozen base sharded by a parameter budget: the same as one device."""
    from test_train import torchrun

    base_model, directory = save_tiny(tmp_path / "base", seed=3)
    run = tmp_path / "run"
    args = ["--model", f"hf:{directory}", "--init-from", str(directory), "--lora", LORA, *RUN]
    args[args.index("--mesh") + 1] = "2x2"
    torchrun(*args, "--memory-budget", str(budget_bytes(base_model, (2, 2))), "--out", str(run))
    (facts,) = executed_plans()
    assert_shards(facts, batch_split=False)
    plan = json.loads((run / "plan.json").read_text())
    assert any("S" in p["layout"] for p in plan["parameters"] if p["frozen"])
    fine_tuned_like_peft(tmp_path, base_model, directory, run)


@ONE_PROCESS
def test_a_frozen_embedding_stays_as_it_was_and_exports_whole(tmp_path):
    run = tmp_path / "run"
    assert train_main(["--model", "llama3-tiny", "--freeze", "tok_embeddings.*", *RUN, "--out", str(run)]) == 0
    start = dict(get_workload("llama3-tiny", 16).initial_values(0, {"tok_embeddings.weight"}))
    saved = checkpoint_tensors(run / "checkpoints" / "step-000003")
    assert torch.equal(saved["tok_embeddings.weight"], start["tok_embeddings.weight"])
    assert not torch.equal(
        saved["output.weight"],
        dict(get_workload("llama3-tiny", 16).initial_values(0, {"output.weight"}))["output.weight"],
    )
    plan = json.loads((run / "plan.json").read_text())
    assert [p["fqn"] for p in plan["parameters"] if p["frozen"]] == ["tok_embeddings.weight"]
    assert export_hf(run, tmp_path / "hf").tensors == len(saved)
    with pytest.raises(ValueError, match="--merge: .* is not a LoRA run"):
        export_hf(run, tmp_path / "merged", merge=True)


@ONE_PROCESS
def test_a_bf16_lora_run_holds_its_frozen_base_in_bf16_and_exports_it(tmp_path):
    """With `--param-dtype bf16` the frozen base is held (and checkpointed) in bf16, what every
    forward computes with; the adapters stay fp32 master weights; the merged export and the adapter
    still load."""
    base_model, directory = save_tiny(tmp_path / "base", seed=3)
    run = tmp_path / "run"
    args = ["--model", f"hf:{directory}", "--init-from", str(directory), "--lora", LORA, *RUN]
    assert train_main([*args, "--param-dtype", "bf16", "--reduce-dtype", "fp32", "--out", str(run)]) == 0
    saved = checkpoint_tensors(run / "checkpoints" / "step-000003")
    frozen = {p["fqn"] for p in json.loads((run / "plan.json").read_text())["parameters"] if p["frozen"]}
    assert frozen and frozen < set(saved)
    for fqn, value in saved.items():
        if fqn in frozen:
            assert value.dtype == torch.bfloat16, fqn
            assert torch.equal(value, base_model.get_parameter(base_name(fqn)).to(torch.bfloat16)), fqn
        elif value.is_floating_point():
            assert value.dtype == torch.float32, fqn
    export_hf(run, tmp_path / "merged", merge=True)
    assert type(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")) is transformers.LlamaForCausalLM
    export_hf(run, tmp_path / "adapter")
    peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(directory), tmp_path / "adapter")


@pytest.mark.slow
@ONE_PROCESS
def test_the_documented_flow_chats_to_a_peft_adapter_and_a_resume_repeats_the_losses(tmp_path):
    """docs/finetuning.md's commands at tiny size: an HF Llama's own weights, a chat JSONL with a
    chat template (packed rows: the model takes `position_ids`), `--lora`, the adapter exported and
    loaded by peft; a run resumed from its step-2 checkpoint repeats the uninterrupted losses."""
    from test_instruction_data import chat, jsonl, make_tokenizer, text_of

    _, directory = save_tiny(tmp_path / "base", seed=3)
    tokenizer = make_tokenizer(tmp_path / "tok")
    rng = __import__("numpy").random.default_rng(0)
    chats = jsonl(tmp_path / "chats.jsonl", [chat(text_of(rng, 2, 6), text_of(rng, 2, 6)) for _ in range(40)])
    args = ["--model", f"hf:{directory}", "--init-from", str(directory), "--tokenizer", str(tokenizer)]
    args += ["--data", str(chats), "--lora", LORA, "--batch", "4", "--seq", "16", "--mesh", "1", "--steps", "4"]
    run, again = tmp_path / "run", tmp_path / "again"
    assert train_main([*args, "--checkpoint-every", "2", "--out", str(run)]) == 0
    plan = json.loads((run / "plan.json").read_text())
    assert [i["shape"] for i in plan["inputs"] if i["kind"] == "input"] == [[4, 16]] * 3  # packed: positions too
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    export_hf(run, tmp_path / "adapter")
    peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(directory), tmp_path / "adapter")
    import shutil

    shutil.copytree(run, again)
    shutil.rmtree(again / "checkpoints" / "step-000004")
    assert train_main([*args, "--checkpoint-every", "2", "--out", str(again)]) == 0  # resumes from step 2
    resumed = [json.loads(line)["loss"] for line in (again / "metrics.jsonl").read_text().splitlines()]
    assert resumed == losses


@ONE_PROCESS
def test_an_embedding_adapter_exports_in_peft_format_and_merges(tmp_path):
    """LoRA on the embedding beside a projection: peft keeps the embedding's halves in parameter
    dicts (`lora_embedding_A.default`, [rank, vocab]); the adapter exported loads in peft, and
    merged (W + scale * (B @ A)^T) gives the same logits in plain transformers."""
    _, directory = save_tiny(tmp_path / "base", seed=3)
    spec = "4,alpha=8,targets=q_proj,embed_tokens"
    run = tmp_path / "run"
    args = ["--model", f"hf:{directory}", "--init-from", str(directory), "--lora", spec, *RUN, "--out", str(run)]
    assert train_main(args) == 0
    saved = checkpoint_tensors(run / "checkpoints" / "step-000003")
    embedding_a = "base_model.model.model.embed_tokens.lora_embedding_A.default"
    assert saved[embedding_a].shape == (4, 128)
    assert saved[embedding_a.replace("_A.", "_B.")].abs().sum() > 0  # B starts at zero: trained
    export_hf(run, tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(directory)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    assert torch.equal(loaded.get_parameter(embedding_a), saved[embedding_a])
    export_hf(run, tmp_path / "merged", merge=True)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens).logits, loaded(tokens).logits, rtol=1e-5, atol=1e-5)
