"""Tracing a training step into a joint forward+backward graph on fake tensors."""

import contextlib

import pytest
import torch

from autoshard.capture.trace import trace_joint
from autoshard_models import build_model, cross_entropy_loss, get_config


def llama_step(model, tokens, targets):
    return cross_entropy_loss(model(tokens), targets)


def trace(model, args, step=llama_step):
    with contextlib.ExitStack() as stack:
        return trace_joint(model, step, args, stack)


@pytest.fixture(scope="module")
def tiny():
    return get_config("llama3-tiny")


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_llama_joint_graph_identifies_params_grads_inputs(tiny, device):
    model = build_model(tiny, device=device, seed=0 if device == "cpu" else None)
    before = {name: p for name, p in model.named_parameters()}
    tokens = torch.zeros(4, 32, dtype=torch.int64, device=device)
    graph = trace(model, (tokens, tokens))

    names = [name for name, _ in model.named_parameters()]
    assert list(graph.params) == names
    assert set(graph.grads) == set(names)
    for name, node in graph.params.items():
        assert tuple(node.meta["val"].shape) == tuple(before[name].shape)
        assert tuple(graph.grads[name].meta["val"].shape) == tuple(before[name].shape)
    assert [tuple(n.meta["val"].shape) for n in graph.inputs] == [(4, 32), (4, 32)]
    assert graph.loss.meta["val"].shape == ()
    assert set(graph.buffers) == {"rope_cos", "rope_sin"}
    # The user's model is left exactly as it was: same parameter objects, real (or meta) values.
    assert all(before[name] is p for name, p in model.named_parameters())
    assert all(p.device.type == device for p in model.parameters())


def test_nodes_carry_module_paths_forward_and_backward(tiny):
    graph = trace(build_model(tiny, device="meta"), (torch.zeros(2, 16, dtype=torch.int64),) * 2)
    mm_paths = {graph.module_path(n) for n in graph.nodes if n.target == torch.ops.aten.mm.default}
    linears = {
        f"layers.{i}.{m}"
        for i in range(2)
        for m in (
            "attention.wq",
            "attention.wk",
            "attention.wv",
            "attention.wo",
            "feed_forward.w1",
            "feed_forward.w2",
            "feed_forward.w3",
        )
    } | {"output"}
    assert mm_paths == linears
    # Backward kernels inherit the path of the forward op they differentiate.
    attn_bwd = [n for n in graph.nodes if "flash_attention_for_cpu_backward" in str(n.target)]
    assert [graph.module_path(n) for n in attn_bwd] == ["layers.1.attention", "layers.0.attention"]
    assert all(graph.is_backward(n) for n in attn_bwd)
    assert not any(graph.is_backward(n) for n in graph.nodes if n.target == torch.ops.aten.embedding.default)


def test_non_scalar_loss_is_a_clear_error(tiny):
    model = build_model(tiny, device="meta")
    tokens = torch.zeros(2, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"scalar tensor, got shape \(2, 8, 256\)"):
        trace(model, (tokens,), step=lambda m, x: m(x))
    # A failed trace restores the model too.
    assert all(p.is_meta for p in model.parameters())


def test_unused_parameter_is_named():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"no gradient.*1\.weight"):
        trace(model, (torch.zeros(2, 4),), step=lambda m, x: m[0](x).sum())


def test_a_capture_logs_no_error(tiny):
    """Tracing logs nothing at error level: torch 2.11's compile metrics sorted the set of Logger
    methods the capture tells dynamo to skip (functions do not sort), and every trace printed an
    error with a traceback."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    try:
        tokens = torch.zeros(2, 8, dtype=torch.int64, device="meta")
        trace(build_model(tiny, device="meta"), (tokens, tokens))
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == []
