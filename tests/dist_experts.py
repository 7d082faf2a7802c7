"""Run under `torchrun --standalone --nproc_per_node=4`: the routed-experts ops on one rank
(`program/experts.py`) under each kind of strategy, against the op on whole tensors.

For each case (a strategy per mesh dim of a (2, 2) or (4,) mesh, a routing) every rank runs the
forward and the backward on its shards; partial results are summed over their mesh dims, and
every output must equal this rank's shard of the single-device op's. Routings: balanced (the top 2
of random scores) and skewed (nearly every token to experts 0 and 1: most ranks receive nothing,
some hold experts no token reaches).

Then whole models, planned on the (2, 2) mesh with sharding forced (tests/plan_audit.py) and
trained 3 AdamW steps beside one device: our moe-tiny and Hugging Face's Qwen3-MoE
(experts wide enough to be worth splitting), their experts run as autoshard's op (`workloads/hf_experts.py`).

Rank 0 prints one line `RESULT [json per rank]`; tests/test_experts.py asserts on it.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from functools import partial  # noqa: E402

import transformers  # noqa: E402

from autoshard.driver.api import AutoShard  # noqa: E402
from autoshard.layout import Layout  # noqa: E402
from autoshard.program.experts import LocalExperts, LocalExpertsBackward  # noqa: E402
from autoshard.report.experts import experts_entry  # noqa: E402
from autoshard.runtime.module import parallelize  # noqa: E402
from autoshard.strategies.rules.experts import _BACKWARD, _FORWARD, ExpertSplit  # noqa: E402
from autoshard.workloads import hf  # noqa: E402
from autoshard_models import MOE_CONFIGS, MarkovTokens, build_moe_model, moe_loss  # noqa: E402
from autoshard_models.experts import experts_backward, experts_forward  # noqa: E402
from autoshard_models.train_single import TrainSettings, make_optimizer  # noqa: E402
from plan_audit import CPU_PRICED, sharded_plan  # noqa: E402
from torchrun import report_ranks  # noqa: E402

T, D, E, F, K = 32, 16, 8, 12, 2
KIND = {"r": 0, "dp": 1, "tp": 2, "xp": 3, "ep": 4}  # the rows of the rule tables
CASES = [
    ("ep",),
    ("ep", "ep"),
    ("dp", "ep"),
    ("ep", "dp"),
    ("ep", "tp"),
    ("xp", "ep"),
    ("dp", "xp"),
    ("tp", "dp"),
]


def routing(kind: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.rand(T, E, generator=gen)
    if kind == "skewed":
        scores[:, :2] += 10.0  # experts 0 and 1 win for every token ...
        scores[:3, 5] += 20.0  # ... but three send one pair to expert 5
    top, chosen = torch.topk(torch.softmax(scores, -1), K)
    return top / top.sum(-1, keepdim=True), chosen


def layouts(table: list, kinds: tuple[str, ...]) -> list[Layout]:
    rows = [table[KIND[k]] for k in kinds]
    return [Layout(tuple(row[slot] for row in rows)) for slot in range(len(table[0]))]


def check(got: torch.Tensor, want_full: torch.Tensor, layout: Layout, mesh, coord) -> float:
    """Largest error of this rank's `got` (partial sums summed first) against its shard of `want_full`."""
    got = got.clone()
    for m, p in enumerate(layout.placements):
        if p.kind == "P":
            dist.all_reduce(got, group=mesh.get_group(m))
    if any(p.kind == "P" for p in layout.placements):
        layout = Layout(tuple(p if p.kind != "P" else type(p)("R") for p in layout.placements), layout.order)
    want = layout.shard_of(want_full, tuple(mesh.shape), coord)
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def main() -> None:
    dist.init_process_group("gloo")
    meshes = {2: init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b")), 1: init_device_mesh("cpu", (4,))}
    gen = torch.Generator().manual_seed(0)
    x, grad = torch.randn(T, D, generator=gen), torch.randn(T, D, generator=gen)
    w1, w3 = torch.randn(E, F, D, generator=gen) / 4, torch.randn(E, F, D, generator=gen) / 4
    w2 = torch.randn(E, D, F, generator=gen) / 4
    result = {}
    for route in ("balanced", "skewed"):
        weights, chosen = routing(route, gen)
        full_in = (x, weights, chosen, w1, w3, w2)
        want_y = experts_forward(*full_in)
        want_grads = experts_backward(grad, *full_in)
        for kinds in CASES:
            mesh = meshes[len(kinds)]
            coord = mesh.get_coordinate()
            ms = tuple(mesh.shape)
            fwd = layouts(_FORWARD, kinds)
            split = ExpertSplit.of(fwd[1], fwd[4], E, ms)
            local = [lay.shard_of(t, ms, coord) for lay, t in zip(fwd[1:], full_in)]
            y = LocalExperts(split, mesh, E)(*local)
            errors = [check(y, want_y, fwd[0], mesh, coord)]
            bwd = layouts(_BACKWARD, kinds)
            local = [lay.shard_of(t, ms, coord) for lay, t in zip(bwd[5:], (grad, *full_in))]
            got = LocalExpertsBackward(split, mesh, E)(*local)
            errors += [check(g, w, lay, mesh, coord) for g, w, lay in zip(got, want_grads, bwd[:5])]
            result[f"{route} {','.join(kinds)}"] = {"errors": errors, "parallel": list(split.parallel_dims)}
    for name in MODELS:
        result[name] = trained(name, meshes[2])
    report_ranks(result)


SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, use_cache=False)  # fmt: skip
MODELS = ("moe-tiny", "hf-qwen3-moe")
BATCH, SEQ = 8, 16


def _model(name: str, device: str):
    """(model, loss_fn, keywords): ours takes (tokens, targets) and a loss function; Hugging Face's
    take keywords and return their loss."""
    if name == "moe-tiny":
        cfg = MOE_CONFIGS[name].with_(expert_ffn=256, n_layers=4)  # 4: planned from 3 traced blocks, unrolled
        return build_moe_model(cfg, device), partial(moe_loss, aux_loss_coef=cfg.aux_loss_coef), False
    config = transformers.Qwen3MoeConfig(
        **SMALL, head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256
    )
    return hf.build(config if device == "cpu" else hf.training_config(config), device, seed=0), None, True


def trained(name: str, mesh) -> dict:
    """3 AdamW steps of `name` planned on `mesh` beside one device: the worst relative error of
    the loss, the worst gradient error past a relative 1e-5 per step, and what the plan did with
    the experts."""
    ref, loss_fn, keywords = _model(name, "cpu")
    initial = {k: v.detach().clone() for k, v in (dict(ref.named_parameters()) | dict(ref.named_buffers())).items()}
    data = [MarkovTokens(128 if keywords else 256, seed=0).batch(step, BATCH, SEQ) for step in range(3)]
    meta = _model(name, "meta")[0]
    empty = torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta")
    example = (lambda: {"input_ids": empty, "labels": empty}) if keywords else (lambda: (empty, empty))
    plan = sharded_plan(AutoShard(meta, example, mesh, loss_fn=loss_fn, **CPU_PRICED))
    pmodel = parallelize(plan, mesh, meta)
    pmodel.load_full(initial)
    optim, ref_optim = (
        make_optimizer(pmodel.parameters(), TrainSettings()),
        make_optimizer(ref.parameters(), TrainSettings()),
    )
    loss_error, grad_error = 0.0, [0.0] * len(data)
    for step, batch in enumerate(data):
        if keywords:
            want = ref(input_ids=batch.inputs, labels=batch.targets).loss
        else:
            want = loss_fn(ref(batch.inputs), batch.targets)
        want.backward()
        loss = pmodel(*pmodel.shard_inputs(batch.inputs, batch.targets))
        loss.backward()
        loss_error = max(loss_error, abs(loss.item() - want.item()) / abs(want.item()))
        refs = dict(ref.named_parameters())
        for fqn, p in pmodel.named_parameters():
            w = refs[fqn].grad
            excess = ((p.grad.full_tensor() - w).abs() - 1e-5 * w.abs()).max().item()  # past rtol 1e-5
            grad_error[step] = max(grad_error[step], excess)
        for o in (optim, ref_optim):
            o.step()
            o.zero_grad()
    experts = experts_entry(plan)
    kinds = sorted({", ".join(op["by_dim"]) for op in experts["ops"]})
    return {"loss": loss_error, "grads": grad_error, "experts": kinds, "ops": len(experts["ops"])}


if __name__ == "__main__":
    main()
