"""Running pipeline stages (`autoshard.driver.stages`): a stage's plan sends its output and its
input's gradient across the boundary, and torch's schedules run the stages exactly as one device
trains the whole model."""

import pytest
import torch

from autoshard.driver.api import AutoShard
from autoshard.driver.config import PlanConfig
from autoshard.driver.stages import StageSpec, boundary_layout, pipeline_run, plan_stage
from autoshard.layout import Layout
from autoshard_models import build_model, get_config
from autoshard_models.llama import cross_entropy_loss
from plan_audit import CPU_PRICED, assert_shards
from torchrun import one_launch_at_a_time, run_ranks

CPU = {"device_profile": CPU_PRICED["device"], "network": CPU_PRICED["network"]}


def test_stages_compose_to_the_model():
    cfg = get_config("llama3-tiny").with_(n_layers=3)
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    targets = torch.randint(0, cfg.vocab_size, (2, 8))
    first, middle, last = (model.pipeline_stage(a, b) for a, b in ((0, 1), (1, 2), (2, 3)))
    assert [n for n, _ in middle.named_parameters()][0] == "layers.1.attention_norm.weight"  # the model's names
    loss = last(middle(first(tokens)), targets)
    assert torch.equal(loss, cross_entropy_loss(model(tokens), targets))
    with pytest.raises(ValueError, match=r"some, unless it is the first or last\), got \[1, 1\)"):
        model.pipeline_stage(1, 1)


def hf_llama(**changes):
    import transformers

    from autoshard.workloads import hf

    small = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4)
    return hf.build(hf.training_config(transformers.LlamaConfig(**(small | changes))), "cpu", seed=0)


def test_a_hugging_face_decoder_splits_into_stages_that_compose_to_it():
    from autoshard.workloads import hf
    from autoshard.workloads.hf_stages import DecoderStages

    model = hf_llama()
    stages = DecoderStages(model)
    tokens, targets = torch.randint(0, 128, (2, 8)), torch.randint(0, 128, (2, 8))
    first, middle, last = (stages.pipeline_stage(a, b) for a, b in ((0, 1), (1, 2), (2, 3)))
    assert {n for n, _ in last.named_parameters()} == {n for n, _ in model.named_parameters() if ".2." in n} | {
        "model.norm.weight",
        "lm_head.weight",
    }
    loss = last(middle(first(tokens)), targets)
    assert torch.equal(loss, hf.logits_loss(model(input_ids=tokens), targets))
    with pytest.raises(ValueError, match="head is tied to its embedding"):
        DecoderStages(hf_llama(tie_word_embeddings=True))
    eager = hf_llama()
    eager.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="the model runs 'eager' attention"):
        DecoderStages(eager)
    with pytest.raises(ValueError, match="not a decoder of Llama's layout"):
        DecoderStages(torch.nn.Linear(2, 2))


def test_a_middle_stage_sends_its_output_and_its_input_gradient_in_the_boundary_layout():
    cfg = get_config("llama3-tiny").with_(n_layers=3)
    stage = build_model(cfg, device="meta").pipeline_stage(1, 2)
    tokens = torch.zeros(4, 8, dtype=torch.long)
    spec = StageSpec(stage, stage.example_inputs(tokens, tokens, torch.float32), sharded=True)
    config = PlanConfig(mesh=(2,), mesh_names=("dp",), **CPU)
    _, plan = plan_stage(spec, config, (2,), micro_batches=2)
    rows = Layout.parse("S(0)")
    assert boundary_layout(config) == rows
    assert plan.input_layouts == [rows] and plan.loss_sink.layout == rows
    assert {i: s.layout for i, s in plan.input_grad_sinks.items()} == {0: rows}
    assert tuple(plan.graph.loss.meta["val"].shape) == (4, 8, cfg.dim)  # the hidden states, not a loss
    assert plan.micro_batches == 2
    assert_shards(plan)  # sharded: every parameter split over the stage mesh


def test_inputs_that_require_a_gradient_need_a_stage_layout():
    """The last stage returns a loss, but its input's gradient goes back to a previous stage:
    planned as a model of its own, that gradient would have no layout to land in."""
    cfg = get_config("llama3-tiny").with_(n_layers=3)
    stage = build_model(cfg, device="meta").pipeline_stage(2, 3)
    hidden, targets = torch.zeros(4, 8, cfg.dim, requires_grad=True), torch.zeros(4, 8, dtype=torch.long)
    auto = AutoShard(stage, lambda: (hidden, targets), (2,), device="cpu", network="cpu-gloo")
    with pytest.raises(ValueError, match="inputs that require a gradient are a pipeline stage's"):
        auto.optimize()


@pytest.mark.parametrize(
    "schedule, chunks, message",
    [
        ("ZBV", 2, "schedule must be one of GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble, got 'ZBV'"),
        ("InterleavedZeroBubble", 3, "InterleavedZeroBubble runs one or more stages per pp rank: 3 stages on 2"),
        ("1F1B", 4, "1F1B runs one stage per pp rank: 4 stages on 2 pp ranks"),
        ("Interleaved1F1B", 2, "Interleaved1F1B runs several stages per pp rank: 2 stages on 2 pp ranks"),
        ("Interleaved1F1B", 3, "Interleaved1F1B runs several stages per pp rank: 3 stages on 2 pp ranks"),
    ],
)
def test_schedule_and_stage_count_must_agree(schedule, chunks, message):
    config = PlanConfig(mesh=(2, 2), mesh_names=("pp", "dp"))
    stages = [StageSpec(torch.nn.Linear(2, 2), (torch.zeros(2, 2),))] * chunks
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pipeline_run(stages, config, None, schedule=schedule, micro_batches=2)


def assert_cases(ranks: list[dict], cases: dict) -> None:
    """Each case's loss and gradients are one device's on every rank, each rank runs the stages
    `cases` gives its pp coordinate, and each stage mesh shards where a batch split is named
    (its parameters too, unless a third item says they are replicated)."""
    for name, (stages_of, batch_split, *replicated) in cases.items():
        pp_of = {0: 0, 1: 0, 2: 1, 3: 1} if len(stages_of) == 2 else {r: r for r in range(4)}
        last = max(s for stages in stages_of.values() for s in stages)
        for rank, result in enumerate(ranks):
            case = result[name]
            assert case["worst_grad"] < 1e-5, (name, rank, case)
            assert case["again"], (name, rank)  # a second step's gradients are the first's
            assert sorted(map(int, case["plans"])) == stages_of[pp_of[rank]]
            if last in stages_of[pp_of[rank]]:
                assert case["loss"] == pytest.approx(case["expected"], rel=1e-5)
            else:
                assert case["loss"] is None
            if batch_split is not None:  # the stage mesh is one device under pp4
                for facts in case["plans"].values():
                    assert_shards(facts, batch_split=batch_split, params_sharded=not replicated)


@pytest.mark.slow
@pytest.mark.replicated_plan  # pp4's stage meshes are one device each; the other cases assert their sharding
def test_pipelines_train_as_one_device_does():
    """4 gloo ranks: pp2 x dp2 under 1F1B with a 4/2 cut, pp2 x tp2 under GPipe with a 2/4 cut
    (every stage's parameters sharded, collectives on every stage mesh dim), pp4 under
    Interleaved1F1B (8 chunks of one block, each rank holding 2), pp2 x dp2 under
    InterleavedZeroBubble (2/1/2/1, parameters replicated: each backward's weight half runs
    apart, holding the all-reduces to the step's last): the loss and every gradient are one
    device's."""
    with one_launch_at_a_time():
        ranks = run_ranks("dist_pipeline.py", timeout=900, args=["by-hand"])
    assert_cases(
        ranks,
        {
            "pp2xdp2 1F1B uneven": ({0: [0], 1: [1]}, True),
            "pp2xtp2 GPipe uneven": ({0: [0], 1: [1]}, False),
            "pp4 interleaved": ({r: [r, r + 4] for r in range(4)}, None),
            "pp2xdp2 zero-bubble": ({0: [0, 2], 1: [1, 3]}, True, "replicated"),
        },
    )
    for result in ranks:  # the weight halves ran apart, replicated gradients reduced once a step
        assert result["pp2xdp2 zero-bubble"]["apart"] == {"weight halves": 16, "reduced": 4}, result


@pytest.mark.slow
def test_a_hugging_face_pipeline_and_the_chosen_one_train_as_one_device_does():
    """4 gloo ranks: a Hugging Face Llama cut 3/1 on pp2 x dp2 (sharded), and the pipeline
    plan_pipeline chose for a model with a large head: the loss and every gradient are one
    device's."""
    with one_launch_at_a_time():
        ranks = run_ranks("dist_pipeline.py", timeout=900, args=["chosen"])
    assert_cases(ranks, {"hf llama": ({0: [0], 1: [1]}, True)})
    for rank, result in enumerate(ranks):
        case = result["planned"]
        assert case["worst_grad"] < 1e-5 and case["again"] and case["chosen"] == ranks[0]["planned"]["chosen"]
        assert sum(case["chosen"]["blocks"]) == 8
        if case["loss"] is not None:
            assert case["loss"] == pytest.approx(case["expected"], rel=1e-5)
    assert sum(r["planned"]["loss"] is not None for r in ranks) == 2  # the two ranks of the last stage


def test_a_pending_weight_half_is_found_by_identity():
    """A zero-bubble schedule may run the weight halves in another order than their backwards:
    finding one among the pending compares nothing but identity (not the tensors it holds)."""
    from autoshard.runtime.module import _Deferred

    first, second = (_Deferred([torch.ones(3)], True, torch.device("cpu")) for _ in range(2))
    pending = [first, second]
    pending.remove(second)
    assert pending[0] is first and len(pending) == 1
