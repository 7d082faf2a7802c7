"""Trace one training step (forward + loss + backward) into a joint FX graph on fake tensors.

The graph is the unit every later stage works on: strategies are chosen per node, the parallel
module runs it on local shards. Tracing uses fake tensors, so an 8B model on `meta` costs no memory:
the model's parameters are swapped for fake ones for the duration of the trace and restored after.
Each node is tagged with the module path it came from (backward nodes inherit their forward node's
path), which the sharding log shows and repeated-layer detection keys on.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import fx, nn

from autoshard import _torch_compat as tc
from autoshard.capture.losses import sum_then_divide
from autoshard.capture.precision import Precision, cast_parameters

log = logging.getLogger("autoshard")

MODULE_KEY = "autoshard_module"
OUTPUT_KEY = "autoshard_output"  # index of a model output marked by `mark_outputs`


@dataclass
class JointGraph:
    """A traced training step and the meaning of its inputs and outputs."""

    gm: fx.GraphModule
    params: dict[str, fx.Node]  # parameter FQN -> placeholder
    buffers: dict[str, fx.Node]  # buffer FQN -> placeholder
    inputs: list[fx.Node]  # user inputs, in call order
    tangents: list[fx.Node]  # seed gradient of the loss (of a pipeline stage's output: its shape)
    loss: fx.Node  # the loss value (first output); a pipeline stage's output, sent to the next stage
    grads: dict[str, fx.Node]  # trained parameter FQN -> node computing its gradient
    precision: Precision = Precision()  # the casts the trace applied to parameters
    # user input index -> its gradient, for inputs that require one (a pipeline stage's input
    # activation, whose gradient goes back to the previous stage)
    input_grads: dict[int, fx.Node] = dataclasses.field(default_factory=dict)

    @property
    def trained(self) -> list[str]:
        """The parameters that get a gradient, in `params` order: the backward's outputs. The
        others are frozen (`requires_grad=False`): no gradient, no reduction, no optimizer state."""
        return [fqn for fqn in self.params if fqn in self.grads]

    @property
    def frozen(self) -> list[str]:
        return [fqn for fqn in self.params if fqn not in self.grads]

    @property
    def nodes(self) -> list[fx.Node]:
        return list(self.gm.graph.nodes)

    @functools.cached_property
    def param_names(self) -> dict[fx.Node, str]:
        """Parameter placeholder -> FQN (the inverse of `params`)."""
        return {node: fqn for fqn, node in self.params.items()}

    @functools.cached_property
    def from_params(self) -> frozenset[fx.Node]:
        """Forward ops computed from parameters alone (casts, transposes of weights): what a
        parameter goes through before it meets an activation."""
        params, out = set(self.params.values()), set()
        for n in self.nodes:  # topological: a node's inputs are classified first
            if (
                n.op == "call_function"
                and not self.is_backward(n)
                and n.all_input_nodes
                and all(a in params or a in out for a in n.all_input_nodes)
            ):
                out.add(n)
        return frozenset(out)

    def module_path(self, node: fx.Node) -> str:
        """Dotted module path the node was produced in ('' = the step function itself)."""
        return (node.meta.get("custom") or {}).get(MODULE_KEY, "")

    def is_backward(self, node: fx.Node) -> bool:
        return node.meta.get("partitioner_tag") == "is_backward"

    def output_index(self, node: fx.Node) -> int | None:
        """Which model output `node` is, if `mark_outputs` marked it."""
        return (node.meta.get("custom") or {}).get(OUTPUT_KEY)


def mark_outputs(outputs: Any) -> Any:
    """Copy each tensor of a model's outputs (in pytree order) through a clone tagged with its
    index, so an output-layout constraint can find the node (the loss consumes the copy)."""
    leaves, spec = tc.tree_flatten(outputs)
    marked, index = [], 0
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            with fx.traceback.annotate({OUTPUT_KEY: index}):
                leaf = leaf.clone()
            index += 1
        marked.append(leaf)
    return tc.tree_unflatten(marked, spec)


class _StepModule(nn.Module):
    """Wraps `step_fn(model, *args) -> loss` so the tracer sees one module whose output is the
    loss; a pipeline stage's (`stage`) is any one tensor, whose gradient comes from the next stage."""

    def __init__(self, model: nn.Module, step_fn: Callable[..., torch.Tensor], stage: bool = False):
        super().__init__()
        self.model = model
        self.step_fn = step_fn
        self.stage = stage

    def forward(self, *args):
        loss = self.step_fn(self.model, *args)
        if self.stage and isinstance(loss, torch.Tensor) and loss.is_floating_point():
            return loss
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            got = type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"shape {tuple(loss.shape)}"
            raise ValueError(f"the loss function must return a scalar tensor, got {got}")
        return loss


@contextlib.contextmanager
def _module_path_annotations(model: nn.Module):
    """Tag every node traced inside a submodule's forward with that submodule's path."""
    open_scopes: list[contextlib.AbstractContextManager] = []

    def enter(path: str):
        def hook(module, args):
            scope = fx.traceback.annotate({MODULE_KEY: path})
            scope.__enter__()
            open_scopes.append(scope)

        return hook

    def leave(module, args, output):
        open_scopes.pop().__exit__(None, None, None)

    handles = []
    for path, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(path)))
        handles.append(module.register_forward_hook(leave))
    try:
        with fx.traceback.preserve_node_meta():
            yield
    finally:
        for handle in handles:
            handle.remove()
        while open_scopes:  # an exception inside forward leaves scopes open
            open_scopes.pop().__exit__(None, None, None)


@contextlib.contextmanager
def _fake_parameters(model: nn.Module, fake_mode, device: torch.device):
    """Temporarily replace every parameter and buffer by a fake tensor of the same shape/dtype;
    a tensor shared by several modules (tied embeddings) stays one shared fake."""
    saved: list[tuple[nn.Module, str, str, Any]] = []
    fakes: dict[int, Any] = {}
    try:
        for module in model.modules():
            for kind in ("_parameters", "_buffers"):
                table = getattr(module, kind)
                for name, value in list(table.items()):
                    if value is None:
                        continue
                    saved.append((module, kind, name, value))
                    if id(value) not in fakes:
                        fake = _fake_like(value, fake_mode, device)
                        fakes[id(value)] = (
                            nn.Parameter(fake, requires_grad=value.requires_grad) if kind == "_parameters" else fake
                        )
                    table[name] = fakes[id(value)]
        yield
    finally:
        for module, kind, name, value in reversed(saved):
            getattr(module, kind)[name] = value


def _fake_like(value: Any, fake_mode, device: torch.device) -> Any:
    """A fake tensor with `value`'s shape and dtype (non-tensors pass through)."""
    if isinstance(value, torch.Tensor):
        with fake_mode:  # an input that requires a gradient (a stage's activation) gets one
            return torch.empty(value.shape, dtype=value.dtype, device=device).requires_grad_(value.requires_grad)
    return value


def trace_joint(
    model: nn.Module,
    step_fn: Callable[..., torch.Tensor],
    example_args: Sequence[Any],
    stack: contextlib.ExitStack,
    precision: Precision = Precision(),
    stage: bool = False,
) -> JointGraph:
    """Trace `step_fn(model, *example_args)` and its backward into one joint graph.

    `example_args` carry global shapes and dtypes only (real, meta or fake tensors all work); an
    input that requires a gradient gets one (`JointGraph.input_grads`).
    `stack` must stay open while the returned graph is compiled into a runnable step.
    `precision` casts parameters for compute (see `capture.precision`). `stage`: a pipeline
    stage's step, whose output need not be a scalar (its gradient is the graph's tangent).
    """
    device = torch.device("cpu")
    fake_mode = tc.new_fake_mode()
    args = tuple(_fake_like(a, fake_mode, device) for a in example_args)
    wrapper = _StepModule(model, step_fn, stage)
    with _fake_parameters(model, fake_mode, device):
        joint = _export(stack, wrapper, model, args, precision)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    return _describe(joint, precision, tied_names(model), frozen)


def tied_names(model: nn.Module) -> dict[str, str]:
    """Every name of a parameter seen under several (`lm_head.weight` tied to the input
    embedding) -> its first name, the one `named_parameters()` and state dicts list it under:
    the model has one parameter there, so the graph must too."""
    first: dict[int, str] = {}
    names = {name: first.setdefault(id(p), name) for name, p in model.named_parameters(remove_duplicate=False)}
    count = collections.Counter(names.values())
    return {name: canonical for name, canonical in names.items() if count[canonical] > 1}


def _export(stack: contextlib.ExitStack, wrapper: nn.Module, model: nn.Module, args: tuple, precision: Precision):
    """Dynamo capture, then the joint export of the captured graph; where capture fails, the
    direct joint export of the step (which raises the error a user can act on)."""
    from autoshard.capture.dynamo import capture

    try:
        with cast_parameters(model, precision):
            captured = capture(wrapper, args, MODULE_KEY)
    except Exception as err:  # dynamo cannot capture the step as one graph
        log.info("autoshard: traced by direct joint export (dynamo capture failed: %s)", _first_line(err))
        try:
            # the path annotations open before the casts run, so a cast is tagged with its module's path
            with _module_path_annotations(model), cast_parameters(model, precision), _transformers_sees_a_trace():
                return tc.export_joint(stack, wrapper, args)
        except Exception as direct:
            # The step's own error (a bad loss, say) beats a tracer's: when the direct route
            # stops earlier (at transformers' masks), report what the step raised under dynamo.
            raised = tc.observed_user_error(err)
            if raised is None or isinstance(direct, (ValueError, TypeError)):
                raise
            raise ValueError(f"the training step raised {raised}") from direct
    log.info("autoshard: traced by dynamo graph capture (%d nodes), then the joint export", len(captured.graph.nodes))
    with fx.traceback.preserve_node_meta():  # the captured nodes' module paths reach the aten nodes
        return tc.export_joint(stack, captured, args)


@contextlib.contextmanager
def _transformers_sees_a_trace():
    """transformers keeps data-dependent branches out of traces by asking `is_tracing`, which
    knows dynamo and fake tensors but not the functional tensors the direct export traces with:
    its mask code then asks a fake tensor for a value (`find_packed_sequence_indices`) and the
    export fails. While the direct export runs, transformers is told what dynamo's capture tells
    it: a graph is being traced."""
    utils = sys.modules.get("transformers.utils.import_utils")
    if utils is None or not hasattr(utils, "is_torchdynamo_compiling"):
        yield
        return
    original = utils.is_torchdynamo_compiling
    utils.is_torchdynamo_compiling = lambda: True
    try:
        yield
    finally:
        utils.is_torchdynamo_compiling = original


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def _strip(fqn: str) -> str:
    prefix = "model."
    return fqn[len(prefix) :] if fqn.startswith(prefix) else fqn


def _one_per_tied_group(gm: fx.GraphModule, tied: dict[str, str]) -> dict[fx.Node, str]:
    """Parameter placeholder -> the name it is planned under. Dynamo's capture lists a tied
    parameter under each of its names and the forward reads one of them, not always the first
    (BERT's `cls.predictions.decoder.bias`, T5's `encoder.embed_tokens.weight`): that placeholder
    is kept, under the first name (the one state dicts use), and the unread ones are erased."""
    groups: dict[str, list[fx.Node]] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        kind, target = tc.describe_input(node.meta.get("desc"))
        if kind == "param":
            name = _strip(target)
            groups.setdefault(tied.get(name, name), []).append(node)
    out = {}
    for name, nodes in groups.items():
        read = [n for n in nodes if n.users]
        if len(read) > 1:
            raise NotImplementedError(
                f"the traced step reads parameter {name} under {len(read)} of its tied names: "
                "autoshard plans one placeholder per parameter"
            )
        keep = read[0] if read else nodes[0]
        out[keep] = name
        for node in nodes:
            if node is not keep:
                gm.graph.erase_node(node)
    return out


def _describe(
    joint, precision: Precision, tied: dict[str, str] | None = None, frozen: set[str] = frozenset()
) -> JointGraph:
    gm = joint.graph_module
    sum_then_divide(gm)
    params, buffers, inputs, tangents = {}, {}, [], []
    planned = _one_per_tied_group(gm, tied or {})
    for node in gm.graph.find_nodes(op="placeholder"):
        kind, target = tc.describe_input(node.meta.get("desc"))
        if kind == "param":
            params[planned[node]] = node
        elif kind == "buffer":
            buffers[_strip(target)] = node
        elif kind == "input":
            inputs.append(node)
        elif kind == "tangent":
            tangents.append(node)
        else:
            raise NotImplementedError(
                f"traced graph has an input autoshard does not understand: {node.meta.get('desc')}"
            )
    (output,) = gm.graph.find_nodes(op="output")
    loss, grads, input_grads = None, {}, {}
    for value, desc in zip(output.args[0], output.meta["desc"]):
        kind, target = tc.describe_output(desc)
        if kind == "output":
            if loss is not None:
                raise ValueError("the step function must return exactly one tensor (the loss)")
            loss = value
        elif kind == "grad" and value is not None:
            name = _strip(target)
            grads[(tied or {}).get(name, name)] = value
        elif kind == "input_grad" and value is not None:
            input_grads[target] = value
    missing = sorted(set(params) - set(grads) - set(frozen))
    if missing:
        raise ValueError(
            f"these parameters get no gradient from the loss: {', '.join(missing)} "
            "(freeze them with requires_grad_(False) if they are not meant to train)"
        )
    return JointGraph(
        gm=gm,
        params=params,
        buffers=buffers,
        inputs=inputs,
        tangents=tangents,
        loss=loss,
        grads=grads,
        precision=precision,
        input_grads=input_grads,
    )
