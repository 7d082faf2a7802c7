"""How the benchmarks start processes: the repository root, torchrun, and the environment a
launched rank needs to import `autoshard` and `benchmarks` from this checkout."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun() -> list[str]:
    """torchrun next to this interpreter (a fresh venv has one), else torch's module entry point."""
    exe = Path(sys.executable).parent / "torchrun"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def rank_env(**extra: str) -> dict[str, str]:
    """This process's environment for torchrun's ranks: one thread each (OMP_NUM_THREADS=1) and
    the repository first on PYTHONPATH (a caller's path kept after it)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, **extra)
