"""A deterministic synthetic token stream that a model can learn: a fixed sparse Markov chain.

Each token has `branching` possible successors with skewed probabilities, so the stream's entropy
(about 1 nat for the defaults) is far below uniform (ln vocab): a model that learns the bigram table
shows a real drop in loss, with no download. Batches are a pure function of (seed, step), so any
rank can produce any step's batch and a resumed run sees exactly the data it would have seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor  # [batch, seq] int64 token ids
    targets: torch.Tensor  # [batch, seq] int64, inputs shifted by one


class MarkovTokens:
    """Sparse random bigram source over `vocab_size` tokens, fixed by `seed`."""

    def __init__(self, vocab_size: int, seed: int = 0, branching: int = 4):
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        if not 1 <= branching <= vocab_size:
            raise ValueError(f"branching must be in [1, vocab_size], got {branching}")
        self.vocab_size = vocab_size
        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        # successors[t] = the tokens that may follow t; probs favour the first ones. Distinct without
        # a permutation per token (O(vocab^2): vocab 65,536 exhausts memory): a random base plus the
        # running sums of `branching` random steps in [1, vocab // branching], whose total stays below
        # vocab, modulo vocab. O(vocab x branching).
        base = torch.randint(vocab_size, (vocab_size, 1), generator=gen)
        steps = torch.randint(1, vocab_size // branching + 1, (vocab_size, branching), generator=gen)
        self.successors = (base + steps.cumsum(1)) % vocab_size
        weights = torch.tensor([2.0**-i for i in range(branching)])
        self.probs = weights / weights.sum()

    @property
    def entropy(self) -> float:
        """Entropy rate in nats: the loss a perfect model converges to."""
        return -sum(p * math.log(p) for p in self.probs.tolist())

    def batch(self, step: int, batch_size: int, seq_len: int) -> Batch:
        """The global batch for `step`: same (seed, step) -> same tokens, on any process."""
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(self.vocab_size, (batch_size,), generator=gen)
        picks = torch.multinomial(self.probs, batch_size * seq_len, replacement=True, generator=gen)
        picks = picks.view(batch_size, seq_len)
        for t in range(seq_len):
            tokens[:, t + 1] = self.successors[tokens[:, t], picks[:, t]]
        return Batch(inputs=tokens[:, :-1].contiguous(), targets=tokens[:, 1:].contiguous())
