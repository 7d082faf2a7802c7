"""The GPU check's driver (`python -m benchmarks.gpu.check`): each part in a process of its own,
stopped when the time budget is spent; gpu_check.json and gpu_check.md written after every part."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import benchmarks.gpu.check
from benchmarks.gpu.check.measure import say
from benchmarks.gpu.check.parts import one_line, rank0_part, step_part
from benchmarks.gpu.check.report import GOALS, case_of, table, write
from benchmarks.launch import ROOT

# the parts in the order they run, each with the least it needs to be worth starting (seconds: GPU,
# CPU tiny)
MIN_SECONDS = {"step-eager": (60, 10), "rank0": (45, 10), "rank0-big": (60, 10), "step-compiled": (90, 20)}


def importable() -> None:
    """On a GPU machine the repository is a bare copy, not installed: its solver/ and models/
    folders are registered under the names they install as."""
    for name, folder in (("autoshard_solver", "solver"), ("autoshard_models", "models")):
        if importlib.util.find_spec(name) is None:
            spec = importlib.util.spec_from_file_location(
                name, ROOT / folder / "__init__.py", submodule_search_locations=[str(ROOT / folder)]
            )
            assert spec is not None and spec.loader is not None
            sys.modules[name] = module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)


# ---------------------------------------------------------------------------------- running
def run_part(a: argparse.Namespace) -> int:
    """A child: one part, its result (or the one line it failed with) to --result."""
    importable()
    if a.part.startswith("step"):
        work = lambda: step_part(a, compiled=a.part == "step-compiled")  # noqa: E731
    else:
        work = lambda: rank0_part(a, a.part)  # noqa: E731
    try:
        result = work()
    except Exception as err:  # noqa: BLE001 - the report says why the part failed, in one line
        result = {"status": "failed", "notes": [one_line(err)]}
        say(f"{a.part} failed: {one_line(err)}")
    Path(a.result).write_text(json.dumps(result) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu.check", description=benchmarks.gpu.check.__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="where gpu_check.json and .md go")
    parser.add_argument("--tiny", action="store_true", help="every part at toy sizes (CPU or GPU)")
    parser.add_argument("--big", action="store_true", help="also llama3-70b on (64, 8) (always with --tiny)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile'd step")
    parser.add_argument("--budget", type=float, default=None, help="seconds for every part (default 450; tiny 300)")
    parser.add_argument("--profile", type=Path, default=None, help="one more profiled step per part: tables here")
    parser.add_argument("--parts", default=None, help="run only these parts (comma-separated names)")
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # a child: run this part
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.part is not None:
        return run_part(a)
    start = time.perf_counter()
    budget = a.budget if a.budget is not None else (300.0 if a.tiny else 450.0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not a.tiny:
        print("error: no CUDA device: the full check needs a GPU (--tiny runs it at toy sizes on CPU)", file=sys.stderr)
        return 2
    # the compiled step last: its compiles take the longest, and a spent budget should skip it, not
    # the goals the other parts measure
    parts = (
        ["step-eager", "rank0"]
        + (["rank0-big"] if a.big or a.tiny else [])
        + ([] if a.no_compile else ["step-compiled"])
    )
    if a.parts is not None:
        wanted = set(a.parts.split(","))
        if unknown := sorted(wanted - set(MIN_SECONDS)):
            print(f"error: --parts: no part {', '.join(unknown)} (parts: {', '.join(MIN_SECONDS)})", file=sys.stderr)
            return 2
        parts = [p for p in MIN_SECONDS if p in wanted]
    result: dict[str, Any] = {
        "meta": {
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__,
            "tiny": a.tiny,
            "budget_s": budget,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(
                ["python", "-m", "benchmarks.gpu.check", *(argv if argv is not None else sys.argv[1:])]
            ),
            "goals": GOALS,
            "seconds": 0.0,
        },
        "parts": {},
    }
    for name in parts:
        left = budget - (time.perf_counter() - start)
        if left < MIN_SECONDS[name][1 if a.tiny else 0]:
            result["parts"][name] = {
                **case_of(name, a.tiny),
                "status": "skipped",
                "notes": [f"the time budget was spent ({left:.0f} s left of {budget:.0f} s)"],
            }
            say(f"{name}: skipped, {left:.0f} s left")
        else:
            result["parts"][name] = {**case_of(name, a.tiny), **child(name, a, left)}
        result["meta"]["seconds"] = time.perf_counter() - start
        write(a.out, result)
    say(f"done in {result['meta']['seconds']:.0f} s: {a.out / 'gpu_check.md'}")
    print(table(result))
    return 0


def child(name: str, a: argparse.Namespace, left: float) -> dict:
    """Run one part in a process of its own, stopped when the budget's `left` seconds are spent."""
    result = a.out.resolve() / f".{name}.json"
    a.out.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    command = [sys.executable, "-m", "benchmarks.gpu.check", "--part", name, "--result", str(result)]
    command += ["--tiny"] if a.tiny else []
    command += ["--profile", str(a.profile.resolve())] if a.profile else []
    say(f"{name}: starting ({left:.0f} s left)")
    start = time.perf_counter()
    try:
        code = subprocess.run(command, cwd=ROOT, timeout=left).returncode
    except subprocess.TimeoutExpired:
        return {"status": "timed out", "notes": [f"stopped after {left:.0f} s: the time budget was spent"]}
    seconds = time.perf_counter() - start
    if not result.exists():
        return {"status": "failed", "notes": [f"its process ended with code {code} and no result"], "seconds": seconds}
    found = json.loads(result.read_text())
    result.unlink()
    return {**found, "seconds": seconds}
