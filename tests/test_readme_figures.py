"""README.md's figures come from benchmarks/suite/results.json, the file `make bench` writes: every number
in the autoshard and baseline cells of the README's Figures table is a value of results.json,
rounded as printed, its date is the date of the run that measured it, and the README states no
figure (seconds, bytes, rates) anywhere else. A README figure can then only change with the
results file, and a figure measured outside it goes to docs/benchmarks.md instead."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "suite" / "results.json"

# Each row of the Figures table, by its first cell: for each number of its autoshard and baseline
# cells, in order, the results.json path (dot-separated; list indices as numbers) and the format it
# is printed in; then the `meta` entry whose date is the row's date.
ROWS: dict[str, tuple[list[tuple[str, str]], str]] = {
    "`plan --model llama3-8b --mesh 8x8 --batch 8 --seq 8192 --memory-limit none`, whole command with the dry run": (
        [("command.0.dry_run_s", ".1f"), ("speed.0.peer.total", ".1f")],
        "command_rerun",
    ),
    "the same for llama3-70b (64,8), batch 64": ([("command.1.dry_run_s", ".1f")], "command_rerun"),
    "planning llama3-8b (8,8): peak RSS": (
        [("speed.0.rss_gib", ".2f"), ("speed.0.peer.rss_gib", ".1f")],
        "speed_rerun",
    ),
    "redistribution paths, llama3-8b tensors on (8,8), 324 layout pairs: cost ratio, cheaper / equal / dearer": (
        [
            ("planner.costs.0.graph.total_cost_ratio", ".3f"),
            ("planner.costs.0.graph.wins", "d"),
            ("planner.costs.0.graph.ties", "d"),
            ("planner.costs.0.graph.losses", "d"),
        ],
        "date",
    ),
    "llama3-debug 2x2, 4 gloo ranks, 20 steps: largest relative loss deviation from one device": (
        [
            ("training.autoshard.max_rel_loss_dev", ".1e"),
            ("training.fsdp2.max_rel_loss_dev", ".1e"),
            ("training.recipe.max_rel_loss_dev", ".1e"),
        ],
        "training_rerun",
    ),
}
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:e-?\d+)?(?![\w])")
# a figure: a number with a unit of time, bytes, rate or speed-up
FIGURE = re.compile(
    r"(?<![\w.])~?\d[\d,]*(?:\.\d+)?\s?(?:s|ms|min|GiB|GB|MiB|MB|KiB|TB/s|GB/s|TFLOP/s|tokens/s|x)"
    r"(?![\w/])"
)


def lookup(data, path: str):
    for key in path.split("."):
        data = data[int(key)] if isinstance(data, list) else data[key]
    return data


def figures_table(text: str) -> tuple[list[list[str]], str]:
    """The Figures section's table rows (cells, header and rule left out) and the README without
    that table."""
    section = re.search(r"^## Figures\n(.*?)(?=^## )", text, re.M | re.S)
    assert section, "README.md has no ## Figures section"
    lines = [line for line in section.group(1).splitlines() if line.startswith("|")]
    assert len(lines) > 2, "the Figures section has no table"
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    rest = text.replace("\n".join(lines), "")
    return rows, rest


def check(text: str, results: dict) -> list[str]:
    """What in README text `text` does not come from `results` (empty: everything does)."""
    rows, rest = figures_table(text)
    problems = []
    for label, autoshard, baseline, date in rows:
        if label not in ROWS:
            problems.append(f"row {label!r}: no results.json source for it in tests/test_readme_figures.py")
            continue
        sources, dated_by = ROWS[label]
        want = [format(lookup(results, path), spec) for path, spec in sources]
        got = NUMBER.findall(f"{autoshard} {baseline}")
        if got != want:
            problems.append(f"row {label!r}: figures {got}, results.json {want} ({[p for p, _ in sources]})")
        measured = str(results["meta"].get(dated_by, results["meta"]["date"]))[:10]
        if date != measured:
            problems.append(f"row {label!r}: dated {date}, results.json's run {measured} (meta.{dated_by})")
    problems += [f"README states {m.group()!r} outside the Figures table" for m in FIGURE.finditer(rest)]
    return problems


def test_every_readme_figure_is_a_value_of_results_json():
    assert not check(README.read_text(), json.loads(RESULTS.read_text()))


def test_every_source_row_is_in_the_readme():
    rows, _ = figures_table(README.read_text())
    assert {row[0] for row in rows} == set(ROWS)


@pytest.mark.parametrize(
    "edit",
    [
        ("| 8.2 s |", "| 8.3 s |"),  # a figure changed
        ("| 0.55 GiB |", "| 0.5 GiB |"),  # rounded otherwise than printed
        ("| 1.3e-07 |", "| 1.3e-07, 4 tokens/s |"),  # a figure added to a row
        ("| 2026-11-21 |", "| 2026-11-27 |"),  # misdated
        ("## Packages", "Plans 70B in 5 s.\n\n## Packages"),  # a figure outside the table
    ],
)
def test_a_wrong_readme_figure_is_caught(edit):
    text = README.read_text()
    assert edit[0] in text
    assert check(text.replace(*edit, 1), json.loads(RESULTS.read_text()))
