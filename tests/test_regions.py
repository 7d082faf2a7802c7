"""Repeated transformer blocks are found, so the ILP size does not grow with depth."""

import contextlib

import pytest
import torch

from autoshard.capture.regions import block_of, find_repeated_blocks
from autoshard.capture.trace import trace_joint
from autoshard_models import build_model, cross_entropy_loss, get_config


def traced(n_layers):
    model = build_model(get_config("llama3-tiny").with_(n_layers=n_layers), device="meta")
    tokens = torch.zeros(2, 16, dtype=torch.int64)
    with contextlib.ExitStack() as stack:
        return trace_joint(model, lambda m, x, y: cross_entropy_loss(m(x), y), (tokens, tokens), stack)


def test_block_of_paths():
    assert block_of("layers.7.attention.wq") == ("layers", 7)
    assert block_of("layers.12") == ("layers", 12)
    assert block_of("model.layers.3.feed_forward.w1.weight") == ("model.layers", 3)
    assert block_of("tok_embeddings") is None and block_of("") is None


@pytest.mark.parametrize("n_layers", [2, 4])
def test_every_llama_layer_is_one_copy_of_the_same_region(n_layers):
    graph = traced(n_layers)
    (copies,) = find_repeated_blocks(graph)
    assert len(copies) == n_layers
    sizes = {len(c) for c in copies}
    assert len(sizes) == 1
    for index, copy in enumerate(copies):
        params = [fqn for fqn, node in graph.params.items() if node in copy]
        assert len(params) == 9 and all(p.startswith(f"layers.{index}.") for p in params)
        # Every op of the layer, forward and backward, is in its copy.
        for node in graph.nodes:
            if graph.module_path(node).startswith(f"layers.{index}."):
                assert node in copy, node
    # Position i of every copy is the same op with the same relative module path.
    for nodes in zip(*copies):
        assert len({str(n.target) if n.op != "placeholder" else "param" for n in nodes}) == 1
    # What stays outside: embedding, final norm, output projection and loss.
    inside = set().union(*map(set, copies))
    outside = {graph.module_path(n) for n in graph.nodes if n.op == "call_function" and n not in inside}
    assert outside <= {"", "tok_embeddings", "norm", "output"}


def test_a_layer_that_differs_is_left_out():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(5))
            self.layers[3] = torch.nn.Linear(8, 8, bias=False)

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x

    with contextlib.ExitStack() as stack:
        graph = trace_joint(Odd(), lambda m, x: m(x).sum(), (torch.zeros(4, 8),), stack)
    (copies,) = find_repeated_blocks(graph)
    layers = [{graph.module_path(n).split(".")[1] for n in copy if n.op == "call_function"} for copy in copies]
    # Layer 0 differs too (its input needs no gradient); layer 3 has no bias.
    assert layers == [{"1"}, {"2"}, {"4"}]
