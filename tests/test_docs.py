"""The documentation matches the code: every command-line flag README.md and docs/ name exists in
the parser of one of autoshard's commands (or is one of the few other tools' flags listed here),
every relative link points at a file of the repository, nothing points outside the repository,
and the README stays short."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from autoshard.cli.args import flag_reference
from autoshard.cli.calibrate import calibrate_parser
from autoshard.cli.export import add_export_arguments
from autoshard.cli.plan import plan_parser
from autoshard.cli.report import add_report_arguments
from autoshard.cli.train import train_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]")
# Flags of other tools the docs show: torchrun's, SLURM's, and the benchmark scripts' own.
OTHER_TOOLS = {
    "--standalone",
    "--nproc_per_node",
    "--nnodes",
    "--max-restarts",
    "--signal",  # torchrun, SLURM
    "--rdzv-backend",
    "--rdzv-endpoint",
    "--rdzv-id",
    "--nodes",
    "--ntasks-per-node",
    "--gpus-per-node",
    "--quick",
    "--only",
    "--json",
    "--wide",
    "--repeats",
    "--kills",
    "--stall-only",
    "--no-stall",  # benchmarks
    "--gap-only",
    "--two-ranks",
    "--make-train",
    "--baselines",
    "--moe",
    "--all",
    "--ddp",
    "--rounds",
    "--calibrated",  # benchmarks.cost_model.overlap
    "--tiny",
    "--big",
    "--parts",
    "--profile",  # benchmarks.gpu.check
    "--trainers",
    "--vocab",
    "--layers",
    "--micro-batches",
    "--dp",  # benchmarks.training.pipeline
    "--no-index",
    "--no-deps",
    "--target",
    "--only-binary",
    "--python-version",
    "--platform",  # pip
}


def autoshard_flags() -> set[str]:
    report, export = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_report_arguments(report)
    add_export_arguments(export)
    return {
        flag
        for parser in (train_parser(), plan_parser(), calibrate_parser(), report, export)
        for action in parser._actions
        for flag in action.option_strings
    }


def unknown_flags(text: str, known: set[str]) -> set[str]:
    return {flag for flag in FLAG.findall(text) if flag not in known and flag not in OTHER_TOOLS}


def test_every_flag_the_docs_name_exists():
    known = autoshard_flags()
    missing = {f"{doc.relative_to(ROOT)}: {flag}" for doc in DOCS for flag in unknown_flags(doc.read_text(), known)}
    assert not missing, sorted(missing)


def test_a_made_up_flag_is_caught():
    assert unknown_flags("run `train --mesh 2x2 --turbo-mode`, see `--resume`", autoshard_flags()) == {"--turbo-mode"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_stay_in_the_repository_and_point_at_files(doc):
    text = doc.read_text()
    assert not re.search(r"ANCHORS\.md|DESIGN\.md|\.\./shared|shared/seeds", text)
    for target in re.findall(r"\]\(([^)]+)\)", text):
        if target.startswith(("http://", "https://", "#")):
            continue
        path = target.split("#")[0]
        assert (doc.parent / path).exists(), f"{doc.name} links to {target}, which does not exist"


def test_the_cli_flag_reference_is_the_parsers_own():
    """docs/cli.md's flag tables are what `autoshard.cli.args.flag_reference` makes of each
    command's parser: every flag, default and help text as the code has them."""
    report, export = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_report_arguments(report)
    add_export_arguments(export)
    parsers = {
        "train": train_parser(),
        "plan": plan_parser(),
        "report": report,
        "export": export,
        "calibrate": calibrate_parser(),
    }
    text = (ROOT / "docs" / "cli.md").read_text()
    for name, parser in parsers.items():
        section = re.search(rf"^### {name}\n\n(\|.*?)\n(?:\n|\Z)", text, re.M | re.S)
        assert section, f"docs/cli.md has no flag table for {name}"
        assert section.group(1) == flag_reference(parser), (
            f"docs/cli.md's {name} table; the parser's:\n" + flag_reference(parser)
        )


def test_the_readme_is_short_and_names_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for page in (ROOT / "docs").glob("*.md"):
        assert f"docs/{page.name}" in readme, page.name
