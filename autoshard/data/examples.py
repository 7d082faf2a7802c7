"""Instruction examples as training rows: packed several to a row, or padded one to a row.

Each example is `seq + 1` tokens at most (longer ones are cut, said in the run's first log line);
in a row it gives inputs `x[:-1]` and targets `x[1:]`, a target -100 (ignored by the loss) where
`--loss-on completion` does not train: on the prompt's tokens, the padding, and never across two
examples. `pad` puts one example in each row, right-padded: under causal attention no real token
sees the padding, so the model takes (tokens, targets) as for plain text. `pack` fills each row
with whole examples (next-fit, in an order drawn from the data seed) and hands the model a third
input, `positions`: each token's position in its example, restarting at 0, from which the model
masks attention to its own example (`autoshard_models.llama.document_mask`) and rotates from its
start, so a packed row trains exactly as its examples would alone. Rows are fixed when the data is
opened; epochs visit them in a per-epoch permutation (`corpus.shuffled`), so the rows of step N are
a pure function of (data seed, N), and a rank builds only its own rows (`pmodel.input_rows`).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from autoshard.data.corpus import SPLIT_SALT, _mix, _round, permute
from autoshard.data.instruct import Example
from autoshard.options import UsageError

LAYOUTS = ("pack", "pad")
LOSS_ON = ("all", "completion")
IGNORE = -100  # the target cross-entropy leaves out


@dataclass(frozen=True)
class Rows:
    """Examples laid into rows of `seq` inputs: row r holds examples members[bounds[r]:bounds[r+1]]."""

    ids: np.ndarray  # every example's tokens, one after another (each cut to seq + 1)
    trained: np.ndarray  # bool: the token is a target the loss counts
    starts: np.ndarray  # example e is ids[starts[e]:starts[e + 1]]
    members: np.ndarray
    bounds: np.ndarray
    seq: int
    pad: int  # the token padding holds (the EOS: any id in the vocabulary would do)

    @property
    def count(self) -> int:
        return len(self.bounds) - 1

    def read(self, rows: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, positions, targets) of rows `rows`, int64 [len(rows), seq] each; the padding at
        a row's end counts as one more example (positions from 0, no targets)."""
        n = len(rows)
        tokens = np.full((n, self.seq), self.pad, np.int64)
        targets = np.full((n, self.seq), IGNORE, np.int64)
        positions = np.zeros((n, self.seq), np.int64)
        for i, r in enumerate(np.asarray(rows, np.int64)):
            at = 0
            for e in self.members[self.bounds[r] : self.bounds[r + 1]]:
                lo, hi = int(self.starts[e]), int(self.starts[e + 1])
                k = hi - lo - 1
                tokens[i, at : at + k] = self.ids[lo : hi - 1]
                targets[i, at : at + k] = np.where(self.trained[lo + 1 : hi], self.ids[lo + 1 : hi], IGNORE)
                positions[i, at : at + k] = np.arange(k)
                at += k
            positions[i, at:] = np.arange(self.seq - at)
        return tokens, positions, targets


@dataclass(frozen=True)
class Laid:
    """What `lay_out` made of the examples, and what it dropped or cut."""

    rows: Rows
    examples: int  # kept
    cut: int  # longer than seq + 1 tokens: cut
    dropped: int  # no target left to train on: left out
    trained: int  # targets the loss counts, in all rows


def lay_out(examples: list[Example], seq: int, layout: str, loss_on: str, pad: int, seed: int) -> Laid:
    """The examples cut to seq + 1 tokens, those with no trained target left out, in rows."""
    keep, cut = [], 0
    for ex in examples:
        cut += len(ex.ids) > seq + 1
        ids = ex.ids[: seq + 1]
        trained = ex.answer[: seq + 1] if loss_on == "completion" else np.ones(len(ids), bool)
        if trained[1:].any():
            keep.append((ids, trained))
    lengths = np.array([len(ids) for ids, _ in keep], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = np.concatenate([k[0] for k in keep]) if keep else np.zeros(0, np.int64)
    trained = np.concatenate([k[1] for k in keep]) if keep else np.zeros(0, bool)
    if layout == "pad":
        members, bounds = np.arange(len(keep)), np.arange(len(keep) + 1)
    else:
        members, bounds = _pack(lengths - 1, seq, seed)
    rows = Rows(ids, trained, starts, members, bounds, seq, pad)
    count = int(sum(t[1:].sum() for _, t in keep))
    return Laid(rows, len(keep), cut, len(examples) - len(keep), count)


def _pack(inputs: np.ndarray, seq: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Next-fit packing of examples of `inputs` inputs each into rows of `seq`, in a random order
    drawn from `seed` (so that a row's examples do not follow the file's order)."""
    order = permute(np.arange(len(inputs)), len(inputs), _mix(_mix(seed) ^ PACK_SALT))
    bounds, used = [0], 0
    for i, e in enumerate(order.tolist()):
        if used + int(inputs[e]) > seq and used:
            bounds.append(i)
            used = 0
        used += int(inputs[e])
    bounds.append(len(order))
    return order, np.array(bounds if len(order) else [0], np.int64)


PACK_SALT = 0x9ACC_ED5E_ED00_0001  # keys the packing order apart from the epochs' shuffles


def held_out(count: int, fraction: float, seed: int) -> np.ndarray | None:
    """Which of `count` examples `--val-fraction` holds out: each with probability `fraction`,
    drawn from the data seed and its index; never none and never all. None for fewer than two."""
    if count < 2:
        return None
    drawn = _round(np.arange(count, dtype=np.uint64), np.uint64(_mix(_mix(seed) ^ SPLIT_SALT))) >> np.uint64(11)
    held = drawn < np.uint64(min(int(fraction * 2.0**53), 2**53))
    if not held.any():
        held[drawn.argmin()] = True
    if held.all():
        held[drawn.argmax()] = False
    return held


def positions_input(workload: Any) -> str | None:
    """How the workload's model takes each token's position in its example, so that packed
    examples stay apart: "positions" (second, our llama family), "position_ids" (a transformers
    causal LM whose attention mask comes from transformers' masking functions, which find the
    examples where the positions restart; its `packed` variant runs them), or None (it cannot:
    pad). A peft model over either passes them through. Sequence-to-sequence and loss-returning
    models never pack."""
    if workload.n_model_inputs != 1 or workload.loss_fn is None:
        return None
    model = workload.build("meta")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = list(inspect.signature(base.forward).parameters)
    if len(params) > 1 and params[1] == "positions":
        return "positions"
    if workload.packed is not None and "position_ids" in params and _masks_packed_positions(type(base)):
        return "position_ids"
    return None


def _masks_packed_positions(cls: type) -> bool:
    """Whether a transformers model class makes its attention mask with transformers' masking
    functions (which, given positions and no padding mask, keep packed sequences apart)."""
    try:
        from transformers import masking_utils
    except ImportError:
        return False
    module = sys.modules.get(cls.__module__)
    if module is None:
        return False
    makers = (getattr(masking_utils, name, None) for name in MASK_MAKERS)
    return any(maker is not None and maker in vars(module).values() for maker in makers)


MASK_MAKERS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask")


def packed_workload(workload: Any) -> Any:
    """The workload stepping on (tokens, positions, targets): the model takes the first two
    (positionally, or `input_ids=` and `position_ids=` for a transformers model)."""
    how = positions_input(workload)
    if how is None:
        raise UsageError(
            f"--instruction-layout pack: {workload.name} takes no document positions to keep packed examples "
            "apart (our llama3 models and transformers causal LMs do); use --instruction-layout pad"
        )

    def example_inputs(batch: int, seq: int, device: Any = "meta") -> Any:
        rows = (torch.empty(batch, seq, dtype=torch.int64, device=device),) * 3
        return rows if how == "positions" else dict(zip(("input_ids", "position_ids", "targets"), rows))

    model = workload if how == "positions" else workload.packed()
    return dataclasses.replace(model, example_inputs=example_inputs, n_model_inputs=2)
