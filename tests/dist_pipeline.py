"""Pipeline stages run by torch's schedules on 4 gloo ranks, against one device: each case builds
the stages of llama3-debug (every stage's parameters fully sharded over its stage mesh, so
every mesh dim runs collectives), runs one step of 8 rows and reports the loss on the last
stage's ranks, the largest relative gradient error of this rank's parameters (gathered whole)
and the summary of each of its stages' plans (`by-hand`). Or a Hugging Face Llama cut by
`DecoderStages`, and what `plan_pipeline` chose (`chosen`)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from autoshard.driver.config import PlanConfig  # noqa: E402
from autoshard.driver.pipeline import plan_pipeline  # noqa: E402
from autoshard.driver.stages import StageSpec, apply_pipeline, pipeline_run  # noqa: E402
from autoshard_models import build_model, get_config  # noqa: E402
from autoshard_models.llama import cross_entropy_loss  # noqa: E402
from plan_audit import CPU_PRICED, summary  # noqa: E402
from torchrun import report_ranks  # noqa: E402

BATCH, SEQ = 8, 32
# name: (mesh, mesh names, schedule, blocks per stage, micro-batches, parameters sharded)
CASES = {
    "pp2xdp2 1F1B uneven": ((2, 2), ("pp", "dp"), "1F1B", (4, 2), 4, True),
    "pp2xtp2 GPipe uneven": ((2, 2), ("pp", "tp"), "GPipe", (2, 4), 2, True),
    "pp4 interleaved": ((4, 1), ("pp", "dp"), "Interleaved1F1B", (1,) * 8, 4, True),
    "pp2xdp2 zero-bubble": ((2, 2), ("pp", "dp"), "InterleavedZeroBubble", (2, 1, 2, 1), 4, False),
}


def config_of(shape, names):
    return PlanConfig(mesh=shape, mesh_names=names, device_profile=CPU_PRICED["device"], network=CPU_PRICED["network"])


def check(run, reference, loss_of, vocab, mesh, names):
    """One step of the run (its weights `reference`'s) against `loss_of(reference, tokens,
    targets)` on one device: the loss, the worst relative gradient error, and whether a second
    step on the same rows gives the first one's gradients."""
    g = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, vocab, (BATCH, SEQ), generator=g) for _ in range(2))
    rows = slice(None)
    if "dp" in names and mesh.shape[names.index("dp")] > 1:
        share = BATCH // mesh.shape[names.index("dp")]
        at = mesh.get_local_rank(names.index("dp")) * share
        rows = slice(at, at + share)
    loss = run.step(tokens[rows], targets[rows])
    first = {name: p.grad.to_local().clone() for name, p in run.named_parameters()}
    for p in run.parameters():
        p.grad = None
    run.step(tokens[rows], targets[rows])  # a second step holds and reduces afresh: the same gradients
    again = all(torch.equal(p.grad.to_local(), first[name]) for name, p in run.named_parameters())
    expected = loss_of(reference, tokens, targets)
    expected.backward()
    grads = {name: p.grad for name, p in reference.named_parameters()}
    worst = max(
        ((p.grad.full_tensor() - grads[name]).abs().max() / grads[name].abs().max()).item()
        for name, p in run.named_parameters()
    )
    return {
        "loss": None if loss is None else loss.item(),
        "expected": expected.item(),
        "worst_grad": worst,
        "again": again,
        "plans": {k: summary(m.plan) for k, m in run.modules.items()},
    }


def llama_check(run, cfg, mesh, names):
    """`check` of a run of our llama, its weights `initial_values(0)`'s."""
    reference = build_model(cfg, seed=0)
    run.load_each(reference.initial_values(0))
    return check(run, reference, lambda m, t, y: cross_entropy_loss(m(t), y), cfg.vocab_size, mesh, names)


def by_hand(shape, names, schedule, blocks, micro_batches, sharded):
    cfg = get_config("llama3-debug").with_(n_layers=sum(blocks))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = build_model(cfg, device="meta")
    tokens, targets = (torch.zeros(BATCH // micro_batches, SEQ, dtype=torch.long) for _ in range(2))
    specs, start = [], 0
    for n in blocks:
        stage = model.pipeline_stage(start, start + n)
        specs.append(StageSpec(stage, stage.example_inputs(tokens, targets, torch.float32), sharded=sharded))
        start += n
    run = pipeline_run(specs, config_of(shape, names), mesh, schedule=schedule, micro_batches=micro_batches)
    phases = count_phases(run)
    out = llama_check(run, cfg, mesh, names)
    if schedule == "InterleavedZeroBubble":
        assert phases["backward"] == phases["backward_held"] == 0, phases  # never the whole backward
        out["apart"] = {
            "weight halves": phases["backward_weight"] + phases["backward_weight_held"],
            "reduced": phases["backward_weight"],
        }
    return out


def count_phases(run):
    """Per program phase, how many times this rank's stages run it from now on."""
    counts = dict.fromkeys(
        ("backward", "backward_held", "backward_input", "backward_weight", "backward_weight_held"), 0
    )
    for module in run.modules.values():
        inner = module._run

        def counted(phase, args, inner=inner):
            counts[phase] = counts.get(phase, 0) + 1
            return inner(phase, args)

        module._run = counted
    return counts


def hf_by_hand():
    """A Hugging Face Llama cut 3/1 (`DecoderStages`) on pp2 x dp2 under 1F1B, sharded."""
    import transformers

    from autoshard.workloads import hf
    from autoshard.workloads.hf_stages import DecoderStages

    config = hf.training_config(
        transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    shape, names, micro_batches = (2, 2), ("pp", "dp"), 2
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    stages = DecoderStages(hf.build(config, "meta"))
    tokens = torch.zeros(BATCH // micro_batches, SEQ, dtype=torch.long)
    specs = []
    for start, stop in ((0, 3), (3, 4)):
        stage = stages.pipeline_stage(start, stop)
        specs.append(StageSpec(stage, stage.example_inputs(tokens, tokens, torch.float32), sharded=True))
    run = pipeline_run(specs, config_of(shape, names), mesh, schedule="1F1B", micro_batches=micro_batches)
    reference = hf.build(config, "cpu", seed=0)
    run.load_full(dict(reference.named_parameters()) | dict(reference.named_buffers()))
    return check(run, reference, lambda m, t, y: hf.logits_loss(m(input_ids=t), y), config.vocab_size, mesh, names)


def planned():
    """plan_pipeline's choice for a model whose head outweighs a block, run."""
    cfg = get_config("llama3-debug").with_(vocab_size=32768, n_layers=8)
    shape, names = (2, 2), ("pp", "dp")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = build_model(cfg, device="meta")

    def inputs(rows):
        return torch.zeros(rows, SEQ, dtype=torch.long), torch.zeros(rows, SEQ, dtype=torch.long)

    result = plan_pipeline(model, inputs, config_of(shape, names), batch=BATCH, loss_fn=cross_entropy_loss)
    run = apply_pipeline(model, result, mesh, inputs)
    out = llama_check(run, cfg, mesh, names)
    best = result.best
    out["chosen"] = {"blocks": best.blocks, "schedule": best.schedule.name, "micro_batches": best.micro_batches}
    out["stages"] = sorted(run.modules)
    return out


def main():
    """`by-hand`: the CASES; `chosen`: the Hugging Face Llama, then what plan_pipeline chose."""
    parts = {
        "by-hand": lambda: {name: by_hand(*case) for name, case in CASES.items()},
        "chosen": lambda: {"hf llama": hf_by_hand(), "planned": planned()},
    }
    (part,) = sys.argv[1:]
    run = parts[part]  # an unknown part fails before the process group starts
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    report_ranks(run())


if __name__ == "__main__":
    main()
