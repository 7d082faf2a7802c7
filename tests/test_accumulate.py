"""Gradient accumulation (`program/accumulate.py`, `ParallelModule.no_sync`): K micro-batches give
the gradients and the AdamW trajectory of their whole batch on one device, with the all-reduces
of replicated parameters' gradients run once per optimizer step and reduce-scatters every time."""

from __future__ import annotations

import json
from collections import Counter
from contextlib import nullcontext

import pytest
import torch

from autoshard import _torch_compat as tc
from autoshard.driver.api import AutoShard
from autoshard.profiles.device import DeviceProfile
from autoshard.runtime.module import parallelize
from autoshard_models import MarkovTokens, build_model, cross_entropy_loss, get_config
from autoshard_models.train_single import TrainSettings, make_optimizer
from plan_audit import assert_shards
from simulation import simulated_mesh
from test_train import SHARDED_ON_4, metrics, torchrun
from test_train import TINY as TRAIN_TINY
from test_train_loop import SCHEDULED, reference, torch_lrs
from test_train_loop import settings as train_settings

TINY = get_config("llama3-tiny")
BATCH, SEQ, K = 8, 16, 4
MICRO = BATCH // K
# attention replicated on dp (its gradients all-reduced: held), the rest sharded on dp too
# (reduce-scattered every micro-batch): both kinds in one plan, on a batch split on dp
PINS = {
    "layers.*.attention.*.weight": "RS(0)",
    "layers.*.feed_forward.*.weight": "S(0)S(1)",
    "tok_embeddings.weight": "S(0)R",
}
# on 3 ranks (the planner splits only evenly: ffn_hidden 192 is the dim that splits in 3), a
# micro-batch of 3 rows, one per rank
PINS_3 = {
    "layers.*.attention.*.weight": "R",
    "layers.*.feed_forward.w[13].weight": "S(0)",
    "layers.*.feed_forward.w2.weight": "S(1)",
}
CASES = {"2x2": ((2, 2), 8, "S(0)R", PINS), "3": ((3,), 12, "S(0)", PINS_3)}


def plan_micro(mesh_shape=(2, 2), micro=MICRO, inputs="S(0)R", pins=PINS):
    meta = build_model(TINY, device="meta")
    example = lambda: (torch.empty(micro, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    # compute priced 1000x slower than the cpu preset: computing the micro-batch split on dp (and
    # reducing gradients) wins over gathering it, which the tiny model would otherwise do
    slow = DeviceProfile(1e8, 2e7, "slow", peak_flops_fp32=1e8)
    with AutoShard(meta, example, mesh_shape, loss_fn=cross_entropy_loss, device=slow) as auto:
        auto.constrain_inputs(inputs, inputs)
        auto.pin(pins)
        plan = auto.optimize()
    assert_shards(plan, params_sharded=True, batch_split=True)
    return plan


def single_device(steps: int, batch: int = BATCH):
    model = build_model(TINY, seed=0)
    optim = make_optimizer(model.parameters(), TrainSettings())
    data = MarkovTokens(TINY.vocab_size, seed=0)
    losses, first = [], None
    for step in range(steps):
        rows = data.batch(step, batch, SEQ)
        loss = cross_entropy_loss(model(rows.inputs), rows.targets)
        loss.backward()
        first = first or {n: p.grad.clone() for n, p in model.named_parameters()}
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, first


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_micro_batches_train_like_their_whole_batch_and_all_reduce_once(case):
    mesh_shape, batch_rows, inputs, pins = CASES[case]
    micro_rows = batch_rows // K
    plan = plan_micro(mesh_shape, micro_rows, inputs, pins)
    ref_losses, ref_grads = single_device(3, batch_rows)
    data = MarkovTokens(TINY.vocab_size, seed=0)
    with simulated_mesh(mesh_shape) as (mesh, mode):
        pmodel = parallelize(plan, mesh, build_model(TINY, device="meta"), accumulate=True)
        pmodel.init_weights(0)
        held = pmodel.program.held
        names = pmodel.program.grad_names  # held.params index the trained parameters
        held_names = {names[i] for i in held.params}
        attention = {n for n in names if ".attention.w" in n}  # replicated on the batch's dim
        assert attention & held_names  # held (where the plan all-reduces them)
        assert not any(".feed_forward." in n for n in held_names)  # sharded: reduce-scattered
        # a micro-batch under no_sync runs no all-reduce of a held gradient; the last runs them all
        full = pmodel.program.comm.count["backward"]
        holding = held.comm.count["backward"]
        assert full["all_reduce"] > holding["all_reduce"]
        assert holding["reduce_scatter"] == full["reduce_scatter"] > 0
        optim = make_optimizer(pmodel.parameters(), TrainSettings())
        for step, ref in enumerate(ref_losses):
            with mode.disable():
                batch = data.batch(step, batch_rows, SEQ)
            total = 0.0
            for k in range(K):
                rows = slice(k * micro_rows, (k + 1) * micro_rows)
                with pmodel.no_sync() if k < K - 1 else nullcontext():
                    loss = pmodel(*pmodel.shard_inputs(batch.inputs[rows], batch.targets[rows]))
                    (loss / K).backward()
                if k < K - 1:  # held gradients stay out of .grad until the last backward
                    assert all(p.grad is None for n, p in pmodel.named_parameters() if n in held_names)
                with mode.disable():
                    total += next(iter(tc.rank_values(loss).values())).item() / K
            assert pmodel._accumulated is None
            if step == 0:
                for fqn, p in pmodel.named_parameters():
                    assert p.grad.placements == p.placements, fqn
                    with mode.disable():
                        for got in tc.rank_values(p.grad.full_tensor()).values():
                            torch.testing.assert_close(got, ref_grads[fqn], rtol=1e-5, atol=1e-6, msg=fqn)
            optim.step()
            optim.zero_grad()
            assert abs(total - ref) <= 1e-5 * abs(ref), (step, total, ref)


def test_no_sync_needs_a_module_lowered_to_accumulate():
    plan = plan_micro()
    with simulated_mesh((2, 2)) as (mesh, _):
        pmodel = parallelize(plan, mesh, build_model(TINY, device="meta"))
        assert pmodel.program.held is None
        with pytest.raises(ValueError, match="accumulate=True"):
            with pmodel.no_sync():
                pass


def test_lowering_to_accumulate_leaves_the_ordinary_step_alone():
    """The backward of the last micro-batch runs the collectives of the program without
    accumulation, in the same order."""
    plan = plan_micro()
    with simulated_mesh((2, 2)) as (mesh, _):
        plain = parallelize(plan, mesh, build_model(TINY, device="meta")).program
        accumulating = parallelize(plan, mesh, build_model(TINY, device="meta"), accumulate=True).program
    assert accumulating.comm.steps == plain.comm.steps
    assert Counter(accumulating.comm.total_count()) == Counter(plain.comm.total_count())


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.parametrize(
    "model, plan_args",
    [
        (["--model", "llama3-debug", "--seq", "32", "--batch", "16", "--mesh", "4"], []),
        (TRAIN_TINY, SHARDED_ON_4),
    ],
    ids=["ddp-held", "sharded-scattered"],
)
def test_torchrun_grad_accum_trains_like_the_whole_batch(tmp_path, executed_plans, model, plan_args):
    """4 gloo ranks, `--grad-accum 4`: the losses, clipped gradient norms and lrs of the whole
    batch on one device. llama3-debug on mesh 4 (batch 16: micro-batches of 4, split over
    the ranks) plans DDP's layouts, which hold every gradient all-reduce for the last micro-batch; llama3-tiny's
    parameters, sharded on 2x2 by a budget, reduce-scatter at every one (batch 8: micro-batches of 2)."""
    out = tmp_path / "run"
    args = [*TRAIN_TINY, "--mesh", "2x2", *model, *plan_args, "--grad-accum", "4", "--steps", "5", *SCHEDULED]
    torchrun(*args, "--grad-clip", "0.5", "--out", str(out))
    (facts,) = executed_plans()
    held = not plan_args
    assert_shards(facts, params_sharded=not held, batch_split=False)
    rows = metrics(out)
    lrs = torch_lrs(train_settings(steps=5, lr_schedule="cosine", warmup_steps=2, min_lr=3e-4))
    name, seq, batch = (model[1], int(model[3]), int(model[5])) if held else ("llama3-tiny", 16, 8)
    losses, norms = reference(5, 0.5, lrs, weight_decay=0.1, model=name, seq=seq, batch=batch)
    assert [r["lr"] for r in rows] == lrs
    for row, loss, norm in zip(rows, losses, norms, strict=True):
        assert abs(row["loss"] - loss) <= 1e-5 * abs(loss), (row, loss)
        assert row["grad_norm"] == pytest.approx(norm, rel=1e-4)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["settings"]["grad_accum"] == 4 and plan["totals"]["micro_batches"] == 4
    held_params = plan["accumulation"]["held_params"]
    if held:  # DDP's layouts: every block's gradients all-reduced, once a step
        blocks = {p["fqn"] for p in plan["parameters"] if p["fqn"].startswith("layers.")}
        assert blocks and blocks <= set(held_params) and plan["totals"]["held_comm_s"] > 0
    else:  # sharded parameters: their reduce-scatters are not held
        sharded = {p["fqn"] for p in plan["parameters"] if "S" in p["layout"]}
        assert sharded and not sharded & set(held_params)
    log = (out / "sharding.log").read_text()
    assert "4 micro-batches x (compute" in log


@pytest.mark.parametrize(
    "args, message",
    [
        (["--grad-accum", "3"], "--grad-accum 3 does not divide --batch 8"),
        (["--grad-accum", "0"], "--grad-accum: "),
        (
            ["--mesh", "4", "--grad-accum", "4"],
            "--grad-accum 4: a micro-batch of 2 rows (--batch 8 / 4) does not split over the data-parallel mesh dims",
        ),
    ],
)
def test_bad_grad_accum_is_one_line(tmp_path, capsys, args, message):
    from autoshard.cli.train import main

    assert main([*TRAIN_TINY, "--steps", "5", *args, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_micro_batch_counts_follow_the_data_parallel_split():
    from autoshard.train.planning import micro_batch_counts
    from autoshard.train.settings import Settings

    s = Settings(model="llama3-tiny", mesh=(2, 2), batch=8, seq=16)  # dp: mesh dim 0 (2 ranks)
    assert micro_batch_counts(s) == [1, 2, 4]
    assert micro_batch_counts(s.replace(grad_accum=2)) == [2]  # asked for: only that
    assert micro_batch_counts(s.replace(batch=12)) == [1, 2]  # 12 / 4 = 3 rows do not split over 2


@pytest.mark.slow
@pytest.mark.replicated_plan  # a world of one: what is checked is the choice and the loop
def test_a_batch_over_the_memory_limit_runs_as_micro_batches(tmp_path, capsys):
    """llama3-tiny, batch 8, seq 256 on one process: its dry-run peak is ~32 MiB as one batch (~19
    MiB recomputing), ~17 MiB as two micro-batches of 4. Under an 18 MiB limit one batch does not
    fit at all; two micro-batches fit as they are, so train runs those, with the losses of the
    whole batch on one device."""
    from autoshard.cli.train import main

    out = tmp_path / "run"
    args = ["--model", "llama3-tiny", "--mesh", "1", "--batch", "8", "--seq", "256", "--steps", "2"]
    assert main([*args, "--memory-limit", "18MiB", "--out", str(out)]) in (0, None)
    captured = capsys.readouterr()
    chose = [line for line in (captured.out + captured.err).splitlines() if "micro-batches of" in line]
    assert len(chose) == 1 and "--batch 8 runs as 2 micro-batches of 4 rows" in chose[0], chose
    assert "1: none fits; 2: " in chose[0]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["settings"]["grad_accum"] == 2 and plan["totals"]["micro_batches"] == 2
    losses, _ = reference(2, None, [3e-3, 3e-3], model="llama3-tiny", batch=8, seq=256)
    for row, loss in zip(metrics(out), losses, strict=True):
        assert abs(row["loss"] - loss) <= 1e-5 * abs(loss), (row["loss"], loss)


@pytest.mark.slow
@pytest.mark.replicated_plan  # a world of one: what is checked is which draws a resumed run makes
def test_a_resumed_run_with_micro_batches_draws_the_dropout_of_an_uninterrupted_one(tmp_path):
    """A tiny HF GPT-2 with dropout 0.1, `--grad-accum 2`: the program runs twice a step, so a run
    resumed from step 2 must draw from where two micro-batches a step left the stream; its steps 3
    and 4 have the uninterrupted run's losses exactly."""
    import transformers

    from autoshard.cli.train import main

    source = tmp_path / "gpt2"
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=64)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.1
    transformers.GPT2LMHeadModel(config).save_pretrained(source)
    args = ["--model", f"hf:{source}", "--mesh", "1", "--batch", "4", "--seq", "16", "--grad-accum", "2"]
    assert main([*args, "--steps", "4", "--out", str(tmp_path / "whole")]) in (0, None)
    resumed = tmp_path / "resumed"
    assert main([*args, "--steps", "2", "--checkpoint-every", "2", "--out", str(resumed)]) in (0, None)
    assert main([*args, "--steps", "4", "--out", str(resumed)]) in (0, None)
    whole = [r["loss"] for r in metrics(tmp_path / "whole")]
    again = [r["loss"] for r in metrics(resumed) if "loss" in r]
    assert len(set(whole)) == 4 and again == whole, (whole, again)
