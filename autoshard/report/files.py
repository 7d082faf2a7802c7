"""Writing a run's report files: sharding.log, plan.json and report.html, each atomically (a
reader never sees half a file); reading metrics.jsonl back."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from autoshard.fileio import write_atomic
from autoshard.problem.plan import Plan
from autoshard.report.build import plan_report
from autoshard.report.html import render_html
from autoshard.report.text import format_log

LOG_NAME = "sharding.log"
JSON_NAME = "plan.json"
HTML_NAME = "report.html"
METRICS_NAME = "metrics.jsonl"


def write_report(plan: Plan, out_dir: str | os.PathLike, **report_args: Any) -> tuple[Path, Path]:
    """Write `sharding.log`, `plan.json` and `report.html` (`plan_report(plan, **report_args)`) into
    `out_dir` (created), each atomically, so a reader never sees half a file. Returns (log path, json path)."""
    return write_report_files(plan_report(plan, **report_args), out_dir)


def write_report_files(
    report: dict, out_dir: str | os.PathLike, metrics: list[dict] | None = None
) -> tuple[Path, Path]:
    """`write_report` for a report dict already built (a caller that also prints it builds it once);
    also writes `report.html` beside them (`write_html`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log_path, json_path = out / LOG_NAME, out / JSON_NAME
    write_atomic(json_path, json_text(report))
    write_atomic(log_path, format_log(report))
    write_html(report, out, metrics)
    return log_path, json_path


def json_text(report: dict) -> str:
    """The report as JSON with one line per top-level key and per record of a top-level list of
    records (a node, a parameter): readable and diffable line by line, and written by json's C
    encoder (an indented dump goes through its Python one: ~2 s for a 70B plan)."""
    lines = []
    for key, value in report.items():
        head = f"{json.dumps(key)}: "
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            lines.append(head + "[\n  " + ",\n  ".join(map(json.dumps, value)) + "\n ]")
        else:
            lines.append(head + json.dumps(value))
    return "{\n " + ",\n ".join(lines) + "\n}\n"


def write_html(report: dict, out_dir: str | os.PathLike, metrics: list[dict] | None = None) -> Path:
    """Write `report.html` (the report dict, with the training `metrics` rows' curves when given) into
    `out_dir` atomically; returns its path."""
    path = Path(out_dir) / HTML_NAME
    write_atomic(path, render_html(report, metrics))
    return path


def load_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl (blank lines skipped); ValueError naming the first bad line."""
    rows = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{n}: not JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: not a JSON object")
        rows.append(row)
    return rows
