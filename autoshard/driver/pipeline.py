"""Plan a mesh with a pp dim: stage cuts, schedule, micro-batches and each stage's layouts.

    result = plan_pipeline(model, lambda rows: (tokens[:rows], labels[:rows]), PlanConfig(
        mesh=(8, 8, 8), mesh_names=("pp", "dp", "tp"), param_dtype="bf16"), batch=256,
        loss_fn=cross_entropy_loss)
    result.best.blocks, result.best.schedule, result.best.step_time_s

A search above the ILP (Alpa's inter-operator pass over our intra-operator one): for each
micro-batch count it traces the step once at that micro-batch's rows, on the stage sub-mesh (the
mesh without pp), and solves the whole model there in a few layout families: free or fully
sharded parameters, keeping or recomputing activations, priced for gradient accumulation over
the micro-batches (held reductions once a step). Each solved plan splits into per-block segments
(`pipeline.segments`), and a dynamic program over cut points (`pipeline.search`) prices every
cut from those sums, so no cut needs an ILP of its own. Stage memory is the modeled (linear)
peak; `driver.stage_memory` dry-runs the chosen pipeline's stages afterwards.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch
from torch import nn

import autoshard_solver as solver
from autoshard import _torch_compat as tc
from autoshard.driver import limits
from autoshard.driver.api import AutoShard
from autoshard.driver.config import PlanConfig
from autoshard.pipeline.schedules import Schedule, schedules
from autoshard.pipeline.search import Link, Pipeline, Run, even_cut, search
from autoshard.pipeline.segments import Segments, plan_segments, segments_of
from autoshard.problem.build import build_problem, with_options, with_param_budget
from autoshard.problem.memory import peak_memory_table
from autoshard.problem.plan import Plan, decode
from autoshard.profiles.files import device_profile, network_profile

log = logging.getLogger("autoshard")

MAX_COUNTS = 3  # micro-batch counts tried: the fewest that keep every stage busy, and the next ones


@dataclass(frozen=True)
class Family:
    """A way to lay out a stage: parameters free or fully sharded over the sub-mesh, activations
    kept or recomputed; a sharded stage may also gather its parameters once a step and hold them
    across the micro-batches, reducing gradients once (FSDP under torch's pipelining: the same
    layouts, priced by `plan_segments(gathered_once=True)`)."""

    sharded: bool
    recompute: bool
    gathered_once: bool = False

    @property
    def name(self) -> str:
        once = ", gathered once" if self.gathered_once else ""
        return ("sharded" if self.sharded else "free") + (", recompute" if self.recompute else "") + once


FAMILIES = tuple(Family(s, r) for r in (False, True) for s in (False, True))  # each solved on its own


@dataclass
class PipelinePlan:
    """The search's result: the best pipeline, the runners-up (fastest first, one per schedule and
    micro-batch count), torchtitan's even split under the best one's schedule and micro-batches,
    and the stage sub-mesh plans the stages' layouts come from (with their segments). `config` is
    the one planned for, its profiles resolved."""

    config: PlanConfig
    batch: int
    best: Pipeline
    others: list[Pipeline]
    even: Pipeline | None
    plans: dict[tuple[int, str], Plan] = field(repr=False)  # (micro-batches, family name) -> plan
    segments: dict[tuple[int, str], Segments] = field(repr=False)  # the same keys -> its segments
    timings: dict[str, float] = field(default_factory=dict)

    def stage_plan(self, chunk: int = 0) -> Plan:
        """The sub-mesh plan whose layouts chunk `chunk` of the best pipeline runs."""
        return self.plans[(self.best.micro_batches, self.best.stages[chunk].family)]

    def family_steps(self) -> dict[str, float]:
        """Each layout family's step for the whole model on the stage mesh at the best micro-batch
        count, as the family prices it (its micro-batches one after another, no pipeline)."""
        m = self.best.micro_batches
        return {
            family: m * sum(s.micro_s for s in segs.items) + sum(s.step_s for s in segs.items)
            for (count, family), segs in self.segments.items()
            if count == m
        }


def micro_batch_counts(rows_per_replica: int, ranks: int, most: int = MAX_COUNTS) -> list[int]:
    """Micro-batch counts that split each data-parallel replica's rows evenly: the `most`
    smallest of at least `ranks` (fewer leave stages idle), or the largest there is."""
    counts = [m for m in range(1, rows_per_replica + 1) if rows_per_replica % m == 0]
    enough = [m for m in counts if m >= ranks]
    return enough[:most] if enough else counts[-1:]


def plan_pipeline(
    model: nn.Module,
    input_fn: Callable[[int], Any],
    config: PlanConfig,
    *,
    batch: int,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    n_model_inputs: int = 1,
    micro_batches: list[int] | None = None,
) -> PipelinePlan:
    """Plan `model` on `config`'s mesh, whose first dim is pp. `input_fn(rows)` returns the step's
    inputs with `rows` rows (global shapes); `batch` is the global batch. `micro_batches`: the
    counts to try (default `micro_batch_counts`). ValueError when no pipeline fits the memory
    limit, or the batch does not split."""
    ranks = config.pipeline_ranks
    if ranks is None or config.mesh is None:
        raise ValueError("plan_pipeline needs a mesh whose first dim is named pp")
    if getattr(type(model), "pipeline_stages", True) is False:
        raise ValueError(f"{type(model).__name__} does not split into pipeline stages yet: plan it without a pp dim")
    config = config.with_default_profiles()
    assert config.mesh is not None and config.network is not None and config.device_profile is not None
    network = network_profile(config.network, config.mesh, config.intra_node_dims)
    device = device_profile(config.device_profile)
    config = config.replace(network=network, device_profile=device)
    stage = config.stage_config()
    stage.check_batch(batch)
    assert stage.mesh is not None
    replicas = math.prod(stage.mesh[d] for d in stage.data_parallel_dims)
    counts = micro_batches or micro_batch_counts(batch // replicas, ranks)
    for m in counts:
        if batch % (replicas * m):
            raise ValueError(f"{m} micro-batches do not split the {batch // replicas} rows of each dp replica")
    limit = config.memory_limit_bytes(device)
    bound = math.inf if limit is None else limit
    link = Link(*network.link([0]))
    plans: dict[tuple[int, str], Plan] = {}
    segments: dict[tuple[int, str], Segments] = {}
    start = time.perf_counter()
    for m in counts:
        rows = batch // m
        solved = _solve_families(model, partial(input_fn, rows), stage, m, loss_fn, n_model_inputs, ranks, bound)
        for name, (plan, segs) in solved.items():
            plans[(m, name)], segments[(m, name)] = plan, segs
        log.info("autoshard: %d micro-batches of %d rows: %d layout families priced", m, rows, len(solved))
    timings = {"stages": time.perf_counter() - start}
    start = time.perf_counter()
    by_count = {m: (batch // m, {f: s for (c, f), s in segments.items() if c == m}) for m in counts}
    orders = functools.cache(_torch_order)
    ranked = search(by_count, schedules(ranks), ranks, link, bound, orders)
    timings["search"] = time.perf_counter() - start
    log.info("autoshard: pipeline search took %.2f s", timings["search"])
    if not ranked:
        raise ValueError(
            f"no pipeline of {ranks} stages fits {bound / 2**30:.1f} GiB per rank at "
            f"{', '.join(map(str, counts))} micro-batches, in any layout family (a larger mesh, a "
            f"smaller batch or a higher --memory-limit)"
        )
    best = ranked[0]
    rows, families = by_count[best.micro_batches]
    even = even_cut(families, best.schedule, Run(ranks, best.micro_batches, rows, link, bound), orders)
    return PipelinePlan(config, batch, best, _runners_up(ranked), even, plans, segments, timings)


def _torch_order(schedule: Schedule, ranks: int, micro_batches: int) -> tc.Order | None:
    """torch's order of each rank's work under `schedule`, where its class keeps one."""
    return tc.schedule_order(schedule.torch_class, ranks, schedule.virtual, micro_batches)


def _runners_up(ranked: list[Pipeline]) -> list[Pipeline]:
    """The best pipeline of each other (schedule, micro-batch count), fastest first."""
    best = (ranked[0].schedule, ranked[0].micro_batches)
    seen: set[tuple[Schedule, int]] = {best}
    others = []
    for p in ranked[1:]:
        key = (p.schedule, p.micro_batches)
        if key not in seen:
            seen.add(key)
            others.append(p)
    return others


def _solve_families(
    model: nn.Module,
    inputs: Callable[[], Any],
    stage: PlanConfig,
    micro_batches: int,
    loss_fn: Callable[..., torch.Tensor] | None,
    n_model_inputs: int,
    ranks: int,
    bound: float,
) -> dict[str, tuple[Plan, Segments]]:
    """Each family's plan of the whole model on the stage sub-mesh and its segments, from one
    trace and one build. Left out: a family no layout can meet (full sharding that does not
    divide), and free parameters with recomputation when the free plan's parameter state for an
    even share of the blocks (of `ranks` stages) already exceeds the limit `bound` (recomputing
    activations does not shrink it)."""
    auto = AutoShard(
        model,
        inputs,
        config=stage.replace(memory_limit=math.inf),
        loss_fn=loss_fn,
        n_model_inputs=n_model_inputs,
        stages=ranks,
    )
    auto.accumulate(micro_batches)
    with auto.traced() as (graph, planner):
        spec, repeated = auto.graph_spec(graph)
        keep = build_problem(graph, auto.mesh_shape, planner, auto.device, spec, repeated=repeated)
    recompute = with_options(keep, dataclasses.replace(spec, recompute=True))
    budget = sum(p.numel() * p.element_size() for p in model.parameters()) / math.prod(auto.mesh_shape)
    where = segments_of(keep)  # every problem here is of one graph
    problems = {False: keep, True: recompute}  # by whether the family recomputes
    tables = {recomputes: peak_memory_table(sp) for recomputes, sp in problems.items()}
    found: dict[str, tuple[Plan, Segments]] = {}
    for family in FAMILIES:
        if (
            family.recompute
            and not family.sharded
            and _holds_too_much(found.get(Family(False, False).name), ranks, bound)
        ):
            log.info("autoshard: layout family %s left out: free parameters alone overfill a stage", family.name)
            continue
        sp, table = problems[family.recompute], tables[family.recompute]
        problem = with_param_budget(sp, budget) if family.sharded else sp.problem
        try:
            solution = limits.solve(problem, backend=stage.backend, time_limit=stage.time_limit)
        except solver.InfeasibleError as err:
            log.info("autoshard: layout family %s: %s", family.name, err)
            continue
        plan = decode(sp, solution, planner)
        found[family.name] = (plan, plan_segments(plan, sp, segment_map=where, table=table))
        if family.sharded:
            once = dataclasses.replace(family, gathered_once=True)
            found[once.name] = (plan, plan_segments(plan, sp, gathered_once=True, segment_map=where, table=table))
    return found


def _holds_too_much(free: tuple[Plan, Segments] | None, ranks: int, bound: float) -> bool:
    """Whether the free family's state of an even share of the blocks exceeds `bound`."""
    if free is None:
        return False
    blocks = free[1].items[1:-1]
    share = math.ceil(len(blocks) / ranks)
    return sum(sorted(b.state_bytes for b in blocks)[:share]) > bound
