"""Frozen parameters (`requires_grad=False`) are parameters without gradients: planned like any
other (here forced to shard, and asserted), with no gradient sink, reduction or optimizer state.
Each model trains on every rank of a simulated mesh through 3 AdamW steps like one device: the
loss and every trained parameter's gradient equal, the frozen values bit-identical after the steps.
The models: a layer frozen by hand, peft's LoRA over tiny HF Llama and Qwen2, and HF Marian, whose
sinusoidal position tables are parameters that never train."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from autoshard import _torch_compat as tc
from autoshard.driver.api import AutoShard
from autoshard.profiles.device import DeviceProfile
from autoshard.runtime.module import parallelize
from autoshard.workloads import hf
from autoshard_models.train_single import TrainSettings, make_optimizer
from plan_audit import CPU_PRICED, sharded_plan
from simulation import assert_step_matches, simulated_mesh
from test_hf import SMALL

peft = pytest.importorskip("peft")

BATCH, SEQ, VOCAB, STEPS = 4, 8, 128, 3
MARIAN = dict(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4)
MARIAN |= dict(decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
MARIAN |= dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, decoder_start_token_id=0)
MARIAN |= dict(use_cache=False)


class TwoLayers(nn.Module):
    """The first layer frozen, as a user does with `requires_grad_(False)`."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.frozen = nn.Linear(32, 64)
        self.head = nn.Linear(64, VOCAB)
        self.embed.requires_grad_(False)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.relu(self.frozen(self.embed(x))))


def lora(base: nn.Module, dora: bool = False) -> nn.Module:
    """peft's LoRA (or DoRA: a trained magnitude per output row) on q and v, its adapters
    initialized at random (peft zeroes B by default, which would leave A's first gradient zero)."""
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, use_dora=dora
    )
    return peft.get_peft_model(base, config)


def hf_causal(config_class):
    def make(device: str) -> nn.Module:
        config = config_class(**SMALL)
        return hf.build(config if device == "cpu" else hf.training_config(config), device, seed=0)

    return make


MODELS = {
    "two-layers": lambda device: TwoLayers().to(device),
    "lora-llama": lambda device: lora(hf_causal(transformers.LlamaConfig)(device)),
    "lora-qwen2": lambda device: lora(hf_causal(transformers.Qwen2Config)(device)),
    # peft's DoRA layer asks `type(weight).__module__` (for torchao), which dynamo cannot trace:
    # the step is traced by the direct joint export
    "dora-llama": lambda device: lora(hf_causal(transformers.LlamaConfig)(device), dora=True),
    "marian": lambda device: transformers.MarianMTModel(transformers.MarianConfig(**MARIAN)).to(device),
}


def logits_loss(out, y):
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def marian_loss(model, x, y):
    return model(input_ids=x, labels=y).loss


def build(kind: str, device: str) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.device(device):
            return MODELS[kind](device).train()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [tuple(torch.randint(2, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2)) for _ in range(STEPS)]


def single_device(kind: str):
    """Initial values, and per step (loss, trained gradients), of AdamW on one device."""
    model = build(kind, "cpu")
    initial = {k: v.clone() for k, v in (model.state_dict() | dict(model.named_buffers())).items()}
    optim = make_optimizer([p for p in model.parameters() if p.requires_grad], TrainSettings())
    steps = []
    for x, y in batches():
        loss = marian_loss(model, x, y) if kind == "marian" else logits_loss(model(x), y)
        loss.backward()
        steps.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
        optim.step()
        optim.zero_grad()
    return initial, steps


def plan_sharded(kind: str, mesh_shape):
    meta = build(kind, "meta")
    if kind == "marian":  # keyword inputs, the model's own `.loss`
        names = ("input_ids", "labels")
        example = lambda: {k: torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta") for k in names}  # noqa: E731
        auto = AutoShard(meta, example, mesh_shape, **CPU_PRICED)
    else:
        example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
        auto = AutoShard(meta, example, mesh_shape, loss_fn=logits_loss, **CPU_PRICED)
    plan = sharded_plan(auto, budget=1.0 if kind == "two-layers" else 1.5)
    return plan, meta


@pytest.mark.parametrize(
    "kind, mesh_shape",
    [("two-layers", (2, 2)), ("two-layers", (4,)),
     *(pytest.param(*case, marks=pytest.mark.slow)
       for case in [("lora-llama", (2, 2)), ("lora-llama", (4,)), ("lora-qwen2", (2, 2)), ("marian", (2, 2)),
                    ("dora-llama", (2, 2))])],
)  # fmt: skip
def test_frozen_parameters_are_planned_sharded_and_train_like_one_device(kind, mesh_shape):
    initial, ref = single_device(kind)
    plan, meta = plan_sharded(kind, mesh_shape)
    frozen = {n for n, p in meta.named_parameters() if not p.requires_grad}
    trained = {n for n, p in meta.named_parameters() if p.requires_grad}
    assert frozen and trained
    assert set(plan.grad_sinks) == trained  # no gradient, so no reduction, for a frozen parameter
    assert set(plan.graph.frozen) == frozen
    sharded = [n for n in frozen if any(p.kind == "S" for p in plan.param_layouts[n].placements)]
    assert sharded, {n: str(plan.param_layouts[n]) for n in frozen}  # the frozen base is sharded too
    data = batches()
    with simulated_mesh(plan.mesh_shape) as (mesh, mode):
        pmodel = parallelize(plan, mesh, meta)
        pmodel.load_full(initial)
        optim = make_optimizer([p for p in pmodel.parameters() if p.requires_grad], TrainSettings())
        for step, (x, y) in enumerate(data):
            loss = pmodel(*pmodel.shard_inputs(x, y))
            loss.backward()
            assert_step_matches(pmodel, mode, loss, *ref[step], step)  # frozen ones: no gradient
            optim.step()
            optim.zero_grad()
        after = {fqn: pmodel.get_parameter(fqn).full_tensor() for fqn in frozen}
        with mode.disable():
            for fqn, value in after.items():
                for got in tc.rank_values(value).values():
                    assert torch.equal(got, initial[fqn]), fqn  # bit-identical: never stepped


def test_a_frozen_parameter_costs_its_value_alone_in_the_modeled_memory():
    """No gradient and no AdamW state for a frozen parameter, in the ILP's peak and the dry run."""
    from autoshard.problem.memory import ADAMW_STATE_BYTES

    plans = {}
    for frozen in (False, True):
        meta = build("two-layers", "meta")
        if not frozen:
            meta.requires_grad_(True)
        example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
        auto = AutoShard(meta, example, (4,), loss_fn=logits_loss)
        auto.pin("*", "R")  # the same layouts both ways: only what a parameter holds differs
        plans[frozen] = auto.dry_run(auto.optimize()).ranks[0]
    frozen_elements = sum(p.numel() for n, p in build("two-layers", "meta").named_parameters() if not p.requires_grad)
    assert plans[False].optimizer - plans[True].optimizer == ADAMW_STATE_BYTES * frozen_elements


def test_a_parameter_the_loss_never_reaches_says_to_freeze_it():
    model = TwoLayers().to("meta").requires_grad_(True)
    unused = nn.Linear(4, 4, device="meta")
    model.add_module("unused", unused)
    example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    with pytest.raises(ValueError, match=r"no gradient from the loss: unused.bias, unused.weight \(freeze them"):
        AutoShard(model, example, (4,), loss_fn=logits_loss).optimize()
    unused.requires_grad_(False)  # frozen: planned, never trained
    plan = AutoShard(model, example, (4,), loss_fn=logits_loss).optimize()
    assert "unused.weight" in plan.param_layouts and "unused.weight" not in plan.grad_sinks


@pytest.mark.slow
def test_a_peft_model_is_traced_from_its_repeated_blocks(caplog):
    """peft's wrappers reach the model through module tables (`__dict__['_modules']`): the module
    paths still name the blocks, so a LoRA model traces 4 of its blocks (block 0, before which no
    gradient flows, then the pattern) and unrolls the rest."""
    import logging

    config = transformers.LlamaConfig(**(SMALL | {"num_hidden_layers": 6}))
    meta = lora(hf.build(hf.training_config(config), "meta"))
    example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    with caplog.at_level(logging.INFO, logger="autoshard"):
        plan = AutoShard(meta, example, (4,), loss_fn=logits_loss).optimize()
    assert "traced 4 of the 6 blocks of base_model.model.model.layers and unrolled the rest" in caplog.text
    assert set(plan.grad_sinks) == {n for n, p in meta.named_parameters() if p.requires_grad}


def test_accumulated_micro_batches_with_frozen_parameters_train_like_the_whole_batch():
    """Two micro-batches, the first under `no_sync()` (the held all-reduces of replicated trained
    gradients): the trained gradients equal one device's over the whole batch; frozen ones stay None."""
    from contextlib import nullcontext

    model = build("two-layers", "cpu")
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(2, VOCAB, (8, 256), generator=g) for _ in range(2))  # enough work to split the batch
    logits_loss(model(x), y).backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    meta = build("two-layers", "meta")
    example = lambda: (torch.empty(4, 256, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    # compute priced slow, so the batch stays split (its gradients all-reduced: held under no_sync)
    slow = DeviceProfile(1e8, 2e7, "slow", peak_flops_fp32=1e8)
    auto = AutoShard(meta, example, (2,), loss_fn=logits_loss, device=slow)
    auto.constrain_inputs("S(0)", "S(0)")
    auto.pin("*", "R")
    plan = auto.optimize()
    with simulated_mesh((2,)) as (mesh, mode):
        pmodel = parallelize(plan, mesh, meta, accumulate=True)
        pmodel.load_full(initial)
        assert pmodel.program.held.params  # something is held
        for k in range(2):
            rows = slice(4 * k, 4 * (k + 1))
            with pmodel.no_sync() if k == 0 else nullcontext():
                (pmodel(*pmodel.shard_inputs(x[rows], y[rows])) / 2).backward()
        for fqn, p in pmodel.named_parameters():
            if fqn not in want:
                assert p.grad is None, fqn
                continue
            with mode.disable():
                for got in tc.rank_values(p.grad.full_tensor()).values():
                    torch.testing.assert_close(got, want[fqn], rtol=1e-5, atol=1e-6, msg=fqn)


def trained_on_mesh(plan, meta, initial):
    """3 AdamW steps of `plan` on a simulated mesh from `initial`: rank 0's losses and every
    parameter's full value after them."""
    with simulated_mesh(plan.mesh_shape) as (mesh, mode):
        pmodel = parallelize(plan, mesh, meta)
        pmodel.load_full(initial)
        optim = make_optimizer([p for p in pmodel.parameters() if p.requires_grad], TrainSettings())
        losses = []
        for x, y in batches():
            loss = pmodel(*pmodel.shard_inputs(x, y))
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.detach())
        with mode.disable():
            values = {n: tc.rank_values(p.full_tensor())[0] for n, p in pmodel.named_parameters()}
            return [tc.rank_values(v)[0] for v in losses], values


def test_a_frozen_base_held_in_the_compute_dtype_trains_bit_identically_in_half_the_memory():
    """Under bf16 compute every forward reads a frozen parameter cast to bf16, so holding it in bf16
    (what `--lora`/`--freeze` with `--param-dtype bf16` do) computes with the same values: the same
    sharded layouts (pinned) give bit-identical losses and trained values over 3 steps, and the
    frozen parameters take half the bytes in the dry run."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = build("two-layers", "cpu")
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    runs = {}
    for held in (torch.float32, torch.bfloat16):
        meta = build("two-layers", "meta")
        for name in frozen:
            meta.get_parameter(name).data = meta.get_parameter(name).data.to(held)
        example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
        auto = AutoShard(meta, example, (2, 2), loss_fn=logits_loss, mp_policy=policy)
        auto.constrain_inputs("S(0)R", "S(0)R")
        auto.pin({"embed.weight": "RS(1)", "frozen.weight": "RS(0)", "frozen.bias": "RS(0)", "head.*": "RR"})
        plan = auto.optimize()
        assert plan.graph.params["frozen.weight"].meta["val"].dtype == held
        runs[held] = (*trained_on_mesh(plan, meta, initial), auto.dry_run(plan).ranks[0].params)
    (losses32, values32, bytes32), (losses16, values16, bytes16) = runs.values()
    assert all(torch.equal(a, b) for a, b in zip(losses32, losses16))
    for name, value in values32.items():
        if name in frozen:
            assert values16[name].dtype == torch.bfloat16 and torch.equal(values16[name], value.to(torch.bfloat16))
        else:
            assert torch.equal(values16[name], value), name
    frozen_elements = sum(model.get_parameter(n).numel() for n in frozen)
    assert bytes32 - bytes16 == 2 * frozen_elements // 2  # 2 bytes fewer per element, each rank holding half


@pytest.mark.slow
def test_a_lora_model_in_bf16_trains_like_one_device_under_the_same_policy():
    """peft casts a LoRA layer's input to `lora_A.weight.dtype` before calling lora_A: under bf16
    compute the whole layer's parameters are cast as its forward starts (as FSDP2 casts a unit),
    so the adapters compute in bf16 like the single-device policy (every parameter cast, as
    `step_loss` does). The frozen base held in bf16, as `--lora --param-dtype bf16` holds it,
    sharded; 3 AdamW steps on (2,2) follow one device's within bf16's tolerance."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    model = build("lora-llama", "cpu")
    initial = {k: v.clone() for k, v in (model.state_dict() | dict(model.named_buffers())).items()}
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optim = make_optimizer(list(trained.values()), TrainSettings())
    want = []
    for x, y in batches():
        compute = {
            n: p.detach().to(torch.bfloat16).requires_grad_(p.requires_grad) for n, p in model.named_parameters()
        }
        loss = logits_loss(torch.func.functional_call(model, compute, (x,)).logits.float(), y)
        loss.backward()
        for name, p in trained.items():
            p.grad = compute[name].grad.float()
        optim.step()
        optim.zero_grad()
        want.append(loss.item())
    meta = build("lora-llama", "meta")
    for p in meta.parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    auto = AutoShard(meta, example, (2, 2), loss_fn=logits_loss, mp_policy=policy, **CPU_PRICED)
    plan = sharded_plan(auto, budget=1.5)
    assert any(
        any(p.kind == "S" for p in plan.param_layouts[n].placements) for n in plan.graph.frozen
    )  # the frozen base is sharded
    got = [float(loss) for loss in trained_on_mesh(plan, meta, initial)[0]]
    assert all(abs(a - b) <= 1e-2 * b for a, b in zip(got, want)), (got, want)
