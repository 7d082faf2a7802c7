"""Instruction data (`--data` JSONL of `messages` or `prompt`/`completion`): chats rendered with the
tokenizer's chat template and the assistant's tokens marked, rows packed (no attention across
examples) or padded, the loss on the answers only; the goal: a packed batch's loss and gradients
equal those of its examples trained alone, on one device and on a sharded (2, 2) plan."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from autoshard import _torch_compat as tc
from autoshard.data import DataConfig, InstructionFeed, Instructions, open_data, with_layout
from autoshard.data.examples import IGNORE, lay_out, packed_workload
from autoshard.data.fingerprint import data_fingerprint, describe_change
from autoshard.data.instruct import Example, chat_template, read_examples
from autoshard.data.text import load_tokenizer
from autoshard.driver.api import AutoShard
from autoshard.options import UsageError
from autoshard.runtime.module import parallelize
from autoshard.workloads import get_workload
from autoshard_models import build_model, cross_entropy_loss, get_config
from plan_audit import CPU_PRICED, collectives_by_mesh_dim, sharded_plan
from simulation import simulated_mesh

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["[UNK]", *SPECIAL, "user", "assistant", "system"] + [f"w{i}" for i in range(40)]
TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def make_tokenizer(folder: Path, template: str | None = TEMPLATE) -> Path:
    """A word-level tokenizer (one id per word of WORDS) and its tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>"} | ({"chat_template": template} if template else {})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def words(ids) -> list[str]:
    return [WORDS[i] for i in ids]


def jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chat(*turns: str) -> dict:
    roles = ["user", "assistant"]
    return {"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}


def text_of(rng: np.random.Generator, lo: int, hi: int) -> str:
    return " ".join(f"w{i}" for i in rng.integers(0, 40, rng.integers(lo, hi)))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def config(data: Path | tuple, tokenizer: Path, **kw) -> DataConfig:
    specs = tuple(map(str, data)) if isinstance(data, tuple) else (str(data),)
    base = dict(batch=4, seq=16, steps=10, data=specs, tokenizer=str(tokenizer))
    return DataConfig(**(base | kw))


def opened(data, tokenizer: Path, **kw):
    workload = get_workload("llama3-tiny", kw.get("seq", 16))
    return open_data(config(data, tokenizer, **kw), workload, load_tokenizer(str(tokenizer)))


# ---------------------------------------------------------------------------- reading and masks
def test_a_chat_renders_with_the_chat_template_and_marks_the_assistant_turns(tmp_path, tokenizer_dir):
    """The assistant's content and its end-of-turn token are the answer; the template's turn header
    (`<|im_start|> assistant`) and every other turn are prompt; EOS ends the example, as answer."""
    path = jsonl(tmp_path / "chat.jsonl", [chat("w1", "w2 w3", "w4 w5", "w6")])
    tok = load_tokenizer(str(tokenizer_dir))
    [ex] = read_examples(path, tok, chat_template(tok.file))
    got = list(zip(words(ex.ids), ex.answer.tolist()))
    prompt = lambda *w: [(x, False) for x in w]  # noqa: E731
    answer = lambda *w: [(x, True) for x in w]  # noqa: E731
    assert got == (
        prompt("<|im_start|>", "user", "w1", "<|im_end|>", "<|im_start|>", "assistant")
        + answer("w2", "w3", "<|im_end|>")
        + prompt("<|im_start|>", "user", "w4", "w5", "<|im_end|>", "<|im_start|>", "assistant")
        + answer("w6", "<|im_end|>", "<|endoftext|>")
    )


def test_prompt_completion_marks_the_completion_and_eos(tmp_path, tokenizer_dir):
    path = jsonl(tmp_path / "pc.jsonl", [{"prompt": "w1 w2", "completion": "w3"}, {"prompt": "w4", "completion": ""}])
    tok = load_tokenizer(str(tokenizer_dir))
    first, second = read_examples(path, tok, None)
    assert words(first.ids) == ["w1", "w2", "w3", "<|endoftext|>"]
    assert first.answer.tolist() == [False, False, True, True]
    assert words(second.ids) == ["w4", "<|endoftext|>"] and second.answer.tolist() == [False, True]


BAD = {
    "mixed-kinds": ([chat("w1", "w2"), {"prompt": "w1", "completion": "w2"}], r"2: a `prompt/completion` record in"),
    "text-among-instructions": ([{"prompt": "w1", "completion": "w2"}, {"text": "w1"}], r"2: a `text` record in a"),
    "neither": ([chat("w1", "w2"), {"question": "w1"}], r"2: a record of neither .* \(its fields: question\)"),
    "not-a-string": ([{"prompt": "w1", "completion": 3}], r"1: `prompt` and `completion` are strings"),
    "bad-message": ([{"messages": [{"role": "user"}]}], r"1: each message is a \{role, content\}"),
}


@pytest.mark.parametrize("records, match", BAD.values(), ids=BAD.keys())
def test_a_bad_record_is_one_usage_error_naming_file_and_line(tmp_path, tokenizer_dir, records, match):
    with pytest.raises(UsageError, match=r"bad.jsonl:" + match):
        opened(jsonl(tmp_path / "bad.jsonl", records), tokenizer_dir)


def test_usage_errors_of_the_data_and_its_flags(tmp_path, tokenizer_dir):
    chats = jsonl(tmp_path / "chat.jsonl", [chat("w1", "w2")])
    bare = make_tokenizer(tmp_path / "bare", template=None)
    with pytest.raises(UsageError, match=r"chat.jsonl: `messages` records .* has none \(`chat_template`\)"):
        opened(chats, bare)
    plain = jsonl(tmp_path / "plain.jsonl", [{"text": "w1 w2"}])
    with pytest.raises(UsageError, match=r"--data: .*plain.jsonl is not instruction data .* like .*chat.jsonl"):
        opened((chats, plain), tokenizer_dir)
    for flags in ({"loss_on": "completion"}, {"instruction_layout": "pad"}):
        with pytest.raises(UsageError, match=r"--(loss-on|instruction-layout) \w+: --data is not instruction data"):
            opened(plain, tokenizer_dir, **flags)
    short = jsonl(tmp_path / "short.jsonl", [{"prompt": "w1 " * 20, "completion": "w2"}])
    with pytest.raises(UsageError, match=r"--data: no example has a target to train on \(1 examples"):
        opened(short, tokenizer_dir, seq=8)
    hf_like = get_workload("llama3-tiny", 16)
    hf_like = type(hf_like)(**(hf_like.__dict__ | {"build": lambda device: torch.nn.Embedding(4, 4)}))
    with pytest.raises(UsageError, match=r"--instruction-layout pack: .* takes no document positions"):
        packed_workload(hf_like)
    # left to the default, the layout is what the model can: pack for our llama, pad for the others
    assert with_layout(config(chats, tokenizer_dir), get_workload("llama3-tiny", 16)).instruction_layout == "pack"
    assert with_layout(config(chats, tokenizer_dir), hf_like).instruction_layout == "pad"
    assert with_layout(config(chats, tokenizer_dir, instruction_layout="pad"), hf_like).instruction_layout == "pad"
    assert with_layout(config(plain, tokenizer_dir), hf_like).instruction_layout is None  # not instruction data


# ---------------------------------------------------------------------------- rows
def examples(n: int, seed: int = 0) -> list[Example]:
    """Prompt/completion-like examples of random lengths: answer marks on the tail of each."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt, answer = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        ids = np.concatenate([rng.integers(4, 40, prompt + answer), [0]]).astype(np.int64)
        out.append(Example(ids, np.arange(len(ids)) >= prompt))
    return out


@pytest.mark.parametrize("layout", ["pack", "pad"])
@pytest.mark.parametrize("loss_on", ["completion", "all"])
def test_rows_hold_each_example_whole_with_targets_only_inside_it(layout, loss_on):
    """Every example is in exactly one row (pad: alone), its inputs x[:-1] at positions 0.. and its
    targets x[1:] where trained; no target crosses into the next example or the padding."""
    exs = examples(30)
    laid = lay_out(exs, 16, layout, loss_on, pad=0, seed=3)
    rows = laid.rows
    tokens, positions, targets = rows.read(np.arange(rows.count))
    seen = []
    for r in range(rows.count):
        members = rows.members[rows.bounds[r] : rows.bounds[r + 1]]
        assert layout == "pack" or len(members) == 1
        at = 0
        for e in members:
            ids, answer = exs[e].ids, exs[e].answer if loss_on == "completion" else np.ones(len(exs[e].ids), bool)
            k = len(ids) - 1
            assert tokens[r, at : at + k].tolist() == ids[:-1].tolist()
            assert positions[r, at : at + k].tolist() == list(range(k))
            assert targets[r, at : at + k].tolist() == np.where(answer[1:], ids[1:], IGNORE).tolist()
            at += k
            seen.append(int(e))
        assert (targets[r, at:] == IGNORE).all() and positions[r, at:].tolist() == list(range(16 - at))
    assert sorted(seen) == list(range(30)) and laid.cut == laid.dropped == 0
    if layout == "pack":
        assert rows.count < 30  # several to a row


def test_examples_longer_than_a_row_are_cut_and_those_left_without_targets_dropped():
    long = Example(np.arange(4, 34, dtype=np.int64), np.arange(30) >= 3)  # answer from token 3: cut at 9 keeps some
    late = Example(np.arange(4, 34, dtype=np.int64), np.arange(30) >= 20)  # answer past the cut: nothing left
    laid = lay_out([long, late], 8, "pad", "completion", pad=0, seed=0)
    assert (laid.examples, laid.cut, laid.dropped, laid.rows.count) == (1, 2, 1, 1)
    tokens, _, targets = laid.rows.read([0])
    assert tokens[0].tolist() == list(range(4, 12)) and targets[0].tolist() == [IGNORE] * 2 + list(range(7, 13))


# ---------------------------------------------------------------------------- the goal: packed = alone
def data_file(tmp_path: Path, n: int = 24) -> Path:
    rng = np.random.default_rng(1)
    records = [chat(text_of(rng, 1, 5), text_of(rng, 1, 4)) for _ in range(n // 2)]
    records += [chat(*(text_of(rng, 1, 3) for _ in range(4))) for _ in range(n // 2)]
    return jsonl(tmp_path / "chats.jsonl", records)


def alone(model, data: Instructions, rows: np.ndarray, logits=lambda model, x: model(x)) -> tuple[torch.Tensor, dict]:
    """The batch's completion loss from its examples each run alone (plain causal attention, no
    positions: `logits(model, tokens)`), summed over their trained targets / their count, and its
    gradients."""
    model.zero_grad()
    train, total, count = data.train, 0.0, 0
    for r in rows:
        for e in train.members[train.bounds[r] : train.bounds[r + 1]]:
            lo, hi = int(train.starts[e]), int(train.starts[e + 1])
            x = torch.from_numpy(train.ids[lo : hi - 1])[None]
            y = torch.from_numpy(np.where(train.trained[lo + 1 : hi], train.ids[lo + 1 : hi], IGNORE))[None]
            n = int((y != IGNORE).sum())
            total = total + cross_entropy_loss(logits(model, x), y) * n
            count += n
    loss = total / count
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def test_a_packed_batch_trains_like_its_examples_alone_on_one_device(tmp_path, tokenizer_dir):
    data = opened(data_file(tmp_path), tokenizer_dir, seq=24)
    assert isinstance(data, Instructions) and data.layout == "pack"
    assert (np.diff(data.train.bounds) > 1).any()  # some rows hold several examples
    cfg = get_config("llama3-tiny").with_(vocab_size=len(WORDS))
    model = build_model(cfg, seed=0)
    rows = np.arange(data.train.count)
    want, grads = alone(model, data, rows)
    model.zero_grad()
    tokens, positions, targets = data.inputs(data.train, rows)
    packed = cross_entropy_loss(model(tokens, positions), targets)
    packed.backward()
    torch.testing.assert_close(packed.detach(), want, rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():  # without positions, later examples attend to earlier ones: other logits
        assert (model(tokens) - model(tokens, positions)).abs().max() > 1e-2
    padded = opened(data_file(tmp_path), tokenizer_dir, seq=24, instruction_layout="pad")
    model.zero_grad()
    want_padded, _ = alone(model, padded, np.arange(padded.train.count))
    tokens, targets = padded.inputs(padded.train, np.arange(padded.train.count))
    torch.testing.assert_close(cross_entropy_loss(model(tokens), targets).detach(), want_padded, rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # planning llama3-tiny on (2, 2) and 4 simulated ranks
def test_a_packed_batch_trains_like_its_examples_alone_on_a_sharded_plan(tmp_path, tokenizer_dir):
    """(2, 2) mesh, batch split and parameters sharded (asserted, collectives on both mesh dims):
    every rank's loss and every gradient equal the examples' alone on one device."""
    batch, seq = 4, 40
    data = opened(data_file(tmp_path), tokenizer_dir, seq=seq, batch=batch)
    cfg = get_config("llama3-tiny").with_(vocab_size=len(WORDS))
    rows = np.arange(batch)
    assert (np.diff(data.train.bounds)[rows] > 1).all()  # every row holds several examples
    want, grads = alone(build_model(cfg, seed=0), data, rows)
    meta = build_model(cfg, device="meta")
    example = lambda: (torch.empty(batch, seq, dtype=torch.int64, device="meta"),) * 3  # noqa: E731
    plan = sharded_plan(AutoShard(meta, example, (2, 2), loss_fn=cross_entropy_loss, n_model_inputs=2, **CPU_PRICED))
    collectives = collectives_by_mesh_dim(plan)
    assert all(collectives[d] for d in (0, 1)), collectives
    inputs = data.inputs(data.train, rows)
    with simulated_mesh(plan.mesh_shape) as (mesh, mode):
        pmodel = parallelize(plan, mesh, meta)
        pmodel.init_weights(0)
        loss = pmodel(*pmodel.shard_inputs(*inputs))
        loss.backward()
        every_rank_has(pmodel, loss, mode, want, grads)


def every_rank_has(pmodel, loss, mode, want: torch.Tensor, grads: dict) -> None:
    """Every rank's loss is `want` and every parameter's whole gradient is `grads`'."""
    full = {name: p.grad.full_tensor() for name, p in pmodel.named_parameters()}
    with mode.disable():
        for got in tc.rank_values(loss).values():
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for name, grad in full.items():
            for got in tc.rank_values(grad).values():
                torch.testing.assert_close(got, grads[name], rtol=1e-4, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------- each rank's rows, resume
class RowsOf:
    """A parallel module's duck type for the feed: this rank holds rows `rows` of every input."""

    def __init__(self, rows: list[int], inputs: int = 3):
        self.rows, self.inputs = torch.tensor(rows), inputs

    def input_rows(self, i: int) -> torch.Tensor:
        assert i < self.inputs
        return self.rows

    def local_inputs(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return xs


def test_each_rank_builds_only_its_rows_and_a_step_is_a_pure_function_of_seed_and_step(tmp_path, tokenizer_dir):
    data = opened(data_file(tmp_path), tokenizer_dir, seq=24, batch=4, data_seed=5)
    whole = InstructionFeed(data, RowsOf([0, 1, 2, 3]))
    for step in (1, 2, 7):
        full = whole.inputs(step, 0)
        for rows in ([0, 1], [2, 3], [3]):
            part = InstructionFeed(data, RowsOf(rows)).inputs(step, 0)  # a fresh feed: a resumed rank
            assert all(torch.equal(p, f[rows]) for p, f in zip(part, full))
    assert sorted(data.train.members.tolist()) == list(range(24)) and data.train.bounds[-1] == 24  # each once
    other = opened(data_file(tmp_path), tokenizer_dir, seq=24, batch=4, data_seed=6)
    assert not torch.equal(InstructionFeed(other, RowsOf([0, 1, 2, 3])).inputs(1, 0)[0], whole.inputs(1, 0)[0])


def test_the_fingerprint_covers_the_loss_the_layout_and_the_chat_template(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    path = data_file(tmp_path)
    base = data_fingerprint(config(path, tok), "t")
    assert base["instruction"]["loss_on"] == "completion" and base["instruction"]["layout"] == "pack"
    assert base["instruction"]["chat_template"] is not None
    assert describe_change(base, data_fingerprint(config(path, tok, loss_on="all"), "t")) == [
        "--loss-on all: the run's was completion"
    ]
    assert describe_change(base, data_fingerprint(config(path, tok, instruction_layout="pad"), "t")) == [
        "--instruction-layout pad: the run's was pack"
    ]
    make_tokenizer(tmp_path / "tok", template=TEMPLATE.replace("<|im_end|> {% endfor", "<|im_end|>{% endfor"))
    assert describe_change(base, data_fingerprint(config(path, tok), "t")) == [
        "--tokenizer: its chat template (tokenizer_config.json) is not the run's"
    ]
    plain = jsonl(tmp_path / "plain.jsonl", [{"text": "w1"}])
    assert "instruction" not in data_fingerprint(config(plain, tok), "t")  # plain text: as before


def test_validation_holds_out_whole_examples(tmp_path, tokenizer_dir):
    """--val-fraction: each example on one side, never none or all; --val-data: its own rows."""
    path = data_file(tmp_path)
    data = opened(path, tokenizer_dir, seq=24, val_fraction=0.25, eval_every=1)
    assert data.val is not None
    held, kept = len(data.val.starts) - 1, len(data.train.starts) - 1
    assert held + kept == 24 and 0 < held < 24
    alone_val = opened(path, tokenizer_dir, seq=24, val_data=(str(path),), eval_every=1)
    assert alone_val.val is not None and len(alone_val.val.starts) - 1 == 24


# ---------------------------------------------------------------------------- train, resumed
@pytest.mark.slow
@pytest.mark.replicated_plan  # one process: what it checks is the data a resumed run reads
def test_train_on_chats_resumes_exactly(tmp_path, tokenizer_dir):
    """`train --data chats.jsonl` packs and trains; resumed from step 3's checkpoint, steps 4-6
    repeat the uninterrupted run's losses and validation losses exactly (several epochs)."""
    from autoshard.cli.train import main

    path = data_file(tmp_path, n=12)
    args = ["--model", "llama3-tiny", "--mesh", "1", "--batch", "4", "--seq", "24", "--steps", "6"]
    args += ["--data", str(path), "--tokenizer", str(tokenizer_dir), "--checkpoint-every", "3"]
    args += ["--val-fraction", "0.25", "--eval-every", "3", "--eval-batches", "2"]
    first, second = tmp_path / "first", tmp_path / "second"
    assert main([*args, "--out", str(first)]) == 0
    rows = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    plan = json.loads((first / "plan.json").read_text())
    assert [i["shape"] for i in plan["inputs"] if i["kind"] == "input"] == [[4, 24]] * 3  # tokens, positions, targets
    assert plan["data_fingerprint"]["instruction"]["layout"] == "pack"
    short = [a if a != "6" else "3" for a in args]
    assert main([*short, "--out", str(second)]) == 0
    assert main([*args, "--out", str(second)]) == 0
    resumed = [json.loads(line) for line in (second / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in rows]
    assert [r.get("val_loss") for r in resumed] == [r.get("val_loss") for r in rows]
    assert rows[5]["val_loss"] > 0 and all(0 < r["loss"] < 10 for r in rows)
