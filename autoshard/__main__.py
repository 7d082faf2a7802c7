"""`python -m autoshard <command> ...`: dispatch to the subcommand's own main.

plan   plan a model's sharding, write the sharding log and plan JSON (autoshard.cli.plan)
train  distributed training (autoshard.cli.train)
calibrate  measure the network and device into a profile file (autoshard.cli.calibrate)
report rebuild RUN_DIR/report.html from its plan.json and metrics.jsonl (autoshard.cli.report)
export a training run's checkpoint as a Hugging Face model directory (autoshard.cli.export)
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from typing import NoReturn, Sequence

if __name__ == "__main__" and sys.argv[1:2] not in (["train"], ["calibrate"]):
    # A short command (plan, report, export) runs without Python's cyclic collector from its
    # first import: torch's imports and a plan allocate millions of objects that live until the
    # process ends (with os._exit, freeing nothing), and each collection walks them all: ~4 s of
    # a 70B plan, for ~50 MB of cycles never freed. Training commands collect as usual.
    gc.disable()

from autoshard.cli.args import ArgumentParser
from autoshard.cli.export import add_export_arguments, run_export
from autoshard.cli.plan import add_plan_arguments, run_plan
from autoshard.cli.report import add_report_arguments, run_report


def _train(argv: list[str]) -> int:
    from autoshard.cli import train  # imported only when asked for: it pulls in the whole runtime

    return int(train.main(argv) or 0)


def _calibrate(argv: list[str]) -> int:
    from autoshard.cli import calibrate

    return int(calibrate.main(argv) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train":  # train and calibrate parse their own arguments (under torchrun)
        return _train(argv[1:])
    if argv and argv[0] == "calibrate":
        return _calibrate(argv[1:])
    parser = ArgumentParser(prog="python -m autoshard", description="autoshard: automatic FSDP+TP planning")
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="{plan,train,calibrate,report,export}", parser_class=ArgumentParser
    )
    plan = commands.add_parser(
        "plan",
        help="plan a model's sharding; write sharding.log, plan.json, report.html",
        description="Plan a model's sharding and write the sharding log, plan JSON and report.html.",
    )
    add_plan_arguments(plan)
    plan.set_defaults(run=run_plan)
    commands.add_parser("train", help="distributed training (see python -m autoshard train --help)", add_help=False)
    commands.add_parser(
        "calibrate",
        help="measure network and device into a profile file for --network/--device "
        "(see python -m autoshard calibrate --help)",
        add_help=False,
    )
    report = commands.add_parser(
        "report",
        help="rebuild RUN_DIR/report.html from plan.json (+ metrics.jsonl)",
        description="Rebuild RUN_DIR/report.html from RUN_DIR/plan.json, with the "
        "training curves of RUN_DIR/metrics.jsonl when present.",
    )
    add_report_arguments(report)
    report.set_defaults(run=run_report)
    export = commands.add_parser(
        "export",
        help="a training run's checkpoint as a Hugging Face model directory",
        description="Write a training run's checkpoint (the newest, or --step N) as a "
        "Hugging Face model directory: safetensors weights and config.json.",
    )
    add_export_arguments(export)
    export.set_defaults(run=run_export)
    args = parser.parse_args(argv)
    return args.run(args)


def _exit(code: int) -> NoReturn:
    """Leave without tearing down the interpreter object by object: an 8B plan's graphs and
    caches take ~1 s to free, and every output is already written (atomically) and closed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        status = main()
    except SystemExit as done:  # usage errors: keep their code (and argparse's --help exit 0)
        status = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    _exit(status)
