"""Dry run: one rank's lowered step on fake tensors, with its live memory accounted.

    result = dry_run(plan)                 # makes its own fake process group and mesh per rank
    result.peak_bytes, result.ranks[0]     # MemoryEstimate: the peak and what it is made of

Each checked rank lowers the plan on a fake process group seen from that rank, then runs the
program's forward and backward node by node (`CheckedRun`'s local-shape checks) on fake tensors
of the local shapes in the placeholders' LOCAL_SHAPE meta: no memory, no devices, the real
collectives' fake kernels. An op or redistribution met before with inputs of the same geometry
(the same one in the next repeated block) is not run again: its outputs are made as the first run
made them, storages and views alike, so the accounting is the same at a fraction of the time (a
fake op's dispatch costs ~0.25 ms on a CPU core, and a 70B step has ~25,000). A program that
cannot run (a wrong local shape, a consumer that rejects a redistributed value) raises
`DryRunError` naming the node, in one line.

Memory is counted by our own dispatch mode (`live_bytes.LiveBytes`), not torch's MemTracker: it needs the
storages of the values the forward hands to the backward, the gathered parameters and the
gradients told apart, which a node-aware interpreter knows and a module-hook tracker does not;
and it costs one dictionary update per new storage (MemTracker also snapshots per module). The
test suite checks it against MemTracker on a real step (tests/test_dryrun.py).

The step modeled is the one `runtime.module.ParallelModule` runs, in steady state (from the second step
on): parameters, buffers and the AdamW states (two fp32 values per parameter element) live
throughout; the forward's saved values live until the backward returns (the backward is called
with them as one argument tuple); gradients live from the backward to the optimizer step, which is
modeled with one temporary the size of the largest parameter shard: what a per-parameter AdamW
allocates for its denominator. The trainer's fused AdamW updates in place, so that errs high.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from autoshard import _torch_compat as tc
from autoshard.problem.memory import ADAMW_STATE_BYTES
from autoshard.problem.plan import Plan
from autoshard.program.lower import LOCAL_SHAPE, CheckedRun, Program, lower
from autoshard.program.modules import AwaitBucket, Redistribute
from autoshard.program.schedule import StepModel

# the memory accounting lives in `live_bytes`; under this module's names (tests patch `dryrun._LiveBytes`)
from autoshard.runtime.live_bytes import LiveBytes as _LiveBytes
from autoshard.runtime.live_bytes import Replay as _Replay
from autoshard.runtime.live_bytes import tensors_in as _tensors

CATEGORIES = ("params", "buffers", "inputs", "activations", "gathered_params", "grads", "transient")


class DryRunError(RuntimeError):
    """A lowered program that cannot run: names the rank, the phase and the node, in one line."""

    def __init__(self, line: str):
        super().__init__(line)
        self.line = line  # fx's interpreter appends the graph context to args; this stays one line


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's memory at the peak of a training step (bytes), and what is live then."""

    rank: int
    phase: str  # "forward", "backward" or "optimizer": where the peak is
    params: int  # local parameter shards
    buffers: int
    inputs: int  # this rank's shard of the batch
    optimizer: int  # AdamW: two fp32 states per parameter element
    activations: int  # values the forward hands to the backward, live at the peak
    gathered_params: int  # of those, redistributed parameters (gathered in the forward, kept)
    grads: int  # gradient shards live at the peak
    transient: int  # everything else live at the peak: an op's inputs/outputs, collective buffers
    forward_peak_bytes: int  # peak during the forward (optimizer states included)
    backward_peak_bytes: int  # peak during the backward (optimizer states included)
    saved_bytes: int  # all the forward hands to the backward (activations + gathered parameters)
    ops: int = 0  # ops the forward and backward dispatch (graph ops, redistributions' own, collectives, waits)

    @property
    def peak_bytes(self) -> int:
        return (
            self.params
            + self.buffers
            + self.inputs
            + self.optimizer
            + self.activations
            + self.gathered_params
            + self.grads
            + self.transient
        )

    def summary(self) -> str:
        unit, scale = ("GiB", 2**30) if self.peak_bytes >= 2**30 else ("MiB", 2**20)
        parts = ", ".join(
            f"{name} {getattr(self, name) / scale:.2f}"
            for name in (
                "params",
                "grads",
                "optimizer",
                "activations",
                "gathered_params",
                "transient",
                "buffers",
                "inputs",
            )
        )
        return f"rank {self.rank}: peak {self.peak_bytes / scale:.2f} {unit} in the {self.phase} ({parts} {unit})"


@dataclass
class DryRunResult:
    """The dry run of a plan: one MemoryEstimate per checked rank (every other rank runs the same
    shapes as one of them), and the wall time it took."""

    mesh_shape: tuple[int, ...]
    ranks: dict[int, MemoryEstimate] = field(default_factory=dict)
    seconds: float = 0.0
    step: StepModel | None = None  # the lowered program's modeled step (the same on every rank)

    @property
    def peak_bytes(self) -> int:
        return max(m.peak_bytes for m in self.ranks.values())

    def summary(self) -> str:
        return "\n".join(m.summary() for m in self.ranks.values())


def ranks_to_check(plan: Plan) -> list[int]:
    """Ranks whose dry runs differ. Layouts only split evenly (`Layout.local_shape` raises
    otherwise), so every rank holds the same local shapes and runs the same ops on them: rank 0
    stands for all. (With uneven splits, the ranks holding each dim's last chunk would differ.)"""
    return [0]


def dry_run(
    plan: Plan,
    ranks: Sequence[int] | None = None,
    *,
    mesh: Any = None,
    mesh_dim_names: Sequence[str] | None = None,
    prefetch: int = 1,
) -> DryRunResult:
    """Lower `plan` (with `prefetch`, as `parallelize` does) and run each of `ranks` (default
    `ranks_to_check`) on fake tensors under a fake process group. Inside an existing process group,
    runs this process's rank on `mesh` (default: a CPU mesh made here); that is collective, as
    lowering may create flattened groups: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    start = time.perf_counter()
    shape = tuple(plan.mesh_shape)
    names = tuple(mesh_dim_names) if mesh_dim_names else tuple(f"m{i}" for i in range(len(shape)))  # labels only
    world = math.prod(shape)
    result = DryRunResult(shape)
    if dist.is_available() and dist.is_initialized():
        mine = dist.get_rank()
        if ranks is not None and list(ranks) != [mine]:
            raise ValueError(f"inside a process group dry_run runs this rank ({mine}) only, asked for {list(ranks)}")
        if dist.get_world_size() != world:
            raise ValueError(f"the plan's mesh {shape} has {world} ranks, the process group {dist.get_world_size()}")
        if mesh is None:
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        program = lower(plan, mesh, prefetch)
        result.ranks[mine], result.step = estimate(program, mine, plan.module_paths), program.step
    else:
        for rank in ranks_to_check(plan) if ranks is None else ranks:
            if not 0 <= rank < world:
                raise ValueError(f"rank {rank} is not on mesh {shape} ({world} ranks)")
            with tc.fake_process_group(world, rank):
                mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
                program = lower(plan, mesh, prefetch)
                result.ranks[rank], result.step = estimate(program, rank, plan.module_paths), program.step
    result.seconds = time.perf_counter() - start
    return result


def estimate(program: Program, rank: int = 0, module_paths: dict[str, str] | None = None) -> MemoryEstimate:
    """Run this process's rank of `program` (lowered on its mesh) on fake tensors of the
    placeholders' local shapes; the step's memory. Raises DryRunError if a node fails. The
    mesh's own bookkeeping tensors (rank ids, read when a flattened group is first made) are real:
    fake mode takes them as constants."""
    held = program.held.accumulators if program.held is not None else []
    with tc.new_fake_mode(allow_non_fake_inputs=True):
        args = [_fake(n, program.device_type) for n in _placeholders(program.forward)]
        tangent = _fake(_placeholders(program.backward)[-1 - len(held)], program.device_type)
        accumulated = [a.zeros(program.device_type) for a in held]
        return account(program, args, tangent, rank=rank, module_paths=module_paths, accumulated=accumulated)


def account(
    program: Program,
    forward_args: Sequence[torch.Tensor],
    tangent: torch.Tensor,
    *,
    rank: int = 0,
    module_paths: dict[str, str] | None = None,
    accumulated: Sequence[torch.Tensor] = (),
) -> MemoryEstimate:
    """Run forward then backward on the given local tensors (fake or real) and account their live
    memory: the dry run's accounting, usable on real tensors to check it. A program lowered to
    accumulate runs its last micro-batch's backward, with the held reductions' sums `accumulated`
    (gradients: live through the step, as the held ones are until the last backward)."""
    n_params, n_buffers = len(program.param_names), len(program.buffer_names)
    live = _LiveBytes()
    kinds = ["params"] * n_params + ["buffers"] * n_buffers + ["inputs"] * (len(forward_args) - n_params - n_buffers)
    for value, kind in zip(forward_args, kinds):
        live.add(value, kind)
    for value in accumulated:
        live.add(value, "grads")
    trained = set(program.grad_names)  # frozen parameters have no gradient and no optimizer state
    params = [p for p, fqn in zip(forward_args[:n_params], program.param_names) if fqn in trained]
    live.fixed = ADAMW_STATE_BYTES * sum(p.numel() for p in params)  # AdamW states: steady state

    # Each interpreter lets go of its values after its run (`_done`): fx's Interpreter also keeps
    # the iterator over its arguments, which holds them all (the backward's: the saved activations).
    fwd = _Run(program.forward, live, rank, "forward", module_paths, n_params)
    with live:
        loss, *saved = _one_line(fwd.run, *forward_args)
    forward_peak, saved_bytes = live.peak, fwd.saved_bytes
    _done(fwd)
    del loss
    live.peak = 0
    bwd = _Run(program.backward, live, rank, "backward", module_paths)
    with live:
        grads = _one_line(bwd.run, *saved, tangent, *accumulated)
    backward_peak = live.peak
    _done(bwd)
    del saved
    live.phase = "optimizer"
    live.update_peak(extra=max((p.nbytes for p in params), default=0))  # AdamW's per-parameter temporary
    at = live.at_peak
    del grads
    peak_phase = live.peak_phase
    return MemoryEstimate(
        rank=rank,
        phase=peak_phase,
        **{k: at.get(k, 0) for k in CATEGORIES},
        optimizer=live.fixed,
        forward_peak_bytes=forward_peak,
        backward_peak_bytes=backward_peak,
        saved_bytes=saved_bytes,
        ops=live.ops,
    )


# ---------------------------------------------------------------------------------- running
def _done(run: "_Run") -> None:
    """Drop what an interpreter holds after its run: its node values and its arguments."""
    run.env.clear()
    run.args_iter = iter(())


def _one_line(run, *args) -> Any:
    try:
        return run(*args)
    except DryRunError as err:
        raise DryRunError(err.line) from None


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _fake(node: fx.Node, device_type: str = "cpu") -> torch.Tensor:
    """An uninitialized tensor of the placeholder's local shape and traced dtype (in fake mode), on
    the program's device: a program lowered on a CUDA mesh makes its values there."""
    val = node.meta["autoshard_source"].meta["val"]
    shape = node.meta.get(LOCAL_SHAPE)
    return torch.empty(shape if shape is not None else tuple(val.shape), dtype=val.dtype, device=device_type)


class _Run(CheckedRun):
    """CheckedRun that files each value by what it is for (saved for the backward, a gathered
    parameter, a gradient) and turns any failure into a one-line DryRunError naming the node."""

    def __init__(
        self,
        gm: fx.GraphModule,
        live: "_LiveBytes",
        rank: int,
        phase: str,
        module_paths: dict[str, str] | None,
        n_params: int = 0,
    ):
        super().__init__(gm)
        self.live, self.rank, self.phase, self.paths = live, rank, phase, module_paths or {}
        live.phase = phase
        output = next(iter(reversed(gm.graph.nodes)))
        outs = list(output.args[0])
        self.saved: set[fx.Node] = set(outs[1:]) if phase == "forward" else set()
        self.grads: set[fx.Node] = set(outs) if phase == "backward" else set()
        self.from_param: set[fx.Node] = set()  # forward nodes that redistribute a parameter
        if phase == "forward":
            params = set(_placeholders(gm)[:n_params])
            for n in gm.graph.nodes:
                if n.op == "call_module" and isinstance(gm.get_submodule(n.target), Redistribute):
                    if n.args[0] in params:
                        self.from_param.add(n)
                elif (
                    n.op == "call_function"
                    and n.args
                    and isinstance(n.args[0], fx.Node)
                    and n.args[0].op == "call_module"
                    and isinstance(gm.get_submodule(n.args[0].target), AwaitBucket)
                ):
                    launch = n.args[0].args[0]  # a bucket's item: the launch read the member's input
                    if launch.args[n.args[1]] in params:
                        self.from_param.add(n)
        self.saved_bytes = 0

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        """Redistributions repeat per layer with the same plan and shapes: the first of a kind runs
        (collectives and all), the others replay its outputs' layout and its transient peak."""
        module = self.fetch_attr(target)
        if isinstance(module, AwaitBucket):  # what it waits for stands in for its inputs
            (pending,) = args
            plans, tensors = list(zip(pending.plans, pending.dim_orders)), (pending.result,)
        else:
            members = [module] if isinstance(module, Redistribute) else module.members
            plans, tensors = [(m.plan, m.dim_order) for m in members], args
        key = (
            type(module),
            tuple((id(p), order) for p, order in plans),
            tuple((tuple(a.shape), a.stride(), a.dtype) for a in tensors),
        )
        return self._replayed(key, lambda: super(_Run, self).call_module(target, args, kwargs), tensors)

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        """An op met before with inputs of the same shapes, strides and dtypes (the same op of the
        next repeated block) makes the same outputs: on fake tensors they are made directly, the
        op's dispatch skipped (most of a dry run's time)."""
        if not _replayable(target):
            return super().call_function(target, args, kwargs)
        tensors = _tensors((args, list(kwargs.values())))
        key = _op_key(target, args, kwargs, tensors)
        if key is None:
            return super().call_function(target, args, kwargs)
        return self._replayed(
            key, lambda: super(_Run, self).call_function(target, args, kwargs), tensors, fake_only=True
        )

    def _replayed(self, key: tuple, run, tensors, fake_only: bool = False) -> Any:
        """The replay of `key`'s record on `tensors`; the first time, `run`'s result, recorded
        (an op's only where its outputs are fake: real ones carry data a replay would not)."""
        record = self.live.replays.get(key)
        if record is not None:
            return record.replay(self.live, tensors)
        record, result = _Replay.record(self.live, run, tensors)
        if record is not None and (record.fake is not None or not fake_only):
            self.live.replays[key] = record
        return result

    def run_node(self, n: fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except DryRunError:
            raise
        except Exception as err:  # noqa: BLE001 - reported as one line naming the node
            raise DryRunError(self._where(n) + ": " + _first_line(err)) from None
        if n.op == "placeholder":
            return result
        if n in self.from_param:
            self.live.mark_param_storage(result)
        if n in self.saved:
            self.saved_bytes += self.live.tag_saved(result)
        if n in self.grads:
            self.live.tag(result, "grads")
        return result

    def _where(self, n: fx.Node) -> str:
        src = n.meta.get("autoshard_source")
        what = n.name
        if src is not None:
            path = self.paths.get(src.name)
            what += f" ({src.target}" + (f" in {path})" if path else ")")
        return f"dry run of rank {self.rank}, {self.phase}: node {what} failed"


_NO_REPLAY_NAMESPACES = ("_c10d_functional", "c10d", "c10d_functional")  # collectives and waits run
_NO_REPLAY_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


def _replayable(target: Any) -> bool:
    """Whether a call's outputs follow from its arguments' geometry: an aten-style op that is not a
    collective, does not mutate, and whose output shape does not depend on data."""
    return (
        tc.is_op_overload(target)
        and target.namespace not in _NO_REPLAY_NAMESPACES
        and not target._schema.is_mutable
        and not any(tag in target.tags for tag in _NO_REPLAY_TAGS)
    )


def _op_key(target: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> tuple | None:
    """What decides a replayable op's outputs' shapes, strides and aliasing: the op, its tensors'
    geometry and dtypes and which of them share a storage, its other arguments (None: an
    unhashable argument, a symbolic size)."""
    first: dict[int, int] = {}
    shared = tuple(first.setdefault(id(t.untyped_storage()), i) for i, t in enumerate(tensors))
    key = (target, _signature(args), _signature(kwargs), shared)
    try:
        hash(key)
    except TypeError:  # a symbolic size
        return None
    return key


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (type(value), tuple(value.shape), value.stride(), value.storage_offset(), value.dtype)
    if isinstance(value, (tuple, list)):
        return (type(value), *map(_signature, value))
    if isinstance(value, dict):
        return tuple((k, _signature(v)) for k, v in value.items())
    return value


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    line = text[0] if text else type(err).__name__
    return line if len(line) <= 300 else line[:297] + "..."
