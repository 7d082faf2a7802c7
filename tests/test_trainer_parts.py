"""The trainer's seams: an API user's optimizer, data and logger on a sharded plan; rows (and host
syncs) only on logged steps; the step schedule, the data position in checkpoints, the typed plan
file."""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch
import torch.distributed as dist

from autoshard.data import BatchesFeed
from autoshard.options import UsageError
from autoshard.train.loop import train
from autoshard.train.parts import Parts
from autoshard.train.planfile import PlanFile
from autoshard.train.settings import Settings
from autoshard.train.steps import LoopConfig
from autoshard_models import build_model, get_config
from autoshard_models.data import MarkovTokens
from autoshard_models.train_single import step_loss
from plan_audit import assert_shards
from torchrun import run_ranks


def sgd_reference(steps: int, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list, list]:
    """One device: llama3-tiny (seed 0) with SGD (lr 0.05, momentum 0.9) on `batches`; (losses, norms)."""
    net = build_model(get_config("llama3-tiny"), seed=0)
    optim = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    losses, norms = [], []
    for inputs, targets in batches[:steps]:
        losses.append(step_loss(net, inputs, targets).item())
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in net.parameters()])))
        optim.step()
        optim.zero_grad(set_to_none=True)
    return losses, norms


@pytest.mark.slow
@pytest.mark.ranks
def test_an_api_users_optimizer_data_and_logger_train_a_sharded_plan(tmp_path, monkeypatch, executed_plans):
    """4 gloo ranks, parameters sharded: SGD, an iterable of global batches and a logger of the
    user's own, a row every 2 steps: the rows' losses and gradient norms are one device's."""
    monkeypatch.setenv("AUTOSHARD_PARTS_OUT", str(tmp_path / "run"))
    ranks = run_ranks("dist_train_parts.py", timeout=600)
    (facts,) = executed_plans()
    assert_shards(facts, batch_split=False)
    data = MarkovTokens(get_config("llama3-tiny").vocab_size, seed=7)
    batches = [(b.inputs, b.targets) for b in (data.batch(step, 8, 16) for step in range(6))]
    losses, norms = sgd_reference(6, batches)
    for rank in ranks:
        assert rank["closed"] and [r["step"] for r in rank["rows"]] == [2, 4, 6]
        assert rank["losses"] == [r["loss"] for r in rank["rows"]]
        for row in rank["rows"]:
            assert row["loss"] == pytest.approx(losses[row["step"] - 1], abs=1e-5)
            assert row["grad_norm"] == pytest.approx(norms[row["step"] - 1], rel=1e-4)
            assert row["lr"] == 0.05
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6]


class SyncCounter:
    """Counts the reads of tensor values on the host (item, tolist, float/int/bool of a tensor) and
    object collectives, by the step whose batch was taken last."""

    NAMES = ("item", "tolist", "__float__", "__int__", "__bool__")

    def __init__(self, monkeypatch):
        self.step, self.counts = 0, {}
        for name in self.NAMES:
            self._wrap(monkeypatch, torch.Tensor, name)
        self._wrap(monkeypatch, dist, "all_gather_object")

    def _wrap(self, monkeypatch, owner, name):
        real = getattr(owner, name)

        def counted(*args, **kwargs):
            if self.step:
                self.counts[self.step] = self.counts.get(self.step, 0) + 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    def batches(self, steps: int):
        data = MarkovTokens(get_config("llama3-tiny").vocab_size, seed=0)
        for step in range(steps):
            rows = data.batch(step, 8, 16)
            self.step = step + 1
            yield rows.inputs, rows.targets
        self.step = 0


@pytest.mark.replicated_plan  # a world of one: what is counted is the loop's reads, not a plan's
def test_only_logged_steps_read_the_device(tmp_path, monkeypatch):
    """Six steps logged every third: steps 3 and 6 read the step's figures back once each, the
    others never (the forward, backward, clipping and optimizer step included)."""
    settings = Settings(model="llama3-tiny", mesh=(1,), batch=8, seq=16, steps=6, log_every=3, grad_clip=1.0)
    counter = SyncCounter(monkeypatch)
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: dist.destroy_process_group() if dist.is_initialized() else None)
        losses = train(settings.replace(out=str(tmp_path / "run")), Parts(data=counter.batches(6)))
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert {step: counter.counts.get(step, 0) for step in range(1, 7)} == {1: 0, 2: 0, 3: 1, 4: 0, 5: 0, 6: 1}


def test_logged_steps_are_the_rows_and_the_steps_that_read_the_device_anyway():
    config = LoopConfig(steps=10, log_every=4, eval_every=3, checkpoint_every=5, memory_step=7)
    assert [s for s in range(1, 11) if config.logged(s)] == [3, 4, 5, 6, 7, 8, 9, 10]
    assert [s for s in range(1, 6) if LoopConfig(steps=5).logged(s)] == [1, 2, 3, 4, 5]


class Counted:
    """An iterable that says how often it was iterated from the start."""

    def __init__(self, n):
        self.n, self.starts = n, 0

    def __iter__(self):
        self.starts += 1
        return iter([(torch.full((2, 3), i),) for i in range(self.n)])


class Whole:
    """A stand-in parallel module whose shards are the whole inputs."""

    def shard_inputs(self, *x):
        return x


def test_a_user_iterable_resumes_past_the_batches_trained_on():
    source = Counted(5)
    feed = BatchesFeed(source, Whole(), micro_batches=2)
    first = feed.inputs(1, 0), feed.inputs(1, 1), feed.inputs(2, 0)
    assert [x[0][0, 0].item() for x in first] == [0, 0, 1] and first[0][0].shape == (1, 3)
    resumed = BatchesFeed(source, Whole(), micro_batches=2)
    resumed.load_state_dict(feed.state_dict())
    assert resumed.inputs(3, 0)[0][0, 0].item() == 2 and source.starts == 2
    short = BatchesFeed(Counted(1), Whole())
    with pytest.raises(UsageError, match="fewer than the 2 batches"):
        short.load_state_dict({"batches": 2})
    with pytest.raises(UsageError, match="the data ran out at step 2"):
        short = BatchesFeed(Counted(1), Whole())
        short.inputs(1, 0), short.inputs(2, 0)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", ": not JSON ("),
        ('{"fingerprint": "x"}', "not a plan file (no fingerprint/solution"),
        ('{"fingerprint": "x", "solution": {}, "settings": [1]}', "its settings, recompute or reshard section"),
        ('{"fingerprint": "x", "solution": {}, "settings": {"grad_accum": 0}}', "grad_accum 0"),
    ],
)
def test_a_damaged_plan_file_is_one_error(tmp_path, text, message):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        PlanFile.read(path, "--plan-file plan.json", required=True)


def test_a_plan_file_reads_what_planning_reuses(tmp_path):
    path = tmp_path / "plan.json"
    record = {"fingerprint": "f", "solution": [1], "settings": {"grad_accum": 2}, "recompute": {"blocks": ["b0"]}}
    path.write_text(json.dumps(record))
    plan = PlanFile.read(path, "p", required=False)
    assert (plan.fingerprint, plan.solution, plan.micro_batches, plan.recompute, plan.reshard) == (
        "f",
        [1],
        2,
        True,
        False,
    )
