"""`python -m autoshard <command> ...`: dispatch to the subcommand's own main.

  plan   plan a model's sharding, write the sharding log and plan JSON (autoshard.cli)
  train  distributed training (autoshard.train, imported only when asked for)
"""

from __future__ import annotations

import sys
from typing import Sequence

from .cli import ArgumentParser, add_plan_arguments, fail, run_plan


def _train(argv: list[str]) -> int:
    try:
        from . import train
    except ModuleNotFoundError as err:
        if err.name != f"{__package__}.train":
            raise  # a dependency of train.py is missing: that is a real error, keep the traceback
        fail("the train command is not available: autoshard/train.py is not installed")
    return int(train.main(argv) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train":  # train parses its own arguments
        return _train(argv[1:])
    parser = ArgumentParser(prog="python -m autoshard", description="autoshard: automatic FSDP+TP planning")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{plan,train}",
                                     parser_class=ArgumentParser)
    plan = commands.add_parser("plan", help="plan a model's sharding; write sharding.log and plan.json",
                               description="Plan a model's sharding and write the sharding log and plan JSON.")
    add_plan_arguments(plan)
    plan.set_defaults(run=run_plan)
    commands.add_parser("train", help="distributed training (see python -m autoshard train --help)",
                        add_help=False)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
