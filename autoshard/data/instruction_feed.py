"""Instruction data opened and fed: `open_instructions` reads and checks every example before
planning (one `UsageError` for any bad input, alike on every rank); `InstructionFeed` gives each
rank the rows it holds of each step, built from the examples alone (`examples.Rows.read`).

Row r of step N is position (N - 1) * batch + r of the shuffled stream of epochs over the rows
(`corpus.shuffled`): a pure function of (data seed, N), so a resumed run reads what an
uninterrupted one would. With `pack` the step's inputs are (tokens, positions, targets), with
`pad` (tokens, targets).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import numpy as np
import torch

from autoshard.data.corpus import shuffled
from autoshard.data.examples import Laid, Rows, held_out, lay_out, packed_workload
from autoshard.data.files import DataFile, find_files
from autoshard.data.instruct import KINDS, Example, chat_template, file_kind, read_examples
from autoshard.data.text import Tokenizer
from autoshard.data.validation import Position, validation_loss
from autoshard.options import UsageError

log = logging.getLogger("autoshard")


def instruction_files(files: list[DataFile], flag: str) -> bool:
    """Whether `files` are instruction data (`.jsonl` of messages or prompt/completion records);
    UsageError for a mix of instruction files and others."""
    instruction = [f.kind == "text" and file_kind(f.path) in KINDS for f in files]
    if any(instruction) and not all(instruction):
        odd = files[instruction.index(False)].path
        first = files[instruction.index(True)].path
        raise UsageError(
            f"{flag}: {odd} is not instruction data (messages or prompt/completion records) like {first}: "
            "train on one kind of data at a time"
        )
    return bool(instruction) and all(instruction)


@dataclass(frozen=True)
class Instructions:
    """Instruction data opened and checked: the training rows, the validation ones, and what to log."""

    config: Any  # DataConfig
    layout: str
    train: Rows
    val: Rows | None
    summary: str

    def feed(self, pmodel: Any, micro_batches: int) -> InstructionFeed:
        return InstructionFeed(self, pmodel, micro_batches)

    def model_workload(self, workload: Any) -> Any:
        """The workload as the rows feed it: packed rows add the positions input."""
        return packed_workload(workload) if self.layout == "pack" else workload

    def inputs(self, rows: Rows, ids: np.ndarray) -> tuple[torch.Tensor, ...]:
        """The model's inputs of rows `ids` of `rows`: (tokens, positions, targets) packed, else
        (tokens, targets)."""
        tokens, positions, targets = (torch.from_numpy(a) for a in rows.read(ids))
        return (tokens, positions, targets) if self.layout == "pack" else (tokens, targets)


class InstructionFeed(Position):
    """The `Feed` of instruction rows, each rank building its own rows; validation every
    `eval_every` steps on the first `eval_batches` batches of the held-out rows (in order, wrapping)."""

    def __init__(self, data: Instructions, pmodel: Any, micro_batches: int = 1):
        self.data, self.pmodel, self.micro_batches = data, pmodel, micro_batches
        self.summary: str | None = data.summary  # logged at the first step (logging is set up by then)

    def inputs(self, step: int, micro: int) -> tuple[torch.Tensor, ...]:
        """This rank's inputs of micro-batch `micro` of step `step`."""
        if self.summary is not None:
            log.info("%s", self.summary)
            self.summary = None
        config, train = self.data.config, self.data.train
        first = (step - 1) * config.batch + micro * (config.batch // self.micro_batches)
        self.served = step
        return self._local(train, lambda rows: shuffled(first + rows, train.count, config.data_seed))

    def evaluate(self, step: int) -> dict[str, float]:
        """Every `eval_every` steps: the mean validation loss over `eval_batches` batches (without
        gradients), and its perplexity."""
        val, config = self.data.val, self.data.config
        if val is None or not config.eval_every or step % config.eval_every:
            return {}
        return validation_loss(self.pmodel, config, self.micro_batches, val.count, partial(self._local, val), step)

    def _local(self, rows: Rows, ids: Callable[[np.ndarray], np.ndarray]) -> tuple[torch.Tensor, ...]:
        """This rank's inputs: the rows it holds of each input, built once, cut by the layout."""
        pmodel = self.pmodel
        n = 3 if self.data.layout == "pack" else 2
        wanted = [np.asarray(pmodel.input_rows(i).cpu(), np.int64) for i in range(n)]
        union = np.unique(np.concatenate(wanted))
        full = self.data.inputs(rows, ids(union))
        return pmodel.local_inputs(*(x[torch.from_numpy(np.searchsorted(union, w))] for x, w in zip(full, wanted)))


def open_instructions(config: Any, tokenizer: Tokenizer | None) -> Instructions:
    """The instruction files of `--data` (and `--val-data`, or `--val-fraction` of the examples)
    read, tokenized and laid into rows; every bad input one UsageError."""
    if tokenizer is None:
        raise UsageError(f"--data {config.data[0]}: instruction data (messages, prompt/completion) needs --tokenizer")
    layout, loss_on = config.instruction_layout or "pack", config.loss_on or "completion"
    examples = _examples(config.data, "--data", tokenizer)
    val_examples = None
    if config.val_data:
        val_examples = _examples(config.val_data, "--val-data", tokenizer)
    elif config.val_fraction:
        held = held_out(len(examples), config.val_fraction, config.data_seed)
        if held is None:
            raise UsageError("--val-fraction: --data holds fewer than two examples to hold some out")
        val_examples = [e for e, h in zip(examples, held) if h]
        examples = [e for e, h in zip(examples, held) if not h]
    train = _laid("--data", examples, config, layout, loss_on, tokenizer.eos_id)
    val = _laid("validation", val_examples, config, layout, loss_on, tokenizer.eos_id) if val_examples else None
    summary = (
        f"autoshard data: {train.examples} instruction examples {'packed into' if layout == 'pack' else 'in'} "
        f"{train.rows.count} rows of {config.seq} tokens, {train.trained} targets trained (--loss-on {loss_on}; "
        f"{config.steps * config.batch / train.rows.count:.2f} epochs in {config.steps} steps)"
        + (f"; {train.cut} cut to --seq + 1 = {config.seq + 1} tokens" if train.cut else "")
        + (f"; {train.dropped} with no target to train on left out" if train.dropped else "")
        + (f"; validation: {val.examples} examples in {val.rows.count} rows" if val is not None else "")
    )
    return Instructions(config, layout, train.rows, val.rows if val is not None else None, summary)


def _examples(specs: tuple[str, ...], flag: str, tokenizer: Tokenizer) -> list[Example]:
    files = find_files(specs, flag)
    if not instruction_files(files, flag):
        raise UsageError(f"{flag}: {files[0].path} is not instruction data like --data (one kind of data at a time)")
    template = chat_template(tokenizer.file)
    return [e for f in files for e in read_examples(f.path, tokenizer, template)]


def _laid(flag: str, examples: list[Example], config: Any, layout: str, loss_on: str, pad: int) -> Laid:
    laid = lay_out(examples, config.seq, layout, loss_on, pad, config.data_seed)
    if laid.rows.count == 0 or laid.trained == 0:
        raise UsageError(
            f"{flag}: no example has a target to train on ({len(examples)} examples; --loss-on {loss_on} trains "
            f"on {'the answers' if loss_on == 'completion' else 'every token'} within --seq + 1 = {config.seq + 1} "
            "tokens)"
        )
    return laid
