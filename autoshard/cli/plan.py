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

from autoshard import options
from autoshard.cli.args import ArgumentParser, add_dataclass_arguments, add_option, fail
from autoshard.driver.config import PlanConfig
from autoshard.options import from_values, run_name

log = logging.getLogger("autoshard")

COMPARE = {"manual": "fsdp-tp"}  # --compare name -> the hand-written recipe it pins (recipes.py)
NO_PP = "no-pp"  # --compare for a pp mesh: the same devices planned without pipeline stages


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    add_option(parser, options.MODEL, required=True)
    add_option(parser, options.BATCH, required=True)
    add_option(parser, options.SEQ, required=True)
    add_option(parser, options.LORA, default=None)
    add_option(parser, options.FREEZE, default=None)
    add_dataclass_arguments(parser, PlanConfig, {"mesh": {"required": True}})
    add_option(
        parser,
        options.OUT,
        type=Path,
        default=None,
        help="directory for sharding.log, plan.json and report.html (default plans/<model>-<mesh>)",
    )
    add_option(
        parser,
        options.INIT_FROM,
        default=None,
        help="check that this safetensors checkpoint (file or directory) holds every parameter of the model "
        "with its shape (reads headers only), as `train --init-from` will load it",
    )
    parser.add_argument(
        "--compare",
        choices=sorted([*COMPARE, NO_PP]),
        default=None,
        help="also plan with the hand-written FSDP+TP recipe pinned (manual, 2-D meshes) or the same "
        "devices without the pp dim (no-pp, folded into the first dp dim), and compare",
    )
    parser.add_argument(
        "--explain",
        default=None,
        metavar="FQN",
        help="after planning, show the chosen layout of this parameter (FQN or pattern) and the "
        "next best layouts, each re-solved with it pinned, with their step-time difference "
        "and the redistributions that change (with a pp dim: in the stage that holds it, after "
        "the pipeline's runners-up)",
    )
    add_option(
        parser,
        options.option(
            "--explain-top",
            type=options.positive_int,
            default=3,
            metavar="N",
            help="how many next best layouts --explain shows (default 3)",
        ),
    )
    parser.add_argument(
        "--dry-run",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run rank 0's lowered program on fake tensors and report its peak memory "
        "(default on; --no-dry-run skips it)",
    )


def plan_parser(prog: str = "python -m autoshard plan") -> ArgumentParser:
    parser = ArgumentParser(prog=prog, description="Plan a model's sharding and write the sharding log and plan JSON.")
    add_plan_arguments(parser)
    return parser


def plan_main(argv: Sequence[str] | None = None) -> int:
    """`python -m autoshard plan ...` (argv without the `plan` word)."""
    return run_plan(plan_parser().parse_args(argv))


# ------------------------------------------------------------------------------------ plan
def _check(args: argparse.Namespace):
    """Validate everything cheap before the expensive part; returns the workload and the config
    (profiles resolved: a preset or a calibrated file)."""
    from autoshard.profiles.files import device_profile, network_profile
    from autoshard.workloads import get_workload
    from autoshard.workloads.finetune import FineTune, fine_tuned

    try:
        config = from_values(PlanConfig, vars(args)).with_default_profiles()
        config.check_batch(args.batch)
        workload = get_workload(args.model, args.seq)
        tune = FineTune.from_flags(args.lora, args.freeze, config.precision.param_dtype)  # --lora, --freeze
        workload = fine_tuned(workload, tune)
        config = config.replace(
            network=network_profile(config.network, config.mesh, config.intra_node_dims),
            device_profile=device_profile(config.device_profile),
        )
    except ValueError as err:
        fail(str(err))
    if config.pipeline_ranks is not None and args.compare in COMPARE:
        fail(f"--compare {args.compare} plans one stage mesh: not with a pp dim")
    if args.compare == NO_PP and config.pipeline_ranks is None:
        fail(f"--compare {NO_PP} needs a mesh with a pp dim (--mesh-names pp,...)")
    if args.compare in COMPARE and len(config.mesh) != 2:
        fail(f"--compare {args.compare} needs a 2-D (dp, tp) mesh, got {config.mesh}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        fail(f"--out {args.out} exists and is not a directory")
    if args.init_from is not None:  # headers only: no weights are read
        from autoshard.workloads import check_checkpoint, read_safetensors

        try:
            check_checkpoint(
                workload, workload.adapt_state_dict(read_safetensors(args.init_from, shapes_only=True)), args.init_from
            )
        except ValueError as err:
            fail(f"--init-from {err}")
    if args.explain is not None:  # a name check on the meta model, before planning
        from autoshard.problem.explain import ExplainError, match_params

        try:
            match_params(args.explain, [name for name, _ in workload.build("meta").named_parameters()])
        except ExplainError as err:
            fail(f"--explain {err}")
    return workload, config


def _setup_logging() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)


def _plan_once(
    workload, config: PlanConfig, args, *, pins: dict | None = None, budget: float | None = None, what: str, fit=None
):
    """One AutoShard run on a fresh meta model; returns (plan, timings, the AutoShard). `fit`: under
    the memory limit (default: for autoshard's own plan; a compared recipe is planned as it is)."""
    from autoshard.driver.api import AutoShard

    model = workload.build("meta")

    def inputs():
        return workload.example_inputs(args.batch, args.seq, "meta")

    if not (what == "autoshard" if fit is None else fit):
        config = config.replace(memory_limit=math.inf)
    elif not args.dry_run:
        log.info("memory limit checked on the modeled peak only (--no-dry-run: no program runs)")
    log.info("planning %s: %s on mesh %s, batch %d, seq %d", what, workload.name, config.mesh, args.batch, args.seq)
    try:
        with AutoShard(
            model,
            inputs,
            config=config.replace(memory_budget=budget),
            loss_fn=workload.loss_fn,
            n_model_inputs=workload.n_model_inputs,
        ) as auto:
            if pins:
                auto.pin(pins)
            plan = auto.optimize(dry_run=args.dry_run)
    except ValueError as err:  # e.g. a layout that does not split a shape evenly on this mesh
        fail(f"planning {what} failed: {err}")
    return plan, dict(auto.timings), auto


def _explain(auto, args):
    """`--explain`: re-solve the problem just built with the parameter pinned to each other layout."""
    from autoshard.problem.explain import ExplainError

    log.info("explaining %s: re-solving with each other layout pinned", args.explain)
    try:
        return auto.explain(args.explain, top=args.explain_top)
    except ExplainError as err:
        fail(f"--explain {err}")


def _dry_run(plan, auto):
    """Run the plan's program on fake tensors (in the fake process group); one error line if it cannot."""
    from autoshard.runtime.dryrun import DryRunError, dry_run

    if auto.fit_dry_run is not None:
        return auto.fit_dry_run  # fitting the memory limit dry-ran this plan already
    log.info("dry run: rank 0's program on fake tensors")
    try:
        return dry_run(plan, mesh_dim_names=auto.config.mesh_names)
    except DryRunError as err:
        fail(f"the planned program cannot run: {err.line}")


def _manual_budget(workload, recipe: str, mesh: tuple[int, ...]) -> float:
    """Parameter bytes per rank of the recipe's layouts: the budget its pinned plan needs
    (norms are replicated over tp, so the default total / world size would be infeasible)."""
    from autoshard.problem.recipes import param_bytes_per_rank, recipe_layouts

    model = workload.build("meta")
    try:
        return param_bytes_per_rank(model, recipe_layouts(model, recipe, len(mesh)), mesh)
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
    from autoshard.report.build import plan_report
    from autoshard.report.files import HTML_NAME, write_report_files
    from autoshard.report.text import compare_lines, explain_lines, summary_lines

    workload, config = _check(args)
    _setup_logging()
    out = args.out if args.out is not None else Path("plans") / run_name(args.model, config.mesh)
    run = {
        "model": args.model,
        "mesh": list(config.mesh),
        "mesh_names": list(config.mesh_names),
        "batch": args.batch,
        "seq": args.seq,
        "network": args.network or config.network.name,
        "device": args.device_profile or config.device_profile.name,
        "backend": config.backend,
        "memory_budget": config.memory_budget,
        "dry_run": args.dry_run,
        "recompute": config.recompute,
        "reshard_after_forward": config.reshard_after_forward,
        "param_dtype": config.param_dtype,
        "reduce_dtype": config.reduce_dtype,
        "memory_limit": config.memory_limit,
    }
    extra: dict = {"run": run}
    if config.pipeline_ranks is not None:
        return _run_pipeline(workload, config, args, out, extra)
    with _process_group(math.prod(config.mesh)):
        plan, timings, auto = _plan_once(workload, config, args, budget=config.memory_budget, what="autoshard")
        explanation = _explain(auto, args) if args.explain is not None else None
        if explanation is not None:
            timings["explain"] = explanation.seconds
        memory = _dry_run(plan, auto) if args.dry_run else None
        if memory is not None and memory is not auto.fit_dry_run:
            timings["dry_run"] = memory.seconds  # (a dry run that fitting the limit ran is in its stage)
        if args.compare:
            extra["compare"] = {args.compare: _compare(workload, config, args)}
        extra |= {"fingerprint": auto.sharding.fingerprint(), "solution": plan.solution.to_json()}  # --plan-file
    report = plan_report(
        plan,
        dry_run=memory,
        device=config.device_profile,
        timings=timings,
        explanation=explanation,
        memory_fit=auto.fit,
        mesh_names=config.mesh_names,
        extra=extra,
    )
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


def _run_pipeline(workload, config: PlanConfig, args, out: Path, extra: dict) -> int:
    """`plan` on a mesh with a pp dim: the pipeline search (`driver.pipeline`), then the report of
    the search and of the first stage's layout family."""
    from autoshard.driver.pipeline import plan_pipeline
    from autoshard.report.build import explain_entry, plan_report
    from autoshard.report.files import HTML_NAME, write_report_files
    from autoshard.report.pipeline import pipeline_entry, pipeline_explain_lines
    from autoshard.report.text import explain_lines, summary_lines

    log.info("planning a pipeline: %s on mesh %s, batch %d, seq %d", workload.name, config.mesh, args.batch, args.seq)
    if args.dry_run:
        from autoshard.driver.stage_memory import start_workers

        start_workers()  # the stages' dry runs fork from it later: it imports while the search runs
    model = workload.build("meta")
    inputs = lambda rows: workload.example_inputs(rows, args.seq, "meta")  # noqa: E731
    if args.explain is not None:  # a name no stage holds fails now, not after the search
        from autoshard.problem.explain import ExplainError, match_params

        try:
            match_params(args.explain, [name for name, _ in model.named_parameters()])
        except ExplainError as err:
            fail(f"--explain {err}")
    with _process_group(math.prod(config.mesh[1:])):
        try:
            result = plan_pipeline(
                model,
                inputs,
                config,
                batch=args.batch,
                loss_fn=workload.loss_fn,
                n_model_inputs=workload.n_model_inputs,
            )
        except ValueError as err:
            fail(f"planning the pipeline failed: {err}")
        chosen = _chosen_stages(model, result, inputs, args.explain)
        memory = _dry_run_stages(chosen) if args.dry_run and chosen is not None else None
        explained = _explain_stage(chosen, args) if args.explain is not None else None
    if memory is not None:
        result.timings["dry run"] = memory.seconds
    entry = pipeline_entry(result, args.batch * args.seq, memory)
    if explained is not None:
        chunk, explanation = explained
        result.timings["explain"] = explanation.seconds
        entry["explain"] = {"stage": chunk, "rank": result.best.stages[chunk].rank} | explain_entry(explanation)
    if args.compare == NO_PP:
        entry["without_pp"] = _without_pp(workload, result.config.without_pipeline(), args)
        result.timings["without pp"] = entry["without_pp"]["seconds"]
    stage_config = result.config.stage_config()
    report = plan_report(
        result.stage_plan(0),
        device=stage_config.device_profile,
        timings=result.timings,
        mesh_names=stage_config.mesh_names,
        extra=extra | {"pipeline": entry},
    )
    try:
        log_path, json_path = write_report_files(report, out)
    except OSError as err:
        fail(f"cannot write the report to {out}: {err}")
    for line in summary_lines(report):
        _say(line)
    if explained is not None:
        for line in ["explain pipeline:"] + pipeline_explain_lines(entry):
            _say(line)
        where = f"stage {entry['explain']['stage']} on pp rank {entry['explain']['rank']}"
        for line in [f"explain {args.explain} ({where}):"] + explain_lines(entry["explain"]):
            _say(line)
    _say(f"wrote {log_path}, {json_path} and {log_path.with_name(HTML_NAME)}")
    return 0


def _chosen_stages(model, result, inputs, explain: str | None):
    """The chosen pipeline's stages to plan one by one (`driver.stage_memory.ChosenStages`). A
    model that cannot be cut into stages to run: None, with a line saying its stages are not
    dry-run, or with `--explain` one error line."""
    from autoshard.driver.stage_memory import ChosenStages
    from autoshard.workloads.hf_stages import splittable

    try:
        return ChosenStages(splittable(model), result, inputs, result.best)
    except ValueError as err:
        if explain is not None:
            fail(f"--explain on a pp mesh plans the stage that holds {explain}: {err}")
        log.info("stages not dry-run (memory modeled only): %s", err)
        return None


def _explain_stage(chosen, args):
    """`--explain` on a pp mesh: the stage of the chosen pipeline that holds the parameter, planned
    as `train` plans it, re-solved with the parameter pinned to each other layout. (stage, explanation)."""
    from autoshard.problem.explain import ExplainError, match_params

    def holds(module) -> bool:
        try:
            return bool(match_params(args.explain, [name for name, _ in module.named_parameters()]))
        except ExplainError:
            return False

    holding = (k for k, spec in enumerate(chosen.specs) if holds(spec.module))
    chunk = next(holding, 0)  # none holds it: the first stage's explain names close ones
    log.info("explaining %s in stage %d: re-solving with each other layout pinned", args.explain, chunk)
    auto, _ = chosen.planned(chunk)
    try:
        return chunk, auto.explain(args.explain, top=args.explain_top)
    except ExplainError as err:
        fail(f"--explain {err}")


def _dry_run_stages(chosen):
    """Each distinct stage of the chosen pipeline dry-run (`driver.stage_memory`)."""
    from autoshard.driver.stage_memory import dry_run_stages
    from autoshard.runtime.dryrun import DryRunError

    log.info("dry run: each distinct stage's rank-0 program on fake tensors")
    try:
        return dry_run_stages(chosen)
    except DryRunError as err:
        fail(f"a planned stage cannot run: {err.line}")


def _without_pp(workload, config: PlanConfig, args) -> dict:
    """`--compare no-pp`: the same devices planned without pipeline stages, memory-fitted as `plan`
    fits any plan, in a fake process group of their own."""
    assert config.mesh is not None
    with _process_group(math.prod(config.mesh)):
        plan, timings, auto = _plan_once(workload, config, args, what="without pp", fit=True)
    peak = auto.fit.peak_bytes if auto.fit is not None else None
    return {
        "mesh": list(config.mesh),
        "mesh_names": list(config.mesh_names or ()),
        "step_time_s": plan.step_time_s,
        "tokens_per_s_per_device": args.batch * args.seq / plan.step_time_s / math.prod(config.mesh),
        "peak_bytes": peak,
        "seconds": sum(timings.values()),
    }


def _compare(workload, config: PlanConfig, args) -> dict:
    """`--compare`: the hand-written recipe's layouts pinned, planned and priced the same way."""
    from autoshard.problem.recipes import recipe_pins
    from autoshard.report.build import modeled_figures

    recipe = COMPARE[args.compare]
    budget = _manual_budget(workload, recipe, config.mesh)
    manual, manual_timings, manual_auto = _plan_once(
        workload,
        config,
        args,
        pins=recipe_pins(recipe, len(config.mesh)),
        budget=budget,
        what=f"{args.compare} ({recipe} recipe pinned)",
    )
    ran = _dry_run(manual, manual_auto) if args.dry_run else None
    program = {"overlapped_step_s": ran.step.overlapped_s, "peak_bytes": ran.peak_bytes} if ran is not None else {}
    return {
        "label": f"{recipe} pinned",
        "recipe": recipe,
        "memory_budget": budget,
        "param_bytes_per_rank": budget,  # every parameter is pinned: exactly the recipe's bytes
        **modeled_figures(manual),
        "non_default_order_params": len(manual.non_default_order_params()),
        "timings": manual_timings,
        **program,  # as its program runs: collectives overlapped, and its dry-run peak
    }
