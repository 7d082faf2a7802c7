"""Training on one's own data (`train --data`, autoshard.data): every file kind loads, windows pack
exactly and shuffle per epoch deterministically, each rank reads only its own rows, a 4-rank run
matches one process on the same text, a resumed run sees the batches an uninterrupted one saw,
and every bad input is one error line before planning."""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoshard import _torch_compat as tc
from autoshard.cli.train import main
from autoshard.data import Corpus, DataConfig, fitted_vocab, open_data, text
from autoshard.data.corpus import Tokens, Windows, permute, split_by_document
from autoshard.data.files import LLMC_MAGIC, open_tokens
from autoshard.driver.api import AutoShard
from autoshard.runtime.module import parallelize
from autoshard.workloads import get_workload
from autoshard_models import MarkovTokens, build_model, get_config
from plan_audit import assert_shards, budget_bytes, sharded_plan
from simulation import simulated_mesh
from test_train import metrics, torchrun

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "ve", "zu", "an", "el"]


def documents(n: int, seed: int = 0) -> list[str]:
    """Made-up prose: enough distinct words for a BPE of a few hundred tokens."""
    rng = random.Random(seed)
    word = lambda: "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))  # noqa: E731
    return [" ".join(word() for _ in range(rng.randint(20, 60))) + "." for _ in range(n)]


def make_tokenizer(folder: Path, vocab: int = 320, eos: bool = True) -> Path:
    """A byte-level BPE trained here by `tokenizers` (with <|endoftext|> unless `eos` is False)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"] if eos else [],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(documents(300, seed=99), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def write_text(folder: Path, docs: list[str]) -> dict[str, Path]:
    """The same documents as .txt (one file each), .jsonl and .parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "txt").mkdir()
    for i, doc in enumerate(docs):
        (folder / "txt" / f"{i:03d}.txt").write_text(doc)
    (folder / "docs.jsonl").write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))
    pq.write_table(pa.table({"text": docs, "id": list(range(len(docs)))}), folder / "docs.parquet")
    return {"txt": folder / "txt", "jsonl": folder / "docs.jsonl", "parquet": folder / "docs.parquet"}


def opened(workload, **kw):
    """(vocabulary, workload as built, data) as a run resolves them from these data settings."""
    base = dict(data=None, tokenizer=None, data_cache=None, vocab_size=None, val_fraction=0.0, batch=4, seq=8, steps=10)
    s = SimpleNamespace(**(base | kw))
    tokenizer = text.load_tokenizer(s.tokenizer) if s.tokenizer else None
    vocab = fitted_vocab(s.vocab_size, tokenizer, workload, s.tokenizer or "")
    if vocab is not None and vocab != workload.vocab_size:
        workload = workload.resize_vocab(vocab)
    config = DataConfig(
        s.batch, s.seq, s.steps, s.data, data_cache=s.data_cache, tokenizer=s.tokenizer, val_fraction=s.val_fraction
    )
    return vocab, workload, open_data(config, workload, tokenizer)


# ---------------------------------------------------------------------------- files
def test_token_files_load_as_memory_maps(tmp_path):
    tokens = np.arange(1000) * 37 % 70000
    small = (tokens % 65536).astype("<u2")
    small.tofile(tmp_path / "a.bin")
    tokens.astype("<u4").tofile(tmp_path / "b.bin")
    np.save(tmp_path / "c.npy", tokens.astype(np.int32))
    header = np.zeros(256, "<i4")
    header[:3] = (LLMC_MAGIC, 2, len(tokens))  # llm.c's uint32 variant
    (tmp_path / "d.bin").write_bytes(header.tobytes() + tokens.astype("<u4").tobytes())
    assert np.array_equal(open_tokens(tmp_path / "a.bin", "auto", 2048), small)  # uint16: vocab <= 65536
    assert np.array_equal(open_tokens(tmp_path / "b.bin", "auto", 128256), tokens)  # uint32: a larger one
    assert np.array_equal(open_tokens(tmp_path / "b.bin", "uint32", 2048), tokens)  # --data-dtype says
    assert np.array_equal(open_tokens(tmp_path / "c.npy", "auto", 2048), tokens)
    assert np.array_equal(open_tokens(tmp_path / "d.bin", "auto", 2048), tokens)  # the header says
    assert isinstance(open_tokens(tmp_path / "a.bin", "auto", 2048), np.memmap)


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_text_files_tokenize_once_with_eos_between_documents(tmp_path, tokenizer_file, kind, monkeypatch):
    docs = documents(12, seed=1)
    path = write_text(tmp_path / "data", docs)[kind]
    tok = text.load_tokenizer(str(tokenizer_file))
    assert tok.eos_id == tok.tokenizer.token_to_id("<|endoftext|>") and tok.vocab_size == 320
    want = [t for d in docs for t in [*tok.tokenizer.encode(d, add_special_tokens=False).ids, tok.eos_id]]
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    got = np.concatenate([text.tokenized(f, tok, tmp_path / "cache") for f in files])
    assert got.tolist() == want
    monkeypatch.setattr(text, "_tokenize", lambda *a: pytest.fail("tokenized again"))
    again = np.concatenate([text.tokenized(f, tok, tmp_path / "cache") for f in files])  # from the cache
    assert again.tolist() == want
    (files[0]).write_text(docs[0] + " changed")  # another content: another key
    with pytest.raises(pytest.fail.Exception, match="tokenized again"):
        text.tokenized(files[0], tok, tmp_path / "cache")


def test_a_long_document_is_cut_at_line_starts():
    doc = "".join(f"line {i}\n" for i in range(100))
    pieces = text.pieces(doc, longest=50)
    assert "".join(pieces) == doc and all(len(p) <= 50 and p.endswith("\n") for p in pieces)
    assert text.pieces("x" * 120, longest=50) == ["x" * 50, "x" * 50, "x" * 20]


def test_markov_tokens_build_in_linear_time_for_a_large_vocabulary():
    start = time.perf_counter()
    big = MarkovTokens(128_256, seed=0)
    assert time.perf_counter() - start < 2.0
    ordered = big.successors.sort(1).values
    assert (ordered[:, 1:] != ordered[:, :-1]).all() and big.successors.max() < 128_256  # distinct successors
    assert torch.equal(big.successors, MarkovTokens(128_256, seed=0).successors)
    assert not torch.equal(big.successors, MarkovTokens(128_256, seed=1).successors)


# ---------------------------------------------------------------------------- windows
def test_windows_pack_the_stream_exactly_across_files():
    parts = [np.arange(0, 30, dtype="<u2"), np.zeros(0, "<u2"), np.arange(30, 75, dtype="<u4")]
    tokens = Tokens(parts)
    windows = Windows(tokens, seq=8)  # windows of 9 tokens: 75 // 9 = 8, the last 3 tokens left out
    assert len(tokens) == 75 and windows.count == 8
    assert windows.read([0, 3, 7]).tolist() == [list(range(w * 9, w * 9 + 9)) for w in (0, 3, 7)]
    corpus = Corpus(DataConfig(batch=4, seq=8, steps=1), windows, None, None, "")
    rows = corpus.rows(1, np.arange(4))
    inputs, targets = rows[:, :-1], rows[:, 1:]
    assert inputs.shape == (4, 8) and np.array_equal(inputs[:, 1:], targets[:, :-1])
    assert all(r[0] % 9 == 0 and list(r) == list(range(r[0], r[0] + 9)) for r in rows)


def test_windows_shuffle_per_epoch_deterministically():
    for n in (1, 2, 3, 10, 97, 1000):
        for key in (0, 1, 2**40):
            assert sorted(permute(np.arange(n), n, key).tolist()) == list(range(n))
    windows = Windows(Tokens([np.arange(10 * 5)]), seq=4)  # 10 windows
    order = windows.shuffled(np.arange(30), seed=3)  # three epochs
    epochs = [order[i : i + 10].tolist() for i in (0, 10, 20)]
    assert all(sorted(e) == list(range(10)) for e in epochs)  # each window once per epoch
    assert len({tuple(e) for e in epochs}) == 3  # a new order each epoch
    assert np.array_equal(windows.shuffled(np.arange(30), seed=3), order)  # a pure function of (seed, position)
    assert np.array_equal(windows.shuffled(np.arange(17, 23), seed=3), order[17:23])
    assert not np.array_equal(windows.shuffled(np.arange(30), seed=4), order)


def corpus_of_documents(n: int, seed: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    """`n` documents of 3-60 tokens, document d's tokens all d + 1 and EOS 0 after each but the last,
    cut into two token files mid-document; (the files, each document's length with its EOS)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 61, n)
    docs = [np.r_[np.full(k, d + 1), [0] if d < n - 1 else []] for d, k in enumerate(lengths)]
    stream = np.concatenate(docs).astype("<u4")
    cut = len(stream) // 3 + 1
    return [stream[:cut], stream[cut:]], np.array([len(d) for d in docs])


def documents_in(tokens: Tokens) -> dict[int, int]:
    """Document id -> how many of its tokens (EOS included) `tokens` holds, by EOS-ended runs."""
    values = tokens.read(0, len(tokens))
    ids, counts = np.unique(values[values > 0] - 1, return_counts=True)
    held = dict(zip(ids.tolist(), counts.tolist()))
    for eos_at in np.flatnonzero(values == 0):  # an EOS belongs to the document before it
        held[int(values[eos_at - 1]) - 1] += 1
    return held


def test_validation_holds_out_random_whole_documents():
    """About F of the documents, drawn from the data seed: whole (every token and its EOS on one
    side), spread over the corpus rather than its end, the same for the same seed, other for
    another, and never inside a training window."""
    files, lengths = corpus_of_documents(400)
    tokens = Tokens(files)
    split = split_by_document(tokens, 0.2, 0, seed=7)
    assert split is not None and split.documents == 400 and len(split.train) + len(split.val) == len(tokens)
    val, train = documents_in(split.val), documents_in(split.train)
    assert split.held == len(val) and set(val).isdisjoint(train) and set(val) | set(train) == set(range(400))
    assert all(val[d] == lengths[d] for d in val) and all(train[d] == lengths[d] for d in train)  # whole
    held = sorted(val)
    assert 0.12 < len(held) / 400 < 0.28 and 0.12 < len(split.val) / len(tokens) < 0.28  # about F, both ways
    assert held[0] < 100 and held != list(range(400 - len(held), 400))  # not the last documents
    assert min(sum(d < 200 for d in held), sum(d >= 200 for d in held)) > 0.3 * len(held)  # over the whole corpus
    again = split_by_document(Tokens(files), 0.2, 0, seed=7)
    assert again is not None and sorted(documents_in(again.val)) == held  # a pure function of the seed
    other = split_by_document(Tokens(files), 0.2, 0, seed=8)
    assert other is not None and sorted(documents_in(other.val)) != held
    windows = Windows(split.train, seq=15)
    seen = windows.read(windows.shuffled(np.arange(2 * windows.count), seed=3))  # two epochs of training
    assert set(np.unique(seen[seen > 0] - 1).tolist()).isdisjoint(held)
    assert windows.count == len(split.train) // 16


def test_validation_holds_out_at_least_one_document_and_not_all():
    two = Tokens([np.array([5, 6, 0, 7, 8, 9, 0])])
    for fraction in (0.001, 0.999):
        split = split_by_document(two, fraction, 0, seed=0)
        assert split is not None and split.held == 1 and sorted([len(split.train), len(split.val)]) == [3, 4]
    tail = split_by_document(Tokens([np.array([5, 6, 0, 7, 8])]), 0.5, 0, seed=0)  # the last document has no EOS
    assert tail is not None and tail.documents == 2
    assert sorted([tail.train.read(0, len(tail.train)).tolist(), tail.val.read(0, len(tail.val)).tolist()]) == [
        [5, 6, 0],
        [7, 8],
    ]
    assert split_by_document(Tokens([np.array([1, 2, 3])]), 0.3, 0, seed=0) is None  # one document: no EOS
    assert split_by_document(Tokens([np.array([1, 2, 0])]), 0.3, 0, seed=0) is None  # one document


def test_chosen_ranges_read_as_one_stream_across_files():
    tokens = Tokens([np.arange(1, 10, dtype="<u2"), np.zeros(0, "<u2"), np.arange(10, 30, dtype="<u4")])
    picked = tokens.select([2, 15], [5, 25])
    assert picked.read(0, len(picked)).tolist() == [3, 4, 5, *range(16, 26)]
    again = picked.select([1, 5], [4, 12])  # ranges of ranges
    assert again.read(0, len(again)).tolist() == [4, 5, 16, *range(18, 25)]
    assert np.concatenate([c for _, c in again.chunks()]).tolist() == again.read(0, len(again)).tolist()
    with pytest.raises(IndexError):
        picked.read(0, len(picked) + 1)


# ---------------------------------------------------------------------------- rows per rank
class TokenModel(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        return self.out(self.emb(tokens))


def ce(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize(
    "layout, row_dims",
    [("S(0)R", (0,)), ("S(0)S(1)", (0,)), ("S(0)S(0)[1,0]", (0, 1))],
    ids=["batch-on-dp", "seq-on-tp", "batch-on-both-reversed"],
)
def test_each_rank_reads_only_its_own_rows(layout, row_dims):
    """On a (2, 2) mesh: ranks with the same coordinate on the mesh dims that split the batch read
    the same rows, other coordinates disjoint rows, together the whole batch; those rows make the
    very inputs `shard_inputs` cuts from the global batch."""
    batch, seq = 8, 6
    torch.manual_seed(0)
    model = TokenModel()
    example = lambda: (torch.empty(batch, seq, dtype=torch.int64),) * 2  # noqa: E731
    with AutoShard(model, example, (2, 2), loss_fn=ce) as auto:
        auto.constrain_inputs(layout, layout)
        plan = sharded_plan(auto, budget=1.0, split_batch=False)
    tokens = torch.randint(64, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    with simulated_mesh((2, 2)) as (mesh, mode):
        pmodel = parallelize(plan, mesh, model)
        rows = pmodel.input_rows(0)
        assert all(
            torch.equal(a, b)
            for a, b in zip(tc.rank_values(rows).values(), tc.rank_values(pmodel.input_rows(1)).values())
        )
        local = pmodel.local_inputs(tokens[:, :-1][rows], tokens[:, 1:][rows])
        cut = pmodel.shard_inputs(tokens[:, :-1], tokens[:, 1:])
        loss_local, loss_cut = pmodel(*local), pmodel(*cut)
        with mode.disable():
            per_rank = {r: v.tolist() for r, v in tc.rank_values(rows).items()}
            for got, want in zip(local, cut):
                for r, value in tc.rank_values(want).items():
                    assert torch.equal(tc.rank_values(got)[r], value), (layout, r)
            assert all(
                torch.equal(a, b)
                for a, b in zip(tc.rank_values(loss_local).values(), tc.rank_values(loss_cut).values())
            )
    coordinate = {r: tuple((r // 2, r % 2)[d] for d in row_dims) for r in range(4)}  # rank = 2 * m0 + m1
    by_coordinate: dict[tuple, list[int]] = {}
    for r, got in per_rank.items():
        assert by_coordinate.setdefault(coordinate[r], got) == got, (layout, r)  # same coordinate, same rows
    sets = [set(v) for v in by_coordinate.values()]
    assert sum(map(len, sets)) == batch and set().union(*sets) == set(range(batch)), per_rank  # disjoint, all rows
    assert len(sets) == 2 ** len(row_dims)


# ---------------------------------------------------------------------------- vocabulary and errors
def test_a_tokenizer_gives_a_llama_model_its_vocabulary(tmp_path, tokenizer_file):
    data = write_text(tmp_path / "data", documents(40))["jsonl"]
    workload = get_workload("llama3-tiny", 8)
    vocab, resized, corpus = opened(
        workload, data=(str(data),), tokenizer=str(tokenizer_file), data_cache=str(tmp_path / "c")
    )
    assert vocab == 320 and resized.vocab_size == 320 and workload.vocab_size == 256
    assert resized.build("meta").tok_embeddings.weight.shape[0] == 320
    wider = opened(
        workload, data=(str(data),), tokenizer=str(tokenizer_file), data_cache=str(tmp_path / "c"), vocab_size=384
    )
    assert wider[1].vocab_size == 384
    assert isinstance(corpus, Corpus) and corpus.vocab_size == 320


def hf_config(folder: Path, vocab: int) -> Path:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    config.save_pretrained(folder)
    return folder


TINY = ["--model", "llama3-tiny", "--mesh", "1", "--batch", "4", "--seq", "8", "--steps", "2"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "{tmp}/nope.bin"], "--data {tmp}/nope.bin: no such file or directory"),
        (["--data", "{tmp}/*.nothing"], "the pattern matches no file"),
        (["--data", "{tmp}/emptydir"], "the directory holds no data file"),
        (["--data", "{tmp}/notes.md"], "unknown data file type .md"),
        (["--data", "{tmp}/empty.bin"], "the corpus is empty"),
        (["--data", "{tmp}/short.bin"], "5 tokens are shorter than one window of --seq + 1 = 9 tokens"),
        (["--data", "{tmp}/odd.bin"], "not a whole number of uint16 tokens"),
        (["--data", "{tmp}/wide.bin"], "token 300 is outside the model's vocabulary of 256"),
        (["--data", "{tmp}/docs.jsonl"], "text files ({tmp}/docs.jsonl) need --tokenizer"),
        (["--data", "{tmp}/docs.jsonl", "--tokenizer", "{tmp}/none.json"], "--tokenizer {tmp}/none.json: no such file"),
        (["--data", "{tmp}/docs.jsonl", "--tokenizer", "{tmp}/emptydir"], "holds no tokenizer.json"),
        (["--data", "{tmp}/docs.jsonl", "--tokenizer", "{tmp}/noeos"], "no EOS token to put between documents"),
        (["--data", "{tmp}/notext.jsonl", "--tokenizer", "{tok}"], "record 0 has no text field (its fields: id)"),
        (["--data", "{tmp}/ok.bin", "--tokenizer", "{tok}", "--vocab-size", "300"], "--vocab-size 300 is smaller"),
        (["--data", "{tmp}/docs.jsonl", "--tokenizer", "{tok}", "--model", "hf:{tmp}/hf"], "(320 tokens) is larger"),
        (["--data", "{tmp}/ok.bin", "--eval-every", "2"], "--eval-every K needs validation data"),
        (["--data", "{tmp}/ok.bin", "--val-data", "{tmp}/ok.bin"], "needs --eval-every K"),
        (["--data", "{tmp}/ok.bin", "--val-fraction", "0.1", "--eval-every", "1"], "it needs --tokenizer"),
        (
            ["--data", "{tmp}/docs.jsonl", "--tokenizer", "{tok}", "--val-fraction", "0.1", "--eval-every", "1"],
            "--val-fraction: --data holds fewer than two documents",
        ),
        (["--tokenizer", "{tok}"], "--tokenizer without --data"),
        (["--data", "{tmp}/ok.bin", "--val-fraction", "1.5"], "--val-fraction must be in [0, 1)"),
    ],
)
def test_bad_data_is_one_error_line_before_planning(tmp_path, tokenizer_file, capsys, args, message):
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "notes.md").write_text("# notes")
    (tmp_path / "empty.bin").write_bytes(b"")
    np.arange(5, dtype="<u2").tofile(tmp_path / "short.bin")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    np.array([1, 2, 300] * 10, "<u2").tofile(tmp_path / "wide.bin")
    np.arange(100, dtype="<u2").tofile(tmp_path / "ok.bin")
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "ka lo mi"}) + "\n")
    (tmp_path / "notext.jsonl").write_text(json.dumps({"id": 1}) + "\n")
    make_tokenizer(tmp_path / "noeos", eos=False)
    hf_config(tmp_path / "hf", vocab=128)
    fill = lambda a: a.replace("{tmp}", str(tmp_path)).replace("{tok}", str(tokenizer_file))  # noqa: E731
    cache = ["--data-cache", str(tmp_path / "cache"), "--out", str(tmp_path / "run")]
    code = main([*TINY, *map(fill, args), *cache])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, err
    assert fill(message) in lines[0], lines
    assert "Traceback" not in err and not (tmp_path / "run" / "plan.json").exists()  # before planning


# ---------------------------------------------------------------------------- training runs
@pytest.mark.replicated_plan  # one process: what it checks is the data a resumed run reads
def test_a_run_resumed_mid_epoch_sees_the_uninterrupted_batches(tmp_path, tokenizer_file):
    """A corpus of 5 steps an epoch: resumed from step 6's checkpoint (later ones gone), steps 7-9
    repeat the uninterrupted run's losses and validation losses exactly; the run exports to a
    Hugging Face directory with the tokenizer's vocabulary and files."""
    data = write_text(tmp_path / "data", documents(5, seed=5))["jsonl"]
    args = [*TINY, "--seq", "16", "--steps", "9", "--checkpoint-every", "3", "--keep-checkpoints", "0"]
    args += ["--data", str(data), "--tokenizer", str(tokenizer_file), "--data-cache", str(tmp_path / "cache")]
    args += ["--val-fraction", "0.2", "--eval-every", "3", "--eval-batches", "2"]
    data_settings = dict(data=(str(data),), tokenizer=str(tokenizer_file), data_cache=str(tmp_path / "cache"))
    _, _, corpus = opened(get_workload("llama3-tiny", 16), **data_settings, seq=16, val_fraction=0.2)
    assert corpus.train.count < 4 * 6 and 4 * 6 % corpus.train.count  # step 6 ends in the middle of epoch 2+
    first, second = tmp_path / "first", tmp_path / "second"
    assert main([*args, "--out", str(first)]) == 0
    rows = metrics(first)
    windows = json.loads((first / "plan.json").read_text())["settings"]
    assert windows["vocab_size"] == 320 and windows["tokenizer"] == str(tokenizer_file)
    shutil.copytree(first, second)
    for late in ("step-000009",):
        shutil.rmtree(second / "checkpoints" / late)
    (second / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:6]))
    assert main([*args, "--out", str(second)]) == 0
    resumed = metrics(second)
    assert [r["step"] for r in resumed] == list(range(1, 10))
    assert [r["loss"] for r in resumed[6:]] == [r["loss"] for r in rows[6:]]
    assert [r.get("val_loss") is not None for r in rows] == [False, False, True] * 3
    assert resumed[8]["val_loss"] == rows[8]["val_loss"] and rows[8]["val_ppl"] == pytest.approx(
        np.exp(rows[8]["val_loss"])
    )
    from autoshard.train.export import export_hf

    export_hf(first, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == 320 and (tmp_path / "hf" / "tokenizer.json").is_file()
    import transformers

    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok.eos_token == "<|endoftext|>" and hf_tok("ka lo").input_ids


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.replicated_plan  # the one-process reference; the 4-rank plan is checked to shard below
def test_torchrun_on_text_matches_one_process(tmp_path, tokenizer_file, executed_plans):
    """4 gloo ranks on (2, 2), parameters sharded, each rank reading its own rows of text tokenized
    once for all (a file lock; the cache then serves the reference run): the losses and validation
    losses equal those of one process on the same data."""
    paths = write_text(tmp_path / "data", documents(60, seed=2))
    args = ["--model", "llama3-tiny", "--batch", "32", "--seq", "128", "--steps", "6"]  # a batch it splits
    args += ["--data", str(paths["txt"]), "--data", str(paths["jsonl"]), "--tokenizer", str(tokenizer_file)]
    args += ["--data-cache", str(tmp_path / "cache"), "--val-fraction", "0.1", "--eval-every", "2"]
    args += ["--eval-batches", "2"]
    model = build_model(get_config("llama3-tiny").with_(vocab_size=320), device="meta")
    budget = ["--memory-budget", str(budget_bytes(model, (4,)))]
    torchrun(*args, *budget, "--mesh", "2x2", "--out", str(tmp_path / "four"))
    (facts,) = executed_plans()
    assert_shards(facts, batch_split=False)
    inputs = [
        i["layout"] for i in json.loads((tmp_path / "four" / "plan.json").read_text())["inputs"] if i["kind"] == "input"
    ]
    assert any("S(0)" in layout for layout in inputs), inputs  # ranks read rows of their own
    assert main([*args, "--mesh", "1", "--out", str(tmp_path / "one")]) == 0
    four, one = metrics(tmp_path / "four"), metrics(tmp_path / "one")
    assert [r["step"] for r in four] == [r["step"] for r in one] == list(range(1, 7))
    for a, b in zip(four, one):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"], (a, b)
        assert ("val_loss" in a) == ("val_loss" in b) == (a["step"] % 2 == 0)
        if "val_loss" in a:
            assert abs(a["val_loss"] - b["val_loss"]) <= 1e-5 * b["val_loss"], (a, b)
    assert len(list((tmp_path / "cache").glob("*.bin"))) == 61  # 60 .txt files and the .jsonl, once each


@pytest.mark.replicated_plan  # one process: what it checks is the refusal
def test_a_resume_with_other_data_is_refused_naming_both(tmp_path, capsys):
    paths = []
    for name, seed in (("a.bin", 0), ("b.bin", 1)):
        np.random.default_rng(seed).integers(0, 256, 4096, dtype=np.uint16).tofile(tmp_path / name)
        paths.append(str(tmp_path / name))
    out = str(tmp_path / "run")
    assert main([*TINY, "--checkpoint-every", "2", "--data", paths[0], "--out", out]) == 0
    capsys.readouterr()
    assert main([*TINY, "--steps", "3", "--data", paths[1], "--out", out]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: resuming {out} with settings that define another run (--data: 1 of its 1 files differ from the "
        "run's (size or content)): its "
        "losses would mix two runs; use another --out, or --resume force to continue anyway (recorded in metrics.jsonl)"
    ]
