"""Executor correctness: every plan, run on simulated ranks (LocalTensorMode), must produce each
rank's shard of the destination layout and send back the dual gradient."""

from __future__ import annotations

import itertools
import math
import random
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from autoshard import _torch_compat as tc
from autoshard.layout import Layout, P, R, S
from autoshard.pricing.planner import Planner
from autoshard.profiles.network import NetworkProfile
from autoshard.program.collectives import execute
from ranks import coords
from simulation import simulated_mesh
from torchrun import child_env, torchrun_command

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- reference


def make_locals(full, layout, mesh_shape, split, scale, gen) -> dict[int, torch.Tensor]:
    """Per-rank values representing `full`: shards along S dims; along mesh dims in `split`, a
    random additive split (values + noise with zero mean over those dims); times `scale[m]`."""
    world = math.prod(mesh_shape)
    factor = math.prod(scale.get(m, 1.0) for m in range(len(mesh_shape)))
    base = {r: layout.shard_of(full, mesh_shape, coords(r, mesh_shape)) * factor for r in range(world)}
    if not split:
        return base
    noise = {r: torch.randn(base[r].shape, generator=gen, dtype=full.dtype) for r in range(world)}
    for members in groups(mesh_shape, split):
        mean = sum(noise[r] for r in members) / len(members)
        for r in members:
            base[r] = base[r] + noise[r] - mean
    return base


def groups(mesh_shape, dims):
    """Ranks grouped by their coordinates on every mesh dim not in `dims`."""
    out: dict[tuple, list[int]] = {}
    for r in range(math.prod(mesh_shape)):
        c = coords(r, mesh_shape)
        out.setdefault(tuple(v for m, v in enumerate(c) if m not in dims), []).append(r)
    return out.values()


def check(values, full, layout, mesh_shape, reduce, scale, what):
    """Reduce `values` over the mesh dims in `reduce` ({mesh dim: "sum"|"avg"}) and compare every
    rank with its shard of `full` (times `scale`)."""
    for members in groups(mesh_shape, set(reduce)):
        total = sum(values[r] for r in members)
        n_avg = math.prod(mesh_shape[m] for m, op in reduce.items() if op == "avg")
        for r in members:
            got = total / n_avg if reduce else values[r]
            want = layout.shard_of(full, mesh_shape, coords(r, mesh_shape)) * scale
            assert got.shape == want.shape, (what, r, got.shape, want.shape)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what} rank {r}: {m}")


# ----------------------------------------------------------------------------- harness
def layouts(mesh_ndim: int, tensor_ndim: int, partial_ops=("sum",)) -> list[Layout]:
    """Every layout: each mesh dim R, S(d) or P(op), with every order of multi-sharded dims."""
    choices = [R] + [S(d) for d in range(tensor_ndim)] + [P(op) for op in partial_ops]
    out = []
    for placements in itertools.product(choices, repeat=mesh_ndim):
        base = Layout(placements)
        per_dim = [[(td, perm) for perm in itertools.permutations(mds)] for td, mds in base.order]
        out += [Layout(placements, combo) for combo in itertools.product(*per_dim)]
    return out


class Simulation:
    """Fake process group + DeviceMesh + LocalTensorMode: all ranks of a mesh in this process."""

    def __init__(self, mesh_shape, profile="cpu-gloo"):
        self.mesh_shape = tuple(mesh_shape)
        self.world = math.prod(mesh_shape)
        self.planner = Planner(mesh_shape, profile)
        self.names = tuple(f"m{i}" for i in range(len(mesh_shape)))
        self.seen: set[tuple[str, int, bool]] = set()  # (kind, #mesh dims, ascending) executed

    def __enter__(self):
        self._sim = simulated_mesh(self.mesh_shape, self.names)
        self.mesh, self._mode = self._sim.__enter__()
        return self

    def __exit__(self, *exc):
        self._sim.__exit__(*exc)

    def run(self, src: Layout, dst: Layout, shape, gen) -> None:
        """Redistribute random data src -> dst; check every rank's values, and the gradient of
        sum(out * cotangent) under the dual layouts: a cotangent split randomly over dst's R dims
        and replicated over its P dims must come back split over src's R dims (replica grads sum
        to the shard) and replicated over src's P dims."""
        ms = self.mesh_shape
        plan = self.planner.plan(src, dst, shape, torch.float64)
        src_p, dst_p, dst_r = _on(src, "P"), _on(dst, "P"), _on(dst, "R")
        with self._mode.disable():  # reference data and checks run as plain torch
            full = torch.randn(shape, generator=gen, dtype=torch.float64)
            cot = torch.randn(shape, generator=gen, dtype=torch.float64)
            xs = make_locals(full, src, ms, set(src_p), {m: 1 / ms[m] for m, p in src_p.items() if p.op == "sum"}, gen)
            dual = {m: 1 / ms[m] for m in dst_r} | {m: 1 / ms[m] for m, p in dst_p.items() if p.op == "avg"}
            gs = make_locals(cot, dst, ms, set(dst_r), dual, gen)
            x = tc.local_tensor(xs).requires_grad_()
            g = tc.local_tensor(gs)
        y = execute(plan, x, self.mesh)
        (y * g).sum().backward()
        self.seen |= {(st.kind, len(st.mesh_dims), list(st.mesh_dims) == sorted(st.mesh_dims)) for st in plan.steps}
        with self._mode.disable():
            check(tc.rank_values(y), full, dst, ms, {m: p.op for m, p in dst_p.items()}, 1.0, f"value {plan}")
            grad_scale = math.prod(1 / ms[m] for m, p in src_p.items() if p.op == "avg")
            check(tc.rank_values(x.grad), cot, src, ms, dict.fromkeys(_on(src, "R"), "sum"), grad_scale, f"grad {plan}")


def _on(lay: Layout, kind: str) -> dict:
    """{mesh dim: placement} of the mesh dims with placement kind `kind`."""
    return {m: p for m, p in enumerate(lay.placements) if p.kind == kind}


def sweep(sim: Simulation, pairs, shape, gen) -> list[str]:
    """Run every pair that is even for `shape`; uneven ones must be refused at planning time."""
    failures = []
    for src, dst in pairs:
        uneven = [lay for lay in (src, dst) if _uneven(lay, shape, sim.mesh_shape)]
        try:
            if not uneven:
                sim.run(src, dst, shape, gen)
                continue
            sim.planner.plan(src, dst, shape, 8)
            failures.append(f"{src} -> {dst} {shape}: uneven layout was not refused")
        except ValueError as e:
            if not uneven or not re.search(r"tensor dim \d+ of size \d+ is not divisible", str(e)):
                failures.append(f"{src} -> {dst} {shape}: ValueError: {e}")
        except Exception as e:  # collect all, report the first few
            failures.append(f"{src} -> {dst} {shape}: {type(e).__name__}: {str(e)[:400]}")
    return failures


def _uneven(lay: Layout, shape, mesh_shape) -> bool:
    return any(shape[td] % math.prod(mesh_shape[m] for m in mds) for td, mds in lay.order)


def _assert_none(failures):
    assert not failures, f"{len(failures)} failures, first: " + "\n".join(failures[:5])


def _recorder(ops: list[str]) -> type:
    """A dispatch mode appending the name of every op dispatched under it to `ops`."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    return Ops


# ----------------------------------------------------------------------------- tests
@pytest.mark.slow
def test_every_pair_on_2x2():
    """All 18x18 layout pairs of a rank-2 tensor on (2,2): divisible, half-divisible (S(0)S(0)
    impossible, so intermediates must avoid it) and indivisible shapes; one session."""
    gen = torch.Generator().manual_seed(0)
    every = layouts(2, 2)
    assert len(every) == 18
    pairs = list(itertools.product(every, every))
    with Simulation((2, 2)) as sim:
        failures = sweep(sim, pairs, (4, 8), gen) + sweep(sim, pairs, (6, 4), gen)
        failures += sweep(sim, random.Random(0).sample(pairs, 40), (3, 5), gen)
    _assert_none(failures)
    wanted = {(k, 1, True) for k in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "chunk", "to_partial")}
    wanted |= {(k, 2, asc) for k in ("all_gather", "reduce_scatter", "all_to_all") for asc in (True, False)}
    wanted |= {("all_reduce", 2, True), ("permute", 2, True)}
    assert wanted <= sim.seen, f"step kinds never exercised: {wanted - sim.seen}"


@pytest.mark.slow
def test_sample_on_2x2x2():
    gen, rnd = torch.Generator().manual_seed(1), random.Random(1)
    every = layouts(3, 3)
    pairs = [(rnd.choice(every), rnd.choice(every)) for _ in range(150)]
    # flattened groups over non-adjacent and reversed mesh dims, and a 3-cycle permute
    forced = [
        ("S(0)RS(0)[2,0]", "RRR"),
        ("S(0)S(0)S(0)[2,1,0]", "RRR"),
        ("PRP", "S(1)RS(1)[2,0]"),
        ("S(0)S(0)S(0)[1,2,0]", "S(0)S(0)S(0)"),
        ("S(0)RS(0)[2,0]", "S(2)RS(2)[2,0]"),
    ]
    pairs += [(Layout.parse(a), Layout.parse(b)) for a, b in forced]
    # launches dominate: one collective over a flattened group beats several over its dims
    with Simulation((2, 2, 2), NetworkProfile((1e-6,) * 3, (4e9,) * 3, launch_s=1e-3, mem_bw=20e9)) as sim:
        failures = sweep(sim, pairs, (8, 4, 8), gen) + sweep(sim, pairs[:50], (4, 6, 2), gen)
    _assert_none(failures)
    wanted = {
        ("all_gather", 2, False),
        ("all_gather", 3, False),
        ("reduce_scatter", 2, False),
        ("all_to_all", 2, False),
        ("permute", 3, True),
    }
    assert wanted <= sim.seen, f"step kinds never exercised: {wanted - sim.seen}"


@pytest.mark.parametrize(
    "mesh_shape, tensor_ndims, count", [((4,), (1, 4), None), ((1, 4), (2,), 60), ((2, 1, 2), (2,), 60)]
)
def test_other_meshes(mesh_shape, tensor_ndims, count):
    """1-D meshes (rank-1 and rank-4 tensors) and meshes with size-1 dims (relabel-only steps)."""
    gen, rnd = torch.Generator().manual_seed(2), random.Random(2)
    failures = []
    with Simulation(mesh_shape) as sim:
        for nd in tensor_ndims:
            every = layouts(len(mesh_shape), nd)
            pairs = list(itertools.product(every, every))
            pairs = pairs if count is None else rnd.sample(pairs, count)
            failures += sweep(sim, pairs, (4,) * nd, gen)
    _assert_none(failures)
    assert 1 not in mesh_shape or ("reorder", 0, True) in sim.seen


def test_partial_avg_and_mixed_partials():
    gen = torch.Generator().manual_seed(3)
    every = layouts(2, 2, ("sum", "avg"))
    avg = [lay for lay in every if any(p.op == "avg" for p in lay.placements)]
    pairs = [(a, b) for a in avg for b in every[::3]] + [(a, b) for a in every[::3] for b in avg]
    with Simulation((2, 2)) as sim:
        failures = sweep(sim, pairs, (4, 4), gen)
    _assert_none(failures)


def test_reference_matches_dtensor():
    """The hand-chunked reference used above equals torch DTensor's shards for the physical
    (_StridedShard) encoding of every layout, so "matches the reference" means "matches DTensor"."""
    from torch.distributed.tensor import distribute_tensor

    for mesh_shape, nd in (((2, 2), 2), ((2, 2, 2), 2)):
        with Simulation(mesh_shape) as sim:
            full = torch.arange(math.prod([8] * nd), dtype=torch.float64).reshape([8] * nd)
            for lay in layouts(len(mesh_shape), nd, partial_ops=()):
                dt = distribute_tensor(full, sim.mesh, lay.to_torch_placements(sim.mesh), src_data_rank=None)
                with sim._mode.disable():
                    shards = tc.rank_values(dt.to_local())
                    for r in range(sim.world):
                        want = lay.shard_of(full, mesh_shape, coords(r, mesh_shape))
                        assert torch.equal(shards[r], want), (lay, r)


def test_executor_rejects_bad_inputs():
    with Simulation((2, 2)) as sim:
        plan = sim.planner.plan("S(0)S(0)[0,1]", "RR", (4, 4), 4)
        assert plan.collective_counts == {"all_gather": 1}
        x = tc.local_tensor({r: torch.zeros(2, 4) for r in range(4)})
        with pytest.raises(ValueError, match="local shape"):
            execute(plan, x, sim.mesh)
        unnamed = torch.distributed.device_mesh.DeviceMesh("cpu", torch.arange(4).view(2, 2))
        with pytest.raises(ValueError, match="mesh_dim_names"):
            execute(plan, tc.local_tensor({r: torch.zeros(1, 4) for r in range(4)}), unnamed)
        with pytest.raises(ValueError, match="mesh shape"):
            execute(Planner((4,), "cpu-gloo").plan("S(0)", "R", (4, 4), 4), x, sim.mesh)


@pytest.mark.slow
@pytest.mark.ranks
def test_torchrun_gloo_2x2():
    """Real processes: torchrun, 4 gloo ranks on a (2,2) mesh, a handful of plans incl. an order
    change (permute) and one-shot steps, checked numerically inside the script."""
    env = child_env()
    cmd = torchrun_command(str(ROOT / "tests" / "dist_redistribute.py"))
    start = time.time()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (
        f"torchrun failed after {time.time() - start:.0f}s:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    )
    assert "ALL OK" in out.stdout


def test_results_are_dense_in_the_asked_dim_order():
    """`in_dim_order` keeps a tensor already dense in the order, else copies into it; `dim_order`
    reads the order back (row-major for contiguous tensors)."""
    from autoshard.program.collectives import dim_order, in_dim_order

    x = torch.arange(24.0).reshape(2, 1, 3, 4)
    strided = x.movedim(0, 2)  # [1, 3, 2, 4], not contiguous
    assert in_dim_order(x) is x and dim_order(x) == (0, 1, 2, 3)
    dense = in_dim_order(strided)
    assert dense.is_contiguous() and torch.equal(dense, strided)
    t = torch.randn(3, 5).t()  # the layout a traced transpose has
    assert dim_order(t) == (1, 0)
    back = in_dim_order(torch.randn(5, 3), dim_order(t))
    assert back.stride() == t.stride() and in_dim_order(t, (1, 0)) is t
    # whether a tensor is dense in an order is read off its strides, as permute + is_contiguous says
    from autoshard.program.collectives import _dense_in

    for y in (x, strided, strided[..., ::2], torch.empty(0, 3), torch.empty(3, 1, 2).transpose(0, 2)):
        for order in itertools.permutations(range(y.dim())):
            assert _dense_in(y, order) == y.permute(*order).is_contiguous(), (y.shape, y.stride(), order)


def test_a_collective_on_an_inner_dim_is_one_split_and_one_cat_or_a_view():
    """Each op is host work on a GPU: gathering, scattering or exchanging a tensor dim past 0 costs
    one split and one cat around the collective, and only a view where the shard's outer dims are
    all 1 (the chunks lie one after another: a batch of 1 per rank); values as the planner's
    reference layouts say (the sweeps above)."""
    from torch.distributed.device_mesh import init_device_mesh

    ops: list[str] = []
    Ops = _recorder(ops)

    cases = [
        ("S(0)S(1)", "S(0)R", (2, 4, 3), ["all_gather_into_tensor", "wait_tensor", "view"]),
        ("S(0)S(1)", "S(0)R", (4, 4, 3), ["all_gather_into_tensor", "wait_tensor", "split", "cat"]),
        ("S(0)P", "S(0)S(1)", (2, 4, 3), ["view", "reduce_scatter_tensor", "wait_tensor"]),
        ("S(0)P", "S(0)S(1)", (4, 4, 3), ["split", "cat", "reduce_scatter_tensor", "wait_tensor"]),
        ("S(0)S(1)", "S(0)S(2)", (2, 4, 4), ["split", "cat", "all_to_all_single", "wait_tensor", "view"]),
        ("S(0)S(1)", "S(0)S(2)", (4, 4, 4), ["split", "cat", "all_to_all_single", "wait_tensor", "split", "cat"]),
        ("S(0)R", "RR", (4, 3), ["all_gather_into_tensor", "wait_tensor"]),
    ]
    with tc.fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("m0", "m1"))
        for src, dst, shape, want in cases:
            plan = Planner((2, 2), "cpu-gloo").plan(Layout.parse(src), Layout.parse(dst), shape, torch.float32)
            assert len(plan.steps) == 1, plan
            x = torch.randn(plan.src.local_shape(shape, (2, 2)))
            ops.clear()
            with Ops():
                y = execute(plan, x, mesh)
            assert ops == want, (src, dst, shape, ops)
            assert tuple(y.shape) == plan.dst.local_shape(shape, (2, 2)) and y.is_contiguous()


def test_a_bucket_gives_each_member_what_execute_gives_with_one_copy_out_for_gathers():
    """A bucket's members come out as `execute` returns each alone (values, shapes, strides), for
    gathers (ordered shards and a dim order among them) and reduce-scatters (on one dim, on
    several, in another order); a gathered bucket copies its members in and out of the shared
    buffer with one kernel each, and dispatches no other op per member than its allocation."""
    from autoshard.program.collectives import finish_bucket, launch_bucket

    cases = {
        "all_gather": [
            ("S(0)R", "RR", (4, 6), None),
            ("S(1)R", "RR", (2, 4), (1, 0)),
            ("S(0)S(0)[1,0]", "RS(0)", (8, 3), None),
            ("S(1)S(0)", "RS(0)", (4, 4), (1, 0)),
        ],
        "reduce_scatter": [("PR", "S(0)R", (4, 6), None), ("PR", "S(1)R", (2, 4), None)],
        "reduce_scatter, all on dim 1": [("PR", "S(1)R", (2, 4), None), ("PR", "S(1)R", (2, 6), (1, 0))],
        "reduce_scatter, ordered": [("PP", "S(0)S(0)[1,0]", (8, 3), None), ("PP", "S(1)S(1)[1,0]", (2, 8), None)],
    }
    gen = torch.Generator().manual_seed(0)
    with Simulation((2, 2)) as sim:
        for kind, members in cases.items():
            plans = [
                sim.planner.plan(Layout.parse(a), Layout.parse(b), shape, torch.float64) for a, b, shape, _ in members
            ]
            assert {p.steps[0].kind for p in plans} == {kind.split(",")[0]}
            with sim._mode.disable():
                shapes = [p.src.local_shape(p.shape, (2, 2)) for p in plans]
                xs = [
                    tc.local_tensor({r: torch.randn(s, generator=gen, dtype=torch.float64) for r in range(4)})
                    for s in shapes
                ]
            orders = [order for *_, order in members]
            got = finish_bucket(launch_bucket(plans, xs, sim.mesh, orders))
            for plan, x, order, y in zip(plans, xs, orders, got):
                want = execute(plan, x, sim.mesh, order)
                assert y.shape == want.shape and y.stride() == want.stride(), (kind, plan)
                with sim._mode.disable():
                    for r, v in tc.rank_values(y).items():
                        assert torch.equal(v, tc.rank_values(want)[r]), (kind, plan, r)

    ops: list[str] = []
    Ops = _recorder(ops)

    with tc.fake_process_group(4):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("m0", "m1"))
        plans = [
            Planner((2, 2), "cpu-gloo").plan(Layout.parse("S(0)R"), Layout.parse("RR"), (4, n), torch.float32)
            for n in (2, 3, 5)
        ]
        xs = [torch.randn(2, n) for n in (2, 3, 5)]
        with Ops():
            pending = launch_bucket(plans, xs, mesh)
        assert ops == ["_chunk_cat", "all_gather_into_tensor"], ops  # one copy in, no reshape per member
        ops.clear()
        with Ops():
            got = finish_bucket(pending)
    # each member allocated in its final shape and copied into by one kernel: no op after it
    assert ops == ["wait_tensor", *["new_empty", "view"] * 3, "split_with_sizes_copy"], ops
    assert [tuple(g.shape) for g in got] == [(4, 2), (4, 3), (4, 5)]


def test_a_buckets_priced_copies_are_the_bytes_its_copy_kernels_move():
    """What the ILP charges a bucketed edge for the executor's copies (`bucket_copy_bytes`: read
    and written) is what the bucket's copy kernels write, twice: every member into the buffer, and
    a gather's members out of the gathered one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from autoshard.pricing.ring import bucket_copy_bytes
    from autoshard.program.collectives import finish_bucket, launch_bucket

    written: list[int] = []

    class Copies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ in (
                "cat",
                "_chunk_cat",
                "split_with_sizes_copy",
                "copy_",
                "clone",
                "contiguous",
            ):
                tensors = (kwargs or {}).get("out", out)
                for t in tensors if isinstance(tensors, (list, tuple)) else [tensors]:
                    written.append(t.numel() * t.element_size())
            return out

    cases = {"all_gather": ("S(0)R", "RR"), "reduce_scatter": ("PR", "S(0)R"), "all_reduce": ("PR", "RR")}
    with tc.fake_process_group(4):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("m0", "m1"))
        for kind, (src, dst) in cases.items():
            plans = [
                Planner((2, 2), "cpu-gloo").plan(Layout.parse(src), Layout.parse(dst), (4, n), torch.float32)
                for n in (2, 3, 5)
            ]
            assert {p.steps[0].kind for p in plans} == {kind}
            xs = [torch.randn(p.src.local_shape(p.shape, (2, 2))) for p in plans]
            written.clear()
            with Copies():
                finish_bucket(launch_bucket(plans, xs, mesh))
            priced = sum(bucket_copy_bytes(kind, 2, p.steps[0].in_bytes) for p in plans)
            assert 2 * sum(written) == priced > 0, (kind, written)
