"""Pipeline planning: the schedules' cost model, the search over cuts, a plan read as segments,
and `plan` on a mesh with a pp dim."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from autoshard import AutoShard, PlanConfig, plan_pipeline
from autoshard._torch_compat import fake_process_group
from autoshard.pipeline.schedules import Schedule, schedules, timeline_s
from autoshard.pipeline.search import Link, Run, Stage, best_cut, even_cut, search
from autoshard.pipeline.segments import Segment, Segments, plan_segments
from autoshard.problem.memory import modeled_bytes, peak_memory_table
from autoshard.profiles.network import NetworkProfile
from autoshard.report.pipeline import pipeline_summary
from autoshard.report.units import human_bytes
from autoshard_models import build_model, cross_entropy_loss, get_config

CPU = {"network": "cpu-gloo", "device_profile": "cpu"}  # PlanConfig's names
CPU_KW = {"network": "cpu-gloo", "device": "cpu"}  # AutoShard's
FREE_LINK = Link(0.0, math.inf)


def _segments(n: int, block_s: float = 1.0, head_s: float = 0.0, state: float = 1.0, act: float = 1.0) -> Segments:
    before = Segment("before layers", 0.0, 0.0, 0.0, 0.0, 1.0)
    blocks = tuple(Segment(f"layers.{i}", block_s, 0.0, state, act, 1.0) for i in range(n))
    after = Segment("after layers", head_s, 0.0, 0.0, 0.0, 0.0)
    return Segments("layers", (before, *blocks, after))


def test_the_schedules_model_torchs_bubbles_and_in_flight_micro_batches():
    t, ranks, m = 1.0, 4, 8
    one_f_one_b, gpipe, interleaved = Schedule("1F1B"), Schedule("GPipe"), Schedule("Interleaved1F1B", 2)
    # even stages: (P - 1) t of bubble, (P - 1) t / v interleaved (each chunk is t / v)
    assert one_f_one_b.step_s([t] * ranks, ranks, m) == gpipe.step_s([t] * ranks, ranks, m) == (m + ranks - 1) * t
    assert interleaved.step_s([t / 2] * 2 * ranks, ranks, m) == pytest.approx(m * t + (ranks - 1) * t / 2)
    # memory: GPipe holds every micro-batch, 1F1B P - rank, interleaved its warm-up's forwards
    # ((v - 1) x micro-batches per round + 2 (P - 1 - rank), one more before the first backward)
    assert [gpipe.in_flight(r, ranks, m) for r in range(ranks)] == [[8]] * 4
    assert [one_f_one_b.in_flight(r, ranks, m) for r in range(ranks)] == [[4], [3], [2], [1]]
    assert interleaved.in_flight(0, ranks, m) == [7, 4]  # forwards 0-3 and 8-10 on chunk 0, 4-7 on chunk 1
    assert interleaved.in_flight(3, ranks, m) == [4, 1]
    # what torch refuses
    assert "at least as many micro-batches as stages" in one_f_one_b.refuses(4, 2)
    assert interleaved.refuses(4, 9) is not None and interleaved.refuses(4, 10) is None  # rounds of 2
    assert [(s.torch_class, s.virtual) for s in schedules(4)] == [
        ("Schedule1F1B", 1),
        ("ScheduleInterleaved1F1B", 2),
        *(("ScheduleInterleavedZeroBubble", v) for v in (1, 2)),
        ("ScheduleGPipe", 1),
    ]


def test_the_zero_bubble_schedule_fills_the_bubble_with_the_weights_backward():
    """Even stages of F = B = W = 1 (forward, the backward the stage before waits for, the
    weights' own): 1F1B idles (P - 1)(F + B + W), ZB-H1 (P - 1)(F + B - W), holding what 1F1B
    holds; a stage whose weights' part outweighs the rest still adds its forward (the fill)."""
    ranks, m = 4, 8
    zb, zb2 = Schedule("InterleavedZeroBubble"), Schedule("InterleavedZeroBubble", 2)
    even = Stage(0, 0, 0, 1, False, False, "f", 3.0, 0.0, 0.0, 0.0, 1, 0.0, input_s=1.0, weight_s=1.0)
    assert even.deferred_s == 2.0
    assert zb.step_s([3.0] * ranks, ranks, m, [2.0] * ranks) == m * 3 + (ranks - 1) * 1
    assert Schedule("1F1B").step_s([3.0] * ranks, ranks, m, [2.0] * ranks) == m * 3 + (ranks - 1) * 3
    assert zb2.step_s([1.5] * 2 * ranks, ranks, m, [1.0] * 2 * ranks) == m * 3 + (ranks - 1) * 1 / 2
    first = Stage(0, 0, 0, 1, True, False, "f", 3.0, 0.0, 0.0, 0.0, 1, 0.0, input_s=0.0, weight_s=2.0)
    assert first.deferred_s == 2.0  # F = 1 left: its backward is all the weights'
    assert [zb.in_flight(r, ranks, m) for r in range(ranks)] == [[4], [3], [2], [1]]
    assert zb2.in_flight(0, ranks, m) == [4, 4]  # a warm-up of P - 1 - rank past the first round
    assert zb2.refuses(4, 9) is not None and zb2.refuses(4, 10) is None


def test_a_heavy_head_gets_a_short_last_stage_and_beats_the_even_split():
    families = {"only": _segments(14, head_s=4.0)}
    run = Run(4, 8, 8, FREE_LINK, math.inf)
    cut, even = best_cut(families, Schedule("1F1B"), run), even_cut(families, Schedule("1F1B"), run)
    assert even.blocks == [3, 4, 4, 3]  # torchtitan's: the embedding and the head count as a block each
    assert (
        cut.blocks[-1] == 1 and sorted(cut.blocks[:-1]) == [4, 4, 5] and cut.stages[-1].after and cut.stages[0].before
    )
    assert max(cut.rank_micro_s) == 5.0 and cut.step_time_s == 8 * 5 + (18 - 5)
    assert cut.step_time_s < even.step_time_s == 8 * 7 + (18 - 7)


def test_each_stage_takes_the_fastest_family_that_fits_its_in_flight_micro_batches():
    """The first stage holds 4 micro-batches under 1F1B: its activations only fit recomputed."""
    kept = _segments(8, block_s=1.0, state=1.0, act=4.0)
    recomputed = _segments(8, block_s=1.5, state=1.0, act=0.5)
    found = best_cut({"keep": kept, "recompute": recomputed}, Schedule("1F1B"), Run(4, 8, 1, FREE_LINK, 12.0))
    assert [s.in_flight for s in found.stages] == [4, 3, 2, 1]
    assert [s.family for s in found.stages][0] == "recompute" and found.stages[-1].family == "keep"
    assert all(s.memory_bytes <= 12.0 for s in found.stages)
    assert best_cut({"keep": kept}, Schedule("1F1B"), Run(4, 8, 1, FREE_LINK, 2.0)) is None  # nothing fits


def test_the_search_ranks_schedules_and_micro_batch_counts_and_prices_the_sends():
    segs = _segments(8)
    ranked = search({4: (2, {"a": segs}), 8: (1, {"a": segs})}, schedules(4), 4, FREE_LINK, math.inf)
    assert [p.step_time_s for p in ranked] == sorted(p.step_time_s for p in ranked)
    assert {(p.schedule.name, p.micro_batches) for p in ranked} >= {("1F1B", 4), ("GPipe", 8), ("Interleaved1F1B", 8)}
    slow = Link(1.0, 1.0)  # a second per send and per byte: each block sends 1 byte, twice a micro-batch
    priced = best_cut({"a": segs}, Schedule("1F1B"), Run(4, 4, 1, slow, math.inf))
    assert [s.micro_s - s.n_blocks for s in priced.stages] == [4, 4, 4, 0]  # the last sends nothing
    assert priced.blocks == [1, 1, 1, 5]  # so it takes the most blocks


def test_a_plan_read_as_segments_adds_up_to_the_plan():
    model = build_model(get_config("llama3-debug"), device="meta")
    with fake_process_group(4):
        auto = AutoShard(
            model,
            lambda: (torch.empty(8, 64, dtype=torch.int64),) * 2,
            (2, 2),
            loss_fn=cross_entropy_loss,
            **CPU_KW,
        )
        auto.accumulate(4)
        auto.memory_limit(math.inf)
        plan = auto.optimize(dry_run=False)
    segs = plan_segments(plan, auto.sharding)
    assert segs.blocks == "layers" and segs.n_blocks == 6
    assert [s.name for s in segs.items] == ["before layers", *[f"layers.{i}" for i in range(6)], "after layers"]
    total = lambda field: sum(getattr(s, field) for s in segs.items)  # noqa: E731
    assert total("micro_s") == pytest.approx(plan.compute_s + plan.comm_s - plan.held_comm_s, rel=1e-12)
    assert total("step_s") == pytest.approx(plan.held_comm_s + plan.optimizer_s, rel=1e-12)
    linear = modeled_bytes(peak_memory_table(auto.sharding), plan.solution.choice)
    assert total("state_bytes") + total("act_bytes") == pytest.approx(linear, rel=1e-12)
    blocks = segs.items[1:-1]
    assert len({(s.micro_s, s.state_bytes, s.act_bytes) for s in blocks[1:-1]}) == 1  # the middle blocks repeat
    # a block sends its output, [8, 64, 256] fp32 over 4 ranks at most and the whole at least
    assert 8 * 64 * 256 * 4 / 4 <= blocks[2].out_bytes <= 8 * 64 * 256 * 4
    assert segs.items[-1].out_bytes == 0 and segs.items[-1].state_bytes > 0  # the head's weight
    # the backward split as a zero-bubble schedule runs it: the embedding's is its weight's
    # gradient alone; a block's and the head's also pass a gradient on, and their forward remains
    assert segs.items[0].input_s == 0 < segs.items[0].weight_s
    assert all(0 < s.weight_s and 0 < s.input_s and s.input_s + s.weight_s < s.micro_s for s in segs.items[1:])


def test_the_planner_cuts_a_model_with_a_large_head_unevenly():
    """A 32K vocabulary on 8 small blocks: the head costs several blocks, so the last stage holds
    fewer blocks than torchtitan's even split gives it, and the modeled step is faster."""
    model = build_model(get_config("llama3-debug").with_(vocab_size=32768, n_layers=8), device="meta")
    with fake_process_group(2):
        result = plan_pipeline(
            model,
            lambda rows: (torch.empty(rows, 64, dtype=torch.int64, device="meta"),) * 2,
            PlanConfig(mesh=(2, 2), mesh_names=("pp", "dp"), **CPU),
            batch=8,
            loss_fn=cross_entropy_loss,
            micro_batches=[4],
        )
    best, even = result.best, result.even
    assert best.schedule == Schedule("InterleavedZeroBubble") and best.micro_batches == 4 and best.rows == 2
    one_f_one_b = next(p for p in result.others if p.schedule.name == "1F1B")
    assert best.blocks == one_f_one_b.blocks and best.bubble_s < one_f_one_b.bubble_s  # the weights' halves fill it
    assert sum(best.blocks) == 8 and best.blocks[-1] < 4 and even.blocks == [4, 4]
    assert best.step_time_s < even.step_time_s
    assert all(best.step_time_s <= other.step_time_s for other in result.others)
    assert {family for m, family in result.plans} == {
        *("free", "sharded", "free, recompute", "sharded, recompute"),
        *("sharded, gathered once", "sharded, recompute, gathered once"),  # priced from the sharded plans
    }
    assert result.stage_plan(0).micro_batches == 4  # priced as accumulation over the micro-batches


def test_the_devices_without_the_pp_dim_fold_it_into_data_parallelism():
    three = PlanConfig(mesh=(4, 2, 2), mesh_names=("pp", "dp", "tp")).without_pipeline()
    assert (three.mesh, three.mesh_names) == ((8, 2), ("dp", "tp"))
    hsdp = PlanConfig(mesh=(2, 2, 2, 2), mesh_names=("pp", "dp_replicate", "dp_shard", "tp")).without_pipeline()
    assert (hsdp.mesh, hsdp.mesh_names) == ((4, 2, 2), ("dp_replicate", "dp_shard", "tp"))
    no_dp = PlanConfig(mesh=(2, 4), mesh_names=("pp", "tp")).without_pipeline()
    assert (no_dp.mesh, no_dp.mesh_names) == ((2, 4), ("dp", "tp"))


def test_a_network_profile_without_a_dim_keeps_the_others_links():
    net = NetworkProfile.preset("h100-node", 3, intra_node_dims=(2,))
    sub = net.without(0)
    assert (sub.alpha, sub.beta) == (net.alpha[1:], net.beta[1:]) and sub.mesh_ndim == 2
    assert NetworkProfile.preset("cpu-gloo", 3).without(0).kinds == NetworkProfile.preset("cpu-gloo", 2).kinds


def test_plan_on_a_pp_mesh_writes_the_stages(tmp_path, capsys):
    from autoshard.__main__ import main

    out = tmp_path / "plan"
    argv = ["plan", "--model", "llama3-debug", "--mesh", "2x2", "--mesh-names", "pp,dp", "--batch", "4", "--seq", "64"]
    argv += ["--network", "cpu-gloo", "--device", "cpu", "--out", str(out), "--compare", "no-pp"]
    assert main([*argv, "--explain", "layers.3.attention.wq.weight"]) == 0
    console = capsys.readouterr().out
    assert "pipeline over pp 2 x dp 2:" in console and "blocks per stage:" in console
    entry = json.loads((out / "plan.json").read_text())["pipeline"]
    flat = entry["without_pp"]  # the same 4 devices as one dp dim, planned and priced alike
    assert flat["mesh"] == [4] and flat["mesh_names"] == ["dp"] and flat["step_time_s"] > 0
    assert "without pp, mesh (4,) (dp): modeled step" in console
    assert f"the pipeline's step is {entry['step_time_s'] / flat['step_time_s']:.3f}x its" in console
    assert entry["mesh"] == [2, 2] and entry["stage_mesh"] == [2] and entry["micro_batches"] == 2
    assert sum(entry["blocks_per_stage"]) == 6 and len(entry["stages"]) == 2 * entry["virtual_stages"]
    assert entry["stages"][0]["before_blocks"] and entry["stages"][-1]["after_blocks"]
    assert entry["peak_bytes"] == max(entry["rank_bytes"]) and entry["tokens_per_s_per_device"] > 0
    families = entry["families"]  # the whole model's step on the stage mesh, as each family prices it
    assert families["sharded, gathered once"] < families["sharded"]  # its gathers once a step, not per micro-batch
    log = (out / "sharding.log").read_text()
    assert log.startswith("autoshard sharding log: mesh (2, 2) = pp 2 x dp 2")
    assert "== pipeline (modeled, per rank of a stage) ==" in log and "runners-up" in log
    assert "== layouts of the first stage's family" in log
    # each distinct stage dry-run once (twins share it), a rank's peak from its stages' dry runs
    assert 1 <= entry["dry_run_programs"] <= len(entry["stages"]) and "dry-run peak" in console
    assert entry["dry_run_peak_bytes"] == max(entry["rank_dry_run_bytes"]) and "dry run, held" in log
    for rank, measured in enumerate(entry["rank_dry_run_bytes"]):
        held = [s["dry_run_held_bytes"] for s in entry["stages"] if s["rank"] == rank]
        assert sum(held) < measured <= sum(held) + max(s["dry_run_bytes"] for s in entry["stages"])
        assert 0.5 < measured / entry["rank_bytes"][rank] < 2  # the linear model is near what runs
    assert not any(line.startswith("warning:") for line in pipeline_summary(entry))
    limit = entry["memory_limit_bytes"] = entry["dry_run_peak_bytes"] - 1  # as if the device were smaller
    over = [r for r, b in enumerate(entry["rank_dry_run_bytes"]) if b > limit]
    assert [line for line in pipeline_summary(entry) if line.startswith("warning:")] == [
        f"warning: the dry runs exceed the memory limit {human_bytes(limit)} on pp ranks {over}"
    ]
    assert 'id="pipeline"' in (out / "report.html").read_text()
    # --explain: the runners-up against the chosen pipeline, then the parameter in its own stage
    explain = console[console.index("explain pipeline:") :].splitlines()
    assert explain[1].startswith(f"  chosen: {entry['schedule']}") and len(entry["runners_up"]) >= 1
    assert explain[2].endswith(f"({entry['runners_up'][0]['step_time_s'] / entry['step_time_s']:.3f}x)")
    first, *last = map(int, entry["stages"][entry["explain"]["stage"]]["blocks"].split("-"))
    assert first <= 3 <= (last[0] if last else first)  # the stage that holds block 3
    assert entry["explain"]["params"][0] == "layers.3.attention.wq.weight" and entry["explain"]["alternatives"]
    assert f"explain layers.3.attention.wq.weight (stage {entry['explain']['stage']} on pp rank " in console


def test_a_stage_that_gathers_once_a_step_pays_its_gathers_once_and_holds_them():
    """Fully sharded parameters (a budget of total / world forces it): under gradient accumulation
    each micro-batch gathers them again; a pipeline stage that holds them across its micro-batches
    (as torch's pipelining runs FSDP) moves those gathers and the gradient reductions to once a
    step and holds the gathered copies and unreduced gradients instead."""
    model = build_model(get_config("llama3-debug"), device="meta")
    total = sum(p.numel() * 4 for p in model.parameters())
    with fake_process_group(4):
        auto = AutoShard(
            model, lambda: (torch.empty(8, 64, dtype=torch.int64),) * 2, (2, 2), loss_fn=cross_entropy_loss, **CPU_KW
        )
        auto.accumulate(4)
        auto.memory_limit(math.inf)
        auto.memory_budget(total / 4)
        plan = auto.optimize(dry_run=False)
    graph = auto.sharding.graph
    derived = {n.name for n in graph.from_params} | {n.name for n in graph.params.values()}
    moved = [r for r in plan.redistributions if r.producer in derived or r.consumer.startswith("sink:grad:")]
    assert any(r.plan.collective_counts.get("all_gather") for r in moved), "the plan gathers no parameter"
    per_micro, once = plan_segments(plan, auto.sharding), plan_segments(plan, auto.sharding, gathered_once=True)
    total = lambda segs, field: sum(getattr(s, field) for s in segs.items)  # noqa: E731
    moved_s = sum(r.cost_s for r in moved if not r.held)
    assert total(once, "step_s") == pytest.approx(total(per_micro, "step_s") + moved_s, rel=1e-9)
    assert total(once, "micro_s") == pytest.approx(total(per_micro, "micro_s") - moved_s, rel=1e-9)
    assert total(once, "state_bytes") > total(per_micro, "state_bytes")  # the gathered copies, held
    assert total(once, "act_bytes") == total(per_micro, "act_bytes")


def test_free_parameters_that_overfill_a_stage_skip_their_recomputed_solve():
    from autoshard.driver.pipeline import _holds_too_much

    free = (None, _segments(8, state=10.0))  # an even share of 2 stages: 4 blocks, 40 bytes of state
    assert _holds_too_much(free, 2, 39.0) and not _holds_too_much(free, 2, 40.0)
    assert not _holds_too_much(None, 2, 0.0)  # no free plan: nothing to judge by


def test_stage_dry_runs_in_worker_processes_measure_what_one_process_does(monkeypatch):
    """`plan`'s stage dry runs run side by side in forkserver workers: each distinct stage's
    estimate is the one its planning and dry run give in this process."""
    from autoshard.driver import stage_memory

    model = build_model(get_config("llama3-debug"), device="meta")
    inputs = lambda rows: (torch.zeros(rows, 64, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    config = PlanConfig(mesh=(2, 2), mesh_names=("pp", "dp"), device_profile="cpu", network="cpu-gloo")
    with fake_process_group(2):
        result = plan_pipeline(model, inputs, config, batch=4, loss_fn=cross_entropy_loss)
        stage_memory.start_workers()
        chosen = stage_memory.ChosenStages(model, result, inputs, result.best)
        monkeypatch.setattr(stage_memory, "_cores", lambda: 2)
        apart = stage_memory.dry_run_stages(chosen)
        assert not chosen._planned  # planned in the workers, not here
        monkeypatch.setattr(stage_memory, "_cores", lambda: 1)
        here = stage_memory.dry_run_stages(chosen)
    assert apart.plans == here.plans >= 2  # the embedding's stage and the head's differ
    assert [s.estimate for s in apart.stages] == [s.estimate for s in here.stages]
    assert all(s.estimate.peak_bytes > 0 for s in here.stages)


def test_a_later_stage_takes_hidden_states_on_the_tokens_device():
    """Meta tokens give meta hidden states: a 405B stage's example input is never allocated."""
    stage = build_model(get_config("llama3-405b"), device="meta").pipeline_stage(40, 48)
    tokens = torch.zeros(16, 8192, dtype=torch.int64, device="meta")
    (hidden,) = stage.example_inputs(tokens, tokens, torch.bfloat16)
    assert hidden.device.type == "meta" and hidden.shape == (16, 8192, 16384) and hidden.requires_grad


def test_a_timeline_runs_each_ranks_work_in_order_once_what_it_waits_for_is_done():
    """1F1B on 2 ranks, 2 micro-batches, forward 1 s, backward 2 s: rank 1's first backward ends
    at 4 s, its second at 7 s (its second forward waits for rank 0's and for its own backward),
    and rank 0's second backward waits for it: 9 s, Alpa's sum(t) + (m - 1) * max(t)."""
    order = [
        [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)],
        [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1)],
    ]
    assert timeline_s(order, [1.0, 1.0], [2.0, 2.0], [0.0, 0.0]) == 9.0
    assert Schedule("1F1B").step_s([3.0, 3.0], 2, 2) == 9.0
    with pytest.raises(ValueError, match="never runs"):
        timeline_s([[("F", 1, 0)], [("I", 0, 0)]], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0])


def test_interleaved_schedules_are_priced_by_torchs_own_order():
    """Per block 1 s of forward, 1 of the input's gradient, 1 of the weights' (the first chunk's
    backward all weights'), 2 ranks, 2 micro-batches. Even chunks: torch's order takes what the
    formula says. Chunks of 3/2/1/2 blocks under InterleavedZeroBubble: the formula says 26 s,
    ahead of one stage per rank (28 s), but torch's order runs rank 0's first chunk's backward
    after everything else, 32 s; the search prices the cut by the order."""
    from autoshard._torch_compat import schedule_order

    def times(blocks):
        forward, inputs, weights = [float(b) for b in blocks], [float(b) for b in blocks], [float(b) for b in blocks]
        weights[0], inputs[0] = weights[0] + inputs[0], 0.0
        return forward, inputs, weights

    def both(blocks, schedule):
        forward, inputs, weights = times(blocks)
        order = schedule_order(schedule.torch_class, 2, schedule.virtual, 2)
        chunk = [f + i + w for f, i, w in zip(forward, inputs, weights)]
        deferred = [w + min(w, i) for i, w in zip(inputs, weights)]
        return timeline_s(order, forward, inputs, weights), schedule.step_s(chunk, 2, 2, deferred)

    assert both([2, 2, 2, 2], Schedule("InterleavedZeroBubble", 2)) == (26.0, 26.0)
    assert both([2, 2, 2, 2], Schedule("Interleaved1F1B", 2)) == (30.0, 30.0)
    assert both([4, 4], Schedule("InterleavedZeroBubble", 1)) == (28.0, 28.0)
    assert both([3, 2, 1, 2], Schedule("InterleavedZeroBubble", 2)) == (32.0, 26.0)
    assert schedule_order("Schedule1F1B", 2, 1, 2) is None  # one stage per rank: priced by its formula


@pytest.mark.slow
def test_the_search_prices_the_benchmarks_pipelines_by_torchs_order():
    """`benchmarks/training/pipeline.py`'s case (8 blocks, (pp 2, dp 2), 2 micro-batches of 4
    rows, seq 256): by the formula two stages per rank (3/2/1/2) were the fastest, and measured
    0.85-0.95x of one; priced by torch's order they are slower than one stage per rank."""
    model = build_model(get_config("llama3-debug").with_(n_layers=8, vocab_size=2048), device="meta")
    inputs = lambda rows: (torch.zeros(rows, 256, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    config = PlanConfig(mesh=(2, 2), mesh_names=("pp", "dp"), **CPU)
    with fake_process_group(2):
        result = plan_pipeline(model, inputs, config, batch=8, loss_fn=cross_entropy_loss, micro_batches=[2])
    best = result.best
    assert (best.schedule, best.blocks) == (Schedule("InterleavedZeroBubble", 1), [4, 4]) and best.order is not None
    two = next(p for p in result.others if p.schedule == Schedule("InterleavedZeroBubble", 2))
    formula = dataclasses.replace(two, order=None)
    assert formula.step_time_s < best.step_time_s < two.step_time_s


def test_an_hf_decoders_stages_dry_run_in_worker_processes(tmp_path, capsys, caplog, monkeypatch):
    """The workers are other processes: an HF stage registers there the attention implementation
    of ours its layers look up (without it the dry run raised a KeyError from transformers)."""
    import logging

    import transformers

    from autoshard.__main__ import main
    from autoshard.driver import stage_memory

    transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ).save_pretrained(tmp_path / "model")
    monkeypatch.setattr(stage_memory, "_cores", lambda: 2)
    argv = ["plan", "--model", f"hf:{tmp_path / 'model'}", "--mesh", "2x2", "--mesh-names", "pp,dp"]
    with caplog.at_level(logging.INFO, logger="autoshard"):
        assert main([*argv, "--batch", "4", "--seq", "32", "--out", str(tmp_path / "out")]) == 0
    assert "at a time in worker processes" in caplog.text and "dry-run peak" in capsys.readouterr().out
    entry = json.loads((tmp_path / "out" / "plan.json").read_text())["pipeline"]
    assert entry["dry_run_programs"] >= 2 and all(s["dry_run_bytes"] > 0 for s in entry["stages"])
