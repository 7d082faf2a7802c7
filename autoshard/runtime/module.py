"""The parallel module: a plan's program wrapped as an `nn.Module` whose parameters are DTensors.

    pmodel = parallelize(plan, mesh, model)       # model real: its values are sharded in
    pmodel.init_weights(seed)                     # model on meta: same values as single-device
    loss = pmodel(*pmodel.shard_inputs(*batch))   # or local shards in the plan's input layouts
    loss = pmodel(*pmodel.local_inputs(*rows))    # or from this rank's rows alone (`input_rows(i)`)
    loss.backward(); optim.step()                 # AdamW over pmodel.parameters() (DTensors)

    pmodel = parallelize(plan, mesh, model, accumulate=True)   # K micro-batches per optimizer step:
    for k, micro in enumerate(micro_batches):                   # the gradients it all-reduces are
        with pmodel.no_sync() if k < K - 1 else nullcontext():  # reduced once, in the last backward
            (pmodel(*micro) / K).backward()

Parameters and buffers keep the original FQNs, so `state_dict()` has the original keys with DTensor
values. A parameter whose layout has a non-default device order is stored physically as
`_StridedShard` (torch's own encoding of that order), so `torch.distributed.checkpoint` computes
correct offsets. Gradients arrive in the same layout (the plan's SameChoice constraint), as DTensors.

`compile=True` runs both halves of the program through `torch.compile` (inductor) from their second
run on: the first run of each stays the checked, node-by-node one (`CheckedRun`), which names a
lowering bug's node where compiled code could not. Dynamo traces the executor's functional
collectives into the graph; a phase that graph-breaks still runs (`compile_stats` counts the breaks).

Values come in one full tensor at a time (`load_each`: an init that yields each tensor;
`init_weights` when the template has `initial_values(seed)`) or by slices (`load_slices`: each
rank reads only its own part of a checkpoint), so no rank holds the whole model; `load_full` takes
a state dict that is already whole.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoshard import _torch_compat as tc
from autoshard.layout import Layout
from autoshard.problem.plan import Plan
from autoshard.program.buckets import DEFAULT_BUCKET_BYTES
from autoshard.program.lower import CheckedRun, CommStats, Program, lower
from autoshard.program.random import RandomStream
from autoshard.runtime.shards import SliceReader, read_local

# Inductor's pass that moves each collective's wait to just before the first use of its result.
# Without it inductor schedules a wait right after its collective: a program that waits late
# (prefetch) would, once compiled, wait at once (checked on 4 gloo ranks, torch 2.13).
INDUCTOR_OPTIONS = {"reorder_for_compute_comm_overlap": True, "reorder_for_compute_comm_overlap_passes": ["sink_waits"]}


class _JointStep(torch.autograd.Function):
    """Forward runs the lowered forward graph; backward runs the lowered backward graph on what
    the forward handed over. Inputs: (runner, n_params, *params, *buffer_locals, *inputs), the
    parameters as the DTensors they are: their local shards go in, and each gradient comes back
    as a DTensor of its parameter's spec, with no autograd node per parameter (`to_local` and its
    backward cost llama3-debug's 57 parameters 14 ms a step on a CPU core)."""

    @staticmethod
    def forward(ctx, runner: "ParallelModule", n_params: int, *flat: torch.Tensor) -> torch.Tensor:
        params = flat[:n_params]
        loss, *saved = runner._run("forward", (*(tc.local_of(p) for p in params), *flat[n_params:]))
        ctx.runner, ctx.saved, ctx.n_rest = runner, saved, len(flat) - n_params
        ctx.holding = runner._holding  # as DDP: a forward inside no_sync() holds its backward's reductions
        ctx.params = params
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        saved, ctx.saved = ctx.saved, None  # free activations as soon as they are used
        if saved is None:
            raise RuntimeError("autoshard: backward ran twice through the same step; call the module again")
        grads, input_grads = ctx.runner._backward(saved, grad_loss, ctx.holding)
        rest: list[torch.Tensor | None] = [None] * ctx.n_rest
        n_buffers = len(ctx.runner.program.buffer_names)
        for i, g in zip(ctx.runner.program.input_grads, input_grads):  # a pipeline stage's, sent back
            rest[n_buffers + i] = g
        return (
            None,
            None,
            *(None if g is None else tc.dtensor_like(p, g) for p, g in zip(ctx.params, grads)),
            *rest,
        )


_PHASES = ("forward", "backward", "backward_held", "backward_input", "backward_weight", "backward_weight_held")


@dataclass(eq=False)  # found by identity: comparing the tensors it holds would not give a bool
class _Deferred:
    """A weight half waiting to run: what its input half handed over, its forward in `no_sync()`?"""

    handed: list[torch.Tensor]
    holding: bool
    device: torch.device


@dataclass
class CompileStats:
    """One phase's first compiled run, which traces and compiles it, then runs it once."""

    seconds: float  # that whole call: compile time plus one run
    graphs: int  # graphs dynamo made of the phase: 1 when it traced without a break
    graph_breaks: int


def owner_of(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    """The module under `root` that holds `fqn` (its path made of empty modules where missing),
    and the attribute's name: where a tensor of that name is registered."""
    *path, leaf = fqn.split(".")
    module = root
    for part in path:
        child = dict(module.named_children()).get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    return module, leaf


class ParallelModule(nn.Module):
    """Runs one training step's forward (returning the loss) on this rank's shards; `backward()`
    of the loss fills `.grad` of every DTensor parameter in its planned layout."""

    def __init__(
        self, plan: Plan, mesh: Any, template: nn.Module, program: Program, *, compile: bool = False, seed: int = 0
    ):
        super().__init__()
        if not isinstance(compile, bool):
            raise TypeError(f"compile must be True or False, got {compile!r}")
        why = tc.inductor_unavailable(mesh.device_type) if compile else None
        if why is not None:  # now, not as a traceback from inside the second step
            raise RuntimeError(f"compile=True: {why}")
        self.plan, self.mesh = plan, mesh
        self.comm: CommStats = program.comm
        object.__setattr__(self, "_template", template)  # kept out of the module tree
        object.__setattr__(self, "program", program)
        program.random.seed = seed
        self._checked = dict.fromkeys(_PHASES, False)
        self._holding = False  # inside `no_sync()`
        self._accumulated: list[torch.Tensor] | None = None  # the held reductions' sums so far
        self._deferred: list[_Deferred] = []  # weight halves not yet run (a zero-bubble stage's)
        self.compiled = compile  # (`compile` is nn.Module's method)
        self.compile_stats: dict[str, CompileStats] = {}
        object.__setattr__(self, "_compiled", {})  # phase -> torch.compile'd program half
        non_persistent = tc.non_persistent_buffer_names(template)
        shapes = dict(template.named_parameters()) | dict(template.named_buffers())
        object.__setattr__(self, "_owners", {})  # FQN -> (owning module, attribute), found once
        object.__setattr__(self, "_input_index", {})  # input -> its index sets (`input_index`), found once
        for fqn in program.param_names:
            self._empty(fqn, shapes[fqn], plan.param_layouts[fqn], parameter=True)
        for fqn in program.buffer_names:
            layout = plan.strategies[plan.graph.buffers[fqn].name].outputs[0]
            self._empty(fqn, shapes[fqn], layout, parameter=False, persistent=fqn not in non_persistent)

    # ------------------------------------------------------------------ structure
    def _empty(self, fqn: str, like: torch.Tensor, layout: Layout, *, parameter: bool, persistent: bool = True) -> None:
        """Register an uninitialized DTensor in `layout` (values come from `load_full` / `init_weights`)."""
        local = torch.empty(
            layout.local_shape(tuple(like.shape), self.plan.mesh_shape), dtype=like.dtype, device=self.mesh.device_type
        )
        value = tc.dtensor_from_local(local, self.mesh, layout.to_torch_placements(self.mesh), tuple(like.shape))
        owner, leaf = owner_of(self, fqn)
        self._owners[fqn] = (owner, leaf)
        if parameter:
            owner.register_parameter(leaf, nn.Parameter(value, requires_grad=like.requires_grad))
        else:
            owner.register_buffer(leaf, value, persistent=persistent)

    def _tensor(self, fqn: str) -> torch.Tensor:
        owner, leaf = self._owners.get(fqn) or owner_of(self, fqn)
        return getattr(owner, leaf)

    # ------------------------------------------------------------------ values
    @torch.no_grad()
    def load_full(self, values: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
        """Take every rank's shard of full (single-device) values: a state dict, plus buffers."""
        names = self.program.param_names + self.program.buffer_names
        if strict:
            missing = [n for n in self.program.param_names if n not in values]
            if missing:
                raise KeyError(f"full values lack {len(missing)} parameters, e.g. {missing[:3]}")
            # a state dict leaves out non-persistent buffers (rotary tables): left empty, they are garbage
            missing = [n for n in self.program.buffer_names if n not in values]
            if missing:
                raise KeyError(
                    f"full values lack {len(missing)} buffers, e.g. {missing[:3]} (a state dict leaves "
                    "out non-persistent ones: add dict(model.named_buffers()))"
                )
        for fqn in names:
            if fqn in values:
                self._take(fqn, values[fqn])

    @torch.no_grad()
    def load_each(self, values: Iterable[tuple[str, torch.Tensor]], *, exclude: Collection[str] = ()) -> None:
        """Take full values one at a time, each rank keeping its shard of each: with an init that
        yields a tensor and drops it, no rank ever holds more than one whole tensor. Every
        parameter and buffer not in `exclude` must come (a later value of a name replaces an
        earlier one); names the module lacks are skipped. The values are made outside any
        dispatch mode: one global value, not one per simulated rank."""
        left = {n for n in (*self.program.param_names, *self.program.buffer_names) if n not in exclude}
        items = iter(values)
        while True:
            with tc.no_dispatch_modes():
                item = next(items, None)
            if item is None:
                break
            fqn, full = item
            del item
            if fqn not in exclude and self.take(fqn, full):
                left.discard(fqn)
            del full  # before the next one is made
        if left:
            raise KeyError(f"the values lack {len(left)} parameters or buffers, e.g. {sorted(left)[:3]}")

    @torch.no_grad()
    def load_slices(self, read: SliceReader, names: Collection[str] | None = None) -> None:
        """Every parameter (those in `names`, None: all) from `read(fqn, box)`: the part of its
        full value inside `box` (one slice per dim, `shards.shard_box`), which is exactly this
        rank's shard, so a checkpoint read this way is never whole on any rank. Buffers are left
        to `load_each`."""
        for fqn in self.program.param_names:
            if names is not None and fqn not in names:
                continue
            target = self._tensor(fqn)
            local = target.to_local()
            layout = self.plan.param_layouts[fqn]
            local.copy_(read_local(read, fqn, layout, tuple(target.shape), self.mesh, local))

    @torch.no_grad()
    def take(self, fqn: str, full: torch.Tensor) -> bool:
        """This rank's shard of `full`, the whole value of parameter or buffer `fqn`, copied from
        its box; False (nothing taken) when the module has no `fqn`."""
        if fqn not in self._owners:
            return False
        self._take(fqn, full, by_box=True)
        return True

    def _take(self, fqn: str, full: torch.Tensor, *, by_box: bool = False) -> None:
        """This rank's shard of `full`, the whole value of `fqn`, into its local tensor; `by_box`:
        copied straight from its box of `full` (no intermediate shards, as `distribute_local`
        makes for an ordered layout), unless the layout is partial."""
        target = self._tensor(fqn)
        if tuple(full.shape) != tuple(target.shape):
            raise ValueError(f"{fqn}: full value has shape {tuple(full.shape)}, the model has {tuple(target.shape)}")
        layout = self.plan.param_layouts.get(fqn) or self.plan.strategies[self.plan.graph.buffers[fqn].name].outputs[0]
        local, full = target.to_local(), full.detach()
        if by_box and not any(p.kind == "P" for p in layout.placements):
            local.copy_(read_local(lambda _, box: full[box], fqn, layout, tuple(target.shape), self.mesh, local))
            return
        full = full.to(device=self.mesh.device_type, dtype=target.dtype)
        local.copy_(tc.distribute_local(full, self.mesh, target.placements))

    def init_weights(self, seed: int = 0) -> None:
        """The values `template.init_weights(seed)` gives the single-device model, sharded: one
        tensor at a time when the template has `initial_values(seed)` (our llama family), else
        from one whole CPU copy of the model."""
        stream = getattr(self._template, "initial_values", None)
        if stream is not None:
            self.load_each(stream(seed))
            return
        if not hasattr(self._template, "init_weights"):
            raise TypeError(f"{type(self._template).__name__} has no init_weights(seed); use load_full(state_dict)")
        with tc.no_dispatch_modes():  # one global value: not per simulated rank under LocalTensorMode
            full = copy.deepcopy(self._template).to_empty(device="cpu")
            full.init_weights(seed)
        self.load_full(dict(full.named_parameters()) | dict(full.named_buffers()))

    def shard_inputs(self, *full_inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's shards of global inputs, in the plan's input layouts."""
        if len(full_inputs) != len(self.program.input_shapes):
            raise ValueError(f"the plan has {len(self.program.input_shapes)} inputs, got {len(full_inputs)}")
        out = []
        for i, (x, (shape, layout)) in enumerate(zip(full_inputs, self.program.input_shapes)):
            if tuple(x.shape) != shape:
                raise ValueError(f"input {i}: global shape {tuple(x.shape)}, the plan was made for {shape}")
            x = x.to(self.mesh.device_type)
            out.append(tc.distribute_local(x, self.mesh, layout.to_torch_placements(self.mesh)))
        return tuple(out)

    def input_index(self, i: int) -> tuple[torch.Tensor, ...]:
        """Per dim, the global indices this rank's shard of input `i` holds, in local order: a
        block shard is the Cartesian product of these sets. Found by sharding index tensors as the
        input is sharded, so that a loader reads only its rows (`input_rows`) and `local_inputs`
        cuts the rest (any layout, device order included); computed once per input."""
        cached = self._input_index.get(i)
        if cached is not None:
            return cached
        shape, layout = self.program.input_shapes[i]
        if any(p.kind == "P" for p in layout.placements):
            raise ValueError(f"input {i}: layout {layout} is partial; an input holds values, not partial sums")
        placements = layout.to_torch_placements(self.mesh)
        sets = []
        for d, size in enumerate(shape):
            view = [1] * len(shape)
            view[d] = size
            index = torch.arange(size, device=self.mesh.device_type).view(view).expand(shape)
            local = tc.distribute_local(index, self.mesh, placements)
            if local.numel() == 0:  # an empty shard: only the count matters
                sets.append(torch.zeros(local.shape[d], dtype=torch.int64, device=local.device))
            else:
                sets.append(local[tuple(slice(None) if k == d else 0 for k in range(len(shape)))])
        self._input_index[i] = tuple(sets)
        return self._input_index[i]

    def input_rows(self, i: int) -> torch.Tensor:
        """The rows (indices along dim 0, the batch) of input `i` that this rank holds: ranks that
        share a data-parallel coordinate hold the same rows, and no two coordinates share one."""
        return self.input_index(i)[0]

    def local_inputs(self, *row_inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's inputs from the rows `input_rows(i)` names of each input (whole along the
        other dims): what `shard_inputs` cuts from the global inputs, without anyone building them."""
        if len(row_inputs) != len(self.program.input_shapes):
            raise ValueError(f"the plan has {len(self.program.input_shapes)} inputs, got {len(row_inputs)}")
        out = []
        for i, (x, (shape, _)) in enumerate(zip(row_inputs, self.program.input_shapes)):
            index = self.input_index(i)
            want = (len(index[0]), *shape[1:])
            if tuple(x.shape) != want:
                raise ValueError(f"input {i}: rows of shape {tuple(x.shape)}, this rank holds {want} of {shape}")
            x = x.to(self.mesh.device_type)
            for d in range(1, len(shape)):
                if len(index[d]) != shape[d]:  # split on this dim too (e.g. the sequence over tp)
                    x = x.index_select(d, index[d])
            out.append(x.contiguous())
        return tuple(out)

    # ------------------------------------------------------------------ running
    @property
    def random(self) -> RandomStream:
        """What the program's random ops draw from: the run's `seed` and the `step`, the number of
        forward calls so far (a resumed run sets it to the step it resumes from)."""
        return self.program.random

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        self._check_inputs(inputs)
        self.program.random.step += 1
        params = [self._tensor(f) for f in self.program.param_names]
        buffers = [tc.local_of(self._tensor(f)) for f in self.program.buffer_names]
        if not torch.is_grad_enabled():
            return self._run("forward", (*map(tc.local_of, params), *buffers, *inputs))[0]
        return _JointStep.apply(self, len(params), *params, *buffers, *inputs)

    @contextlib.contextmanager
    def no_sync(self):
        """The backward of a forward run inside holds the gradients the plan all-reduces
        (replicated parameters'): their partial sums accumulate here, unreduced, and their `.grad`
        is left as it is; the first backward of a forward outside reduces the sums of every
        micro-batch once, into `.grad`.
        Gradients the plan reduce-scatters (sharded parameters') are reduced into `.grad` at
        every backward, as FSDP2 does. DDP's `no_sync()`, for a module from
        `parallelize(..., accumulate=True)`."""
        if self.program.held is None:
            raise ValueError("no_sync() needs a module lowered to accumulate: parallelize(..., accumulate=True)")
        self._holding = True
        try:
            yield
        finally:
            self._holding = False

    def _backward(
        self, saved: list, grad_loss: torch.Tensor, holding: bool
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
        """One backward: a gradient per parameter (`param_names` order; None: frozen, or held when
        `holding`), then those of the inputs in `program.input_grads` (a pipeline stage's). A
        program in halves runs its input half: no gradient until `deferred_weights()` runs."""
        if self.program.halves is not None:
            out = self._run("backward_input", (*saved, grad_loss))
            n_inputs = len(self.program.input_grads)
            self._deferred.append(_Deferred(list(out[n_inputs:]), holding, grad_loss.device))
            return [None] * len(self.program.param_names), list(out[:n_inputs])
        return self._reduced("backward", "backward_held", (*saved, grad_loss), holding, grad_loss.device)

    def deferred_weights(self) -> Callable[[], None]:
        """The newest backward's weight half (adding into `.grad`), to run when a zero-bubble
        schedule says: torch `PipelineStage`'s `dw_builder`."""
        work = self._deferred[-1]
        return lambda: self._weights(work)

    @torch.no_grad()
    def _weights(self, work: _Deferred) -> None:
        self._deferred.remove(work)
        if not work.holding and any(w.holding for w in self._deferred):
            raise RuntimeError("autoshard: a weight half reduced the gradients before a held one ran")
        grads, _ = self._reduced(
            "backward_weight", "backward_weight_held", tuple(work.handed), work.holding, work.device
        )
        for fqn, g in zip(self.program.param_names, grads):
            if g is None:
                continue
            if (p := self._tensor(fqn)).grad is None:
                p.grad = tc.dtensor_like(p, g)
            else:
                tc.local_of(p.grad).add_(g)

    def _reduced(
        self, phase: str, held_phase: str, args: tuple, holding: bool, device: torch.device
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
        """`phase` (or, `holding`, `held_phase`) on `args` and the held reductions' sums: the
        parameters' gradients (None for frozen and held ones), then what else it returns."""
        held = self.program.held
        n_grads = len(self.program.grad_names)
        if held is None:
            out = self._run(phase, args)
            return self._by_param(out[:n_grads]), list(out[n_grads:])
        sums = self._accumulated
        if sums is None:
            sums = [a.zeros(device) for a in held.accumulators]
        if not holding:
            self._accumulated = None
            out = self._run(phase, (*args, *sums))
            return self._by_param(out[:n_grads]), list(out[n_grads:])
        out = self._run(held_phase, (*args, *sums))
        kept = len(out) - len(sums)
        self._accumulated = list(out[kept:])
        skip = set(held.params)
        others = iter(out[: n_grads - len(skip)])
        grads = [None if i in skip else next(others) for i in range(n_grads)]
        return self._by_param(grads), list(out[n_grads - len(skip) : kept])

    def _by_param(self, grads) -> list[torch.Tensor | None]:
        """The backward's gradients (one per trained parameter) placed by parameter, None for a
        frozen one."""
        program = self.program
        if len(program.grad_names) == len(program.param_names):
            return list(grads)
        by_name = dict(zip(program.grad_names, grads))
        return [by_name.get(fqn) for fqn in program.param_names]

    def _run(self, phase: str, args: tuple) -> tuple:
        gm = getattr(self.program, phase)
        if not self._checked[phase]:  # the first run checks every node's local shape, uncompiled
            out = CheckedRun(gm).run(*args)
            self._checked[phase] = True
            return out
        if not self.compiled or tc.dispatch_mode_blocks_compile():  # dynamo would run it eagerly anyway
            return gm(*args)
        if phase in self._compiled:
            return self._compiled[phase](*args)
        return self._compile(phase, gm, args)

    def _compile(self, phase: str, gm: torch.fx.GraphModule, args: tuple) -> tuple:
        """The phase's first compiled run, timed: shapes are fixed by the plan (dynamic=False)."""
        fn = torch.compile(tc.write_code(gm), dynamic=False, options=INDUCTOR_OPTIONS)
        graphs, breaks = tc.dynamo_counts()
        start = time.perf_counter()
        out = fn(*args)
        seconds = time.perf_counter() - start
        now_graphs, now_breaks = tc.dynamo_counts()
        self.compile_stats[phase] = CompileStats(seconds, now_graphs - graphs, now_breaks - breaks)
        self._compiled[phase] = fn
        return out

    def _check_inputs(self, inputs: tuple) -> None:
        expected = self.program.input_shapes
        if len(inputs) != len(expected):
            raise ValueError(f"the plan has {len(expected)} inputs, got {len(inputs)}")
        for i, (x, (shape, layout)) in enumerate(zip(inputs, expected)):
            local = layout.local_shape(shape, self.plan.mesh_shape)
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != local:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(
                    f"input {i}: expected a local shard of shape {local} (global {shape} in layout "
                    f"{layout} on mesh {self.plan.mesh_shape}), got {got}"
                )


def parallelize(
    plan: Plan,
    mesh: Any,
    model: nn.Module,
    prefetch: int = 1,
    *,
    bucket_bytes: float = DEFAULT_BUCKET_BYTES,
    compile: bool = False,
    seed: int = 0,
    accumulate: bool = False,
    apart: bool = False,
) -> ParallelModule:
    """The parallel module of `plan` on `mesh`; values are copied from `model` unless it is on meta.
    Bucketed collectives run up to `prefetch` buckets ahead (0: each waited on where it is launched);
    gradient all-reduces run in buckets of at most `bucket_bytes`. `accumulate=True`: its
    `no_sync()` holds gradient all-reduces for the last of several micro-batches.
    `compile=True`: its program runs through torch.compile from the second step on. `seed`: what
    its random ops (dropout) draw from, the same on every rank (`autoshard.program.random`).
    `apart`: its backward runs in two halves, the weights' when `deferred_weights()` says (a
    pipeline stage under a zero-bubble schedule)."""
    program = lower(plan, mesh, prefetch, bucket_bytes, accumulate, apart)
    pmodel = ParallelModule(plan, mesh, model, program, compile=compile, seed=seed)
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    if not any(t.is_meta for t in params.values()):
        pmodel.load_full(params)
    return pmodel
