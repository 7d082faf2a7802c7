"""`python -m autoshard plan`: plan a model's sharding and write the sharding log, plan JSON and report.html.

`python -m autoshard plan --model llama3-8b --mesh 8x8 --batch 8 --seq 8192 --out plans/8b`
plans in one process (fake process group, model on meta: no weights, no devices) and writes the
sharding log, plan JSON and report.html. Bad input ends with one `error: ...` line on stderr and exit code 2
(autoshard.cli.args), never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import sys
from pathlib import Path
from typing import Sequence

from autoshard.cli import args as shared
from autoshard.cli.args import DEFAULT_MESH_NAMES, ArgumentParser, fail, mesh_names

log = logging.getLogger("autoshard")

BACKENDS = ("auto", "highs", "cbc")
COMPARE = {"manual": "fsdp-tp"}  # --compare name -> the hand-written recipe it pins (recipes.py)


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    shared.MODEL.add(parser, required=True)
    shared.MESH.add(parser, required=True)
    shared.BATCH.add(parser, required=True)
    shared.SEQ.add(parser, required=True)
    shared.OUT.add(parser, type=Path, default=None,
                   help="directory for sharding.log, plan.json and report.html (default plans/<model>-<mesh>)")
    shared.NETWORK.add(parser, default="h100-node", help=shared.NETWORK.kwargs["help"] + " (default h100-node)")
    shared.DEVICE.add(parser, dest="device", default="h100", help=shared.DEVICE.kwargs["help"] + " (default h100)")
    shared.MESH_NAMES.add(parser, default=None, help="mesh dim names, e.g. dp,tp (recorded in the report)")
    shared.MEMORY_BUDGET.add(parser, default=None)
    shared.PARAM_DTYPE.add(parser, default=None)
    shared.REDUCE_DTYPE.add(parser, default=None)
    shared.RECOMPUTE.add(parser, default=False)
    shared.RESHARD.add(parser, default=False)
    shared.MEMORY_LIMIT.add(parser, default=None)
    shared.INIT_FROM.add(parser, default=None, help="check that this safetensors checkpoint (file or directory) "
                                                    "holds every parameter of the model with its shape (reads headers "
                                                    "only), as `train --init-from` will load it")
    parser.add_argument("--compare", choices=sorted(COMPARE), default=None,
                        help="also plan with the hand-written FSDP+TP recipe pinned and compare (2-D meshes)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="ILP backend (default auto)")
    parser.add_argument("--time-limit", type=float, default=None, metavar="SECONDS", help="ILP time limit")
    parser.add_argument("--explain", default=None, metavar="FQN",
                        help="after planning, show the chosen layout of this parameter (FQN or pattern) and the "
                             "next best layouts, each re-solved with it pinned, with their step-time difference "
                             "and the redistributions that change")
    parser.add_argument("--explain-top", type=shared._arg_type(shared._positive_int), default=3, metavar="N",
                        help="how many next best layouts --explain shows (default 3)")
    parser.add_argument("--dry-run", action=argparse.BooleanOptionalAction, default=True,
                        help="run rank 0's lowered program on fake tensors and report its peak memory "
                             "(default on; --no-dry-run skips it)")


def plan_parser(prog: str = "python -m autoshard plan") -> ArgumentParser:
    parser = ArgumentParser(prog=prog, description="Plan a model's sharding and write the sharding log and plan JSON.")
    add_plan_arguments(parser)
    return parser


def plan_main(argv: Sequence[str] | None = None) -> int:
    """`python -m autoshard plan ...` (argv without the `plan` word)."""
    return run_plan(plan_parser().parse_args(argv))


# ------------------------------------------------------------------------------------ plan
def _check(args: argparse.Namespace):
    """Validate everything cheap before the expensive part; returns the workload."""
    from autoshard.profiles.files import device_profile, network_profile
    from autoshard.workloads import get_workload

    try:
        workload = get_workload(args.model, args.seq)
        args.network_profile = network_profile(args.network, args.mesh)  # a preset or a calibrated file
        args.device_profile = device_profile(args.device)
    except ValueError as err:
        fail(str(err))
    if args.batch % args.mesh[0]:
        fail(f"batch {args.batch} is not divisible by mesh dim 0 (size {args.mesh[0]})")
    if args.mesh_names is None and len(args.mesh) > len(DEFAULT_MESH_NAMES):  # the names are only a label here
        args.mesh_dim_names = tuple(f"m{i}" for i in range(len(args.mesh)))
    else:
        try:
            args.mesh_dim_names = mesh_names(args.mesh_names, args.mesh)  # the dry run's mesh is named
        except ValueError as err:
            fail(str(err))
    if args.compare and len(args.mesh) != 2:
        fail(f"--compare {args.compare} needs a 2-D (dp, tp) mesh, got {args.mesh}")
    if args.time_limit is not None and args.time_limit <= 0:
        fail(f"--time-limit must be positive, got {args.time_limit}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        fail(f"--out {args.out} exists and is not a directory")
    if args.init_from is not None:  # headers only: no weights are read
        from autoshard.workloads import check_checkpoint, read_safetensors

        try:
            check_checkpoint(workload, workload.adapt_state_dict(read_safetensors(args.init_from, shapes_only=True)),
                             args.init_from)
        except ValueError as err:
            fail(f"--init-from {err}")
    if args.explain is not None:  # a name check on the meta model, before planning
        from autoshard.problem.explain import ExplainError, match_params

        try:
            match_params(args.explain, [name for name, _ in workload.build("meta").named_parameters()])
        except ExplainError as err:
            fail(f"--explain {err}")
    return workload


def _setup_logging() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)


def _plan_once(workload, args, *, pins: dict | None = None, budget: float | None = None, what: str):
    """One AutoShard run on a fresh meta model; returns (plan, timings, the AutoShard)."""
    from autoshard.api import AutoShard

    model = workload.build("meta")

    def inputs():
        return workload.example_inputs(args.batch, args.seq, "meta")

    log.info("planning %s: %s on mesh %s, batch %d, seq %d", what, workload.name, args.mesh, args.batch, args.seq)
    try:
        with AutoShard(model, inputs, args.mesh, loss_fn=workload.loss_fn, n_model_inputs=workload.n_model_inputs,
                       network=args.network_profile, device=args.device_profile,
                       mp_policy=shared.mp_policy(args.param_dtype, args.reduce_dtype),
                       recompute=args.recompute, reshard_after_forward=args.reshard_after_forward) as auto:
            if pins:
                auto.pin(pins)
            auto.memory_budget(budget)
            if what != "autoshard":  # a compared recipe is planned as it is, memory aside
                auto.memory_limit(None)
            elif args.memory_limit is not None:  # else the device's capacity less the reserve
                auto.memory_limit(None if math.isinf(args.memory_limit) else args.memory_limit)
            elif not args.dry_run:  # fitting the default limit dry-runs plans: --no-dry-run skips it
                log.info("memory limit not checked (--no-dry-run; give --memory-limit to check one)")
                auto.memory_limit(None)
            plan = auto.optimize(backend=args.backend, time_limit=args.time_limit)
    except ValueError as err:  # e.g. a layout that does not split a shape evenly on this mesh
        fail(f"planning {what} failed: {err}")
    return plan, dict(auto.timings), auto


def _explain(auto, args):
    """`--explain`: re-solve the problem just built with the parameter pinned to each other layout."""
    from autoshard.problem.explain import ExplainError

    log.info("explaining %s: re-solving with each other layout pinned", args.explain)
    try:
        return auto.explain(args.explain, top=args.explain_top, backend=args.backend, time_limit=args.time_limit)
    except ExplainError as err:
        fail(f"--explain {err}")


def _dry_run(plan, args, auto):
    """Run the plan's program on fake tensors (in the fake process group); one error line if it cannot."""
    from autoshard.runtime.dryrun import DryRunError, dry_run

    if auto.fit is not None and auto.fit.plan is plan and auto.fit.dry_run is not None:
        return auto.fit.dry_run  # fitting the memory limit dry-ran this plan already
    log.info("dry run: rank 0's program on fake tensors")
    try:
        return dry_run(plan, mesh_dim_names=args.mesh_dim_names)
    except DryRunError as err:
        fail(f"the planned program cannot run: {err.line}")


def _manual_budget(workload, recipe: str, mesh: tuple[int, ...]) -> float:
    """Parameter bytes per rank of the recipe's layouts: the budget its pinned plan needs
    (norms are replicated over tp, so the default total / world size would be infeasible)."""
    from autoshard.problem.recipes import param_bytes_per_rank, recipe_layouts

    model = workload.build("meta")
    try:
        return param_bytes_per_rank(model, recipe_layouts(model, recipe), mesh)
    except ValueError as err:
        fail(f"recipe {recipe}: {err}")


def _process_group(world: int):
    """A fake process group of `world` ranks, unless the caller already made one."""
    import torch.distributed as dist

    from autoshard._torch_compat import fake_process_group

    if dist.is_available() and dist.is_initialized():
        return contextlib.nullcontext()
    return fake_process_group(world)


def _say(line: str) -> None:
    """Print to stdout, replacing characters (µ) a non-UTF-8 console cannot show."""
    enc = getattr(sys.stdout, "encoding", None) or "utf-8"
    print(line.encode(enc, errors="replace").decode(enc))


def run_plan(args: argparse.Namespace) -> int:
    from autoshard.problem.recipes import recipe_pins
    from autoshard.report.build import modeled_figures, plan_report
    from autoshard.report.files import HTML_NAME, write_report_files
    from autoshard.report.text import compare_lines, explain_lines, summary_lines

    workload = _check(args)
    _setup_logging()
    mesh_text = "x".join(map(str, args.mesh))
    out = args.out if args.out is not None else Path("plans") / f"{args.model}-{mesh_text}"
    run = {"model": args.model, "mesh": list(args.mesh), "mesh_names": list(args.mesh_dim_names), "batch": args.batch,
           "seq": args.seq, "network": args.network, "device": args.device, "backend": args.backend,
           "memory_budget": args.memory_budget, "dry_run": args.dry_run, "recompute": args.recompute,
           "reshard_after_forward": args.reshard_after_forward,
           "param_dtype": args.param_dtype, "reduce_dtype": args.reduce_dtype,
           "memory_limit": args.memory_limit}
    extra: dict = {"run": run}
    with _process_group(math.prod(args.mesh)):
        plan, timings, auto = _plan_once(workload, args, budget=args.memory_budget, what="autoshard")
        explanation = _explain(auto, args) if args.explain is not None else None
        if explanation is not None:
            timings["explain"] = explanation.seconds
        memory = _dry_run(plan, args, auto) if args.dry_run else None
        if memory is not None and not (auto.fit is not None and memory is auto.fit.dry_run):
            timings["dry_run"] = memory.seconds  # (a dry run that fitting the limit ran is in its stage)
        if args.compare:
            recipe = COMPARE[args.compare]
            budget = _manual_budget(workload, recipe, args.mesh)
            manual, manual_timings, _ = _plan_once(workload, args, pins=recipe_pins(recipe), budget=budget,
                                                what=f"{args.compare} ({recipe} recipe pinned)")
            extra["compare"] = {args.compare: {
                "label": f"{recipe} pinned",
                "recipe": recipe,
                "memory_budget": budget,
                "param_bytes_per_rank": budget,  # every parameter is pinned: exactly the recipe's bytes
                **modeled_figures(manual),
                "non_default_order_params": len(manual.non_default_order_params()),
                "timings": manual_timings,
            }}
    report = plan_report(plan, dry_run=memory, device=args.device_profile, timings=timings,
                         explanation=explanation, memory_fit=auto.fit, extra=extra)
    try:
        log_path, json_path = write_report_files(report, out)
    except OSError as err:
        fail(f"cannot write the report to {out}: {err}")
    for line in summary_lines(report) + compare_lines(report):
        _say(line)
    if report.get("explain"):
        for line in [f"explain {args.explain}:"] + explain_lines(report["explain"]):
            _say(line)
    _say(f"wrote {log_path}, {json_path} and {log_path.with_name(HTML_NAME)}")
    return 0
