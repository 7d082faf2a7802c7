"""Command-line arguments shared by the subcommands: value parsers, the options `plan` and `train`
both take (declared once here), and dataclass fields that are also options.

Bad input ends with one `error: ...` line on stderr and exit code 2, never a traceback: the user can
fix it. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from dataclasses import dataclass
from typing import Any, NoReturn


class UsageError(ValueError):
    """Bad input the user can fix; reported as one line, no traceback."""


def fail(msg: str) -> NoReturn:
    """One line on stderr and exit code 2: for mistakes in what the user asked for."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


# ------------------------------------------------------------------------------------ values
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


def dtype_option(text: str) -> str:
    """A floating dtype's short name ('bf16', 'fp32', ...) from any name torch or we use for it."""
    from autoshard.capture.precision import dtype_name, parse_dtype

    return dtype_name(parse_dtype(text))


def mp_policy(param_dtype: str | None, reduce_dtype: str | None):
    """The `MixedPrecisionPolicy` of --param-dtype/--reduce-dtype (None when neither is given)."""
    if param_dtype is None and reduce_dtype is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from autoshard.capture.precision import parse_dtype

    return MixedPrecisionPolicy(param_dtype=parse_dtype(param_dtype) if param_dtype else None,
                                reduce_dtype=parse_dtype(reduce_dtype) if reduce_dtype else None)


def parse_limit(text: str) -> float:
    """--memory-limit: bytes ('70GiB', '8e10'), or 'none' for no limit (inf)."""
    return math.inf if text.strip().lower() == "none" else parse_bytes(text)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise ValueError(f"expected a positive integer, got {value}")
    return value


DEFAULT_MESH_NAMES = ("dp", "tp", "pp", "cp")


def mesh_names(text: str | None, mesh: tuple[int, ...]) -> tuple[str, ...]:
    """The mesh dims' names: `text` ('dp,tp'), or by default dp, tp, pp, cp as many as the mesh has
    dims. ValueError unless there is one distinct, non-empty name per mesh dim."""
    if text is None and len(mesh) > len(DEFAULT_MESH_NAMES):
        raise ValueError(f"mesh {'x'.join(map(str, mesh))} has {len(mesh)} dims: name them with --mesh-names "
                         f"(the default names only {len(DEFAULT_MESH_NAMES)}: {','.join(DEFAULT_MESH_NAMES)})")
    names = DEFAULT_MESH_NAMES[: len(mesh)] if text is None else tuple(n.strip() for n in text.split(","))
    if len(names) != len(mesh) or len(set(names)) != len(names) or not all(names):
        raise ValueError(f"--mesh-names {','.join(names)!r} must give {len(mesh)} distinct names, one per dim of "
                         f"mesh {'x'.join(map(str, mesh))}")
    return names


# ------------------------------------------------------------------------------------ parsers
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


class RaisingArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage mistake raises UsageError: for a `main` that reports errors itself
    (under torchrun, once for all ranks)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


# ------------------------------------------------------------------------------------ options
@dataclass(frozen=True)
class Option:
    """One command-line option: its flags and argparse keywords. A command adds it with its own
    default (and dest, required...) where they differ."""

    flags: tuple[str, ...]
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def add(self, parser: argparse.ArgumentParser, *flags: str, **overrides: Any) -> argparse.Action:
        return parser.add_argument(*(flags or self.flags), **(self.kwargs | overrides))


def option(*flags: str, **kwargs: Any) -> Option:
    return Option(flags, kwargs)


# The options `plan` and `train` share: same flag, same meaning.
MODEL = option("--model", help="model name, e.g. llama3-tiny, llama3-debug, llama3-8b (autoshard.workloads), or "
                                "hf:PATH, a local Hugging Face config.json or model directory")
INIT_FROM = option("--init-from", metavar="PATH", help="start from the weights of a safetensors file or directory "
                                                       "(e.g. an HF model directory) instead of a seeded init")
MESH = option("--mesh", type=_arg_type(parse_mesh), help="mesh shape, e.g. 8x8, 2x2 or 4")
MESH_NAMES = option("--mesh-names", help="mesh dim names, e.g. dp,tp (default: dp,tp,pp,cp as many as needed)")
BATCH = option("--batch", type=_arg_type(_positive_int), help="global batch size")
SEQ = option("--seq", type=_arg_type(_positive_int), help="sequence length")
NETWORK = option("--network", help="network profile for planning: a preset (h100-node, cpu-gloo) or a profile file "
                                   "from `autoshard calibrate`")
DEVICE = option("--device", "--device-profile", help="device (compute) profile for planning: a preset (h100, h200, "
                                                     "cpu) or a profile file from `autoshard calibrate`")
MEMORY_BUDGET = option("--memory-budget", type=_arg_type(parse_bytes), metavar="BYTES",
                       help="parameter bytes per rank, e.g. 2e9 or 16GiB (default: total / world size)")
PARAM_DTYPE = option("--param-dtype", type=_arg_type(dtype_option), metavar="DTYPE",
                     help="mixed precision: compute and gather parameters in this dtype (bf16, fp16; parameters "
                          "and optimizer states stay fp32; default: no cast)")
REDUCE_DTYPE = option("--reduce-dtype", type=_arg_type(dtype_option), metavar="DTYPE",
                      help="mixed precision: reduce gradients in this dtype (fp32, bf16; default: --param-dtype)")
MEMORY_LIMIT = option("--memory-limit", type=_arg_type(parse_limit), metavar="BYTES",
                      help="peak memory per rank a plan must fit, e.g. 70GiB, or 'none' (default: the device "
                           "profile's capacity less 10%%; `plan --no-dry-run` leaves it unchecked); the ILP then "
                           "chooses layouts, resharding and activation checkpointing under it, checked by the dry run")
RECOMPUTE = option("--recompute", action="store_true",
                   help="activation checkpointing: the backward recomputes each repeated block's forward "
                        "(parameters gathered again) instead of keeping its activations")
RESHARD = option("--reshard-after-forward", action="store_true",
                 help="free the parameters each repeated block gathered once its forward is done and gather "
                      "them again for its backward (FSDP's reshard_after_forward; implied by --recompute)")
OUT = option("--out", help="output directory")

_OPTION = "autoshard.option"  # dataclass field metadata key


def setting(default: Any, shared: Option | None = None, /, *flags: str, **kwargs: Any) -> Any:
    """A dataclass field that is also a command-line option: a `shared` one (flags, type, help as
    declared here) or its own argparse keywords; flags default to --field-name. A bool field is a
    store_true flag."""
    return dataclasses.field(default=default, metadata={_OPTION: (shared, flags, kwargs)})


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type) -> argparse.ArgumentParser:
    """One option per field of dataclass `cls` that `setting` made; parse into `cls(**vars(ns))`."""
    for f in dataclasses.fields(cls):
        if _OPTION not in f.metadata:
            continue
        shared, flags, kwargs = f.metadata[_OPTION]
        flags = flags or (shared.flags if shared else ("--" + f.name.replace("_", "-"),))
        kwargs = {"dest": f.name, "default": f.default} | kwargs
        if isinstance(f.default, bool):
            kwargs.setdefault("action", "store_false" if f.default else "store_true")
        if shared is not None:
            shared.add(parser, *flags, **kwargs)
        else:
            parser.add_argument(*flags, **kwargs)
    return parser
