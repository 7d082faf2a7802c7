"""Model name -> Workload. Every module of this package that defines `resolve(name, seq)` (the
family's Workload, or None when the name is not the family's) and `names()` (for error messages)
is a family, asked in the order of its `ORDER`: a new family is one new file."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from types import ModuleType

from autoshard.workloads.base import Workload


def families() -> list[ModuleType]:
    """The family modules of this package, in the order they are asked."""
    found = []
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        module = importlib.import_module(f"{__package__}.{info.name}")
        if callable(getattr(module, "resolve", None)) and callable(getattr(module, "names", None)):
            found.append(module)
    return sorted(found, key=lambda m: (getattr(m, "ORDER", 0), m.__name__))


def known_names() -> list[str]:
    return [name for family in families() for name in family.names()]


def get_workload(name: str, seq: int) -> Workload:
    """The workload called `name`, able to run sequences of length `seq`; unknown names raise
    ValueError listing the known ones."""
    for family in families():
        workload = family.resolve(name, seq)
        if workload is not None:
            return workload
    raise ValueError(f"unknown model config {name!r}; valid names: {', '.join(known_names())}")
