"""Tracing three repeated blocks and unrolling the rest gives the graph a full trace gives."""

import contextlib
import logging

import pytest
import torch
from torch import fx, nn

from autoshard.capture.repeat import repeated_block_list, trace_step
from autoshard.capture.trace import trace_joint
from autoshard.driver.api import AutoShard
from autoshard_models import build_model, cross_entropy_loss, get_config

LOG = "autoshard"


def llama_step(model, tokens, targets):
    return cross_entropy_loss(model(tokens), targets)


def traced(model, args, step=llama_step, unrolled=True):
    with contextlib.ExitStack() as stack:
        return trace_step(model, step, args, stack) if unrolled else trace_joint(model, step, args, stack)


def canonical(graph):
    """Every node as (op, target, module path, shapes, args by position): equal graphs, equal lists."""
    index = {node: i for i, node in enumerate(graph.nodes)}
    rows = []
    for node in graph.nodes:
        if node.op == "output":
            continue
        args = []
        fx.node.map_aggregate(
            (node.args, node.kwargs),
            lambda a: args.append(("node", index[a]) if isinstance(a, fx.Node) else ("const", repr(a))),
        )
        val = node.meta.get("val")
        shapes = tuple(
            (tuple(v.shape), v.dtype)
            for v in (val if isinstance(val, (tuple, list)) else [val])
            if isinstance(v, torch.Tensor)
        )
        target = "" if node.op == "placeholder" else str(node.target)
        rows.append((node.op, target, graph.module_path(node), shapes, tuple(args)))
    roles = (
        [
            (fqn, index[node], index[graph.grads[fqn]] if fqn in graph.grads else None)
            for fqn, node in graph.params.items()
        ],
        [(fqn, index[node]) for fqn, node in graph.buffers.items()],
        [index[n] for n in graph.inputs],
        [index[n] for n in graph.tangents],
        index[graph.loss],
    )
    return rows, roles


def tiny(n_layers):
    return build_model(get_config("llama3-tiny").with_(n_layers=n_layers), device="meta")


@pytest.mark.slow
@pytest.mark.parametrize("n_layers", [4, 7])
def test_unrolled_llama_equals_the_full_trace(n_layers, caplog):
    model = tiny(n_layers)
    tokens = torch.zeros(2, 16, dtype=torch.int64)
    with caplog.at_level(logging.INFO, logger=LOG):
        unrolled = traced(model, (tokens, tokens))
    assert f"traced 3 of the {n_layers} blocks of layers" in caplog.text
    full = traced(model, (tokens, tokens), unrolled=False)
    rows, roles = canonical(unrolled)
    assert (rows, roles) == canonical(full)
    assert list(unrolled.params) == [name for name, _ in model.named_parameters()]
    last = f"layers.{n_layers - 1}.attention"
    assert sum(unrolled.module_path(n) == last for n in unrolled.nodes) > 0
    # The unrolled graph runs: placeholders are unique and the code generates.
    assert "def forward" in unrolled.gm.code


def test_in_bf16_each_block_casts_its_parameters_and_the_blocks_still_repeat(caplog):
    """Under mixed precision a block casts its whole subtree's parameters as its forward starts
    (dynamo names the submodules through the patched forward's closure): the casts carry the
    block's path and the blocks still repeat, so 3 of them are traced."""
    from autoshard.capture.precision import Precision, is_cast

    model = tiny(4)
    tokens = torch.zeros(2, 16, dtype=torch.int64)
    with caplog.at_level(logging.INFO, logger=LOG), contextlib.ExitStack() as stack:
        graph = trace_step(model, llama_step, (tokens, tokens), stack, precision=Precision(torch.bfloat16))
    assert "traced 3 of the 4 blocks of layers" in caplog.text
    casts = {fqn: [u for u in node.users if is_cast(u)] for fqn, node in graph.params.items()}
    assert all(len(c) == 1 for c in casts.values())
    assert graph.module_path(casts["layers.3.feed_forward.w2.weight"][0]) == "layers.3"
    assert graph.module_path(casts["output.weight"][0]) == "output"


@pytest.mark.slow
@pytest.mark.parametrize("n_layers", [5, 7])
def test_with_a_frozen_embedding_blocks_1_to_3_are_the_pattern(n_layers, caplog):
    """No gradient flows into block 0 (its input is a frozen embedding's), so its backward differs
    from the next blocks': blocks 1-3 are traced as the pattern and the graph is still a full trace's."""
    model = tiny(n_layers)
    model.tok_embeddings.requires_grad_(False)
    tokens = torch.zeros(2, 16, dtype=torch.int64)
    with caplog.at_level(logging.INFO, logger=LOG):
        unrolled = traced(model, (tokens, tokens))
    assert f"traced 4 of the {n_layers} blocks of layers" in caplog.text
    assert canonical(unrolled) == canonical(traced(model, (tokens, tokens), unrolled=False))
    assert "tok_embeddings.weight" not in unrolled.grads and len(unrolled.grads) == len(unrolled.params) - 1


@pytest.mark.parametrize(
    "start, stop", [pytest.param(0, 5, marks=pytest.mark.slow), (2, 7), pytest.param(3, 9, marks=pytest.mark.slow)]
)
def test_a_pipeline_stage_unrolls_its_numbered_blocks(start, stop, caplog):
    """A stage keeps the whole model's block names (a ModuleDict `layers.2` .. `layers.6`): it is
    traced from three of its blocks like a whole model, and the graph is its full trace's, input
    gradient included."""
    from autoshard.capture.precision import Precision

    stage = tiny(9).pipeline_stage(start, stop)
    tokens = torch.zeros(2, 16, dtype=torch.int64)
    args = stage.example_inputs(tokens, tokens, torch.float32)
    step = lambda module, *xs: module(*xs)  # noqa: E731

    def seen(graph):
        position = {n: i for i, n in enumerate(graph.nodes)}
        return canonical(graph), {k: position[n] for k, n in graph.input_grads.items()}, list(graph.params)

    with caplog.at_level(logging.INFO, logger=LOG), contextlib.ExitStack() as stack:
        unrolled = seen(trace_step(stage, step, args, stack, stage=True))
    assert f"traced 3 of the {stop - start} blocks of layers" in caplog.text
    with contextlib.ExitStack() as stack:
        assert unrolled == seen(trace_joint(stage, step, args, stack, Precision(), True))
    assert unrolled[2] == [name for name, _ in stage.named_parameters()]
    assert bool(unrolled[1]) == (start > 0)  # a later stage sends its input's gradient back


class Scaled(nn.Module):
    """A block whose constant depends on its depth: not a repeat of its neighbours."""

    def __init__(self, depth):
        super().__init__()
        self.lin = nn.Linear(8, 8, bias=False)
        self.depth = depth

    def forward(self, x):
        return self.lin(x) * (self.depth + 1.0)


class Stack(nn.Module):
    def __init__(self, blocks, index_last=False):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.index_last = index_last

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.blocks[4](x) if self.index_last else x


def sum_step(model, x):
    return model(x).sum()


@pytest.mark.parametrize(
    "case, reason",
    [
        ("depth", "differs from|wired unlike"),
        ("indexed", "the cut model failed"),
    ],
)
def test_blocks_that_do_not_repeat_are_traced_in_full(case, reason, caplog):
    torch.manual_seed(0)
    model = Stack([Scaled(i) for i in range(5)], index_last=(case == "indexed"))
    x = torch.randn(4, 8)
    with caplog.at_level(logging.INFO, logger=LOG):
        graph = traced(model, (x,), step=sum_step)
    assert "tracing all 5 blocks of blocks" in caplog.text
    assert any(part in caplog.text for part in reason.split("|"))
    assert canonical(graph) == canonical(traced(model, (x,), step=sum_step, unrolled=False))


def test_a_step_that_reads_the_number_of_blocks_is_traced_in_full(caplog):
    """A llama whose step scales the loss by 1/sqrt(len(layers)): the cut list's length (3) is
    not the model's (4), so the step is traced in full and its graph holds the true scale. The
    plain step, which only iterates the blocks, still unrolls."""
    model = tiny(4)
    tokens = torch.zeros(2, 16, dtype=torch.int64)

    def scaled_step(model, tokens, targets):
        return llama_step(model, tokens, targets) / len(model.layers) ** 0.5

    with caplog.at_level(logging.INFO, logger=LOG):
        graph = traced(model, (tokens, tokens), step=scaled_step)
    assert "tracing all 4 blocks of layers: " in caplog.text
    assert "the step reads the number of blocks (len of layers)" in caplog.text
    assert canonical(graph) == canonical(traced(model, (tokens, tokens), step=scaled_step, unrolled=False))
    assert type(model.layers) is nn.ModuleList
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOG):
        traced(model, (tokens, tokens))
    assert "traced 3 of the 4 blocks of layers" in caplog.text


def test_which_lists_unroll():
    assert repeated_block_list(tiny(4))[0] == "layers"
    assert repeated_block_list(tiny(3)) is None  # three blocks: nothing to save
    mixed = Stack([nn.Linear(8, 8) for _ in range(4)] + [nn.Linear(8, 4)])
    assert repeated_block_list(mixed) is None
    shared = nn.Linear(8, 8)
    assert repeated_block_list(Stack([nn.Sequential(shared, nn.ReLU()) for _ in range(5)])) is None
    stage = tiny(9).pipeline_stage(2, 7)
    assert repeated_block_list(stage)[::2] == ("layers", 2)  # numbered from its first block
    stage.layers = nn.ModuleDict({k: stage.layers[k] for k in ("2", "3", "5", "6")})  # a gap
    assert repeated_block_list(stage) is None


@pytest.mark.slow
def test_plans_with_and_without_unrolling_agree():
    def plan(unroll):
        model = tiny(6)
        with AutoShard(
            model,
            lambda: (torch.zeros(8, 64, dtype=torch.int64),) * 2,
            (2, 2),
            loss_fn=cross_entropy_loss,
            unroll=unroll,
        ) as auto:
            return auto.optimize()

    fast, slow = plan(True), plan(False)
    assert fast.param_layouts == slow.param_layouts
    assert fast.step_time_s == pytest.approx(slow.step_time_s, rel=1e-9)
    assert fast.comm_bytes == pytest.approx(slow.comm_bytes, rel=1e-9)
