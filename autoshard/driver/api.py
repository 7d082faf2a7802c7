"""The user-facing entry point: describe the training step and the mesh, get a sharding plan.

    auto = AutoShard(model, input_fn, mesh, loss_fn=cross_entropy_loss)
    auto.pin({"layers.*.attention.wq.weight": "S(0)S(0)[1,0]"})
    plan = auto.optimize()
    pmodel = auto.apply(plan)                # needs a DeviceMesh (with dim names)

or in one call: `pmodel = auto_shard(model, input_fn, mesh, loss_fn=cross_entropy_loss)`. How to plan
is a `PlanConfig` (`config=`); the keyword arguments are sugar for its fields. Inside a process
group of more than one rank (torchrun) rank 0 solves for every rank (`driver.ranks`).

The step traced is `loss_fn(model(*inputs[:n_model_inputs]), *inputs[n_model_inputs:])`, or with
`loss_fn=None` the loss `model(*inputs)` returns (a scalar, a tuple's `loss_output`-th element,
default the first scalar, or `.loss`), with `inputs = input_fn()` in GLOBAL shapes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import autoshard_solver as solver
from autoshard import _torch_compat as tc
from autoshard.capture.calls import run_step, step_inputs
from autoshard.capture.precision import cast_floating
from autoshard.capture.regions import find_repeated_blocks
from autoshard.capture.repeat import trace_step
from autoshard.capture.trace import JointGraph, mark_outputs
from autoshard.driver import limits
from autoshard.driver.config import Mesh, PlanConfig
from autoshard.driver.fit import FitSteps, fit_memory
from autoshard.driver.ranks import RankZeroPlanning, in_process_group
from autoshard.driver.replicas import fix_replicate_dim
from autoshard.layout import Layout
from autoshard.pricing.planner import Planner
from autoshard.problem.build import ProblemSpec, ShardingProblem, build_problem
from autoshard.problem.explain import MAX_SOLVES, Explanation, explain
from autoshard.problem.memory import MemoryFit
from autoshard.problem.plan import Plan, decode
from autoshard.profiles.device import DeviceProfile
from autoshard.profiles.files import device_profile, network_profile
from autoshard.profiles.network import NetworkProfile
from autoshard.program.buckets import DEFAULT_BUCKET_BYTES
from autoshard.runtime.dryrun import DryRunResult, dry_run
from autoshard.runtime.module import ParallelModule, parallelize

log = logging.getLogger("autoshard")


def device_mesh(mesh: Mesh | None) -> DeviceMesh | None:
    """`mesh` when it is a DeviceMesh (applying and running need one), None for a shape."""
    return mesh if isinstance(mesh, DeviceMesh) else None


@contextlib.contextmanager
def without_cyclic_gc():
    """Python's cyclic garbage collector paused (as it was before, after): planning a 70B model
    allocates tens of millions of small objects that live until it ends, and every collection
    of the oldest generation walks them all (a quarter of a 70B plan's time). What planning
    leaves in cycles is collected once the collector runs again."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _outside_modes(
    solve: Callable[..., solver.Solution], problem: solver.Problem, cutoff: float | None
) -> solver.Solution:
    with tc.no_dispatch_modes():  # leave the tracer's fake mode: ranks communicate
        return solve(problem, cutoff)


def _as_layout(value: Layout | str) -> Layout:
    return Layout.parse(value) if isinstance(value, str) else value


class AutoShard:
    """Collects constraints, then traces, builds the ILP, solves it and decodes a `Plan`.

    `mesh` is a DeviceMesh or a mesh shape (planning needs no process group); it may be left to
    `config.mesh`. `config` (a `PlanConfig`) says how to plan: profiles, precision, memory limit
    and budget, recomputation and resharding, the ILP backend. The keyword arguments are sugar for
    its fields: `network`, `device` (preset names, profiles, or profile files from `autoshard
    calibrate`; they price communication and compute), `mp_policy` (torch's
    `MixedPrecisionPolicy`), `recompute`, `reshard_after_forward`, `unroll`. Under a memory limit
    the fit may turn recomputation or resharding on. `compile=True`: the applied module runs its
    program's forward and backward through `torch.compile` (inductor) from the second step on.
    `stages`: the model is one pipeline stage of that many pp ranks (`autoshard.pipeline_run`), so
    the mesh is that share of the world.
    """

    def __init__(
        self,
        model: nn.Module,
        input_fn: Callable[[], Any],
        mesh: Mesh | None = None,
        *,
        config: PlanConfig | None = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        n_model_inputs: int = 1,
        loss_output: int | str | None = None,
        network: NetworkProfile | str | None = None,
        device: DeviceProfile | str | None = None,
        unroll: bool | None = None,
        mp_policy: MixedPrecisionPolicy | None = None,
        recompute: bool | None = None,
        reshard_after_forward: bool | None = None,
        compile: bool = False,
        stages: int = 1,
    ):
        config = config or PlanConfig()
        sugar = {
            "network": network,
            "device_profile": device,
            "unroll": unroll,
            "recompute": recompute,
            "reshard_after_forward": reshard_after_forward,
        }
        config = config.replace(**{k: v for k, v in sugar.items() if v is not None})
        if mp_policy is not None:
            config = config.with_policy(mp_policy)
        self.config = config.with_mesh(mesh, stages).with_default_profiles()
        if self.config.pipeline_ranks is not None:
            raise ValueError(
                "AutoShard plans one stage's mesh, without a pp dim: a pipeline is planned by "
                "autoshard.plan_pipeline (or `python -m autoshard plan` with --mesh-names pp,...)"
            )
        self.model = model
        self.compile = compile
        self.precision = self.config.precision
        self.input_fn = input_fn
        self.mesh = mesh
        shape, network, device = self.config.mesh, self.config.network, self.config.device_profile
        assert shape is not None  # with_mesh gave the config one
        assert network is not None and device is not None  # with_default_profiles filled them in
        self.mesh_shape: tuple[int, ...] = shape
        self.loss_fn = loss_fn
        self.n_model_inputs = n_model_inputs
        self.loss_output = loss_output  # which of the model's outputs is its loss (loss_fn=None)
        self.network = network_profile(network, self.mesh_shape, self.config.intra_node_dims)
        self.device = device_profile(device)
        self._input_names: tuple[str, ...] | None = None  # keyword names when input_fn returns a dict
        self.spec = ProblemSpec(
            recompute=self.config.recompute,
            reshard=self.config.reshard_after_forward,
            param_memory_bytes=self.config.memory_budget,
        )
        self.timings: dict[str, float] = {}
        self.fit: MemoryFit | None = None  # how the last optimize() met the memory limit
        self._fit_dry_run: DryRunResult | None = None  # the dry run that fit ran of its plan
        self.plan: Plan | None = None
        # what the last optimize() built, kept so explain() re-solves it without tracing again
        self.sharding: ShardingProblem | None = None
        self.planner: Planner | None = None

    # AutoShard holds nothing to close (its fake modes live inside each call): `with AutoShard(...)
    # as auto:` is accepted for code written that way and does nothing more than `auto = ...`.
    def __enter__(self) -> "AutoShard":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    # ------------------------------------------------------------------ constraints
    def constrain_inputs(self, *layouts: Layout | str | None) -> None:
        """Layout of each user input (None = let the solver choose)."""
        self.spec.input_layouts = {i: _as_layout(lay) for i, lay in enumerate(layouts) if lay is not None}

    def constrain_outputs(self, *layouts: Layout | str | None) -> None:
        """Layout of each tensor the model returns, in pytree order (None = let the solver choose);
        the loss function then reads outputs in these layouts."""
        if self.loss_fn is None:
            raise ValueError("constrain_outputs needs a loss_fn: without one the model's output is the loss")
        self.spec.output_layouts = {i: _as_layout(lay) for i, lay in enumerate(layouts) if lay is not None}

    def pipeline_stage(self, layout: Layout | str) -> None:
        """Plan the model as one pipeline stage (`autoshard.pipeline_run`): what it returns is
        sent to the next stage, not a loss (unless it is a scalar: the last stage's loss), and it
        and the gradients of the inputs that require one (the activations the previous stage
        sent) are in `layout`, as every stage's boundary is."""
        self.spec.stage_layout = _as_layout(layout)

    def memory_budget(self, param_bytes_per_rank: float | None) -> None:
        """Cap on parameter bytes per rank (None: no cap; the memory limit bounds the peak)."""
        self.config = self.config.replace(memory_budget=param_bytes_per_rank)
        self.spec.param_memory_bytes = param_bytes_per_rank

    def accumulate(self, micro_batches: int) -> None:
        """Plan for gradient accumulation: the example inputs are one of `micro_batches` per
        optimizer step. The plan prices what `apply()`'s module then runs: the optimizer step and
        the gradient all-reduces `no_sync()` holds once per step, the rest once per micro-batch."""
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
        self.spec.micro_batches = micro_batches

    def memory_limit(self, bytes_per_rank: float | None) -> None:
        """Peak memory per rank a plan must fit in, as `PlanConfig.memory_limit` means it: `math.inf`
        for no limit, None for the default, the device profile's capacity less `MEMORY_RESERVE`
        (allocator slack, communication buffers, the CUDA context)."""
        self.config = self.config.replace(memory_limit=bytes_per_rank)

    @property
    def resolved_memory_limit(self) -> float | None:
        return self.config.memory_limit_bytes(self.device)

    def pin(self, pins: Mapping[str, Layout | str] | str, layout: Layout | str | None = None) -> None:
        """Fix the layout of parameters matching an FQN pattern (`fnmatch`, e.g. `layers.*.wq.weight`)."""
        items = {pins: layout} if isinstance(pins, str) else dict(pins)
        for pattern, lay in items.items():
            if lay is None:
                raise ValueError(f"pin {pattern!r} needs a layout")
            self.spec.pins[pattern] = _as_layout(lay)

    # ------------------------------------------------------------------ planning
    def _step(self, model: nn.Module, *inputs: Any) -> torch.Tensor:
        if self.spec.stage_layout is not None:  # a pipeline stage returns what it sends on, uncast
            p = self.precision
            return model(*cast_floating(inputs, p.param_dtype if p.cast_forward_inputs else None))
        how = (self._input_names, self.n_model_inputs, self._mark_outputs, self.loss_output)
        return run_step(self._with_casts(model), self.loss_fn, inputs, *how)

    def _with_casts(self, model: nn.Module) -> Callable[..., Any]:
        """The model as the step calls it under the mixed precision policy: floating inputs cast to
        `param_dtype` (`cast_forward_inputs`), floating outputs to `output_dtype`."""
        p = self.precision
        cast_in = p.param_dtype if p.cast_forward_inputs else None
        if cast_in is None and p.output_dtype is None:
            return model

        def call(*args: Any, **kwargs: Any) -> Any:
            return cast_floating(model(*cast_floating(args, cast_in), **cast_floating(kwargs, cast_in)), p.output_dtype)

        return call

    def _mark_outputs(self, outputs: Any) -> Any:
        if self.spec.output_layouts:
            count = sum(isinstance(leaf, torch.Tensor) for leaf in tc.tree_leaves(outputs))
            if max(self.spec.output_layouts) >= count:
                raise ValueError(
                    f"output constraint for output {max(self.spec.output_layouts)}, but the model "
                    f"returns {count} tensor(s)"
                )
            outputs = mark_outputs(outputs)
        return outputs

    def optimize(self, *, planning: RankZeroPlanning | None = None, dry_run: bool = True) -> Plan:
        """Trace, build the ILP, solve it, decode the plan, fit it under the memory limit. Inside a
        process group of more than one rank, rank 0 solves and dry-runs for all (`planning`,
        default a `RankZeroPlanning` on this mesh) and the ranks check they hold the same plan.
        `dry_run=False`: the fit runs no program, holding the modeled (linear) part of the peak
        under the limit."""
        if planning is None and in_process_group():
            if device_mesh(self.mesh) is None:
                raise TypeError(
                    f"planning in a process group of {torch.distributed.get_world_size()} ranks needs "
                    f"the DeviceMesh, got mesh shape {self.mesh_shape}"
                )
            planning = RankZeroPlanning(
                device_mesh(self.mesh), backend=self.config.backend, time_limit=self.config.time_limit
            )
        with self.traced() as (graph, planner):
            spec, repeated = self.graph_spec(graph, planning)
            with self._stage("build"):
                sharding = build_problem(graph, self.mesh_shape, planner, self.device, spec, repeated=repeated)
            with self._stage("solve"):
                if planning is not None:
                    with tc.no_dispatch_modes():  # leave the tracer's fake mode: ranks communicate
                        solution = planning.solve(sharding)
                else:
                    solution = self._solve_step(None)(sharding.problem)
            with self._stage("decode"):
                plan = decode(sharding, solution, planner)
            plan, sharding = self._fit(plan, sharding, planner, planning, spec, dry_run)
        if planning is not None:
            planning.agree(sharding, plan)
        log.info("autoshard plan: %s", plan.summary())
        self.plan, self.sharding, self.planner = plan, sharding, planner
        return plan

    @contextlib.contextmanager
    def traced(self):
        """Yields (the traced joint graph, a planner for this mesh), valid inside the block: the
        tracer's fake mode ends with it. Planning sees global shapes only: no ambient mode (e.g.
        LocalTensorMode) applies to it."""
        inputs, self._input_names = step_inputs(self.input_fn())
        self._check_input_layouts(inputs)
        planner = Planner(self.mesh_shape, self.network)
        with tc.no_dispatch_modes(), without_cyclic_gc(), contextlib.ExitStack() as stack:
            with self._stage("trace"):
                graph = trace_step(
                    self.model,
                    self._step,
                    inputs,
                    stack,
                    unroll=self.config.unroll,
                    precision=self.precision,
                    stage=self.spec.stage_layout is not None,
                )
            yield graph, planner

    def graph_spec(
        self, graph: JointGraph, planning: RankZeroPlanning | None = None
    ) -> tuple[ProblemSpec, list | None]:
        """The constraints to build `graph`'s problem with, and its repeated blocks when finding
        them was needed already: a dp_replicate dim's placements are planned first (HSDP)."""
        replicate = self.config.replicate_dim
        if replicate is None:
            return self.spec, None
        with self._stage("replicas"):
            repeated = find_repeated_blocks(graph)
            fixed = fix_replicate_dim(
                graph,
                self.mesh_shape,
                replicate,
                self.network,
                self.device,
                self.spec,
                self._solve_step(planning),
                repeated=repeated,
            )
        return dataclasses.replace(self.spec, fixed_dim=fixed), repeated

    def _check_input_layouts(self, inputs: Sequence[Any]) -> None:
        for index, layout in self.spec.input_layouts.items():
            if index >= len(inputs):
                raise ValueError(f"input constraint for input {index}, but input_fn returns {len(inputs)} inputs")
            shape = tuple(inputs[index].shape)
            try:
                layout.validate(len(shape), self.mesh_shape)
            except ValueError as err:
                raise ValueError(f"input {index} (shape {shape}): {err}") from None

    def _solve_step(self, planning: RankZeroPlanning | None) -> Callable[..., solver.Solution]:
        """How a problem is solved here, under an optional cutoff: by this process, or by rank 0
        for every rank."""
        if planning is not None:
            return lambda problem, cutoff=None: _outside_modes(planning.solve_problem, problem, cutoff)
        return lambda problem, cutoff=None: limits.solve(
            problem, backend=self.config.backend, time_limit=self.config.time_limit, cutoff=cutoff
        )

    def _fit(
        self,
        plan: Plan,
        sharding: ShardingProblem,
        planner: Planner,
        planning: RankZeroPlanning | None,
        spec: ProblemSpec,
        dry_run: bool,
    ) -> tuple[Plan, ShardingProblem]:
        """The plan (and the problem it solves) fitted under the memory limit, if there is one."""
        self.fit, self._fit_dry_run = None, None
        limit = self.resolved_memory_limit
        if limit is None:
            return plan, sharding
        start = time.perf_counter()
        steps = planning.fit_steps(dry_run) if planning is not None else None  # None: solve and dry-run here
        if steps is None and not dry_run:
            steps = FitSteps(limits.solving_here(self.config.backend, self.config.time_limit), None)
        with tc.no_dispatch_modes():  # the dry run makes its own fake mode
            fitted = fit_memory(
                plan,
                sharding,
                planner,
                spec,
                limit,
                backend=self.config.backend,
                time_limit=self.config.time_limit,
                steps=steps,
            )
        self.fit, self._fit_dry_run = fitted.fit, fitted.dry_run
        if fitted.fit.peak_bytes is not None or fitted.fit.constrained:  # a stage when it dry-ran or re-planned
            self.timings["memory"] = time.perf_counter() - start
            log.info("autoshard: memory took %.2f s", self.timings["memory"])
        return fitted.plan, fitted.sharding

    @property
    def fit_dry_run(self) -> DryRunResult | None:
        """The dry run the memory fit ran of the plan it chose (None: it ran none)."""
        return self._fit_dry_run if self.fit is not None and self.fit.plan is self.plan else None

    def explain(self, fqn: str, top: int = 3, *, max_solves: int = MAX_SOLVES) -> Explanation:
        """Why the last `optimize()` gave parameter `fqn` (an FQN, or a pattern naming parameters
        with one layout) its layout: the `top` next best layouts, each the optimum re-solved with
        the parameter pinned to it (in every repeated block, as `pin` would), with its modeled
        step-time difference and the redistributions that change. Re-solves the problem that
        optimize() built: no tracing, no building. Raises ExplainError (a ValueError) naming close
        matches when `fqn` names no parameter."""
        if self.sharding is None or self.plan is None or self.planner is None:
            raise ValueError("nothing to explain: call optimize() first")
        with self._stage("explain"), limits.within_time_limit(self.config.time_limit):
            return explain(
                self.sharding,
                self.plan,
                self.planner,
                fqn,
                top=top,
                max_solves=max_solves,
                backend=self.config.backend,
                time_limit=self.config.time_limit,
            )

    def apply(
        self,
        plan: Plan | None = None,
        *,
        prefetch: int = 1,
        bucket_bytes: float = DEFAULT_BUCKET_BYTES,
        seed: int = 0,
        accumulate: bool | None = None,
        apart: bool = False,
    ) -> ParallelModule:
        """The parallel module of `plan` (default: the last `optimize()` result) on this mesh.
        Bucketed gathers and gradient reductions run up to `prefetch` buckets ahead (0: none);
        gradient all-reduces run in buckets of at most `bucket_bytes` (DDP's bucket_cap_mb).
        Its random ops (dropout) draw from `seed`: the same values on every rank holding a value.
        `accumulate` (default: when the plan is for micro-batches, `spec.micro_batches` > 1): its
        `no_sync()` holds gradient all-reduces for the last micro-batch. `apart`: its backward
        runs in an input and a weight half (a pipeline stage under a zero-bubble schedule)."""
        plan = plan if plan is not None else self.plan
        if plan is None:
            raise ValueError("nothing to apply: call optimize() first or pass a plan")
        mesh = device_mesh(self.mesh)
        if mesh is None:
            raise TypeError(
                f"applying a plan needs a DeviceMesh, got mesh shape {self.mesh_shape}; "
                "planning alone works with a shape"
            )
        with self._stage("apply"):
            return parallelize(
                plan,
                mesh,
                self.model,
                prefetch=prefetch,
                bucket_bytes=bucket_bytes,
                compile=self.compile,
                seed=seed,
                accumulate=plan.micro_batches > 1 if accumulate is None else accumulate,
                apart=apart,
            )

    def dry_run(self, plan: Plan | None = None) -> DryRunResult:
        """Run rank 0's program of `plan` (default: the last `optimize()` result) on fake tensors
        under a fake process group (inside a process group: this rank's program on this mesh, a
        collective call): proof that it runs at the scale it was planned for, and its peak memory
        per rank with a breakdown. Raises `DryRunError` naming the node that cannot run."""
        plan = plan if plan is not None else self.plan
        if plan is None:
            raise ValueError("nothing to dry-run: call optimize() first or pass a plan")
        mesh = device_mesh(self.mesh)  # a DeviceMesh: run on it
        if mesh is None and self.fit_dry_run is not None and plan is self.plan:
            self.timings["dry_run"] = 0.0  # fitting the memory limit ran this very dry run
            return self.fit_dry_run
        with self._stage("dry_run"):
            return dry_run(plan, mesh=mesh, mesh_dim_names=self.config.mesh_names)

    @contextlib.contextmanager
    def _stage(self, stage: str):
        """Time one planning stage into `self.timings` and log it."""
        start = time.perf_counter()
        yield
        self.timings[stage] = time.perf_counter() - start
        log.info("autoshard: %s took %.2f s", stage, self.timings[stage])


def auto_shard(
    model: nn.Module,
    input_fn: Callable[[], Any],
    mesh: Mesh | None = None,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    input_layouts: Sequence[Layout | str | None] = (),
    pins: Mapping[str, Layout | str] | None = None,
    memory_budget: float | None = None,
    seed: int = 0,
    **options: Any,
) -> ParallelModule:
    """Plan and apply in one call: the parallel module for `model` on the DeviceMesh `mesh`.
    `options` go to `AutoShard` (config, n_model_inputs, loss_output, network, device, unroll, mp_policy, recompute,
    reshard_after_forward, compile). Under torchrun, rank 0 solves for every rank. Random ops
    (dropout) draw from `seed`, the same values on every rank holding a value."""
    auto = AutoShard(model, input_fn, mesh, loss_fn=loss_fn, **options)
    if input_layouts:
        auto.constrain_inputs(*input_layouts)
    if pins:
        auto.pin(pins)
    auto.memory_budget(memory_budget)
    auto.optimize()
    return auto.apply(seed=seed)
