"""Argument parsing shared by the subcommands: parsers whose mistakes are one `error:` line, and
options generated from settings dataclasses (`PlanConfig`, the trainer's `Settings`; see
`autoshard.options`).

Bad input ends with one `error: ...` line on stderr and exit code 2, never a traceback: the user can
fix it. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from autoshard.options import Option, UsageError, field_options


def fail(msg: str) -> NoReturn:
    """One line on stderr and exit code 2: for mistakes in what the user asked for."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def arg_type(fn):
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


class RaisingArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage mistake raises UsageError: for a `main` that reports errors itself
    (under torchrun, once for all ranks)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def add_option(parser: argparse.ArgumentParser, option: Option, *flags: str, **overrides: Any) -> argparse.Action:
    """Add a declared option (its `type` made argparse's), with this command's own keywords."""
    kwargs = option.kwargs | overrides
    if "type" in kwargs:
        kwargs["type"] = arg_type(kwargs["type"])
    return parser.add_argument(*(flags or option.flags), **kwargs)


def add_dataclass_arguments(
    parser: argparse.ArgumentParser, cls: type, overrides: dict[str, dict[str, Any]] | None = None
) -> argparse.ArgumentParser:
    """One option per field of dataclass `cls` that `setting` made (`overrides`: a field's argparse
    keywords for this command, e.g. required); parse into `from_values(cls, vars(namespace))`."""
    for f, flags, kwargs in field_options(cls):
        add_option(parser, Option(flags, kwargs | (overrides or {}).get(f.name, {})))
    return parser


def flag_reference(parser: argparse.ArgumentParser) -> str:
    """The parser's options as docs/cli.md's Markdown table (flag, default, meaning), so that the
    flag reference there is generated from the parsers and checked against them
    (tests/test_docs.py)."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = ", ".join(f"`{flag}`" for flag in action.option_strings) or f"`{action.metavar or action.dest.upper()}`"
        if action.choices and not isinstance(action, argparse.BooleanOptionalAction):
            name += " (" + " \\| ".join(map(str, action.choices)) + ")"
        rows.append(f"| {name} | {_default_text(action)} | {(action.help or '').replace('%%', '%')} |")
    return "\n".join(rows)


def _default_text(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if action.default is None:
        return ""
    value = action.default
    if isinstance(value, tuple) and all(isinstance(v, int) for v in value):
        value = "x".join(map(str, value))
    return f"`{value}`"
