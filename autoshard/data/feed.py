"""What the training steps read: each rank's own inputs of step N, and the validation loss.

    settings, workload, feed = open_feed(settings, workload)   # every rank, before planning
    inputs = feed.inputs(step - 1, pmodel)                     # this rank's local inputs
    row |= feed.evaluate(step, pmodel)                         # every K steps: val_loss, val_ppl

Without `--data` the feed is the workload's synthetic source (the GLOBAL batch, cut by
`shard_inputs`, as before). With it, a rank reads only the windows of its own rows
(`pmodel.input_rows`) and `pmodel.local_inputs` cuts what the layout splits further: no rank
builds the global batch. Row r of step N is position N * batch + r of the shuffled stream of
epochs (`corpus.Windows.shuffled`), a pure function of (data seed, N). Every check of the input
(paths, tokenizer, vocabulary, sizes) runs here, alike on every rank, before the process group:
one `UsageError`. Duck-typed on the settings, workload and parallel module: no planning stage.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from autoshard.data.corpus import Tokens, Windows, split_by_document
from autoshard.data.files import check_range, find_files, open_tokens
from autoshard.data.text import Tokenizer, default_cache, load_tokenizer, tokenized
from autoshard.options import UsageError

log = logging.getLogger("autoshard")


class SyntheticFeed:
    """The workload's own data source: the global batch of a step, cut to this rank's shards."""

    def __init__(self, source: Any, batch: int, seq: int, micro_batches: int = 1):
        self.source, self.batch, self.seq, self.micro_batches = source, batch, seq, micro_batches

    def inputs(self, index: int, pmodel: Any, micro: int = 0) -> tuple[torch.Tensor, ...]:
        """This rank's inputs of micro-batch `micro` (rows micro * m .. of the global batch, m
        rows each) of step `index + 1`."""
        m = self.batch // self.micro_batches
        rows = slice(micro * m, (micro + 1) * m)
        return pmodel.shard_inputs(*(x[rows] for x in self.source.batch(index, self.batch, self.seq)))

    def evaluate(self, step: int, pmodel: Any) -> dict[str, float]:
        return {}


class CorpusFeed:
    """Windows of a token corpus, each rank reading its own rows; validation every `eval_every`
    steps on the first `eval_batches` batches of the held-out windows (in order, wrapping)."""

    def __init__(
        self,
        train: Windows,
        val: Windows | None,
        *,
        batch: int,
        seed: int,
        vocab_size: int | None,
        eval_every: int = 0,
        eval_batches: int = 1,
        micro_batches: int = 1,
    ):
        self.train, self.val, self.batch, self.seed = train, val, batch, seed
        self.micro_batches = micro_batches
        self.vocab_size, self.eval_every, self.eval_batches = vocab_size, eval_every, eval_batches
        self.summary: str | None = None  # logged at the first step (logging is set up by then)

    def inputs(self, index: int, pmodel: Any, micro: int = 0) -> tuple[torch.Tensor, ...]:
        """This rank's inputs (tokens, targets) of micro-batch `micro` of step `index + 1`: rows
        micro * m .. (micro + 1) * m - 1 of its global batch, m = batch / micro_batches."""
        if self.summary is not None:
            log.info("%s", self.summary)
            self.summary = None
        first = index * self.batch + micro * (self.batch // self.micro_batches)
        return self._local(pmodel, self.train, lambda rows: self.train.shuffled(first + rows, self.seed))

    def rows(self, index: int, rows: np.ndarray) -> np.ndarray:
        """Rows `rows` of the global batch of step `index + 1`: [len(rows), seq + 1] windows."""
        return self.train.read(self.train.shuffled(index * self.batch + np.asarray(rows, np.int64), self.seed))

    def evaluate(self, step: int, pmodel: Any) -> dict[str, float]:
        """Every `eval_every` steps: the mean validation loss over `eval_batches` batches, run
        through the parallel module without gradients, and its perplexity."""
        val = self.val
        if val is None or not self.eval_every or step % self.eval_every:
            return {}
        drawn = pmodel.random.step  # the next step's random ops draw as if no evaluation had run
        total = 0.0
        micro = self.batch // self.micro_batches  # the rows the program takes
        count = self.eval_batches * self.micro_batches
        with torch.no_grad():
            for k in range(count):
                ids = lambda rows, k=k: (k * micro + rows) % val.count  # noqa: E731
                total += float(pmodel(*self._local(pmodel, val, ids)).item())
        pmodel.random.step = drawn
        loss = total / count
        ppl = math.exp(loss) if loss < 700 else math.inf
        log.info("step %4d  val loss %.4f  val ppl %.2f", step, loss, ppl)
        return {"val_loss": loss, "val_ppl": ppl}

    def _local(self, pmodel: Any, windows: Windows, ids: Callable[[np.ndarray], np.ndarray]) -> tuple:
        """(tokens, targets) of this rank: the windows of the rows it holds, cut by the layout."""
        wanted = [np.asarray(pmodel.input_rows(i).cpu(), np.int64) for i in (0, 1)]
        read = [windows.read(ids(rows)) for rows in wanted[: 1 if np.array_equal(wanted[0], wanted[1]) else 2]]
        tokens, targets = torch.from_numpy(read[0][:, :-1]), torch.from_numpy(read[-1][:, 1:])
        top = max(int(tokens.max()), int(targets.max())) if tokens.numel() else 0
        if self.vocab_size is not None and top >= self.vocab_size:
            raise UsageError(
                f"--data holds token {top}, outside the model's vocabulary of {self.vocab_size} "
                "(another tokenizer's corpus, or the wrong --data-dtype)"
            )
        return pmodel.local_inputs(tokens, targets)


Feed = SyntheticFeed | CorpusFeed


def open_feed(settings: Any, workload: Any) -> tuple[Any, Any, Feed]:
    """(settings, workload, feed): the workload with the vocabulary the data needs (a llama3 model
    takes `--vocab-size` or the tokenizer's; `settings.vocab_size` then records it, for resuming and
    exporting), and the feed of its data. UsageError for any bad input, on every rank alike."""
    tokenizer = load_tokenizer(settings.tokenizer) if settings.tokenizer else None
    settings, workload = _fit_vocab(settings, workload, tokenizer)
    if not settings.data:
        source = workload.data(settings.data_seed)
        return settings, workload, SyntheticFeed(source, settings.batch, settings.seq, settings.grad_accum or 1)
    vocab = tokenizer.vocab_size if tokenizer is not None else workload.vocab_size
    stream = _stream(settings, "--data", settings.data, tokenizer, vocab, workload.vocab_size)
    val, held = None, ""
    if settings.val_data:
        val = _stream(settings, "--val-data", settings.val_data, tokenizer, vocab, workload.vocab_size)
    elif settings.val_fraction:
        assert tokenizer is not None  # Settings asks for one
        split = split_by_document(stream, settings.val_fraction, tokenizer.eos_id, settings.data_seed)
        if split is None:
            raise UsageError(
                f"--val-fraction: --data holds fewer than two documents (EOS token {tokenizer.eos_id} ends one) "
                "to hold some out; give --val-data instead"
            )
        stream, val = split.train, split.val
        held = f" in {split.held} of {split.documents} documents"
    train = _windows("--data", stream, settings.seq)
    feed = CorpusFeed(
        train,
        _windows("--val-data" if settings.val_data else "--val-fraction", val, settings.seq) if val else None,
        batch=settings.batch,
        seed=settings.data_seed,
        vocab_size=workload.vocab_size,
        eval_every=settings.eval_every,
        eval_batches=settings.eval_batches,
        micro_batches=settings.grad_accum or 1,
    )
    feed.summary = (
        f"autoshard data: {len(stream)} tokens, {train.count} windows of {train.size} "
        f"({settings.steps * settings.batch / train.count:.2f} epochs in {settings.steps} steps)"
        + (f"; validation: {len(val)} tokens{held}" if val is not None else "")
    )
    return settings, workload, feed


def _fit_vocab(settings: Any, workload: Any, tokenizer: Tokenizer | None) -> tuple[Any, Any]:
    """The workload resized to `--vocab-size` or the tokenizer's vocabulary where it can be; a
    model whose vocabulary cannot hold the tokenizer's is an error."""
    want = settings.vocab_size
    if want is None and tokenizer is not None and workload.resize_vocab is not None:
        want = tokenizer.vocab_size
    if want is not None:
        if workload.resize_vocab is None:
            raise UsageError(f"--vocab-size: {workload.name} has its config's vocabulary ({workload.vocab_size})")
        if tokenizer is not None and want < tokenizer.vocab_size:
            raise UsageError(
                f"--vocab-size {want} is smaller than the vocabulary of --tokenizer {settings.tokenizer} "
                f"({tokenizer.vocab_size})"
            )
        if want != workload.vocab_size:
            workload = workload.resize_vocab(want)
        settings = settings.replace(vocab_size=want)
    if tokenizer is not None and workload.vocab_size is not None and workload.vocab_size < tokenizer.vocab_size:
        raise UsageError(
            f"--tokenizer {settings.tokenizer}: its vocabulary ({tokenizer.vocab_size} tokens) is larger than "
            f"{workload.name}'s ({workload.vocab_size})"
        )
    return settings, workload


def _stream(
    settings: Any, flag: str, specs: tuple[str, ...], tokenizer: Tokenizer | None, vocab: int | None, model: int | None
) -> Tokens:
    """The tokens of the files `specs` names, one stream: token files mapped, text tokenized (cached)."""
    files = find_files(specs, flag)
    text = [f.path for f in files if f.kind == "text"]
    if text and tokenizer is None:
        raise UsageError(f"{flag}: text files ({text[0]}{', ...' if len(text) > 1 else ''}) need --tokenizer")
    cache = Path(settings.data_cache).expanduser() if settings.data_cache else default_cache()
    arrays = []
    for f in files:
        if f.kind == "text":
            assert tokenizer is not None
            arrays.append(tokenized(f.path, tokenizer, cache))
        else:
            array = open_tokens(f.path, settings.data_dtype, vocab if vocab is not None else 2**16)
            if model is not None:
                check_range(array, f.path, model)
            arrays.append(array)
    tokens = Tokens(arrays)
    if len(tokens) == 0:
        raise UsageError(f"{flag} {' '.join(specs)}: the corpus is empty (no tokens in {len(files)} file(s))")
    return tokens


def _windows(flag: str, tokens: Tokens, seq: int) -> Windows:
    windows = Windows(tokens, seq)
    if windows.count == 0:
        raise UsageError(f"{flag}: {len(tokens)} tokens are shorter than one window of --seq + 1 = {seq + 1} tokens")
    return windows
