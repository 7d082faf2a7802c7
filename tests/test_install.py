"""The installed package next to a user's project: the CLI and the API run from a directory that
holds its own `models/` and `solver/` packages (the most common package names in ML repositories)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_the_cli_runs_from_a_project_with_its_own_models_and_solver(tmp_path):
    for name in ("models", "solver"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text('raise ImportError("the user project\'s own package")\n')
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a user runs it: the install only
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "autoshard",
            "plan",
            "--model",
            "llama3-tiny",
            "--mesh",
            "2x2",
            "--batch",
            "8",
            "--seq",
            "32",
            "--no-dry-run",
            "--out",
            str(tmp_path / "plan"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "plan" / "plan.json").is_file()
    api = subprocess.run(
        [sys.executable, "-c", "import models, autoshard"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "the user project's own package" in api.stderr  # the user's `models` is what `import models` gets
