"""Command-line pieces: argument parsing shared by the subcommands, and `plan`.

`python -m autoshard plan --model llama3-8b --mesh 8x8 --batch 8 --seq 8192 --out plans/8b`
plans in one process (fake process group, model on meta: no weights, no devices) and writes the
sharding log and plan JSON. Bad input ends with one `error: ...` line on stderr and exit code 2,
never a traceback: the user can fix it. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import re
import sys
from pathlib import Path
from typing import NoReturn, Sequence

log = logging.getLogger("autoshard")

BACKENDS = ("auto", "highs", "cbc")
COMPARE = {"manual": "fsdp-tp"}  # --compare name -> the hand-written recipe it pins (recipes.py)


def fail(msg: str) -> NoReturn:
    """One line on stderr and exit code 2: for mistakes in what the user asked for."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def parse_mesh(text: str) -> tuple[int, ...]:
    """'8x8' -> (8, 8), '4' -> (4,), '2x2x2' -> (2, 2, 2); every size >= 1, else ValueError."""
    parts = text.strip().lower().split("x")
    if not all(re.fullmatch(r"\d+", p.strip()) for p in parts):
        raise ValueError(f"bad mesh {text!r}: expected sizes joined by 'x', e.g. 8x8")
    shape = tuple(int(p) for p in parts)
    if min(shape) < 1:
        raise ValueError(f"bad mesh {text!r}: every mesh size must be >= 1")
    return shape


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> float:
    """'1.5e9', '2GiB', '800 MB' -> bytes (positive), else ValueError."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m[2] not in _UNITS:
        raise ValueError(f"bad byte count {text!r}: expected e.g. 2e9, 16GiB or 800MB")
    value = float(m[1]) * _UNITS[m[2]]
    if value <= 0:
        raise ValueError(f"bad byte count {text!r}: must be positive")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise ValueError(f"expected a positive integer, got {value}")
    return value


def _arg_type(fn):
    """Adapt a ValueError-raising parser for argparse, keeping its message (argparse would
    replace it with a generic 'invalid value')."""
    def parse(text: str):
        try:
            return fn(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = fn.__name__.lstrip("_")
    return parse


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one `error:` line (exit 2) like every other bad input."""

    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see {self.prog} --help)")


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model config name, e.g. llama3-8b (models.get_config)")
    parser.add_argument("--mesh", required=True, type=_arg_type(parse_mesh), help="mesh shape, e.g. 8x8")
    parser.add_argument("--batch", required=True, type=_arg_type(_positive_int), help="global batch size")
    parser.add_argument("--seq", required=True, type=_arg_type(_positive_int), help="sequence length")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for sharding.log and plan.json (default plans/<model>-<mesh>)")
    parser.add_argument("--network", default="h100-node", help="network profile preset (default h100-node)")
    parser.add_argument("--device", default="h100", help="device profile preset (default h100)")
    parser.add_argument("--mesh-names", default=None, help="mesh dim names, e.g. dp,tp (recorded in the report)")
    parser.add_argument("--memory-budget", type=_arg_type(parse_bytes), default=None, metavar="BYTES",
                        help="parameter bytes per rank, e.g. 2e9 or 16GiB (default: total / world size)")
    parser.add_argument("--compare", choices=sorted(COMPARE), default=None,
                        help="also plan with the hand-written FSDP+TP recipe pinned and compare (2-D meshes)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="ILP backend (default auto)")
    parser.add_argument("--time-limit", type=float, default=None, metavar="SECONDS", help="ILP time limit")


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
    from autoshard.profiles.network import NetworkProfile
    from autoshard.profiles.device import DeviceProfile
    from autoshard.workload import get_workload

    try:
        workload = get_workload(args.model, args.seq)
        NetworkProfile.preset(args.network, len(args.mesh))
        DeviceProfile.preset(args.device)
    except ValueError as err:
        fail(str(err))
    if args.batch % args.mesh[0]:
        fail(f"batch {args.batch} is not divisible by mesh dim 0 (size {args.mesh[0]})")
    if args.mesh_names is not None:
        names = tuple(n.strip() for n in args.mesh_names.split(","))
        if len(names) != len(args.mesh) or len(set(names)) != len(names) or not all(names):
            fail(f"--mesh-names {args.mesh_names!r} must give {len(args.mesh)} distinct names for mesh {args.mesh}")
    if args.compare and len(args.mesh) != 2:
        fail(f"--compare {args.compare} needs a 2-D (dp, tp) mesh, got {args.mesh}")
    if args.time_limit is not None and args.time_limit <= 0:
        fail(f"--time-limit must be positive, got {args.time_limit}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        fail(f"--out {args.out} exists and is not a directory")
    return workload


def _setup_logging() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)


def _plan_once(workload, args, *, pins: dict | None = None, budget: float | None = None, what: str):
    """One AutoShard run on a fresh meta model; returns (plan, timings)."""
    from autoshard.api import AutoShard

    model = workload.build("meta")

    def inputs():
        return workload.example_inputs(args.batch, args.seq, "meta")

    log.info("planning %s: %s on mesh %s, batch %d, seq %d", what, workload.name, args.mesh, args.batch, args.seq)
    try:
        with AutoShard(model, inputs, args.mesh, loss_fn=workload.loss_fn, n_model_inputs=workload.n_model_inputs,
                       network=args.network, device=args.device) as auto:
            if pins:
                auto.pin(pins)
            auto.memory_budget(budget)
            plan = auto.optimize(backend=args.backend, time_limit=args.time_limit)
    except ValueError as err:  # e.g. a layout that does not split a shape evenly on this mesh
        fail(f"planning {what} failed: {err}")
    return plan, dict(auto.timings)


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
    from autoshard.report.text import compare_lines, modeled_figures, plan_report, summary_lines, write_report_files

    workload = _check(args)
    _setup_logging()
    mesh_text = "x".join(map(str, args.mesh))
    out = args.out if args.out is not None else Path("plans") / f"{args.model}-{mesh_text}"
    run = {"model": args.model, "mesh": list(args.mesh), "mesh_names": args.mesh_names, "batch": args.batch,
           "seq": args.seq, "network": args.network, "device": args.device, "backend": args.backend,
           "memory_budget": args.memory_budget}
    extra: dict = {"run": run}
    with _process_group(math.prod(args.mesh)):
        plan, timings = _plan_once(workload, args, budget=args.memory_budget, what="autoshard")
        if args.compare:
            recipe = COMPARE[args.compare]
            budget = _manual_budget(workload, recipe, args.mesh)
            manual, manual_timings = _plan_once(workload, args, pins=recipe_pins(recipe), budget=budget,
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
    report = plan_report(plan, timings=timings, extra=extra)
    try:
        log_path, json_path = write_report_files(report, out)
    except OSError as err:
        fail(f"cannot write the report to {out}: {err}")
    for line in summary_lines(report) + compare_lines(report):
        _say(line)
    _say(f"wrote {log_path} and {json_path}")
    return 0
