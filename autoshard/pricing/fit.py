"""Least-squares fits of the planner's cost parameters to measured timings (`autoshard calibrate`).

A collective of `kind` over a group of mesh dims G (n ranks) reading `in_bytes` costs, in
`pricing.ring`'s model,

    launch_s + steps(kind, n) * alpha_G + wire(kind, n) * in_bytes / beta_G

which is linear in (launch_s, alpha_G, 1/beta_G): one weighted non-negative least-squares problem
over every sample of every group fits them all at once, with the coefficients taken from
`ring.collective_terms`, so the fit and the planner cannot disagree about what alpha and beta mean.
Then each kind gets its own (alpha, beta) on each group, fitted to its samples less that launch_s
(`NetworkProfile.kinds`): libraries implement the kinds differently (gloo's all-gather moves a byte
several times slower than its all-reduce), which one link per group cannot express; the group's
link stays the price of kinds that were not timed (permute).
Rows are weighted by 1/seconds: the fit minimises relative error, so a 4 KiB call counts as much as
a 32 MiB one (otherwise the large sizes would decide everything and the latencies would be noise).
A step issues its collectives between ops, and each costs it more than back to back (its peers
are met again after computing; ranks sharing cores may be descheduled then): `between_compute_s`
reads that difference off the smallest all-reduce timed after matmuls, and `calibrate` adds it to
the profile's `launch_s`, which every collective (each bucket once) pays.
Device rates (flop/s, bytes/s) are the same fit with one work column: t = overhead + work / rate;
so are the two costs of a step besides its ops' work (`fit_step_parts`): a chain of n tiny ops
takes n times the per-op dispatch overhead (the slope), and the optimizer step over N parameter
elements N / its rate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.pricing.ring import COLLECTIVE_KINDS, collective_terms
from autoshard.profiles.network import NetworkProfile


class FlatTimings(ValueError):
    """Some groups' collective timings do not grow with the bytes moved (noise on a busy machine,
    or sizes too small): no bandwidth to fit. `groups` names them, so a caller can time again."""

    def __init__(self, groups: Sequence[tuple[int, ...]]):
        self.groups = tuple(groups)
        super().__init__(
            f"timings of group(s) {list(self.groups)} do not grow with the bytes moved: no bandwidth to fit "
            "(use larger sizes)"
        )


@dataclass(frozen=True)
class CollectiveSample:
    """One timed collective: `seconds` per call over the group of `mesh_dims` (ascending)."""

    kind: str
    mesh_dims: tuple[int, ...]
    group_size: int
    in_bytes: float
    seconds: float


@dataclass(frozen=True)
class GroupFit:
    """The fitted link of one group and how well the model reproduces its samples."""

    mesh_dims: tuple[int, ...]
    group_size: int
    alpha: float
    beta: float
    rel_rms: float  # root mean square of (model - measured) / measured over its samples, per-kind links
    max_rel_err: float
    samples: int
    rel_rms_by_kind: dict[str, float]
    group_rel_rms: float  # the same with the group's one link for every kind


@dataclass(frozen=True)
class NetworkFit:
    profile: NetworkProfile
    groups: tuple[GroupFit, ...]
    rel_rms: float

    def model_s(self, sample: CollectiveSample) -> float:
        wire, steps = collective_terms(sample.kind, sample.group_size)
        alpha, beta = self.profile.link(sample.mesh_dims, sample.kind)
        return self.profile.launch_s + steps * alpha + wire * sample.in_bytes / beta


@dataclass(frozen=True)
class RateFit:
    """t = overhead_s + work / rate, fitted to (work, seconds) samples."""

    rate: float
    overhead_s: float
    rel_rms: float
    samples: int


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set method; numpy only)."""
    m, n = a.shape
    passive = np.zeros(n, dtype=bool)
    x = np.zeros(n)
    tol = 10 * np.finfo(float).eps * np.abs(a).sum(axis=0).max() * max(m, n)
    w = a.T @ (b - a @ x)
    for _ in range(max_iter or 3 * n + 10):
        if passive.all() or w[~passive].max() <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if z[passive].min() > 0:
                x = z
                break
            blocked = passive & (z <= 0)
            step = np.min(x[blocked] / (x[blocked] - z[blocked]))
            x = x + step * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        w = a.T @ (b - a @ x)
    return x


def _weighted_nnls(rows: np.ndarray, seconds: np.ndarray, target: np.ndarray | None = None) -> np.ndarray:
    """NNLS of rows @ x = target (default: seconds) minimising error relative to `seconds`, with
    columns scaled to unit norm for conditioning."""
    a = rows / seconds[:, None]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    b = np.ones(len(seconds)) if target is None else target / seconds
    return nnls(a / scale, b) / scale


def _rel_errors(predicted: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    return (predicted - seconds) / seconds


def fit_network(
    samples: Sequence[CollectiveSample], mesh_shape: Sequence[int], mem_bw: float, name: str = "calibrated"
) -> NetworkFit:
    """Fit launch_s and each group's (alpha, beta) to `samples`; single mesh dims become the
    profile's per-dim values, groups over 2+ dims its `groups` overrides, and each kind's own
    (alpha, beta) per group its `kinds` overrides. Every mesh dim of size > 1 needs samples of its
    own; size-1 dims (never in a collective) get the slowest fitted link.
    ValueError when samples are missing, FlatTimings when they cannot determine a bandwidth."""
    mesh_shape = tuple(mesh_shape)
    active = [m for m, s in enumerate(mesh_shape) if s > 1]
    if not active:
        raise ValueError(f"mesh {mesh_shape} has no dim of size > 1: nothing to calibrate")
    bad = [s for s in samples if s.kind not in COLLECTIVE_KINDS or s.seconds <= 0 or s.in_bytes <= 0]
    if bad:
        raise ValueError(f"unusable sample(s), e.g. {bad[0]}: known kind, positive bytes and seconds needed")
    groups = sorted({s.mesh_dims for s in samples}, key=lambda g: (len(g), g))
    missing = [m for m in active if (m,) not in groups]
    if missing:
        raise ValueError(f"no timings for mesh dim(s) {missing} of mesh {mesh_shape}")
    for g in groups:
        if any(not 0 <= m < len(mesh_shape) or mesh_shape[m] == 1 for m in g) or list(g) != sorted(set(g)):
            raise ValueError(f"samples name group {g}, which is not a set of mesh dims of size > 1 of {mesh_shape}")
    column = {g: i for i, g in enumerate(groups)}
    k = len(groups)
    rows = np.zeros((len(samples), 1 + 2 * k))
    seconds = np.array([s.seconds for s in samples])
    for r, s in enumerate(samples):
        wire, steps = collective_terms(s.kind, s.group_size)
        rows[r, 0] = 1.0
        rows[r, 1 + column[s.mesh_dims]] = steps
        rows[r, 1 + k + column[s.mesh_dims]] = wire * s.in_bytes
    x = _weighted_nnls(rows, seconds)
    launch_s, alphas, inv_betas = float(x[0]), x[1 : 1 + k], x[1 + k :]
    flat = [g for g, inv in zip(groups, inv_betas) if not inv > 0]
    if flat:
        raise FlatTimings(flat)
    group_errors = _rel_errors(rows @ x, seconds)
    kinds, predicted = _fit_kinds(samples, rows, column, x, seconds)
    errors = _rel_errors(predicted, seconds)
    fits = []
    for g in groups:
        idx = [r for r, s in enumerate(samples) if s.mesh_dims == g]
        e = errors[idx]
        by_kind = {
            kind: _rms(errors[[r for r in idx if samples[r].kind == kind]])
            for kind in sorted({samples[r].kind for r in idx})
        }
        fits.append(
            GroupFit(
                g,
                samples[idx[0]].group_size,
                float(alphas[column[g]]),
                float(1 / inv_betas[column[g]]),
                _rms(e),
                float(np.abs(e).max()),
                len(idx),
                by_kind,
                _rms(group_errors[idx]),
            )
        )
    single = {f.mesh_dims[0]: f for f in fits if len(f.mesh_dims) == 1}
    slowest = max(fits, key=lambda f: (1 / f.beta, f.alpha))
    alpha = tuple(single[m].alpha if m in single else slowest.alpha for m in range(len(mesh_shape)))
    beta = tuple(single[m].beta if m in single else slowest.beta for m in range(len(mesh_shape)))
    profile = NetworkProfile(
        alpha,
        beta,
        launch_s,
        mem_bw,
        name,
        kinds=kinds,
        groups=tuple((f.mesh_dims, f.alpha, f.beta) for f in fits if len(f.mesh_dims) > 1),
    )
    return NetworkFit(profile, tuple(fits), _rms(errors))


@dataclass(frozen=True)
class BetweenCompute:
    """A collective timed between compute (`profiles.calibrate.time_collectives_between_compute`):
    seconds per call of the work alone and of the work then the collective."""

    kind: str
    mesh_dims: tuple[int, ...]
    group_size: int
    in_bytes: float
    work_s: float
    both_s: float


def between_compute_s(fit: NetworkFit, timings: Sequence[BetweenCompute]) -> float:
    """What a collective costs a step beyond the fitted back-to-back model of it: per group, the
    time the collective added to the work less `fit`'s price of it; the median over groups, at
    least 0 (0 without timings)."""
    extra = [
        t.both_s
        - t.work_s
        - fit.model_s(CollectiveSample(t.kind, t.mesh_dims, t.group_size, t.in_bytes, t.both_s - t.work_s))
        for t in timings
    ]
    return max(0.0, float(np.median(extra))) if extra else 0.0


def _fit_kinds(
    samples: Sequence[CollectiveSample],
    rows: np.ndarray,
    column: dict[tuple[int, ...], int],
    x: np.ndarray,
    seconds: np.ndarray,
) -> tuple[tuple, np.ndarray]:
    """(alpha, beta) of each kind on each group, fitted to its samples less the common launch_s
    `x[0]`; a kind whose timings do not grow with the bytes keeps its group's link (from `x`).
    Returns the overrides and every sample's modeled seconds under them."""
    k = len(column)
    launch_s = float(x[0])
    predicted = rows @ x
    kinds = []
    for kind, g in sorted({(s.kind, s.mesh_dims) for s in samples}):
        idx = [r for r, s in enumerate(samples) if s.kind == kind and s.mesh_dims == g]
        if len(idx) < 2:  # one timing cannot split latency from bandwidth
            continue
        part = rows[idx][:, [1 + column[g], 1 + k + column[g]]]  # latency steps, wire bytes
        alpha, inv_beta = _weighted_nnls(part, seconds[idx], seconds[idx] - launch_s)
        if inv_beta > 0:
            kinds.append((kind, g, float(alpha), float(1 / inv_beta)))
            predicted[idx] = launch_s + part @ np.array([alpha, inv_beta])
    return tuple(kinds), predicted


def fit_rate(work: Sequence[float], seconds: Sequence[float]) -> RateFit:
    """Fit t = overhead + work / rate (relative error, both terms >= 0). ValueError when the
    times do not grow with the work."""
    w, t = np.asarray(work, dtype=float), np.asarray(seconds, dtype=float)
    if len(w) < 2 or (w <= 0).any() or (t <= 0).any():
        raise ValueError("a rate fit needs 2+ samples with positive work and seconds")
    rows = np.stack([np.ones_like(w), w], axis=1)
    overhead, inv_rate = _weighted_nnls(rows, t)
    if not inv_rate > 0:
        raise ValueError("timings do not grow with the work: no rate to fit (use larger sizes)")
    return RateFit(
        float(1 / inv_rate), float(overhead), _rms(_rel_errors(rows @ np.array([overhead, inv_rate]), t)), len(w)
    )


@dataclass(frozen=True)
class StepPartsFit:
    """Per-op dispatch overhead (s) and the optimizer step's rate (parameter elements / s), with
    the optimizer's fixed cost per step and how well each fit reproduces its timings."""

    op_overhead_s: float
    optimizer_rate: float
    optimizer_overhead_s: float
    dispatch_rel_rms: float
    optimizer_rel_rms: float


def fit_step_parts(
    ops: Sequence[float], ops_seconds: Sequence[float], elements: Sequence[float], optimizer_seconds: Sequence[float]
) -> StepPartsFit:
    """From chains of `ops` tiny ops timed at `ops_seconds` each and optimizer steps over
    `elements` parameter elements timed at `optimizer_seconds`. ValueError as `fit_rate`."""
    dispatch = fit_rate(ops, ops_seconds)
    optimizer = fit_rate(elements, optimizer_seconds)
    return StepPartsFit(1 / dispatch.rate, optimizer.rate, optimizer.overhead_s, dispatch.rel_rms, optimizer.rel_rms)


def fit_step_rates(
    flops: float, flop_s: float, memory_bytes: float, memory_ops: int, memory_s: float, op_overhead_s: float
) -> tuple[float, float]:
    """(flop rate, memory rate) of the ops of a whole training step, from the seconds its flop
    ops (matmuls, attention) and its `memory_ops` memory-bound ops took inside it: the rates at
    which the roofline, with `op_overhead_s` per memory-bound op, reproduces both (a matmul's
    dispatch is well under 1% of its time and is not subtracted). Inside a step memory-bound
    ops read operands that left the cache, broadcast, reduce and write fresh allocations, several
    times slower than a streaming add; attention runs below the matmul rate. ValueError when the
    timings leave nothing to fit (noise)."""
    rest = memory_s - memory_ops * op_overhead_s
    if not (flops > 0 and flop_s > 0 and memory_bytes > 0 and rest > 0):
        raise ValueError(
            f"{memory_ops} memory-bound ops took {memory_s * 1e3:.2f} ms, no more than their "
            f"dispatch ({memory_ops * op_overhead_s * 1e3:.2f} ms), or nothing was timed"
        )
    return flops / flop_s, memory_bytes / rest


def _rms(e: np.ndarray) -> float:
    return float(math.sqrt(float(np.mean(np.square(e))))) if len(e) else 0.0
