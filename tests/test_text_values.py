"""Tokenized text is never silently wrong: a damaged token-cache entry is rebuilt (said on stderr),
a tokenizer killed midway leaves no temporary file for good, and a special token's string inside
a document is text, not the EOS id that ends a document."""

from __future__ import annotations

import fcntl
import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from autoshard.data import text
from autoshard.data.corpus import Tokens, split_by_document
from test_data import documents, make_tokenizer

EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def expected(tok: text.Tokenizer, docs: list[str]) -> list[int]:
    return [t for d in docs for t in [*tok.tokenizer.encode(d, add_special_tokens=False).ids, tok.eos_id]]


# ---------------------------------------------------------------------------- the cache
@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_a_damaged_cache_entry_is_rebuilt_and_said(tmp_path, tokenizer_file, capsys, damage):
    tok = text.load_tokenizer(str(tokenizer_file))
    docs = documents(40, seed=3)
    data, cache = jsonl(tmp_path / "d.jsonl", docs), tmp_path / "cache"
    want = expected(tok, docs)
    assert text.tokenized(data, tok, cache).tolist() == want
    (entry,) = cache.glob("*.bin")
    raw = entry.read_bytes()
    if damage == "truncate":  # a copy cut short, a full disk
        entry.write_bytes(raw[: len(raw) * 5 // 6])
    elif damage == "flip":  # the same length, one token changed
        entry.write_bytes(raw[:-3] + bytes([raw[-3] ^ 1]) + raw[-2:])
    else:
        entry.write_bytes(b"")
    capsys.readouterr()
    assert text.tokenized(data, tok, cache).tolist() == want
    err = capsys.readouterr().err
    assert f"autoshard data: the token cache {entry} is " in err and f"tokenizing {data} again" in err, err
    assert {"truncate": "truncated (", "flip": "damaged (", "empty": "not a token cache"}[damage] in err, err
    assert text.tokenized(data, tok, cache).tolist() == want and not capsys.readouterr().err  # whole again


KILLED = """
import os, signal, sys
from pathlib import Path
from autoshard.data import text

tok = text.load_tokenizer(sys.argv[1])
read = text.documents


def documents(path, scratch=None):  # SIGTERM, unhandled, once the first batch is written
    for i, doc in enumerate(read(path, scratch)):
        if i == 300:
            os.kill(os.getpid(), signal.SIGTERM)
        yield doc


text.documents = documents
text.tokenized(Path(sys.argv[2]), tok, Path(sys.argv[3]))
"""


def test_a_tokenizer_killed_midway_leaves_no_temp_for_good(tmp_path, tokenizer_file):
    docs = documents(400, seed=4)
    data, cache = jsonl(tmp_path / "d.jsonl", docs), tmp_path / "cache"
    killed = subprocess.run([sys.executable, "-c", KILLED, str(tokenizer_file), str(data), str(cache)], timeout=300)
    assert killed.returncode == -signal.SIGTERM
    (left,) = cache.glob(".*.tmp")  # no handler ran: the partial file is there
    assert left.stat().st_size > 0 and not list(cache.glob("*.bin"))
    # another target's temp whose tokenizer still runs (its lock taken) stays; a dead one's goes
    (cache / ".busy.uint16.bin.1.tmp").write_bytes(b"x")
    (cache / ".dead.uint16.bin.2.tmp").write_bytes(b"x")
    tok = text.load_tokenizer(str(tokenizer_file))
    with open(cache / "busy.uint16.bin.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert text.tokenized(data, tok, cache).tolist() == expected(tok, docs)
    assert [p.name for p in cache.glob(".*.tmp")] == [".busy.uint16.bin.1.tmp"]


def test_the_cache_key_covers_the_rules():
    """Caches made before special tokens were read as text are not reused."""
    assert text.CACHE_VERSION == b"autoshard-tokens-v2"


# ---------------------------------------------------------------------------- special tokens are text
@pytest.mark.parametrize("eos_special", [True, False], ids=["special", "plain-added-token"])
def test_a_special_token_inside_a_document_is_text(tmp_path, eos_special):
    """A document quoting `<|endoftext|>` stays one document: the only EOS ids are the ones put
    between documents, also when tokenizer.json lists the EOS as a plain (not special) added token."""
    file = make_tokenizer(tmp_path / "tok")
    if not eos_special:
        config = json.loads(file.read_text())
        for token in config["added_tokens"]:
            token["special"] = False
        file.write_text(json.dumps(config))
    tok = text.load_tokenizer(str(file))
    assert tok.eos_id == tok.tokenizer.token_to_id(EOS)
    docs = [f"ka lo {EOS} mi ne", f"{EOS}", f"ru ta shi {EOS}{EOS} po", "ve zu an el"]
    tokens = text.tokenized(jsonl(tmp_path / "d.jsonl", docs), tok, tmp_path / "cache")
    assert np.flatnonzero(tokens == tok.eos_id).size == len(docs)
    pieces = np.split(np.asarray(tokens), np.flatnonzero(tokens == tok.eos_id)[:-1] + 1)
    assert [tok.tokenizer.decode(p[:-1].tolist()) for p in pieces] == docs  # each spelled out, whole
    split = split_by_document(Tokens([tokens]), 0.5, tok.eos_id, seed=0)
    assert split is not None and split.documents == len(docs)


def test_a_tokenizer_whose_model_spells_the_eos_from_text_is_refused(tmp_path):
    """A word-level model with `<|endoftext|>` as a plain word makes the EOS id from text whatever
    the added tokens say: one error line, and nothing cached."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, EOS: 1, "ka": 2, "lo": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([EOS])
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = text.load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert text.tokenized(jsonl(tmp_path / "ok.jsonl", ["ka lo", "lo"]), loaded, tmp_path / "cache").tolist() == [
        2, 3, 1, 3, 1,
    ]  # fmt: skip
    with pytest.raises(
        text.UsageError,
        match=r"bad.jsonl: --tokenizer reads the text .<\|endoftext\|>. in a document as its EOS token 1",
    ):
        text.tokenized(jsonl(tmp_path / "bad.jsonl", [f"ka {EOS} lo"]), loaded, tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("*.bin"))) == 1 and not list((tmp_path / "cache").glob(".*.tmp"))
