"""`python -m autoshard report RUN_DIR`: rebuild RUN_DIR/report.html from RUN_DIR/plan.json, with the
loss and tokens/s curves of RUN_DIR/metrics.jsonl when present. Bad input (no such directory, a
missing or unreadable plan.json or metrics.jsonl) is one `error: ...` line, exit code 2, and nothing
is written.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from autoshard.cli.args import fail
from autoshard.fileio import read_json

_REQUIRED = ("mesh_shape", "parameters", "nodes", "totals")


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir",
        type=Path,
        metavar="RUN_DIR",
        help="a directory written by plan or train (holds plan.json, maybe metrics.jsonl)",
    )


def run_report(args: argparse.Namespace) -> int:
    from autoshard.report.files import HTML_NAME, JSON_NAME, METRICS_NAME, load_metrics, write_html

    run_dir: Path = args.run_dir
    if not run_dir.is_dir():
        fail(f"{run_dir} is not a directory")
    plan_path = run_dir / JSON_NAME
    if not plan_path.exists():
        fail(f"no {JSON_NAME} in {run_dir} (write one with 'python -m autoshard plan' or 'train')")
    try:
        report = read_json(plan_path)
    except ValueError as err:
        fail(str(err))
    missing = [k for k in _REQUIRED if k not in report] if isinstance(report, dict) else list(_REQUIRED)
    if missing:
        fail(f"{plan_path} is not an autoshard plan report (missing {', '.join(missing)})")
    metrics = None
    metrics_path = run_dir / METRICS_NAME
    if metrics_path.exists():
        try:
            metrics = load_metrics(metrics_path)
        except (OSError, UnicodeDecodeError, ValueError) as err:
            fail(f"cannot read {metrics_path}: {err}")
    try:
        out = write_html(report, run_dir, metrics)  # renders first: nothing is written if that fails
    except OSError as err:
        fail(f"cannot write {run_dir / HTML_NAME}: {err}")
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        fail(f"{plan_path} is not an autoshard plan report ({type(err).__name__}: {err})")
    print(f"wrote {out}" + (f" ({len(metrics)} metrics rows)" if metrics else ""))
    return 0
