"""Settings that are also command-line options, declared once on a dataclass field.

    @dataclass(frozen=True)
    class Settings:
        steps: int = setting(50, type=positive_int, help="train until this step")

A field made by `setting` carries its flags (default --field-name) and argparse keywords; the CLI
(`autoshard.cli.args.add_dataclass_arguments`) turns every such field into an option, so a new
knob is one field. Options that several settings classes share (`MODEL`, `BATCH`...) are declared
here once. Value parsers raise ValueError with a message the user can act on. No argparse, no
stage: the planning config (driver), the trainer's settings and the CLI all build on this.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Iterator


class UsageError(ValueError):
    """Bad input the user can fix; reported as one `error:` line, no traceback (under torchrun,
    once for all ranks: every rank reaches it alike)."""


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


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> float:
    """'1.5e9', '2GiB', '800 MB' -> bytes (positive), else ValueError."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m[2] not in _UNITS:
        raise ValueError(f"bad byte count {text!r}: expected e.g. 2e9, 16GiB or 800MB")
    value = float(m[1]) * _UNITS[m[2]]
    if value <= 0:
        raise ValueError(f"bad byte count {text!r}: must be positive")
    return value


def parse_limit(text: str) -> float:
    """--memory-limit: bytes ('70GiB', '8e10'), or 'none' for no limit (inf)."""
    return math.inf if text.strip().lower() == "none" else parse_bytes(text)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise ValueError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise ValueError(f"expected a positive number, got {value}")
    return value


def name_list(text: str) -> tuple[str, ...]:
    """'dp, tp' -> ('dp', 'tp')."""
    return tuple(n.strip() for n in text.split(","))


# ------------------------------------------------------------------------------------ options
@dataclass(frozen=True)
class Option:
    """One command-line option: its flags and argparse keywords (`type` a ValueError-raising
    parser). A settings field or command adds it with its own default where they differ."""

    flags: tuple[str, ...]
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


def option(*flags: str, **kwargs: Any) -> Option:
    return Option(flags, kwargs)


_OPTION = "autoshard.option"  # dataclass field metadata key


def setting(default: Any, *flags: str | Option, **kwargs: Any) -> Any:
    """A dataclass field that is also a command-line option: its flags (default --field-name) and
    argparse keywords, or a shared `Option` (then flags and keywords add to or replace its own). A
    bool field is a store_true flag."""
    shared = flags[0] if flags and isinstance(flags[0], Option) else None
    own = tuple(flags[1:] if shared else flags)
    return dataclasses.field(default=default, metadata={_OPTION: (shared, own, kwargs)})


def field_options(cls: type) -> Iterator[tuple[dataclasses.Field, tuple[str, ...], dict[str, Any]]]:
    """(field, flags, argparse keywords) of every field of dataclass `cls` that `setting` made, in
    field order; keywords include dest and default."""
    for f in dataclasses.fields(cls):
        if _OPTION not in f.metadata:
            continue
        shared, flags, kwargs = f.metadata[_OPTION]
        flags = flags or (shared.flags if shared else ("--" + f.name.replace("_", "-"),))
        merged = (shared.kwargs if shared else {}) | {"dest": f.name, "default": f.default} | kwargs
        if isinstance(f.default, bool):
            merged.setdefault("action", "store_false" if f.default else "store_true")
        yield f, flags, merged


def from_values(cls: type, values: dict[str, Any], **changes: Any) -> Any:
    """An instance of dataclass `cls` from the entries of `values` that name its fields (a parsed
    namespace may hold more), with `changes` on top."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**({k: v for k, v in values.items() if k in names} | changes))


# The options several commands share: same flag, same meaning.
MODEL = option(
    "--model",
    help="model name, e.g. llama3-tiny, llama3-debug, llama3-8b, moe-debug, qwen3-30b-a3b (autoshard.workloads), "
    "or hf:PATH, a local Hugging Face config.json or model directory",
)
INIT_FROM = option(
    "--init-from",
    metavar="PATH",
    help="start from the weights of a safetensors file or directory "
    "(e.g. an HF model directory) instead of a seeded init",
)
LORA = option(
    "--lora",
    metavar="RANK[,alpha=A,targets=NAME,...]",
    help="fine-tune peft's LoRA adapters of this rank over the frozen model (alpha: default 2 x rank; "
    "targets: the modules wrapped, default peft's for the model type, all-linear: every linear but the head)",
)
FREEZE = option(
    "--freeze",
    action="append",
    metavar="GLOB",
    help="freeze the parameters whose names match (repeatable): planned and kept as they are, never trained",
)
BATCH = option("--batch", type=positive_int, help="global batch size")
SEQ = option("--seq", type=positive_int, help="sequence length")
OUT = option("--out", help="output directory")


def run_name(model: str, mesh: tuple[int, ...]) -> str:
    """`<model>-<mesh>` as one safe folder name: a `hf:PATH` model by its folder's name, and
    anything but letters, digits, `.`, `_` and `-` made `_` (`hf:/home/u/Llama-3-8B` on 2x8:
    `Llama-3-8B-2x8`)."""
    name = os.path.basename(os.path.normpath(model[3:])) if model.startswith("hf:") else model
    name = re.sub(r"[^A-Za-z0-9._-]", "_", name).strip(".") or "model"
    return f"{name}-{'x'.join(map(str, mesh))}"
