"""`compile=True` / `train --compile`: the compiled program traces as one graph per half, functional
collectives included, and trains like the uncompiled one; the flag reaches the runtime, which
compiles from the second run on (the first is the checked one)."""

from __future__ import annotations

import json

import pytest
import torch

from autoshard.cli.train import main
from autoshard.runtime.module import INDUCTOR_OPTIONS
from plan_audit import assert_shards
from torchrun import run_ranks


@pytest.mark.slow
@pytest.mark.ranks
def test_torchrun_compiled_program_trains_like_the_uncompiled_one(executed_plans):
    """4 gloo ranks on (2,2): every redistribution kind traces fullgraph; a collective waited late
    stays waited late once compiled (inductor alone would wait at once); llama3-tiny, one plan,
    uncompiled vs compile=True through 4 AdamW steps (steps 2-4 compiled): losses, the last
    gradients and the parameters agree within fp32 tolerance on every rank; each half of the
    program compiled to one graph with no break."""
    ranks = run_ranks("dist_compile.py", timeout=500)
    assert len(ranks) == 4 and executed_plans()
    for facts in executed_plans():  # FSDP over TP, the batch split over dp
        assert_shards(facts)
    for r in ranks:
        kinds = {k for case in r["redistributions"] for k in case["kinds"]}
        assert kinds == {"permute", "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "chunk", "to_partial"}
        assert all(case["equal"] for case in r["redistributions"]), r["redistributions"]
        assert r["late_wait"] == ["all_gather_into_tensor", "mm", "mm", "wait_tensor"]
        assert r["compiled"] == {"eager": False, "compiled": True}  # AutoShard(compile=True) reached the module
        assert {"all_gather", "reduce_scatter"} <= set(r["collective_kinds"])  # FSDP's, bucketed and waited late
        assert {phase: (st["graphs"], st["graph_breaks"]) for phase, st in r["stats"].items()} == {
            "forward": (1, 0),
            "backward": (1, 0),
        }
        assert r["losses"][0] == r["eager_losses"][0]  # step 1: the checked, uncompiled run in both
        for got, want in zip(r["losses"], r["eager_losses"]):
            assert abs(got - want) <= 1e-6 * abs(want), (r["losses"], r["eager_losses"])
        assert r["grads"] <= 1 and r["params"] <= 1, (r["grads"], r["params"])


@pytest.mark.replicated_plan  # a world of one: what it checks is which halves compile, and when
def test_train_compile_flag_compiles_both_halves_from_the_first_unmetered_step(tmp_path, capsys, monkeypatch):
    """`train --compile` (a world of 1): torch.compile gets the program's forward and backward
    once each, with fixed shapes; step 1 runs checked and uncompiled, step 2 is metered
    (--wire-step: dynamo would not compile under the meter's dispatch mode) and runs uncompiled
    too, so step 3 compiles, its row carries compile_s, and steps 3-4 run the compiled halves."""
    compiled: list[tuple[str, dict]] = []
    calls: list[str] = []

    def recording_compile(gm, **options):
        name = type(gm).__name__
        compiled.append((name, options))

        def run(*args):
            calls.append(name)
            return gm(*args)

        return run

    monkeypatch.setattr(torch, "compile", recording_compile)
    out = tmp_path / "run"
    code = main(
        [
            "--model",
            "llama3-tiny",
            "--batch",
            "8",
            "--seq",
            "16",
            "--mesh",
            "1",
            "--steps",
            "4",
            "--wire-step",
            "2",
            "--compile",
            "--out",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr().err
    options = {"dynamic": False, "options": INDUCTOR_OPTIONS}
    assert compiled == [("AutoshardForward", options), ("AutoshardBackward", options)]
    assert calls == ["AutoshardForward", "AutoshardBackward"] * 2  # steps 3 and 4
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert ["compile_s" in r for r in rows] == [False, False, True, False]
    assert "wire_bytes_per_rank" in rows[1] and rows[2]["compile_s"] > 0


def test_train_compile_without_a_cpu_compiler_is_one_error_line(tmp_path, capsys, monkeypatch):
    """No C++ compiler for inductor: one error line, exit 2, before planning; not a traceback from
    inside step 2 (where inductor would first look for one)."""
    from torch._inductor import config

    missing = str(tmp_path / "no-such-g++")
    monkeypatch.setattr(config.cpp, "cxx", (None, missing))
    code = main(
        [
            "--model",
            "llama3-tiny",
            "--batch",
            "8",
            "--seq",
            "16",
            "--mesh",
            "1",
            "--steps",
            "2",
            "--compile",
            "--out",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: --compile: inductor needs a C++ compiler for CPU kernels: No working C++ compiler found in "
        f"torch._inductor.config.cpp.cxx: (None, '{missing}') (install g++ or set CXX)"
    ]
    assert not (tmp_path / "run").exists()
