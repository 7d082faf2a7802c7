"""A corpus as one token stream, cut into training windows, shuffled per epoch.

The stream is its files' tokens one after another (memory maps: nothing is read until a window
is). It is cut into disjoint windows of `seq + 1` tokens (the tail shorter than one is left out);
a window gives inputs `w[:-1]` and targets `w[1:]`, documents packed across window boundaries
with the EOS token between them. Epoch e visits every window once in the order of a keyed
pseudo-random permutation (a Feistel network, cycle-walked to the window count): the window at
any position is computed alone, in O(1) memory, so a rank reads only its own rows and the data of
step N is a pure function of (data seed, N): a resumed run reads what an uninterrupted one would.
`split_by_document` holds out a random set of whole documents, likewise a pure function of the
data seed: the training and held-out parts are each a list of ranges of the same stream.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

SCAN = 1 << 20  # tokens compared at a time when looking for document boundaries
SPLIT_SALT = 0x7A1D_5E7E_C7ED_D0C5  # keys the held-out draw apart from the epochs' shuffles


class Tokens:
    """Token arrays read as one stream, or chosen ranges of it read as one (sharing the arrays)."""

    def __init__(self, arrays: Sequence[np.ndarray]):
        self.arrays = [a for a in arrays if len(a)]
        self.ends = np.cumsum([len(a) for a in self.arrays], dtype=np.int64)
        total = int(self.ends[-1]) if len(self.ends) else 0
        self._set_ranges(np.array([0], np.int64), np.array([total], np.int64))

    def _set_ranges(self, starts: np.ndarray, stops: np.ndarray) -> None:
        """Read the stream's ranges [starts[i], stops[i]) one after another (empty ones dropped)."""
        keep = stops > starts
        self.starts = np.asarray(starts, np.int64)[keep]
        self.offsets = np.concatenate([[0], np.cumsum(stops[keep] - starts[keep])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def select(self, starts: Sequence[int] | np.ndarray, stops: Sequence[int] | np.ndarray) -> Tokens:
        """Positions [starts[i], stops[i]) of this one, one after another, as ranges of the same stream."""
        starts, stops = np.asarray(starts, np.int64), np.asarray(stops, np.int64)
        if len(starts) and not (starts.min() >= 0 and (starts <= stops).all() and stops.max() <= len(self)):
            raise IndexError(f"ranges outside tokens [0, {len(self)})")
        if len(self.starts) == 1:  # one range: a shift (the common case, a whole stream)
            lo, hi = starts + self.starts[0], stops + self.starts[0]
        else:
            pairs = [r for a, b in zip(starts.tolist(), stops.tolist()) for r in self._stream_ranges(a, b)]
            lo, hi = np.array(pairs, np.int64).reshape(-1, 2).T
        out = Tokens.__new__(Tokens)
        out.arrays, out.ends = self.arrays, self.ends
        out._set_ranges(lo, hi)
        return out

    def span(self, start: int, stop: int) -> Tokens:
        """Positions [start, stop) of this one."""
        return self.select([start], [stop])

    def _stream_ranges(self, start: int, stop: int) -> Iterator[tuple[int, int]]:
        """The ranges of the stream that positions [start, stop) of this one are."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"tokens [{start}, {stop}) of {len(self)}")
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while start < stop:
            take = min(stop, int(self.offsets[i + 1])) - start
            lo = int(self.starts[i]) + start - int(self.offsets[i])
            yield lo, lo + take
            start += take
            i += 1

    def _parts(self, lo: int, hi: int, most: int = SCAN) -> Iterator[np.ndarray]:
        """The stream's tokens [lo, hi) in the files' own dtypes, at most `most` at a time."""
        i = int(np.searchsorted(self.ends, lo, side="right"))
        while lo < hi:
            first = int(self.ends[i - 1]) if i else 0
            take = min(hi, int(self.ends[i]), lo + most) - lo
            yield self.arrays[i][lo - first : lo - first + take]
            lo += take
            i += lo == int(self.ends[i])

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of this one as int64 (across ranges and file boundaries)."""
        parts = [
            np.asarray(part, dtype=np.int64)
            for lo, hi in self._stream_ranges(start, stop)
            for part in self._parts(lo, hi, most=hi - lo)
        ]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def chunks(self) -> Iterator[tuple[int, np.ndarray]]:
        """(position, tokens) of the whole of this one, at most SCAN tokens at a time, unconverted."""
        at = 0
        for lo, hi in self._stream_ranges(0, len(self)):
            for part in self._parts(lo, hi):
                yield at, part
                at += len(part)


class Split(NamedTuple):
    """What `split_by_document` made: the two parts, the corpus's document count, how many are held out."""

    train: Tokens
    val: Tokens
    documents: int
    held: int


def split_by_document(tokens: Tokens, fraction: float, eos: int, seed: int) -> Split | None:
    """Hold out each document (its tokens through its EOS; a tail without one is the last document)
    with probability `fraction`, drawn from `seed` and the document's index: a pure function of the
    data seed, so a resumed run holds out the same documents. Never none and never all (the lowest
    or highest draw decides). One pass over the stream, SCAN tokens at a time; memory grows with the
    held-out documents only. None when there are fewer than two documents."""
    key = np.uint64(_mix(_mix(seed) ^ SPLIT_SALT))
    bar = np.uint64(min(int(fraction * 2.0**53), 2**53))
    lows, highs = [], []
    low: tuple[int, int, int] = (2**53, 0, 0)  # (draw, start, stop) of the lowest draw
    high: tuple[int, int, int] = (-1, 0, 0)
    count = begin = 0
    for stops in _document_stops(tokens, eos):
        starts = np.concatenate([[begin], stops[:-1]])
        drawn = _round(np.arange(count, count + stops.size, dtype=np.uint64), key) >> np.uint64(11)
        held = drawn < bar
        lows.append(starts[held])
        highs.append(stops[held])
        lo, hi = int(drawn.argmin()), int(drawn.argmax())
        low = min(low, (int(drawn[lo]), int(starts[lo]), int(stops[lo])))
        high = max(high, (int(drawn[hi]), int(starts[hi]), int(stops[hi])))
        count, begin = count + stops.size, int(stops[-1])
    if count < 2:
        return None
    starts, stops = np.concatenate(lows).astype(np.int64), np.concatenate(highs).astype(np.int64)
    if not starts.size:  # none drawn: the lowest draw is held out
        starts, stops = np.array([low[1]], np.int64), np.array([low[2]], np.int64)
    elif starts.size == count:  # all drawn: the highest draw is not
        keep = starts != high[1]
        starts, stops = starts[keep], stops[keep]
    joined = np.concatenate([[True], starts[1:] != stops[:-1]])  # where a run of held documents begins
    run_lo, run_hi = starts[joined], stops[np.concatenate([joined[1:], [True]])]
    train = tokens.select(np.concatenate([[0], run_hi]), np.concatenate([run_lo, [len(tokens)]]))
    return Split(train, tokens.select(run_lo, run_hi), count, int(starts.size))


def _document_stops(tokens: Tokens, eos: int) -> Iterator[np.ndarray]:
    """The position just after each document, a chunk at a time: after each EOS, and the end of a
    tail without one."""
    last = 0
    for at, chunk in tokens.chunks():
        stops = at + 1 + np.flatnonzero(chunk == eos)
        if stops.size:
            last = int(stops[-1])
            yield stops
    if last < len(tokens):
        yield np.array([len(tokens)], np.int64)


class Windows:
    """The disjoint `seq + 1`-token windows of a token stream (or of chosen ranges of one)."""

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
        """The window at each position of the shuffled stream of epochs (`shuffled`)."""
        return shuffled(positions, self.count, seed)


def shuffled(positions: np.ndarray, count: int, seed: int) -> np.ndarray:
    """The item (of `count`) at each position of the shuffled stream of epochs: position p is in
    epoch p // count, where items come in the order of that epoch's permutation."""
    positions = np.asarray(positions, np.int64)
    epochs, within = np.divmod(positions, count)
    out = np.empty_like(positions)
    for epoch in np.unique(epochs):
        at = epochs == epoch
        out[at] = permute(within[at], count, _mix(_mix(seed) ^ int(epoch)))
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
