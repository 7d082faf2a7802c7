"""Real text learns: llama3-debug on a 2x2 mesh, trained on English prose through `--data` and
`--tokenizer`, against the corpus's unigram entropy.

    python -m benchmarks.training.text_learns                  # 300 steps (~2 min on 2 idle cores)
    python -m benchmarks.training.text_learns --steps 10       # a smoke run
    python -m benchmarks.training.text_learns --json out.json [--out runs/bench-text-learns]

1. The corpus: at least 1 MB of real English text already on the machine, none of it generated:
   the Python documentation's topics (`pydoc_data.topics`, in every CPython: one document per
   topic), the license texts of /usr/share/common-licenses (one per file, symlinked duplicates
   left out) and the prose of the Debian packages' /usr/share/doc/*/copyright files (one document
   per file: field lines such as `Files:` and `Copyright:` dropped, then only paragraphs of at
   least 12 words, 80% of them words and 15% common ones such as `the` and `of` (not lists of
   names or files), without an e-mail address and never seen before in the corpus: the same
   license text in many packages counts once). The documents are shuffled with a fixed seed and
   written as `corpus.jsonl` (`text` field); `--val-fraction` holds out a random 5% of them.
2. A byte-level BPE tokenizer trained on it by the `tokenizers` library (vocabulary 2048: small, so
   that a small model learns it quickly; `<|endoftext|>` as its EOS), saved as `tokenizer.json`.
3. The bar: the unigram entropy of the training split in nats per token, -sum p ln p over the
   token counts of the stream `train` trains on (EOS after each document included; the split cut
   by autoshard's own `--val-fraction` code, tokens from its own tokenizer cache). A model that
   learned only how often each token occurs scores about this; one below it uses context.
4. The run, 4 gloo ranks under torchrun (OMP_NUM_THREADS=1): `python -m autoshard train --model
   llama3-debug --mesh 2x2 --data corpus.jsonl --tokenizer tokenizer.json --val-fraction 0.05
   --eval-every 50 --eval-batches 8 --lr-schedule cosine --warmup-steps 20 --batch 8 --seq 64`;
   the `val_loss` rows of its metrics.jsonl.

Passes (exit 0) when a validation loss falls below the entropy within the steps. Prints and
(`--json`) writes the corpus's size, sources and tokens, the entropy, every validation loss, the
first step below the entropy and the wall time.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from benchmarks.launch import ROOT, rank_env, torchrun

MIN_BYTES = 1_000_000
VOCAB = 2048
EOS = "<|endoftext|>"
VAL_FRACTION = 0.05
SHUFFLE_SEED = 0
LICENSES = "/usr/share/common-licenses"
COPYRIGHTS = "/usr/share/doc/*/copyright"
_FIELD = re.compile(r"^[A-Za-z][\w-]*:(\s|$)")  # a DEP-5 field line: `Files: *`, `License: GPL-2+`
_WORD = re.compile(r"^[(\"'`]?[A-Za-z][a-z'’-]*[,.;:!?)\"'’]*$")
# words most English sentences have some of: a paragraph of names or of file lists has few
_COMMON = frozenset("a an and are as be by for from in is it may not of on or that the this to with you".split())


# ---------------------------------------------------------------------------------- corpus
def _paragraphs(text: str) -> list[str]:
    return [p.strip("\n") for p in re.split(r"\n[ \t]*\n", text) if p.strip()]


def _key(paragraph: str) -> str:
    return " ".join(paragraph.split()).lower()


def _prose(text: str, seen: set[str]) -> str:
    """The prose paragraphs of a Debian copyright file not in `seen` (which takes them): field
    lines and the ` .` lines that stand for blank ones dropped, the one-space indent removed."""
    lines = ["" if _FIELD.match(line) or line.strip() == "." else line.rstrip() for line in text.splitlines()]
    kept = []
    for p in _paragraphs("\n".join(lines)):
        words = p.split()
        if (
            len(words) < 12
            or "@" in p
            or sum(bool(_WORD.match(w)) for w in words) < 0.8 * len(words)
            or sum(w.lower() in _COMMON for w in words) < 0.15 * len(words)
        ):
            continue
        key = _key(p)
        if key not in seen:
            seen.add(key)
            kept.append(textwrap.dedent(p))
    return "\n\n".join(kept)


def documents() -> Iterator[tuple[str, str, str]]:
    """(source, name, text) of every document, sources in order."""
    import pydoc_data.topics

    for name, text in sorted(pydoc_data.topics.topics.items()):
        if text.strip():
            yield "pydoc_data.topics", name, text
    seen: set[str] = set()
    files: dict[str, str] = {}  # real path -> the first name for it (GPL -> GPL-3 is one file)
    for path in sorted(glob.glob(f"{LICENSES}/*")):
        files.setdefault(os.path.realpath(path), path)
    for real, path in sorted(files.items(), key=lambda kv: kv[1]):
        if os.path.isfile(real):
            text = Path(real).read_text(encoding="utf-8", errors="replace")
            seen.update(_key(p) for p in _paragraphs(text))
            yield LICENSES, os.path.basename(path), text
    for path in sorted(glob.glob(COPYRIGHTS)):
        try:
            text = _prose(Path(path).read_text(encoding="utf-8", errors="replace"), seen)
        except OSError:
            continue
        if len(text) >= 200:
            yield COPYRIGHTS, path.split("/")[-2], text


def assemble(out: Path) -> dict:
    """Write `out`/corpus.jsonl (one record per document, `text` and `source`); its figures."""
    docs = list(documents())
    sources: dict[str, dict[str, int]] = {source: {"documents": 0, "bytes": 0} for source, _, _ in docs}
    random.Random(SHUFFLE_SEED).shuffle(docs)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "corpus.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for source, name, text in docs:
            f.write(json.dumps({"text": text, "source": source, "name": name}) + "\n")
            sources[source]["documents"] += 1
            sources[source]["bytes"] += len(text.encode())
    return {
        "path": str(path),
        "bytes": sum(s["bytes"] for s in sources.values()),  # the texts' UTF-8 bytes
        "file_bytes": path.stat().st_size,
        "documents": len(docs),
        "sources": sources,
    }


# ---------------------------------------------------------------------------------- tokens
def train_tokenizer(corpus: Path, out: Path, vocab: int = VOCAB) -> Path:
    """A byte-level BPE tokenizer trained on the corpus's texts, saved as `out`/tokenizer.json."""
    import tokenizers

    def texts() -> Iterator[str]:
        with corpus.open(encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]

    tokenizer = tokenizers.ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(texts(), vocab_size=vocab, special_tokens=[EOS], show_progress=False)
    path = out / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def unigram_entropy(corpus: Path, tokenizer: Path, cache: Path, val_fraction: float = VAL_FRACTION) -> dict:
    """The corpus's tokens as `train` reads them (autoshard's tokenizing and cache, EOS after each
    document, its `--val-fraction` split): the unigram entropy of the training split in nats per
    token, and the held-out split's cross-entropy under those unigram frequencies (add-one)."""
    from autoshard.data.corpus import Tokens, split_by_document
    from autoshard.data.text import load_tokenizer, tokenized

    tok = load_tokenizer(str(tokenizer))
    stream = Tokens([tokenized(corpus, tok, cache)])
    split = split_by_document(stream, val_fraction, tok.eos_id, seed=0)  # train's default --data-seed
    assert split is not None
    train, val = split.train, split.val
    counts = np.bincount(train.read(0, len(train)).astype(np.int64), minlength=tok.vocab_size)
    p = counts[counts > 0] / len(train)
    entropy = float(-(p * np.log(p)).sum())
    smoothed = (counts + 1) / (len(train) + tok.vocab_size)
    val_ids = val.read(0, len(val)).astype(np.int64)
    return {
        "vocab": tok.vocab_size,
        "eos_id": tok.eos_id,
        "tokens": len(stream),
        "train_tokens": len(train),
        "val_tokens": len(val),
        "unigram_entropy": entropy,
        "val_unigram_cross_entropy": float(-np.log(smoothed[val_ids]).mean()),
    }


# ---------------------------------------------------------------------------------- training
def train_args(corpus: Path, tokenizer: Path, cache: Path, run: Path, a: argparse.Namespace) -> list[str]:
    every = min(a.eval_every, a.steps)
    return [
        "-m",
        "autoshard",
        "train",
        "--model",
        "llama3-debug",
        "--mesh",
        "2x2",
        "--data",
        str(corpus),
        "--tokenizer",
        str(tokenizer),
        "--data-cache",
        str(cache),
        "--val-fraction",
        str(VAL_FRACTION),
        "--eval-every",
        str(every),
        "--eval-batches",
        str(a.eval_batches),
        "--steps",
        str(a.steps),
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        str(min(20, a.steps // 2)),
        "--batch",
        str(a.batch),
        "--seq",
        str(a.seq),
        "--out",
        str(run),
        "--overwrite",
    ]


def train(args: list[str], run: Path, timeout: float = 3600) -> tuple[float, list[dict]]:
    """torchrun 4 workers of `args`; (wall s, metrics.jsonl rows). Console output: run/console.txt."""
    run.mkdir(parents=True, exist_ok=True)
    cmd = [*torchrun(), "--standalone", "--nproc_per_node=4", *args]
    print(" ".join(cmd), flush=True)
    start = time.perf_counter()
    with (run / "console.txt").open("w") as console:
        done = subprocess.run(cmd, env=rank_env(), cwd=ROOT, stdout=console, stderr=subprocess.STDOUT, timeout=timeout)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"training failed (exit {done.returncode}):\n{(run / 'console.txt').read_text()[-4000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return wall, rows


# ---------------------------------------------------------------------------------- main
def measure(out: Path, a: argparse.Namespace) -> dict:
    start = time.perf_counter()
    corpus = assemble(out)
    if corpus["bytes"] < MIN_BYTES:
        raise SystemExit(f"the corpus has {corpus['bytes']:,} bytes, under {MIN_BYTES:,}: too little text here")
    tokenizer = train_tokenizer(Path(corpus["path"]), out, a.vocab)
    cache = out / "token-cache"
    tokens = unigram_entropy(Path(corpus["path"]), tokenizer, cache)
    tokens["bytes_per_token"] = corpus["bytes"] / tokens["tokens"]
    prepare_s = time.perf_counter() - start
    figures = {"corpus": corpus, "tokenizer": str(tokenizer), **tokens, "prepare_s": prepare_s}
    print(
        f"corpus: {corpus['bytes']:,} bytes of text in {corpus['documents']} documents ("
        + ", ".join(f"{s}: {v['documents']} docs, {v['bytes']:,} B" for s, v in corpus["sources"].items())
        + f"); BPE vocabulary {tokens['vocab']}: {tokens['tokens']:,} tokens ({tokens['bytes_per_token']:.2f} bytes "
        f"each), {tokens['train_tokens']:,} for training, {tokens['val_tokens']:,} held out; unigram entropy "
        f"{tokens['unigram_entropy']:.4f} nats/token (held-out split under it: "
        f"{tokens['val_unigram_cross_entropy']:.4f}); prepared in {prepare_s:.0f} s",
        flush=True,
    )
    if a.no_train:
        return figures
    args = train_args(Path(corpus["path"]), tokenizer, cache, out / "run", a)
    wall, rows = train(args, out / "run")
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    below = [s for s, loss in sorted(val.items()) if loss < tokens["unigram_entropy"]]
    figures |= {
        "command": "torchrun --standalone --nproc_per_node=4 " + " ".join(args),
        "steps": a.steps,
        "batch": a.batch,
        "seq": a.seq,
        "train_loss": {r["step"]: r["loss"] for r in rows if r["step"] in val or r["step"] == 1},
        "val_loss": val,
        "first_step_below_entropy": below[0] if below else None,
        "wall_s": wall,
        "passed": bool(below),
    }
    for s, loss in sorted(val.items()):
        print(
            f"step {s:4d}: val loss {loss:.4f} ({loss - tokens['unigram_entropy']:+.4f} against the entropy), "
            f"train loss {figures['train_loss'][s]:.4f}"
        )
    print(
        f"{'PASS' if below else 'FAIL'}: validation loss "
        + (f"below the unigram entropy from step {below[0]}" if below else "never below the unigram entropy")
        + f" ({a.steps} steps, {wall:.0f} s wall for the run)"
    )
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=VOCAB, help="the BPE tokenizer's vocabulary")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--out", default=str(ROOT / "runs" / "bench-text-learns"), help="corpus, tokenizer and run")
    p.add_argument("--no-train", action="store_true", help="only the corpus, tokenizer and entropy")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    if a.steps < 2:
        p.error("--steps must be at least 2")
    figures = measure(Path(a.out), a)
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1) + "\n")
    return 0 if a.no_train or figures["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
