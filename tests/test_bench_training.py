"""The training benchmark's quick mode: both parallel runs (autoshard and the FSDP2+TP recipe) train
under torchrun, match the single-device losses, and report throughput and bytes on the wire."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_training", ROOT / "benchmarks" / "training.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_quick_training_benchmark(tmp_path):
    bench = _bench()
    figures = bench.run(quick=True, out_dir=tmp_path)  # raises LossMismatch if a curve leaves the reference
    steps = figures["workload"]["steps"]
    reference = figures["reference"]["losses"]
    assert len(reference) == steps and reference[-1] < reference[0]
    for name in ("autoshard", "recipe"):
        run = figures[name]
        assert len(run["losses"]) == steps
        assert run["max_rel_loss_dev"] <= bench.LOSS_RTOL, (name, run["losses"], reference)
        assert run["tokens_per_s"] > 0 and run["peak_rss_mb"] > 0
        assert len(run["wire_bytes_per_rank"]) == 4 and run["wire_bytes"] > 0
        assert sum(run["wire_bytes_by_kind"].values()) == pytest.approx(run["wire_bytes_per_rank"][0], abs=4)
    assert figures["autoshard"]["planning_s"] > 0
    assert math.isclose(figures["throughput_ratio"],
                        figures["autoshard"]["tokens_per_s"] / figures["recipe"]["tokens_per_s"])
    # the recipe's parameters are laid out as ANCHORS.md says torchtitan's are
    layouts = figures["recipe"]["layouts"]
    assert layouts["layers.0.attention.wq.weight"].startswith("_StridedShard(dim=0")
    assert layouts["layers.0.feed_forward.w2.weight"] == "Shard(dim=0)Shard(dim=1)"
    assert layouts["norm.weight"] == "Shard(dim=0)Replicate()"
