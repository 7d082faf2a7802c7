"""Repeated transformer blocks and the steps of loops over time are found, so the ILP size grows
with neither depth nor sequence length."""

import contextlib
import logging
import re

import pytest
import torch

from autoshard.capture.loops import MIN_STEPS, find_repeated_steps
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


@pytest.mark.slow
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


class Recurrent(torch.nn.Module):
    """An RNN cell run over time in Python: the trace repeats its step `steps` times, in one module."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.inp, self.hid, self.out = (torch.nn.Linear(dim, dim) for _ in range(3))

    def forward(self, x):  # x: (batch, time, dim)
        h = torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            h = torch.tanh(self.inp(x[:, t]) + self.hid(h))
        return self.out(h).square().mean()


def traced_recurrent(steps: int):
    with contextlib.ExitStack() as stack:
        return trace_joint(Recurrent(), lambda m, x: m(x), (torch.zeros(4, steps, 8),), stack)


@pytest.mark.parametrize("steps", [6, 12])
def test_the_steps_of_a_loop_over_time_are_found_position_by_position(steps):
    graph = traced_recurrent(steps)
    groups = find_repeated_steps(graph)
    forward = [g for g in groups if not any(graph.is_backward(n) for n in g[0])]
    backward = [g for g in groups if all(graph.is_backward(n) for n in g[0])]
    assert len(forward) == 1 and len(backward) == 1, [len(g) for g in groups]
    for group in forward + backward:
        assert steps - 2 <= len(group) <= steps
        for nodes in zip(*group):  # position i: the same op, with the same output shape, in every step
            assert len({(str(n.target), tuple(n.meta["val"].shape)) for n in nodes}) == 1
        ops = [n for n in graph.nodes if n.op == "call_function"]
        first, last = ops.index(group[0][0]), ops.index(group[-1][-1])
        assert last - first + 1 >= len(group) * len(group[0]), "steps are consecutive runs of ops"
    (tanh,) = [i for i, n in enumerate(forward[0][0]) if "tanh" in str(n.target)]
    # the carried state: each step's tanh feeds the next step's hidden projection
    for before, after in zip(forward[0], forward[0][1:]):
        assert any(before[tanh] in n.all_input_nodes for n in after)


def test_a_loop_plans_in_one_problem_size_whatever_its_length(caplog):
    from autoshard.driver.api import AutoShard

    classes = {}
    for steps in (8, 24):
        auto = AutoShard(Recurrent(), lambda s=steps: (torch.zeros(8, s, 8),), (2, 2))
        with caplog.at_level(logging.INFO, logger="autoshard"):
            classes[steps] = auto.optimize().solution.stats.classes
    assert classes[8] == classes[24], classes
    (line,) = [r.getMessage() for r in caplog.records if "loops planned as one step" in r.getMessage()][-1:]
    # one loop forward, one backward, of the 24 steps less the first or last (wired to the outside)
    assert re.fullmatch(r".*: the model: 2[2-4] x \d+ ops; the model: 2[2-4] x \d+ ops", line), line


def test_short_repeats_and_repeats_that_carry_nothing_are_not_loops():
    """Fewer than MIN_STEPS steps; and ops that merely look alike (each step reads only what comes
    from outside, as the halves of a rotary slice or a per-position map's forward do). The map's
    backward is a loop: each step adds its part to the shared projection's gradient."""
    assert find_repeated_steps(traced_recurrent(MIN_STEPS - 1)) == []

    class PerPosition(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.stack([torch.tanh(self.proj(x[:, t])) for t in range(x.shape[1])], 1).square().mean()

    with contextlib.ExitStack() as stack:
        graph = trace_joint(PerPosition(), lambda m, x: m(x), (torch.zeros(4, 12, 8),), stack)
    ops = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    assert ops.count("aten.tanh.default") == 12  # it repeats, 12 times
    (backward,) = find_repeated_steps(graph)
    assert all(graph.is_backward(n) for step in backward for n in step)
