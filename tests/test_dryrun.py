"""Dry runs (autoshard.runtime.dryrun): one rank's lowered step on fake tensors with its memory accounted.
The 8B/70B cases are the regression tests for the backward that could not run (a traced `view`
after a gather on an inner dim); the llama3-debug case checks the accounting against torch's
MemTracker on a real step of the parallel module."""

from __future__ import annotations

import math

import pytest
import torch

from autoshard import _torch_compat as tc
from autoshard.driver.api import AutoShard
from autoshard.program.lower import LOCAL_SHAPE, lower
from autoshard.runtime.dryrun import DryRunError, MemoryEstimate, dry_run, estimate, ranks_to_check
from autoshard.runtime.module import parallelize
from autoshard_models import MarkovTokens, build_model, cross_entropy_loss, get_config
from autoshard_models.train_single import TrainSettings, make_optimizer

GIB = 2**30


def make_plan(
    name: str,
    mesh_shape,
    batch: int,
    seq: int,
    sharded: bool = False,
    pins: dict[str, str] | None = None,
    **config,
):
    """The plan for H100s without a memory limit; `sharded`: every parameter fully sharded (small
    models on H100s are cheapest replicated, with no collective to check); `pins`: parameters
    pinned to these layouts; `config`: changes to the model's config."""
    cfg = get_config(name).with_(**config)
    cfg = cfg.with_(max_seq_len=seq) if seq > cfg.max_seq_len else cfg
    model = build_model(cfg, device="meta")
    inputs = lambda: (torch.empty(batch, seq, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    with tc.fake_process_group(math.prod(mesh_shape)):
        with AutoShard(
            model, inputs, mesh_shape, loss_fn=cross_entropy_loss, network="h100-node", device="h100"
        ) as auto:
            auto.memory_limit(math.inf)  # the unconstrained plans: fp32 70B needs more than an H100 has
            if sharded:
                auto.memory_budget(param_bytes(model) / math.prod(mesh_shape))
            if pins is not None:
                auto.pin(pins)
            return auto.optimize(), model


def param_bytes(model) -> int:
    return sum(4 * p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def tiny():
    return make_plan("llama3-tiny", (2, 2), 4, 16, sharded=True)[0]


@pytest.fixture(scope="module")
def debug():
    return make_plan("llama3-debug", (2, 2), 8, 64, sharded=True)


def check_breakdown(m: MemoryEstimate, model, world: int) -> None:
    assert m.peak_bytes == sum(
        getattr(m, k)
        for k in ("params", "buffers", "inputs", "optimizer", "activations", "gathered_params", "grads", "transient")
    )
    assert m.peak_bytes == max(m.forward_peak_bytes, m.backward_peak_bytes) or m.phase == "optimizer"
    # every parameter is somewhere; at least its share of the whole model, AdamW: 2 fp32 states each
    assert param_bytes(model) / world <= m.params <= param_bytes(model)
    assert m.optimizer == 2 * m.params
    assert m.saved_bytes > 0 and m.activations + m.gathered_params <= m.saved_bytes
    assert min(m.transient, m.grads, m.inputs) >= 0
    if m.phase == "optimizer":  # the backward has consumed what the forward saved
        assert m.activations == m.gathered_params == 0, m.summary()


@pytest.mark.slow
def test_tiny_dry_run_reports_rank_0(tiny):
    result = dry_run(tiny)
    assert ranks_to_check(tiny) == [0] and list(result.ranks) == [0]
    m = result.ranks[0]
    check_breakdown(m, build_model(get_config("llama3-tiny"), device="meta"), 4)
    assert result.peak_bytes == m.peak_bytes and result.seconds > 0
    assert "rank 0: peak" in result.summary()


def test_at_the_optimizer_step_the_saved_activations_are_gone():
    """A step whose peak is the optimizer's (a large vocabulary: AdamW's temporary the size of the
    embedding tops the backward) counts no activation there: the backward's interpreter, which
    held every value the forward saved through its arguments, has let them go."""
    plan, model = make_plan("llama3-tiny", (2, 2), 4, 4, vocab_size=4096)
    m = dry_run(plan).ranks[0]
    assert m.phase == "optimizer" and m.saved_bytes > 0, m.summary()
    check_breakdown(m, model, 4)
    assert m.peak_bytes == m.params + m.grads + m.optimizer + m.buffers + m.inputs + m.transient


def test_a_dry_run_writes_no_python_code_for_the_program(tiny):
    """The dry run walks the program's graphs node by node: their Python code (~1.5 s for a 70B
    program, dry-run three times in a memory fit) is written only when the program is called."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    with tc.fake_process_group(4):
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        program = lower(tiny, mesh)
        estimate(program, 0, tiny.module_paths)
    for half in (program.forward, program.backward):
        assert isinstance(half, _LazyGraphModule) and half._needs_recompile()
        assert "def forward" in tc.write_code(half).code and not half._needs_recompile()


def test_a_corrupted_program_is_one_error_naming_the_node(tiny):
    """A placeholder whose local-shape meta is wrong: the dry run names the node that cannot run."""
    with tc.fake_process_group(4):
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        program = lower(tiny, mesh)
        placeholder = next(n for n in program.forward.graph.nodes if n.op == "placeholder")
        shape = placeholder.meta[LOCAL_SHAPE]
        placeholder.meta[LOCAL_SHAPE] = (shape[0] + 1, *shape[1:])
        with pytest.raises(DryRunError) as err:
            estimate(program, 0, tiny.module_paths)
    message = str(err.value)
    assert message.startswith("dry run of rank 0, forward: node ") and "\n" not in message
    assert err.value.__cause__ is None and err.value.__suppress_context__


@pytest.mark.slow
def test_estimate_matches_torch_memtracker_on_a_real_step(debug):
    """llama3-debug on (2,2): rank 0's real step (ParallelModule + AdamW, real tensors, fake
    process group: values do not matter for memory) measured by torch's MemTracker over two steps
    (the second one has its optimizer states) peaks within 10% of the dry run's estimate."""
    plan, model = debug
    m = dry_run(plan).ranks[0]
    check_breakdown(m, model, 4)
    with tc.fake_process_group(4):
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        pmodel = parallelize(plan, mesh, build_model(get_config("llama3-debug"), device="meta"))
        pmodel.init_weights(0)
        optim = make_optimizer(pmodel.parameters(), TrainSettings())
        batch = MarkovTokens(get_config("llama3-debug").vocab_size, seed=0).batch(0, 8, 64)
        inputs = pmodel.shard_inputs(batch.inputs, batch.targets)
        tracker = tc.mem_tracker()
        tracker.track_external(pmodel, optim, *inputs)
        with tracker:
            for _ in range(2):
                pmodel(*inputs).backward()
                optim.step()
                optim.zero_grad()
                tracker.reset_mod_stats()
        real = tc.tracker_total(tracker.get_tracker_snapshot("peak"))
    assert abs(m.peak_bytes - real) <= 0.10 * real, (m.summary(), real)


DEEPER = [f"layers.{i}." for i in range(2, 6)]  # the blocks a 6-block llama3-debug has beyond 2


def test_repeated_blocks_replay_their_ops_and_account_the_same(debug, monkeypatch):
    """An op met before with inputs of the same geometry (the same op of the next block) is not
    dispatched again: its outputs are made directly. The estimate equals the one with every op
    dispatched, and a 6-block model dispatches as many ops as a 2-block one whose parameters have
    the same layouts (pinned: the budget alone leaves ties the ILP may break differently per depth,
    and the executor's ops differ between a dim-0 and a dim-1 shard)."""
    from autoshard.runtime import dryrun

    plan, _ = debug
    dispatched = []
    live_dispatch = dryrun._LiveBytes.__torch_dispatch__

    def counted(self, func, types, args=(), kwargs=None):
        if func is not torch.ops.prim.device.default:
            dispatched.append(func)
        return live_dispatch(self, func, types, args, kwargs)

    monkeypatch.setattr(dryrun._LiveBytes, "__torch_dispatch__", counted)
    replayed = dry_run(plan).ranks[0]
    six = len(dispatched)
    same = {fqn: str(lay) for fqn, lay in plan.param_layouts.items() if not fqn.startswith(tuple(DEEPER))}
    two = make_plan("llama3-debug", (2, 2), 8, 64, sharded=True, pins=same, n_layers=2)[0]
    assert {fqn: str(lay) for fqn, lay in two.param_layouts.items()} == same
    dispatched.clear()
    dry_run(two)
    assert six == len(dispatched)
    with monkeypatch.context() as m:
        m.setattr(dryrun, "_op_key", lambda *args: None)
        dispatched.clear()
        every = dry_run(plan).ranks[0]
    assert len(dispatched) > 2 * six
    assert replayed == every  # the ops counted too: a replay counts those its record dispatched
    with monkeypatch.context() as m:  # nothing replayed, redistributions included: every op dispatched
        m.setattr(dryrun._Run, "_replayed", lambda self, key, run, tensors, fake_only=False: run())
        dispatched.clear()
        assert dry_run(plan).ranks[0].ops == len(dispatched) == replayed.ops  # metadata queries aside


SCALES = [
    ("llama3-8b", (8, 8), 8),
    ("llama3-8b", (32, 8), 32),
    ("llama3-70b", (64, 8), 64),
    ("llama3-70b", (32, 8), 32),
]


@pytest.fixture(scope="module", params=SCALES, ids=lambda c: f"{c[0]}-{c[1][0]}x{c[1][1]}")
def at_scale(request):
    name, mesh_shape, batch = request.param
    return make_plan(name, mesh_shape, batch, 8192)


@pytest.mark.slow
def test_dry_runs_at_scale(at_scale):
    """Forward and backward run on rank 0's shapes; the peak is reported and plausible: at least
    the fp32 parameters, gradients and optimizer states of a fully sharded model, below what
    an unsharded model's states alone would take."""
    plan, model = at_scale
    world = math.prod(plan.mesh_shape)
    result = dry_run(plan)
    m = result.ranks[0]
    check_breakdown(m, model, world)
    assert 4 * param_bytes(model) / world <= m.peak_bytes < 4 * param_bytes(model)
    assert m.saved_bytes > 0 and m.phase in ("forward", "backward", "optimizer")
    print(f"{plan.mesh_shape}: {result.seconds:.2f} s; {m.summary()}")


def test_autoshard_dry_run_api():
    """`AutoShard.dry_run()` runs the last plan's program without a process group and times it."""
    model = build_model(get_config("llama3-tiny"), device="meta")
    inputs = lambda: (torch.empty(4, 16, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    with AutoShard(model, inputs, (2, 2), loss_fn=cross_entropy_loss) as auto:
        with pytest.raises(ValueError, match="call optimize"):
            auto.dry_run()
        plan = auto.optimize()
        result = auto.dry_run()
    assert list(result.ranks) == [0] and result.mesh_shape == plan.mesh_shape and "dry_run" in auto.timings
    check_breakdown(result.ranks[0], model, 4)
    assert not torch.distributed.is_initialized()  # its fake process group is gone
