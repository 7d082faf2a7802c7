"""Per-shard init and per-slice loading (issue 49, items 1-2): every rank keeps only its shards,
with values equal bit for bit to the whole-model path (`load_full` of the single-device values)
for every layout kind (shard, ordered shard, replicate, sizes the mesh does not divide) on
simulated meshes (4,), (2,2), (2,2,2), from a single safetensors file and from a sharded one
with its index. Memory is measured by benchmarks.training.init_memory, not here."""

from __future__ import annotations

import itertools
import json
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from autoshard import _torch_compat as tc
from autoshard.driver.api import AutoShard
from autoshard.layout import Layout
from autoshard.runtime.module import parallelize
from autoshard.runtime.shards import shard_box
from autoshard.strategies.layouts import layouts_for
from autoshard.workloads import get_workload, hf, hf_init
from autoshard.workloads.base import Workload, full_state, initial_stream, token_inputs
from autoshard.workloads.checkpoints import INDEX, CheckpointSlices, Start, checkpoint_values
from autoshard.workloads.llama import hf_name
from autoshard_models import build_model, get_config
from plan_audit import assert_shards
from simulation import simulated_mesh


# ------------------------------------------------------------------ the boxes a rank reads
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2), (2, 2, 2)])
@pytest.mark.parametrize("shape", [(8, 16), (6, 8), (16,), (4, 6, 8)])
def test_each_rank_box_is_its_shard_for_every_layout(mesh_shape, shape):
    """Every layout the ILP can choose for the shape (device orders included): the box's slices
    are the rows `Layout.shard_of` gives that coordinate."""
    full = torch.arange(torch.Size(shape).numel()).view(shape)
    layouts = layouts_for(shape, mesh_shape, allow_partial=False)
    for layout in layouts:
        for coord in itertools.product(*(range(n) for n in mesh_shape)):
            box = shard_box(layout, shape, mesh_shape, coord)
            assert torch.equal(full[box], layout.shard_of(full, mesh_shape, coord)), (layout, coord)


# ------------------------------------------------------------------ the init, one tensor at a time
def test_our_llama_yields_its_init_one_tensor_at_a_time():
    cfg = get_config("llama3-tiny")
    want = full_state(build_model(cfg, seed=5))
    got = dict(build_model(cfg, device="meta").initial_values(5))
    assert list(got) == list(want)
    assert all(torch.equal(got[n], want[n]) for n in want)


SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
HF_CONFIGS = {
    "llama": lambda tie: transformers.LlamaConfig(**SMALL, tie_word_embeddings=tie),
    "qwen2": lambda tie: transformers.Qwen2Config(**SMALL, tie_word_embeddings=tie),  # q/k/v biases
    "qwen3": lambda tie: transformers.Qwen3Config(**SMALL, head_dim=8, tie_word_embeddings=tie),  # q/k norms
    # GPT-2's init writes c_proj's weight from its parent module's call, after c_proj's own
    "gpt2": lambda tie: transformers.GPT2Config(
        vocab_size=96,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=0,
    ),
}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", list(HF_CONFIGS))
def test_hf_init_one_module_at_a_time_equals_the_cpu_build(family, tie):
    """transformers draws from the global RNG in build order; the record-and-replay stream gives
    every parameter and buffer the CPU build's values, and leaves the caller's RNG as it was."""
    config = hf.training_config(HF_CONFIGS[family](tie))
    want = full_state(hf.build(config, "cpu", seed=3))
    rng = torch.get_rng_state()
    got = dict(hf_init.initial_values(config, hf.model_class(config), 3, strict=True))
    assert torch.equal(torch.get_rng_state(), rng)
    assert set(got) == set(want)
    assert [n for n in want if not torch.equal(got[n], want[n])] == []
    buffers = {n for n, _ in hf.build(config, "meta").named_buffers()}
    only = dict(hf_init.initial_values(config, hf.model_class(config), 3, buffers, strict=True))
    assert set(only) == buffers and all(torch.equal(only[n], want[n]) for n in buffers)


def test_hf_init_that_leaves_a_tensor_to_the_constructor_falls_back_to_the_whole_model(monkeypatch):
    """An `_init_weights` that does not write a tensor (its value is the constructor's): the stream
    cannot replay it, so it warns and builds the whole model, with the same values."""
    config = hf.training_config(HF_CONFIGS["llama"](False))
    original = transformers.LlamaPreTrainedModel._init_weights

    def skip_norms(self, module):
        if "RMSNorm" not in type(module).__name__:
            original(self, module)

    monkeypatch.setattr(transformers.LlamaPreTrainedModel, "_init_weights", skip_norms)
    want = full_state(hf.build(config, "cpu", seed=1))
    with pytest.raises(hf_init.Unsupported, match="no _init_weights call writes"):
        dict(hf_init.initial_values(config, hf.model_class(config), 1, strict=True))
    with pytest.warns(UserWarning, match="built whole on every rank"):
        got = dict(hf_init.initial_values(config, hf.model_class(config), 1))
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)


# ------------------------------------------------------------------ sharded models, every layout kind
class Toy(nn.Module):
    """Sizes 6 and 12, which 4 and 8 ranks do not divide: w3's dims stay whole where the mesh
    does not divide them (its weight split on the other dim, its bias replicated); the rest is
    pinned to plain, ordered and mixed shards; w2.bias is the planner's choice."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(16, 32, bias=True)
        self.w2 = nn.Linear(32, 12, bias=True)
        self.w3 = nn.Linear(12, 6, bias=True)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6), persistent=False)

    def forward(self, x):
        return self.w3(F.silu(self.w2(F.silu(self.w1(x))))) * self.scale


def mse(out, target):
    return (out - target).pow(2).mean()


PINS = {
    (4,): {"w1.weight": "S(0)", "w1.bias": "S(0)", "w2.weight": "S(1)", "w3.weight": "S(1)", "w3.bias": "R"},
    (2, 2): {
        "w1.weight": "S(0)S(0)[1,0]",
        "w1.bias": "S(0)S(0)",
        "w2.weight": "S(1)S(1)[1,0]",
        "w3.weight": "RS(0)",
        "w3.bias": "RR",
    },
    (2, 2, 2): {
        "w1.weight": "S(0)S(0)S(0)[2,0,1]",
        "w1.bias": "S(0)S(0)S(0)",
        "w2.weight": "S(1)S(1)S(1)[1,2,0]",
        "w3.weight": "S(1)RS(0)",
        "w3.bias": "RRR",
    },
}


def toy_workload(seed: int = 0) -> Workload:
    def build(device):
        with torch.device(device):
            model = Toy()
        if torch.device(device).type != "meta":
            with torch.no_grad():
                gen = torch.Generator().manual_seed(seed)
                for p in model.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen))
        return model

    return Workload(
        name="toy",
        build=build,
        example_inputs=token_inputs,
        loss_fn=mse,
        data=lambda seed: None,  # type: ignore[arg-type,return-value]
        initial_state=lambda seed: full_state(toy_workload(seed).build("cpu")),
    )


def save(values: dict[str, torch.Tensor], directory, sharded: bool) -> None:
    """`values` as one model.safetensors, or as three files with `model.safetensors.index.json`."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    values = {n: v.contiguous() for n, v in values.items()}
    if not sharded:
        save_file(values, str(directory / "model.safetensors"))
        return
    names, weight_map = list(values), {}
    for i in range(3):
        part = {n: values[n] for n in names[i::3]}
        file = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file(part, str(directory / file))
        weight_map |= dict.fromkeys(part, file)
    save_file({"stray": torch.zeros(2)}, str(directory / "not-in-the-index.safetensors"))
    (directory / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def every_local(pmodel) -> dict[str, dict[int, torch.Tensor]]:
    """Each parameter's and buffer's local shard on every simulated rank."""
    out = {}
    for fqn, t in (*pmodel.named_parameters(), *pmodel.named_buffers()):
        out[fqn] = {r: v.clone() for r, v in tc.rank_values(t.to_local()).items()}
    return out


def assert_same_shards(got, want):
    assert set(got) == set(want)
    for fqn in want:
        for rank, value in want[fqn].items():
            assert torch.equal(got[fqn][rank], value), (fqn, rank)


@pytest.fixture(scope="module", params=list(PINS), ids=lambda m: "x".join(map(str, m)))
def toy_plan(request):
    mesh_shape = request.param
    model = Toy()
    x, y = torch.randn(8, 16), torch.randn(8, 6)
    with AutoShard(model, lambda: (x, y), mesh_shape, loss_fn=mse) as auto:
        auto.pin(PINS[mesh_shape])
        plan = auto.optimize()
    assert_shards(plan, batch_split=False)
    return mesh_shape, plan


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "indexed"])
def test_toy_shards_from_the_stream_and_from_slices_equal_load_full(toy_plan, tmp_path, sharded):
    mesh_shape, plan = toy_plan
    for fqn, layout in PINS[mesh_shape].items():
        assert plan.param_layouts[fqn] == Layout.parse(layout), fqn
    workload = toy_workload(7)
    full = workload.initial_state(7)
    save({n: v for n, v in full.items() if n != "scale"}, tmp_path / "ckpt", sharded)
    whole, meta = workload.build("cpu"), workload.build("meta")
    with simulated_mesh(mesh_shape) as (mesh, mode):
        want = every_local(parallelize(plan, mesh, whole))  # load_full
        streamed = parallelize(plan, mesh, meta)
        Start(workload, 7).load_into(streamed)  # the init one tensor at a time
        assert_same_shards(every_local(streamed), want)
        sliced = parallelize(plan, mesh, meta)
        Start(workload, 7, CheckpointSlices(workload, tmp_path / "ckpt")).load_into(sliced)
        assert_same_shards(every_local(sliced), want)


def test_a_missing_stream_value_is_named(toy_plan):
    mesh_shape, plan = toy_plan
    with simulated_mesh(mesh_shape) as (mesh, mode):
        pmodel = parallelize(plan, mesh, Toy().to("meta"))
        with pytest.raises(KeyError, match="lack 1 parameters or buffers, e.g. \\['scale'\\]"):
            pmodel.load_each((n, v) for n, v in toy_workload().initial_state(0).items() if n != "scale")


# ------------------------------------------------------------------ real models: llama, HF llama
def test_llama_tiny_init_weights_streams_the_single_device_values():
    """Our llama's `init_weights` on a meta template: one tensor at a time, the same shards as
    the whole model's, on (2,2) with ordered shards pinned."""
    cfg = get_config("llama3-tiny")
    meta = build_model(cfg, device="meta")
    tokens = lambda: (torch.empty(8, 16, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    from autoshard_models import cross_entropy_loss

    with AutoShard(meta, tokens, (2, 2), loss_fn=cross_entropy_loss) as auto:
        auto.pin({"layers.*.feed_forward.w1.weight": "S(0)S(0)[1,0]", "tok_embeddings.weight": "S(1)S(1)[1,0]"})
        plan = auto.optimize()
    whole = build_model(cfg, seed=4)
    with simulated_mesh((2, 2)) as (mesh, mode):
        want = every_local(parallelize(plan, mesh, whole))
        pmodel = parallelize(plan, mesh, meta)
        pmodel.init_weights(4)
        assert_same_shards(every_local(pmodel), want)


@pytest.fixture(scope="module")
def hf_plan():
    config = transformers.LlamaConfig(**SMALL, tie_word_embeddings=False)
    meta = hf.build(hf.training_config(config), "meta")
    with AutoShard(meta, lambda: (torch.empty(4, 8, dtype=torch.int64),) * 2, (2, 2), loss_fn=hf.logits_loss) as auto:
        auto.pin({"model.layers.*.mlp.gate_proj.weight": "S(0)S(0)[1,0]", "lm_head.weight": "S(1)S(0)"})
        return config, auto.optimize()


@pytest.mark.slow
def test_hf_llama_from_a_sharded_checkpoint_and_from_its_seed(hf_plan, tmp_path):
    """`--model hf:DIR`: the seed's init (record and replay) and `--init-from DIR` of a
    `save_pretrained` checkpoint in three files with an index give the whole path's shards."""
    config, plan = hf_plan
    saved = hf.build(hf.training_config(config), "cpu", seed=11)
    saved.save_pretrained(tmp_path / "m", max_shard_size="40KB")
    assert (tmp_path / "m" / INDEX).is_file() and len(list((tmp_path / "m").glob("*.safetensors"))) > 2
    workload = get_workload(f"hf:{tmp_path / 'm'}", seq=8)
    meta = workload.build("meta")
    cases = (
        (Start(workload, 2), workload.initial_state(2)),
        (
            Start(workload, 2, CheckpointSlices(workload, tmp_path / "m")),
            checkpoint_values(workload, tmp_path / "m", 2),
        ),
    )
    with simulated_mesh((2, 2)) as (mesh, mode), warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to the whole model
        for start, whole in cases:
            pmodel = parallelize(plan, mesh, meta)
            pmodel.load_full(whole)
            want = every_local(pmodel)
            pmodel = parallelize(plan, mesh, meta)
            start.load_into(pmodel)
            assert_same_shards(every_local(pmodel), want)


def test_llama_checkpoint_under_hf_names_reads_by_slices(tmp_path):
    """Our llama family from LlamaForCausalLM's names (an export): mapped back, read by slices."""
    workload = get_workload("llama3-tiny", seq=16)
    full = workload.initial_state(3)
    params = {n for n, _ in workload.build("meta").named_parameters()}
    save({hf_name(n): full[n] for n in params}, tmp_path / "ckpt", sharded=True)
    ckpt = CheckpointSlices(workload, tmp_path / "ckpt")
    assert sorted(ckpt.params) == sorted(params)
    for n in params:
        shape = full[n].shape
        box = tuple(slice(0, max(1, s // 2)) for s in shape)
        assert torch.equal(ckpt.read(n, box), full[n][box]), n
    assert dict(initial_stream(workload, 3, {"rope_cos"}))["rope_cos"].equal(full["rope_cos"])


def test_a_bad_index_is_named(tmp_path):
    workload = toy_workload()
    save({n: v for n, v in workload.initial_state(0).items() if n != "scale"}, tmp_path / "ckpt", sharded=True)
    index = tmp_path / "ckpt" / INDEX
    index.write_text(json.dumps({"weight_map": {"w1.weight": "model-00009-of-00009.safetensors"}}))
    with pytest.raises(ValueError, match="names model-00009-of-00009.safetensors, which is not in the directory"):
        CheckpointSlices(workload, tmp_path / "ckpt")
    index.write_text("{not json")
    with pytest.raises(ValueError, match="not a safetensors index"):
        CheckpointSlices(workload, index)
