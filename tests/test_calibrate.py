"""Calibration: the fit recovers the planner's parameters from timings (the network's links, each
kind's own link, the cost between compute, one op's dispatch, the optimizer's rate, the rates of a
training step's ops). Profile files and the `autoshard calibrate` command:
tests/test_calibrate_cli.py."""

from __future__ import annotations

import numpy as np
import pytest

from autoshard.pricing.fit import (
    BetweenCompute,
    CollectiveSample,
    between_compute_s,
    fit_network,
    fit_rate,
    fit_step_parts,
    fit_step_rates,
    nnls,
)
from autoshard.pricing.ring import linear_cost, step_cost
from autoshard.profiles.calibrate import CalibrationSettings, planner_groups
from autoshard.profiles.device import DeviceProfile
from autoshard.profiles.network import NetworkProfile
from autoshard.train.metrics import step_time_line

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
TRUE = NetworkProfile((20e-6, 50e-6), (2e9, 0.5e9), 80e-6, 10e9, "true", groups=(((0, 1), 70e-6, 0.4e9),))


def synthetic(profile: NetworkProfile, noise: float = 0.0, seed: int = 0) -> list[CollectiveSample]:
    """Timings the planner's own formulas give on a (2,2) mesh, times (1 + noise * N(0,1))."""
    rng = np.random.default_rng(seed)
    out = []
    for dims in planner_groups((2, 2)):
        n = 2 ** len(dims)
        for kind in KINDS:
            for size in (4096 * 4**i for i in range(8)):
                t = step_cost(profile, kind, dims, n, size) * (1 + noise * rng.standard_normal())
                out.append(CollectiveSample(kind, dims, n, size, t))
    return out


def test_fit_recovers_latency_and_bandwidth_of_every_group():
    exact = fit_network(synthetic(TRUE), (2, 2), mem_bw=10e9)
    p = exact.profile
    assert p.launch_s == pytest.approx(TRUE.launch_s, rel=1e-6)
    assert p.alpha == pytest.approx(TRUE.alpha, rel=1e-6) and p.beta == pytest.approx(TRUE.beta, rel=1e-6)
    assert p.link((1, 0)) == pytest.approx((70e-6, 0.4e9), rel=1e-6)  # the flattened group, either order
    assert exact.rel_rms < 1e-6 and p.mem_bw == 10e9
    # 3% noise per timing: parameters within 10%, the model within a few % of every timing
    noisy = fit_network(synthetic(TRUE, noise=0.03), (2, 2), mem_bw=10e9)
    q = noisy.profile
    for got, want in [
        (q.launch_s, TRUE.launch_s),
        *zip(q.alpha + q.beta, TRUE.alpha + TRUE.beta),
        *zip(q.link((0, 1)), (70e-6, 0.4e9)),
    ]:
        assert got == pytest.approx(want, rel=0.10)
    assert 0.01 < noisy.rel_rms < 0.05
    assert {g.mesh_dims for g in noisy.groups} == {(0,), (1,), (0, 1)}


def test_fit_recovers_each_kinds_own_link():
    """Timings where all-gather moves a byte 4x slower and all-reduce pays twice the latency of
    the group's other kinds (as gloo's do): one link per group cannot fit them, a link per kind
    does, and the planner then prices each kind on its own link."""
    slow = (("all_gather", (0,), 20e-6, 0.5e9), ("all_reduce", (0,), 40e-6, 2e9), ("all_gather", (0, 1), 70e-6, 0.1e9))
    truth = NetworkProfile(TRUE.alpha, TRUE.beta, TRUE.launch_s, TRUE.mem_bw, groups=TRUE.groups, kinds=slow)
    fit = fit_network(synthetic(truth), (2, 2), mem_bw=10e9)
    by_group = {g.mesh_dims: g for g in fit.groups}
    assert fit.rel_rms < 1e-6 and by_group[(0,)].group_rel_rms > 0.2  # one link per group misses by 20%+
    p = fit.profile
    # the planner's price of every timed kind on every group: per byte and fixed (launch_s and the
    # ring latency are one constant per kind and group, so only their sum is determined)
    for dims in planner_groups((2, 2)):
        for kind in KINDS:
            n = 2 ** len(dims)
            assert linear_cost(p, kind, dims, n) == pytest.approx(linear_cost(truth, kind, dims, n), rel=1e-3)
    assert p.link((0,), "all_gather")[1] == pytest.approx(0.5e9, rel=1e-3)
    assert p.link((1, 0), "all_gather")[1] == pytest.approx(0.1e9, rel=1e-3)  # either order
    assert linear_cost(p, "permute", (0,), 2) == linear_cost(
        NetworkProfile(p.alpha, p.beta, p.launch_s), "permute", (0,), 2
    )  # an untimed kind: the group's link
    # 3% noise: every slow kind's bandwidth within 15%
    noisy = fit_network(synthetic(truth, noise=0.03), (2, 2), mem_bw=10e9).profile
    for kind, dims, alpha, beta in slow:
        assert noisy.link(dims, kind)[1] == pytest.approx(beta, rel=0.15)


def test_fit_refuses_missing_dims_and_flat_timings():
    samples = [s for s in synthetic(TRUE) if s.mesh_dims != (1,)]
    with pytest.raises(ValueError, match=r"no timings for mesh dim\(s\) \[1\]"):
        fit_network(samples, (2, 2), 10e9)
    flat = [CollectiveSample(s.kind, s.mesh_dims, s.group_size, s.in_bytes, 1e-3) for s in synthetic(TRUE)]
    with pytest.raises(ValueError, match="do not grow with the bytes"):
        fit_network(flat, (2, 2), 10e9)
    # a size-1 mesh dim takes no part in any collective: it needs no timings
    one = [CollectiveSample(s.kind, (1,), 2, s.in_bytes, s.seconds) for s in synthetic(TRUE) if s.mesh_dims == (1,)]
    assert fit_network(one, (1, 2), 10e9).profile.beta[1] == pytest.approx(0.5e9, rel=1e-6)


def test_calibrate_times_a_flat_group_again_before_the_fit_refuses_it(monkeypatch):
    """A burst of load can flatten one group's timings (here: faster the more bytes it moves);
    that group alone is timed again."""
    from autoshard.cli import calibrate as cli
    from autoshard.profiles import calibrate as timing

    rows = [
        {
            "kind": s.kind,
            "mesh_dims": list(s.mesh_dims),
            "group_size": s.group_size,
            "in_bytes": s.in_bytes,
            "seconds": 1e-3 * (4096 / s.in_bytes) ** 0.1 if s.mesh_dims == (0, 1) else s.seconds,
        }
        for s in synthetic(TRUE)
    ]
    good = [dict(r, seconds=s.seconds) for r, s in zip(rows, synthetic(TRUE))]
    calls: list = []

    def timed(mesh, settings, say, only=None):
        calls.append(only)
        if only is None:
            return rows
        return [r for r in good if tuple(r["mesh_dims"]) in only] if len(calls) == 3 else rows[-32:]

    said: list[str] = []
    monkeypatch.setattr(timing, "time_collectives", timed)
    samples = cli._collective_samples(None, (2, 2), None, said.append)
    assert calls == [None, ((0, 1),), ((0, 1),)] and len(said) == 2 and "timing again" in said[0]
    assert fit_network([cli._sample(r) for r in samples], (2, 2), 10e9).profile.link((0, 1)) == pytest.approx(
        (70e-6, 0.4e9), rel=1e-6
    )
    calls.clear()  # still flat after RETIMES: the samples go to the fit, which refuses them
    monkeypatch.setattr(timing, "time_collectives", lambda mesh, settings, say, only=None: calls.append(only) or rows)
    with pytest.raises(ValueError, match=r"group\(s\) \[\(0, 1\)\] do not grow"):
        fit_network([cli._sample(r) for r in cli._collective_samples(None, (2, 2), None, said.append)], (2, 2), 1.0)
    assert len(calls) == 1 + cli.RETIMES


def test_calibrate_times_the_device_again_while_a_rate_does_not_grow(monkeypatch):
    """A burst of load can flatten the quick run's small matmuls (here bf16's: slower the fewer
    flops); the device is timed again, on every rank alike (the medians over ranks decide), until
    every rate grows, or RETIMES times, after which the fit refuses them."""
    from autoshard.cli import calibrate as cli
    from autoshard.pricing.fit import fit_rate
    from autoshard.profiles import calibrate as timing

    def rows(flat: bool) -> dict:
        mm = [
            {"n": n, "flops": 2.0 * n**3, "seconds": (1e-3 / n if flat else 1e-5 + 2.0 * n**3 / 5e10)}
            for n in (32, 64, 128)
        ]
        mem = [{"numel": k, "bytes": 12.0 * k, "seconds": 1e-6 + 12.0 * k / 2e10} for k in (4096, 16384, 65536)]
        return {"matmul": mm, "memory": mem}

    answers: list[bool] = []
    monkeypatch.setattr(
        timing, "time_device", lambda device, settings, say: {"float32": rows(False), "bfloat16": rows(answers.pop(0))}
    )
    gathered: list = []
    gather = lambda mine: gathered.append(mine) or [mine, mine]  # noqa: E731  (two ranks alike)
    said: list[str] = []
    answers[:] = [True, False]
    timings = cli._device_timings(None, None, said.append, gather)
    assert len(gathered) == 2 and len(said) == 1 and "bfloat16 matmul" in said[0] and "timing again" in said[0]
    assert fit_rate(
        [r["flops"] for r in timings["bfloat16"]["matmul"]], [r["seconds"] for r in timings["bfloat16"]["matmul"]]
    ).rate == pytest.approx(5e10, rel=1e-6)
    gathered.clear()  # still flat after RETIMES: the timings go to the fit, which refuses them
    answers[:] = [True] * (1 + cli.RETIMES)
    timings = cli._device_timings(None, None, said.append, gather)
    assert len(gathered) == 1 + cli.RETIMES and cli._flat_rates(timings) == ["bfloat16 matmul"]


def test_fit_rate_and_nnls():
    work = [1e6, 1e7, 1e8, 1e9]
    fit = fit_rate(work, [2e-5 + w / 3e10 for w in work])
    assert fit.rate == pytest.approx(3e10, rel=1e-6) and fit.overhead_s == pytest.approx(2e-5, rel=1e-4)
    with pytest.raises(ValueError, match="do not grow"):
        fit_rate(work, [1e-3] * 4)
    # the unconstrained optimum has a negative coordinate; NNLS pins it at 0 and refits the rest
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    b = np.array([2.0, -1.0, 1.0])
    assert np.linalg.lstsq(a, b, rcond=None)[0][1] < 0
    assert nnls(a, b) == pytest.approx([1.5, 0.0])


def test_collectives_between_compute_add_what_they_cost_a_step_to_the_launch():
    """The smallest all-reduce timed after matmuls: the time it adds to them, less the back-to-back
    fit's price of it, is what each collective costs a step beyond that price; the median over the
    groups, never below 0."""
    fit = fit_network(synthetic(TRUE), (2, 2), mem_bw=10e9)

    def timed(dims, extra):
        price = step_cost(TRUE, "all_reduce", dims, 2 ** len(dims), 4096)
        return BetweenCompute("all_reduce", dims, 2 ** len(dims), 4096, 3e-3, 3e-3 + price + extra)

    groups = planner_groups((2, 2))
    assert between_compute_s(fit, [timed(g, e) for g, e in zip(groups, (1.5e-3, 2e-3, 6e-3))]) == pytest.approx(2e-3)
    assert between_compute_s(fit, [timed(g, -1e-4) for g in groups]) == 0.0  # faster than back to back: no credit
    assert between_compute_s(fit, []) == 0.0


def test_fit_recovers_the_per_op_overhead_and_the_optimizer_rate():
    """Synthetic timings of a step's other two costs: chains of n tiny ops at 7 us each (+2 us of
    loop), fused AdamW over N elements at 6e8 elements/s (+300 us per step). Exact timings give
    the parameters back; 3% noise keeps them within 10%."""
    ops, elements = [1, 8, 64], [2.0**16, 2.0**18, 2.0**20, 2.0**22]
    rng = np.random.default_rng(0)
    for noise, rel in ((0.0, 1e-6), (0.03, 0.10)):
        jitter = lambda: 1 + noise * rng.standard_normal()  # noqa: E731
        fit = fit_step_parts(
            ops, [(2e-6 + n * 7e-6) * jitter() for n in ops], elements, [(3e-4 + e / 6e8) * jitter() for e in elements]
        )
        assert fit.op_overhead_s == pytest.approx(7e-6, rel=rel) and fit.optimizer_rate == pytest.approx(6e8, rel=rel)
        assert fit.optimizer_overhead_s == pytest.approx(3e-4, rel=3 * rel) and fit.dispatch_rel_rms < 3 * noise + 1e-6
    with pytest.raises(ValueError, match="do not grow"):
        fit_step_parts(ops, [1e-5] * 3, elements, [1e-3 + e / 6e8 for e in elements])
    # what the planner does with them: an op costs its roofline plus the overhead, the step the
    # optimizer over this rank's elements
    device = DeviceProfile(1e10, 1e10, op_overhead_s=fit.op_overhead_s, optimizer_rate=fit.optimizer_rate)
    assert device.optimizer_s(6e8) == pytest.approx(1.0, rel=0.1)
    assert DeviceProfile(1e10, 2.8e10).optimizer_s(1e9) == pytest.approx(1.0)  # no rate: mem_bw over 28 B each


def test_noisy_step_part_timings_keep_the_presets_figures(capsys):
    """Ranks sharing two cores can time a 16x bigger optimizer step no slower: calibrate keeps
    the device kind's preset for dispatch and the optimizer (a note, not an error) and says so in
    the profile's details; timings that do grow are fitted."""
    import torch

    from autoshard.cli.calibrate_device import fit_device_profile as _device_profile

    flat = {
        "float32": {
            "matmul": [{"flops": f, "seconds": 1e-4 + f / 3e10} for f in (1e6, 1e7, 1e8)],
            "memory": [{"bytes": b, "seconds": 1e-5 + b / 1e10} for b in (1e5, 1e6, 1e7)],
        }
    }
    noisy = {
        "dispatch": [{"ops": n, "seconds": 1e-5 + n * 8e-6} for n in (1.0, 8.0, 64.0)],
        "optimizer": [{"elements": e, "seconds": 2e-3} for e in (2.0**14, 2.0**17, 2.0**20)],
    }
    profile, _, step = _device_profile(flat, noisy, torch.device("cpu"), "test")
    cpu = DeviceProfile.preset("cpu")
    assert not step["fitted"] and profile.op_overhead_s == cpu.op_overhead_s
    assert profile.optimizer_s(1e6) == pytest.approx(cpu.optimizer_s(1e6))
    assert "the cpu preset's figures are used" in capsys.readouterr().err
    good = dict(noisy, optimizer=[{"elements": e, "seconds": 1e-4 + e / 5e8} for e in (2.0**14, 2.0**17, 2.0**20)])
    profile, _, step = _device_profile(flat, good, torch.device("cpu"), "test")
    assert step["fitted"] and profile.op_overhead_s == pytest.approx(8e-6, rel=1e-3)
    assert profile.optimizer_rate == pytest.approx(5e8, rel=1e-3)


def test_the_ops_of_a_measured_training_step_give_the_profiles_rates(capsys):
    """A step whose matmuls (2 GFLOP) took 80 ms inside it and whose 1,000 memory-bound ops (200 MB)
    took 45 ms, 5 us of each their dispatch: 25 GFLOP/s and 5 GB/s, which calibrate writes as the
    profile's fp32 and memory rates (those timed alone stay in the details). Memory-bound ops no
    slower than their dispatch are noise: the rates timed alone stand, with a note."""
    import torch

    from autoshard.cli.calibrate_device import fit_device_profile as _device_profile

    assert fit_step_rates(2e9, 0.08, 2e8, 1000, 0.045, 5e-6) == pytest.approx((2.5e10, 5e9))
    with pytest.raises(ValueError, match="no more than their dispatch"):
        fit_step_rates(2e9, 0.08, 2e8, 1000, 0.004, 5e-6)
    rates = {
        "float32": {
            "matmul": [{"flops": f, "seconds": f / 4e10} for f in (1e6, 1e7, 1e8)],
            "memory": [{"bytes": b, "seconds": b / 3e10} for b in (1e5, 1e6, 1e7)],
        }
    }
    step = {
        "dispatch": [{"ops": n, "seconds": n * 5e-6} for n in (1.0, 8.0, 64.0)],
        "optimizer": [{"elements": e, "seconds": e / 5e8} for e in (2.0**14, 2.0**17, 2.0**20)],
        "reference": [
            {
                "seconds": 0.13,
                "ops": 1500,
                "flops": 2e9,
                "flop_ops_s": 0.08,
                "memory_bytes": 2e8,
                "memory_ops": 1000,
                "memory_ops_s": 0.045,
            }
        ],
    }
    profile, _, details = _device_profile(rates, step, torch.device("cpu"), "test")
    assert profile.mem_bw == pytest.approx(5e9, rel=1e-3) and profile.peak_flops_fp32 == pytest.approx(2.5e10)
    assert details["in_step"] == {"fp32_flops": profile.peak_flops_fp32, "mem_bw": profile.mem_bw}
    assert details["alone"] == pytest.approx({"fp32_flops": 4e10, "mem_bw": 3e10}, rel=1e-3)
    step["reference"][0]["memory_ops_s"] = 0.004
    profile, _, details = _device_profile(rates, step, torch.device("cpu"), "test")
    assert profile.mem_bw == pytest.approx(3e10, rel=1e-3) and profile.peak_flops_fp32 == pytest.approx(4e10, rel=1e-3)
    assert details["in_step"] is None and "ops are priced at the rates timed alone" in capsys.readouterr().err


def test_the_reference_step_runs_real_tensors_outside_the_trace(monkeypatch):
    """The timed step computes on real tensors with no mode active: inputs made while the trace's
    fake mode was still open would time fake-tensor bookkeeping instead of the ops."""
    import torch
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    import autoshard.profiles.calibrate as timing
    from autoshard.cli.calibrate_device import time_reference_step

    seen = []

    def timed_once(fn, device, settings):
        seen.append((_get_current_dispatch_mode_stack(), fn()))
        return 0.1

    monkeypatch.setattr(timing, "_timed", timed_once)
    monkeypatch.setattr("autoshard.cli.calibrate_device.REFERENCE", ("llama3-tiny", 1, 2, 16))
    (row,) = time_reference_step(torch.device("cpu"), CalibrationSettings())
    ((modes, outputs),) = seen  # called once, on real tensors, with no mode active
    tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
    assert modes == [] and len(tensors) > 10 and {type(t) for t in tensors} == {torch.Tensor}, {
        type(t) for t in tensors
    }
    assert torch.isfinite(tensors[0])
    assert row["seconds"] == 0.1 and row["ops"] > 100 and row["flops"] > 0 and row["memory_bytes"] > 0
    assert row["flop_ops_s"] > 0 and row["memory_ops_s"] > 0 and 0 < row["memory_ops"] < row["ops"]


def test_graph_work_counts_what_the_roofline_prices():
    """A matmul's flops, an elementwise op's input + output bytes, a view's dispatch alone."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from autoshard.pricing.compute import graph_work

    def f(a, b):
        return torch.relu(a @ b).view(-1)

    work = graph_work(make_fx(f, tracing_mode="fake")(torch.ones(4, 8), torch.ones(8, 16)).graph)
    assert (work.ops, work.flops, work.memory_ops, work.memory_bytes) == (3, 2 * 4 * 8 * 16, 1, 2 * 4 * 16 * 4)


def test_group_override_prices_flattened_steps():
    plain = NetworkProfile(TRUE.alpha, TRUE.beta, TRUE.launch_s, TRUE.mem_bw)
    assert plain.link((0, 1)) == (50e-6, 0.5e9)  # slowest link without a measurement
    per_byte, fixed = linear_cost(TRUE, "all_gather", (1, 0), 4)
    assert per_byte == pytest.approx(3 / 0.4e9) and fixed == pytest.approx(80e-6 + 3 * 70e-6)
    with pytest.raises(ValueError, match="2\\+ distinct mesh dims"):
        NetworkProfile((1e-6,), (1e9,), groups=(((0,), 1e-6, 1e9),))
    with pytest.raises(ValueError, match="all_gather override: needs distinct mesh dims of 1, got \\(1,\\)"):
        NetworkProfile((1e-6,), (1e9,), kinds=(("all_gather", (1,), 1e-6, 1e9),))
    with pytest.raises(ValueError, match="all_reduce on \\(0,\\): latency must be >= 0 and bandwidth > 0"):
        NetworkProfile((1e-6,), (1e9,), kinds=(("all_reduce", (0,), 1e-6, 0.0),))


def test_step_time_line_uses_steps_after_warmup():
    rows = [
        {"step": 1, "step_s": 9.0},
        {"step": 2, "step_s": 5.0},
        {"step": 3, "step_s": 0.2},
        {"step": 4, "step_s": 0.4},
        {"step": 5, "step_s": 0.3},
    ]
    line = step_time_line(0.15, rows)
    assert line == "step time: modeled 150.0 ms, measured 300.0 ms (median of steps 3-5); modeled / measured 0.50"
    assert "(median of step 1);" in step_time_line(0.15, rows[:1])


def test_calibration_settings_validate():
    with pytest.raises(ValueError, match="unknown collective kind or dtype"):
        CalibrationSettings(kinds=("broadcast",))
    assert planner_groups((2, 1, 4)) == [(0,), (2,), (0, 2)]
