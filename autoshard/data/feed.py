"""What the training steps read: each rank's own inputs of a micro-batch, the validation loss,
and the data position as checkpointable state.

    source = open_data(DataConfig.from_settings(settings), workload, tokenizer)  # before planning
    feed = source.feed(pmodel, micro_batches)                                 # from the plan
    inputs = feed.inputs(step, micro)                                         # this rank's inputs
    row |= feed.evaluate(step)                                                # val_loss, val_ppl

Without `--data` the source is the workload's synthetic one (the GLOBAL batch, cut by
`shard_inputs`). With it, a rank reads only the windows of its own rows (`pmodel.input_rows`)
and `pmodel.local_inputs` cuts what the layout splits further: no rank builds the global batch.
Row r of step N is position (N - 1) * batch + r of the shuffled stream of epochs
(`corpus.Windows.shuffled`), a pure function of (data seed, N). Every check of the input (paths,
tokenizer, vocabulary, sizes) runs in `open_data`, alike on every rank, before the process group:
one `UsageError`. Duck-typed on the workload and the parallel module: no planning stage.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch

from autoshard.data.corpus import Tokens, Windows, split_by_document
from autoshard.data.examples import positions_input
from autoshard.data.files import check_range, find_files, open_tokens
from autoshard.data.instruction_feed import Instructions, instruction_files, open_instructions
from autoshard.data.text import Tokenizer, default_cache, tokenized
from autoshard.data.validation import Position, validation_loss
from autoshard.options import UsageError

log = logging.getLogger("autoshard")


class Feed(Protocol):
    """A run's data as the step schedule reads it, built from the plan (it knows this rank's rows
    and the micro-batch count). Steps count from 1; `state_dict` is JSON and goes into every
    checkpoint, `load_state_dict` gets it back on resume."""

    def inputs(self, step: int, micro: int) -> tuple[torch.Tensor, ...]: ...

    def evaluate(self, step: int) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class DataConfig:
    """The settings the data reads (`train`'s flags of the same names)."""

    batch: int
    seq: int
    steps: int
    data: tuple[str, ...] | None = None
    data_dtype: str = "auto"
    data_cache: str | None = None
    data_seed: int = 0
    tokenizer: str | None = None
    val_data: tuple[str, ...] | None = None
    val_fraction: float = 0.0
    eval_every: int = 0
    eval_batches: int = 8
    loss_on: str | None = None  # instruction data: "completion" (its default) or "all"
    instruction_layout: str | None = None  # instruction data: "pack" (its default) or "pad"

    @classmethod
    def from_settings(cls, settings: Any) -> DataConfig:
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})


class SyntheticFeed(Position):
    """The workload's own data source: the global batch of a step, cut to this rank's shards."""

    def __init__(self, source: Any, pmodel: Any, batch: int, seq: int, micro_batches: int = 1):
        self.source, self.pmodel, self.batch, self.seq = source, pmodel, batch, seq
        self.micro_batches = micro_batches

    def inputs(self, step: int, micro: int) -> tuple[torch.Tensor, ...]:
        """This rank's inputs of micro-batch `micro` (rows micro * m .. of the global batch, m rows
        each) of step `step`."""
        m = self.batch // self.micro_batches
        rows = slice(micro * m, (micro + 1) * m)
        self.served = step
        return self.pmodel.shard_inputs(*(x[rows] for x in self.source.batch(step - 1, self.batch, self.seq)))

    def evaluate(self, step: int) -> dict[str, float]:
        return {}


class CorpusFeed(Position):
    """Windows of a token corpus, each rank reading its own rows; validation every `eval_every`
    steps on the first `eval_batches` batches of the held-out windows (in order, wrapping)."""

    def __init__(self, corpus: Corpus, pmodel: Any, micro_batches: int = 1):
        self.corpus, self.pmodel, self.micro_batches = corpus, pmodel, micro_batches
        self.summary: str | None = corpus.summary  # logged at the first step (logging is set up by then)

    def inputs(self, step: int, micro: int) -> tuple[torch.Tensor, ...]:
        """This rank's inputs (tokens, targets) of micro-batch `micro` of step `step`: rows
        micro * m .. (micro + 1) * m - 1 of its global batch, m = batch / micro_batches."""
        if self.summary is not None:
            log.info("%s", self.summary)
            self.summary = None
        c = self.corpus
        first = (step - 1) * c.config.batch + micro * (c.config.batch // self.micro_batches)
        self.served = step
        return self._local(c.train, lambda rows: c.train.shuffled(first + rows, c.config.data_seed))

    def evaluate(self, step: int) -> dict[str, float]:
        """Every `eval_every` steps: the mean validation loss over `eval_batches` batches, run
        through the parallel module without gradients, and its perplexity."""
        val, config = self.corpus.val, self.corpus.config
        if val is None or not config.eval_every or step % config.eval_every:
            return {}
        return validation_loss(self.pmodel, config, self.micro_batches, val.count, partial(self._local, val), step)

    def _local(self, windows: Windows, ids: Callable[[np.ndarray], np.ndarray]) -> tuple:
        """(tokens, targets) of this rank: the windows of the rows it holds, cut by the layout."""
        pmodel, vocab = self.pmodel, self.corpus.vocab_size
        wanted = [np.asarray(pmodel.input_rows(i).cpu(), np.int64) for i in (0, 1)]
        read = [windows.read(ids(rows)) for rows in wanted[: 1 if np.array_equal(wanted[0], wanted[1]) else 2]]
        tokens, targets = torch.from_numpy(read[0][:, :-1]), torch.from_numpy(read[-1][:, 1:])
        both = (tokens, targets) if tokens.numel() else ()
        low, top = min((int(x.min()) for x in both), default=0), max((int(x.max()) for x in both), default=0)
        if low < 0:
            raise UsageError(f"--data holds token {low}: token ids are never negative (the wrong --data-dtype?)")
        if vocab is not None and top >= vocab:
            raise UsageError(
                f"--data holds token {top}, outside the model's vocabulary of {vocab} "
                "(another tokenizer's corpus, or the wrong --data-dtype)"
            )
        return pmodel.local_inputs(tokens, targets)


@dataclass(frozen=True)
class Corpus:
    """`--data` opened and checked: the training windows, the validation ones, and what to log."""

    config: DataConfig
    train: Windows
    val: Windows | None
    vocab_size: int | None
    summary: str

    def feed(self, pmodel: Any, micro_batches: int) -> CorpusFeed:
        return CorpusFeed(self, pmodel, micro_batches)

    def rows(self, step: int, rows: np.ndarray) -> np.ndarray:
        """Rows `rows` of the global batch of step `step`: [len(rows), seq + 1] windows."""
        first = (step - 1) * self.config.batch
        return self.train.read(self.train.shuffled(first + np.asarray(rows, np.int64), self.config.data_seed))


@dataclass(frozen=True)
class Synthetic:
    """The workload's synthetic tokens (no `--data`)."""

    config: DataConfig
    source: Any

    def feed(self, pmodel: Any, micro_batches: int) -> SyntheticFeed:
        return SyntheticFeed(self.source, pmodel, self.config.batch, self.config.seq, micro_batches)


def with_layout(config: DataConfig, workload: Any) -> DataConfig:
    """`config` with instruction data's layout decided: `--instruction-layout` as given, else pack
    where the model keeps packed examples apart (takes their positions: our llama family and
    transformers causal LMs), else pad."""
    if config.instruction_layout is not None or not config.data:
        return config
    if not instruction_files(find_files(config.data, "--data"), "--data"):
        return config
    packs = positions_input(workload) is not None
    return dataclasses.replace(config, instruction_layout="pack" if packs else "pad")


def open_data(config: DataConfig, workload: Any, tokenizer: Tokenizer | None) -> Corpus | Synthetic | Instructions:
    """The run's data, every file checked (UsageError for any bad input, on every rank alike);
    `workload` is the model as it will be built (its vocabulary already fitted to the data).
    Instruction data (`instruction_feed`) steps its model on other inputs: `model_workload`."""
    if not config.data:
        return Synthetic(config, workload.data(config.data_seed))
    if instruction_files(find_files(config.data, "--data"), "--data"):
        return open_instructions(config, tokenizer)
    for flag, value in (("--loss-on", config.loss_on), ("--instruction-layout", config.instruction_layout)):
        if value is not None and (flag, value) != ("--loss-on", "all"):
            raise UsageError(
                f"{flag} {value}: --data is not instruction data (JSONL records of messages or prompt/completion); "
                "plain text and tokens train on every token, packed into windows"
            )
    vocab = tokenizer.vocab_size if tokenizer is not None else workload.vocab_size
    stream = _stream(config, "--data", config.data, tokenizer, vocab, workload.vocab_size)
    val, held = None, ""
    if config.val_data:
        val = _stream(config, "--val-data", config.val_data, tokenizer, vocab, workload.vocab_size)
    elif config.val_fraction:
        assert tokenizer is not None  # Settings asks for one
        split = split_by_document(stream, config.val_fraction, tokenizer.eos_id, config.data_seed)
        if split is None:
            raise UsageError(
                f"--val-fraction: --data holds fewer than two documents (EOS token {tokenizer.eos_id} ends one) "
                "to hold some out; give --val-data instead"
            )
        stream, val = split.train, split.val
        held = f" in {split.held} of {split.documents} documents"
    train = _windows("--data", stream, config.seq)
    summary = (
        f"autoshard data: {len(stream)} tokens, {train.count} windows of {train.size} "
        f"({config.steps * config.batch / train.count:.2f} epochs in {config.steps} steps)"
        + (f"; validation: {len(val)} tokens{held}" if val is not None else "")
    )
    held_out = _windows("--val-data" if config.val_data else "--val-fraction", val, config.seq) if val else None
    return Corpus(config, train, held_out, workload.vocab_size, summary)


def fitted_vocab(requested: int | None, tokenizer: Tokenizer | None, workload: Any, tokenizer_flag: str) -> int | None:
    """The vocabulary the model is built with: `--vocab-size` (`requested`), or the tokenizer's for
    a model that can be resized (None: the model's own). UsageError when the model cannot hold the
    tokenizer's vocabulary or cannot be resized to the one asked for."""
    want = requested
    if want is None and tokenizer is not None and workload.resize_vocab is not None:
        want = tokenizer.vocab_size
    if want is not None:
        if workload.resize_vocab is None:
            raise UsageError(f"--vocab-size: {workload.name} has its config's vocabulary ({workload.vocab_size})")
        if tokenizer is not None and want < tokenizer.vocab_size:
            raise UsageError(
                f"--vocab-size {want} is smaller than the vocabulary of --tokenizer {tokenizer_flag} "
                f"({tokenizer.vocab_size})"
            )
    has = want if want is not None else workload.vocab_size
    if tokenizer is not None and has is not None and has < tokenizer.vocab_size:
        raise UsageError(
            f"--tokenizer {tokenizer_flag}: its vocabulary ({tokenizer.vocab_size} tokens) is larger than "
            f"{workload.name}'s ({has})"
        )
    return want


def _stream(
    config: DataConfig,
    flag: str,
    specs: tuple[str, ...],
    tokenizer: Tokenizer | None,
    vocab: int | None,
    model: int | None,
) -> Tokens:
    """The tokens of the files `specs` names, one stream: token files mapped, text tokenized (cached)."""
    files = find_files(specs, flag)
    text = [f.path for f in files if f.kind == "text"]
    if text and tokenizer is None:
        raise UsageError(f"{flag}: text files ({text[0]}{', ...' if len(text) > 1 else ''}) need --tokenizer")
    cache = Path(config.data_cache).expanduser() if config.data_cache else default_cache()
    arrays = []
    for f in files:
        if f.kind == "text":
            assert tokenizer is not None
            arrays.append(tokenized(f.path, tokenizer, cache))
        else:
            array = open_tokens(f.path, config.data_dtype, vocab if vocab is not None else 2**16)
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
