"""Models as users find them, wrapped as they are (tiny configs, nothing downloaded): BERT and
RoBERTa masked LMs and T5 (a tied parameter whose first name the forward never calls; T5's
`_shift_right` leaves a constant in the graph), GPT-2 (its loss logs a warning), Mamba (a Python
loop over the sequence), a nanoGPT-style model returning `(logits, loss)`, a forward that makes a
`torch.tensor(...)`. Planned with forced sharding (some freely too), and run on
every rank of a simulated (2,2) mesh, they reproduce one device's losses and gradients through 3
AdamW steps."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn
from torch.nn import functional as F

from autoshard.capture.calls import loss_of
from autoshard.driver.api import AutoShard
from autoshard.layout import Layout
from autoshard.runtime.module import parallelize
from autoshard_models.train_single import TrainSettings, make_optimizer
from plan_audit import CPU_PRICED, sharded_plan
from simulation import assert_step_matches, simulated_mesh

BATCH, SEQ, VOCAB, STEPS = 4, 8, 128, 3
MESH = (2, 2)
ENCODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,  # dropout draws differently on a mesh: numbers compare without it
    attention_probs_dropout_prob=0.0,
    attn_implementation="sdpa",
)
T5 = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0, use_cache=False)
T5 |= dict(decoder_start_token_id=0, pad_token_id=0)  # transformers 5 sets neither by default
MODELS = {
    "bert": lambda: transformers.BertForMaskedLM(transformers.BertConfig(**ENCODER)),
    "roberta": lambda: transformers.RobertaForMaskedLM(transformers.RobertaConfig(**ENCODER)),
    "t5-relu": lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(**T5, feed_forward_proj="relu")),
    "t5-gated-gelu": lambda: transformers.T5ForConditionalGeneration(
        transformers.T5Config(**T5, feed_forward_proj="gated-gelu")
    ),
}
# the tied parameter each names first (what state dicts list), though its forward calls another name
UNCALLED_FIRST_NAME = {
    "bert": "cls.predictions.bias",
    "roberta": "lm_head.bias",
    "t5-relu": "shared.weight",
    "t5-gated-gelu": "shared.weight",
}


def build(make, device: str, seed: int | None = None) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        with torch.device(device):
            return make().train()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [tuple(torch.randint(2, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2)) for _ in range(STEPS)]


def meta_inputs(*names: str):
    if not names:
        return lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2
    return lambda: {name: torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta") for name in names}


def single_device(make, step) -> tuple[dict, list]:
    """Initial values, and per step (loss, gradients), of AdamW on one device; `step(model, x, y)`."""
    model = build(make, "cpu", seed=0)
    initial = {k: v.clone() for k, v in (model.state_dict() | dict(model.named_buffers())).items()}
    optim = make_optimizer(model.parameters(), TrainSettings())
    steps = []
    for x, y in batches():
        loss = step(model, x, y)
        loss.backward()
        steps.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        optim.step()
        optim.zero_grad()
    return initial, steps


def trains_like_single_device(plan, meta: nn.Module, initial: dict, ref: list) -> None:
    """The plan's module on a simulated mesh, from `initial`: every rank's loss and every gradient
    equal the single device's `ref` at each step."""
    data = batches()  # one global value, made outside LocalTensorMode
    with simulated_mesh(plan.mesh_shape) as (mesh, mode):
        pmodel = parallelize(plan, mesh, meta)
        pmodel.load_full(initial)
        assert {n for n, _ in meta.named_parameters()} <= set(pmodel.state_dict())
        optim = make_optimizer(pmodel.parameters(), TrainSettings())
        for step, (x, y) in enumerate(data):
            loss = pmodel(*pmodel.shard_inputs(x, y))
            loss.backward()
            assert_step_matches(pmodel, mode, loss, *ref[step], step)
            optim.step()
            optim.zero_grad()


def hf_loss(model, x, y):
    return model(input_ids=x, labels=y).loss


# ------------------------------------------------------------------------------ encoders and T5
def planned_hf(kind: str, sharded: bool):
    meta = build(MODELS[kind], "meta")
    cpu = CPU_PRICED if sharded else {}
    auto = AutoShard(meta, meta_inputs("input_ids", "labels"), MESH, **cpu)  # no loss_fn: the model's .loss
    plan = sharded_plan(auto) if sharded else auto.optimize()
    names = [n for n, _ in meta.named_parameters()]
    assert sorted(plan.param_layouts) == sorted(names)  # every parameter once, under its first name
    assert UNCALLED_FIRST_NAME[kind] in plan.param_layouts
    return plan, meta


@pytest.mark.slow
@pytest.mark.parametrize("kind", MODELS)
def test_tied_encoders_and_t5_train_sharded_like_single_device(kind):
    initial, ref = single_device(MODELS[kind], hf_loss)
    plan, meta = planned_hf(kind, sharded=True)
    if kind.startswith("t5"):  # `_shift_right`'s start token: a constant, every rank holds it
        constants = [n for n in plan.graph.nodes if n.op == "get_attr"]
        assert constants and all(plan.strategies[n.name].outputs[0] == Layout.replicate(2) for n in constants)
    trains_like_single_device(plan, meta, initial, ref)


@pytest.mark.slow
@pytest.mark.replicated_plan  # batch 4 on the CPU presets: the cheapest step computes all on every rank
@pytest.mark.parametrize("kind", MODELS)
def test_tied_encoders_and_t5_train_with_the_free_plan(kind):
    initial, ref = single_device(MODELS[kind], hf_loss)
    plan, meta = planned_hf(kind, sharded=False)
    trains_like_single_device(plan, meta, initial, ref)


def gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.slow
def test_a_model_that_logs_in_its_forward_trains_sharded_like_single_device():
    """GPT-2's loss logs a warning (`logger.warning_once`) on its first call, where dynamo's capture
    stopped and the direct export then failed at transformers' mask: the log call is skipped."""
    initial, ref = single_device(gpt2, hf_loss)
    meta = build(gpt2, "meta")
    plan = sharded_plan(AutoShard(meta, meta_inputs("input_ids", "labels"), MESH))
    trains_like_single_device(plan, meta, initial, ref)


# ------------------------------------------------------------------------------ a loop over time
MAMBA = dict(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4)


def mamba():
    return transformers.MambaForCausalLM(transformers.MambaConfig(**MAMBA, use_cache=False))


@pytest.mark.slow
def test_mamba_plans_its_scan_steps_as_one_and_trains_sharded_like_single_device():
    """Mamba's selective scan is a Python loop over the sequence: its steps are tied in the ILP (one
    region of SEQ - 2 or more steps per direction), and the plan stays exact."""
    initial, ref = single_device(mamba, hf_loss)
    meta = build(mamba, "meta")
    auto = AutoShard(meta, meta_inputs("input_ids", "labels"), MESH)
    plan = sharded_plan(auto)
    loops = [r for r in auto.sharding.problem.regions if len(r.copies) >= SEQ - 2]
    assert len(loops) >= 2, [r.describe() for r in auto.sharding.problem.regions]  # forward and backward
    for region in loops:
        for names in zip(*region.copies):
            assert len({str(auto.sharding.fx_nodes[n].target) for n in names}) == 1
    trains_like_single_device(plan, meta, initial, ref)


# ------------------------------------------------------------------------------ a model's own loss
class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(dim), CausalSelfAttention(dim, heads), nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """nanoGPT's GPT in miniature, as it is written: the output head tied to the token embedding,
    `forward(idx, targets)` returning `(logits, loss)` (loss None without targets)."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, heads: int = 4, layers: int = 2, block_size: int = SEQ):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab, dim),
                wpe=nn.Embedding(block_size, dim),
                h=nn.ModuleList([Block(dim, heads) for _ in range(layers)]),
                ln_f=nn.LayerNorm(dim),
            )
        )
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def gpt_loss(model, x, y):
    return model(x, y)[1]


def test_a_nanogpt_style_model_trains_on_its_own_loss_sharded_like_single_device():
    """No loss_fn: the loss is the first scalar of the `(logits, loss)` the forward returns."""
    initial, ref = single_device(TinyGPT, gpt_loss)
    meta = build(TinyGPT, "meta")
    plan = sharded_plan(AutoShard(meta, meta_inputs(), MESH))
    assert "lm_head.weight" not in plan.param_layouts and "transformer.wte.weight" in plan.param_layouts
    trains_like_single_device(plan, meta, initial, ref)


class WithConstants(nn.Module):
    """A forward that makes tensors of its own: a `torch.tensor(...)` and a scalar written into one."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.up, self.down, self.head = nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(32, VOCAB)

    def forward(self, idx, targets):
        shifted = idx.new_zeros(idx.shape)
        shifted[:, 1:] = idx[:, :-1]
        shifted[:, 0] = 1  # T5's `_shift_right` writes its start token so
        h = torch.relu(self.up(self.emb(shifted))) * torch.tensor([0.5, 2.0]).repeat(32)
        logits = self.head(self.down(h))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def test_constants_made_in_the_forward_are_planned_replicated_and_stay_exact():
    initial, ref = single_device(WithConstants, lambda m, x, y: m(x, y))
    meta = build(WithConstants, "meta")
    auto = AutoShard(meta, meta_inputs(), MESH)
    plan = sharded_plan(auto)
    constants = [n for n in plan.graph.nodes if n.op == "get_attr"]
    assert len(constants) == 2, constants
    assert all(plan.strategies[n.name].outputs[0] == Layout.replicate(len(MESH)) for n in constants)
    assert auto.dry_run(plan).ranks  # the program runs on fake tensors too (plan's dry run)
    trains_like_single_device(plan, meta, initial, ref)


def test_the_loss_among_what_a_model_returns():
    logits, loss, aux = torch.zeros(2, 3), torch.tensor(1.0), torch.tensor(2.0)
    assert loss_of(loss) is loss
    assert loss_of((logits, loss, aux)) is loss  # the first scalar
    assert loss_of((logits, loss, aux), loss_output=2) is aux
    assert loss_of(transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)) is loss

    class Output:
        def __init__(self, **fields):
            self.__dict__.update(fields)

    assert loss_of(Output(loss=loss, logits=logits)) is loss
    assert loss_of(Output(total=aux, logits=logits), loss_output="total") is aux
    how = r"with loss_fn=None the model must return its loss: .* pass loss_fn=f"
    for outputs, kwargs, what in [
        (logits, {}, r"shape \(2, 3\)"),
        ((logits, None), {}, r"a tuple of \(shape \(2, 3\), NoneType\)"),  # nanoGPT without targets
        ((logits, loss), {"loss_output": 0}, r"a tuple of .* \(loss_output=0\)"),
        (Output(logits=logits), {}, "Output"),
    ]:
        with pytest.raises(ValueError, match=f"the model returned {what}.*{how}"):
            loss_of(outputs, **kwargs)
    with pytest.raises(ValueError, match="loss_output=5, but the model returned 2 values"):
        loss_of((logits, loss), loss_output=5)
    with pytest.raises(ValueError, match="CausalLMOutput without a loss .*give it labels="):
        loss_of(transformers.modeling_outputs.CausalLMOutput(logits=logits))


def test_a_model_without_a_loss_is_one_clear_error():
    """nanoGPT called without targets returns `(logits, None)`: planning says how to pass a loss."""
    meta = build(TinyGPT, "meta")
    idx = lambda: torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta")  # noqa: E731
    with pytest.raises(ValueError, match="with loss_fn=None the model must return its loss"):
        AutoShard(meta, idx, MESH).optimize()
    plan = AutoShard(meta, meta_inputs(), MESH, loss_output=1).optimize()  # named: the same loss
    assert sorted(plan.param_layouts) == sorted(n for n, _ in meta.named_parameters())


def test_a_plan_without_collectives_says_so_and_what_would_change_it():
    from autoshard.report.build import plan_report
    from autoshard.report.text import format_log, summary_lines

    meta = build(TinyGPT, "meta")
    free = AutoShard(meta, meta_inputs(), MESH).optimize()
    assert not free.count_by_collective  # batch 4: every rank computes the whole step
    report = plan_report(free)
    (line,) = [line for line in summary_lines(report) if line.startswith("comm per rank:")]
    for words in ("every one of the 4 ranks", "whole batch", "no speed-up", "larger batch", "--memory-budget"):
        assert words in line, line
    assert "computes the whole batch" in format_log(report)
    sharded = plan_report(sharded_plan(AutoShard(meta, meta_inputs(), MESH)))
    assert "no speed-up" not in format_log(sharded) and "no speed-up" not in "\n".join(summary_lines(sharded))
