"""A corpus as one token stream, cut into training windows, shuffled per epoch.

The stream is its files' tokens one after another (memory maps: nothing is read until a window
is). It is cut into disjoint windows of `seq + 1` tokens (the tail shorter than one is left out);
a window gives inputs `w[:-1]` and targets `w[1:]`, documents packed across window boundaries
with the EOS token between them. Epoch e visits every window once in the order of a keyed
pseudo-random permutation (a Feistel network, cycle-walked to the window count): the window at
any position is computed alone, in O(1) memory, so a rank reads only its own rows and the data of
step N is a pure function of (data seed, N): a resumed run reads what an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SCAN = 1 << 20  # tokens read at a time when looking for a document boundary


class Tokens:
    """Token arrays read as one stream, or the span [start, stop) of it (sharing the arrays)."""

    def __init__(self, arrays: Sequence[np.ndarray], start: int = 0, stop: int | None = None):
        self.arrays = [a for a in arrays if len(a)]
        self.ends = np.cumsum([len(a) for a in self.arrays], dtype=np.int64)
        total = int(self.ends[-1]) if len(self.ends) else 0
        self.start, self.stop = start, total if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def span(self, start: int, stop: int) -> Tokens:
        """Positions [start, stop) of this span, as a span of the same stream."""
        out = Tokens.__new__(Tokens)
        out.arrays, out.ends = self.arrays, self.ends
        out.start, out.stop = self.start + start, self.start + stop
        return out

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of this span as int64 (across file boundaries)."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"tokens [{start}, {stop}) of a span of {len(self)}")
        lo, hi = self.start + start, self.start + stop
        parts = []
        i = int(np.searchsorted(self.ends, lo, side="right"))
        while lo < hi:
            first = int(self.ends[i - 1]) if i else 0
            take = min(hi, int(self.ends[i])) - lo
            parts.append(np.asarray(self.arrays[i][lo - first : lo - first + take], dtype=np.int64))
            lo += take
            i += 1
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def find(self, token: int, start: int) -> int | None:
        """The first position >= start holding `token`, or None."""
        for at in range(start, len(self), SCAN):
            hits = np.flatnonzero(self.read(at, min(at + SCAN, len(self))) == token)
            if hits.size:
                return at + int(hits[0])
        return None

    def rfind(self, token: int, stop: int) -> int | None:
        """The last position < stop holding `token`, or None."""
        for at in range(stop, 0, -SCAN):
            hits = np.flatnonzero(self.read(max(at - SCAN, 0), at) == token)
            if hits.size:
                return max(at - SCAN, 0) + int(hits[-1])
        return None


def split_by_document(tokens: Tokens, fraction: float, eos: int) -> tuple[Tokens, Tokens] | None:
    """(training, held out): the held-out part is the last documents, about `fraction` of the
    tokens, cut just after an EOS token; None when the stream has no boundary to cut at."""
    target = max(round(len(tokens) * (1 - fraction)) - 1, 0)
    at = tokens.find(eos, target)
    if at is None or at + 1 >= len(tokens):  # no boundary after the target, or only the final EOS
        at = tokens.rfind(eos, min(target, len(tokens) - 1))
    if at is None:
        return None
    return tokens.span(0, at + 1), tokens.span(at + 1, len(tokens))


class Windows:
    """The disjoint `seq + 1`-token windows of a span."""

    def __init__(self, tokens: Tokens, seq: int):
        self.tokens, self.size = tokens, seq + 1
        self.count = len(tokens) // self.size

    def read(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Windows `ids`, as int64 [len(ids), seq + 1]."""
        out = np.empty((len(ids), self.size), np.int64)
        for row, w in enumerate(ids):
            out[row] = self.tokens.read(int(w) * self.size, (int(w) + 1) * self.size)
        return out

    def shuffled(self, positions: np.ndarray, seed: int) -> np.ndarray:
        """The window at each position of the shuffled stream of epochs: position p is in epoch
        p // count, where windows come in the order of that epoch's permutation."""
        positions = np.asarray(positions, np.int64)
        epochs, within = np.divmod(positions, self.count)
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            at = epochs == epoch
            out[at] = permute(within[at], self.count, _mix(_mix(seed) ^ int(epoch)))
        return out


def _mix(x: int) -> int:
    """splitmix64's finalizer on a Python int: distinct keys for nearby seeds and epochs."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def permute(index: np.ndarray, n: int, key: int, rounds: int = 6) -> np.ndarray:
    """Position `index` of a pseudo-random permutation of range(n) fixed by `key`: a balanced
    Feistel network over the smallest even number of bits that holds n, applied again to values
    that land outside range(n) (cycle walking keeps it a permutation of range(n))."""
    index = np.asarray(index, np.int64)
    if n <= 1:
        return np.zeros_like(index)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = [np.uint64(_mix(key ^ (r + 1) * 0x2545F4914F6CDD1D & 0xFFFFFFFFFFFFFFFF)) for r in range(rounds)]
    out = index.astype(np.uint64)
    todo = np.ones(out.shape, bool)
    while todo.any():
        left, right = out[todo] >> np.uint64(half), out[todo] & mask
        for k in keys:
            left, right = right, left ^ (_round(right, k) & mask)
        out[todo] = (left << np.uint64(half)) | right
        todo = out >= np.uint64(n)
    return out.astype(np.int64)


def _round(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """The Feistel round function: a multiply-xorshift hash of x under key (uint64, wrapping)."""
    with np.errstate(over="ignore"):
        x = (x ^ key) * np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(29)
        x *= np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(32))
