"""Trace a deep model by tracing three of its repeated blocks and unrolling the rest.

Tracing costs about 1-2 ms per op on fake tensors, and llama3-8b's 32 identical blocks make 7,400
ops: most of planning time. So the step is traced with the model's longest list of identical
blocks cut to its first three (a `ModuleList`, or a `ModuleDict` numbered in order from any
block: a pipeline stage's `layers.40` .. `layers.47`). Block 1 then has a block on both sides,
so its ops (forward and backward) show how one middle block connects to its neighbours; copies
of block 1 are spliced in as blocks 2..N-2 and traced block 2 becomes block N-1. The result is
the graph a full trace gives.

Checked before unrolling: block 2 repeats block 1 exactly as block 1 repeats block 0 (same ops,
shapes, constants, wiring one block further on), nothing outside the blocks reads block 1, and
the graph order lets every copy be placed. Where block 0 alone differs (no gradient flows into it
when what precedes it is frozen: a LoRA model's embedding), four blocks are traced and blocks
1-3 are the pattern. If the checks fail, or the cut model does not trace, the whole model is
traced, as it is when the step reads the list's length (`len(layers)`, which the cut changes:
a residual scaled by 1/sqrt(len(layers)) would be traced for three). Assumed, and not checkable
from three blocks: the step's code does not branch on a block's depth past block 2 (`if i ==
n_layers - 1` with the count taken from a config); such models pass `unroll=False` to `AutoShard`.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import fx, nn

from autoshard import _torch_compat as tc
from autoshard.capture.precision import Precision
from autoshard.capture.regions import assign_blocks, flat_args
from autoshard.capture.trace import MODULE_KEY, JointGraph, trace_joint

log = logging.getLogger("autoshard")

TRACED_BLOCKS = 3
MIN_BLOCKS = TRACED_BLOCKS + 1  # below this, unrolling saves nothing


class NotRepeating(Exception):
    """The traced blocks do not repeat in a way unrolling can reproduce (the message says why)."""


def trace_step(
    model: nn.Module,
    step_fn: Callable[..., torch.Tensor],
    example_args: Sequence[Any],
    stack: contextlib.ExitStack,
    *,
    unroll: bool = True,
    precision: Precision = Precision(),
    stage: bool = False,
) -> JointGraph:
    """The joint graph of `step_fn(model, *example_args)`: traced in full, or (when the model has a
    list of >= 4 identical blocks and `unroll`) from three blocks, unrolled. `stage`: a pipeline
    stage's step (`trace_joint`)."""
    found = repeated_block_list(model) if unroll else None
    if found is not None:
        prefix, blocks, start = found
        # Block 0 may differ from the rest (a frozen embedding before it: no gradient flows into
        # it), so when the first three do not repeat, blocks 1-3 are tried as the pattern.
        why = None
        for first in (0, 1):
            if first + MIN_BLOCKS > len(blocks):
                break
            traced = first + TRACED_BLOCKS
            cut_stack = contextlib.ExitStack()  # the cut trace's fake mode; closed if we fall back
            try:
                with tc.truncated_module_list(blocks, traced), length_guarded(blocks, prefix):
                    short = trace_joint(model, step_fn, example_args, cut_stack, precision, stage)
                graph = unroll_blocks(short, prefix, start + len(blocks), start + first)
            except NotRepeating as err:
                cut_stack.close()
                why = why or str(err)
                continue
            except Exception as err:  # the cut model may not run (e.g. code that indexes block N-1)
                cut_stack.close()
                why = f"the cut model failed ({err})"
                break
            stack.push(cut_stack)
            log.info("autoshard: traced %d of the %d blocks of %s and unrolled the rest", traced, len(blocks), prefix)
            return graph
        log.info("autoshard: tracing all %d blocks of %s: %s", len(blocks), prefix, why)
    return trace_joint(model, step_fn, example_args, stack, precision, stage)


class LengthRead(RuntimeError):
    """The step read the length of a cut block list (`length_guarded`)."""


@contextlib.contextmanager
def length_guarded(blocks: nn.ModuleList, prefix: str) -> Iterator[None]:
    """While inside, the step reading the length of `blocks` raises `LengthRead` (an exception,
    which dynamo's capture cannot trace past: a note in a list would be traced as a side effect
    and lost): `len(blocks)`, `reversed(blocks)`, `list(blocks)`. Its own indexing's bounds
    checks and autoshard's code read it freely. Its class is a subclass of its own for that
    while, restored after."""
    own = type(blocks)
    indexing = [False]

    def __len__(self: nn.ModuleList) -> int:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if not indexing[0] and not caller.startswith("autoshard."):
            raise LengthRead(f"the step reads the number of blocks (len of {prefix}), which the cut changes")
        return own.__len__(self)

    def __getitem__(self: nn.ModuleList, idx: Any) -> Any:
        indexing[0] = True
        try:
            return own.__getitem__(self, idx)
        finally:
            indexing[0] = False

    blocks.__class__ = type(own.__name__, (own,), {"__len__": __len__, "__getitem__": __getitem__})
    try:
        yield
    finally:
        blocks.__class__ = own


# ------------------------------------------------------------------------------ finding blocks
def repeated_block_list(model: nn.Module) -> tuple[str, nn.Module, int] | None:
    """The list of >= 4 structurally identical, buffer-free blocks holding the most parameters,
    with its module path and its first block's number; None if there is none. A list is a
    `ModuleList`, or a `ModuleDict` whose keys number its blocks in order from any start (a
    pipeline stage keeping the whole model's names: `layers.40` .. `layers.47`)."""
    best: tuple[str, nn.Module, int] | None = None
    best_size = 0
    for path, module in model.named_modules():
        start = _first_number(module)
        if not path or start is None or len(module) < MIN_BLOCKS:
            continue
        children = list(module.children())
        if len({_structure(child) for child in children}) != 1 or any(True for c in children for _ in c.buffers()):
            continue
        ids = [id(p) for child in children for p in child.parameters()]
        if len(ids) != len(set(ids)):  # a parameter shared between blocks
            continue
        size = sum(p.numel() for child in children for p in child.parameters())
        if best is None or size > best_size:
            best, best_size = (path, module, start), size
    if best is not None:
        inside = {id(p) for p in best[1].parameters()}
        outside = [
            n
            for n, p in model.named_parameters(remove_duplicate=False)
            if id(p) in inside and not n.startswith(best[0] + ".")
        ]
        if outside:  # tied to a parameter outside the list
            return None
    return best


def _first_number(module: nn.Module) -> int | None:
    """0 for a `ModuleList`; for a `ModuleDict` keyed by consecutive numbers, the first; else None."""
    if isinstance(module, nn.ModuleList):
        return 0
    if not isinstance(module, nn.ModuleDict) or not module or not all(k.isdecimal() for k in module.keys()):
        return None
    keys = list(module.keys())
    start = int(keys[0])
    return start if keys == [str(n) for n in range(start, start + len(keys))] else None


def _structure(block: nn.Module) -> tuple:
    return (
        type(block),
        tuple((name, type(m)) for name, m in block.named_modules()),
        tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in block.named_parameters()),
    )


# ------------------------------------------------------------------------------ unrolling
def _inside(path: str, prefix: str, index: int) -> str | None:
    """The rest of `path` under block `<prefix>.<index>` ('' for the block itself); None outside it."""
    head = f"{prefix}.{index}"
    return path[len(head) :] if path == head or path.startswith(head + ".") else None


def _renamed(path: str, prefix: str, old: int, new: int) -> str:
    rest = _inside(path, prefix, old)
    return path if rest is None else f"{prefix}.{new}{rest}"


def _check_recurrence(graph: JointGraph, prefix: str, traced: list[list[fx.Node]], first: int = 0) -> None:
    """Block first + 2 must depend on block first + 1 as that depends on block `first`, op for op."""
    _, b1, b2 = traced
    if len(b1) != len(b2):
        raise NotRepeating(f"block {first + 1} has {len(b1)} ops and block {first + 2} has {len(b2)}")
    pos = [{n: i for i, n in enumerate(b)} for b in traced]
    for a, b in zip(b1, b2):
        same = (
            a.op == b.op
            and (a.op == "placeholder" or a.target == b.target)
            and _shapes(a) == _shapes(b)
            and _relative(graph, prefix, a, first + 1) == _relative(graph, prefix, b, first + 2)
        )
        args_a, args_b = flat_args(a), flat_args(b)
        if not same or len(args_a) != len(args_b):
            raise NotRepeating(f"op {b.name} of block {first + 2} differs from {a.name} of block {first + 1}")
        for x, y in zip(args_a, args_b):
            if not isinstance(x, fx.Node):
                ok = not isinstance(y, fx.Node) and repr(x) == repr(y)
            elif x in pos[1]:
                ok = y is b2[pos[1][x]]
            elif x in pos[0]:
                ok = y in pos[1] and pos[1][y] == pos[0][x]
            elif x in pos[2]:  # the gradient arriving from the next block
                ok = not any(y in p for p in pos)
            else:
                ok = y is x
            if not ok:
                raise NotRepeating(f"{b.name} in block {first + 2} is wired unlike {a.name} in block {first + 1}")
    for node in b1:
        for user in node.users:
            if user.op != "output" and not any(user in p for p in pos):
                raise NotRepeating(f"{user.name}, outside the blocks, reads {node.name} of block {first + 1}")
    for node in b2:
        if any(user in pos[0] for user in node.users):
            raise NotRepeating(f"block {first} reads {node.name} of block {first + 2}")


def _shapes(node: fx.Node) -> tuple:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    return tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v) for v in vals)


def _relative(graph: JointGraph, prefix: str, node: fx.Node, index: int) -> str | None:
    """The node's module path (or parameter FQN) inside block `index`; None if not inside it."""
    path = graph.param_names.get(node, "") if node.op == "placeholder" else graph.module_path(node)
    return _inside(path, prefix, index)


def unroll_blocks(graph: JointGraph, prefix: str, n_blocks: int, first: int = 0) -> JointGraph:
    """The joint graph of the model with `n_blocks` blocks, from the graph of its first
    `first` + 3: blocks `first`..`first` + 2 are the pattern (blocks before it stay as traced)."""
    members: list[list[fx.Node]] = [[] for _ in range(TRACED_BLOCKS)]
    for node, (pre, index) in assign_blocks(graph).items():
        if pre == prefix and first <= index < first + TRACED_BLOCKS:
            members[index - first].append(node)
    if not all(members):
        raise NotRepeating("a traced block has no ops")
    _check_recurrence(graph, prefix, members, first)
    return _Unroller(graph, prefix, members, n_blocks, first + 1).build()


class _Unroller:
    """Copies the traced middle block M (`mid`, 1 unless the pattern starts later) into blocks
    M+1..N-2 of a new graph; traced block M+1 becomes block N-1. In the names below, b1 is block M
    and b2 block M+1; `pos[0]` finds block M-1's nodes."""

    def __init__(self, graph: JointGraph, prefix: str, traced: list[list[fx.Node]], n_blocks: int, mid: int = 1):
        self.graph, self.prefix, self.n, self.mid = graph, prefix, n_blocks, mid
        _, self.b1, self.b2 = traced  # block M-1 is reached through `pos[0]`
        self.pos = [{node: i for i, node in enumerate(b)} for b in traced]
        self.new = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}  # traced node -> new node (blocks up to M, N-1, outside)
        self.copies: dict[int, dict[fx.Node, fx.Node]] = {k: {} for k in range(mid + 1, n_blocks - 1)}
        # Parameters of the unrolled model, in placeholder order: FQN -> (placeholder, traced FQN,
        # index of the copy it belongs to or None for a traced block).
        self.params: dict[str, tuple[fx.Node, str, int | None]] = {}

    def block_node(self, k: int, b1_node: fx.Node) -> fx.Node:
        """Block k's counterpart of traced block 1's `b1_node`, in the new graph."""
        try:
            if k == self.mid:
                return self.env[b1_node]
            if k == self.n - 1:
                return self.env[self.b2[self.pos[1][b1_node]]]
            return self.copies[k][b1_node]
        except KeyError:
            raise NotRepeating(f"block {k}'s copy of {b1_node.name} is needed before it can be placed") from None

    def lookup(self, x: fx.Node) -> fx.Node:
        try:
            return self.env[x]
        except KeyError:
            raise NotRepeating(f"{x.name} is needed before it can be placed") from None

    def copy_arg(self, x: fx.Node, k: int) -> fx.Node:
        """Where an argument of traced block 1 points in block k (2 <= k <= N-2)."""
        if x in self.pos[1]:
            return self.block_node(k, x)
        if x in self.pos[0]:
            return self.block_node(k - 1, self.b1[self.pos[0][x]])
        if x in self.pos[2]:
            return self.block_node(k + 1, self.b1[self.pos[2][x]])
        return self.lookup(x)

    def original_arg(self, node: fx.Node, x: fx.Node) -> fx.Node:
        """Traced blocks 1 and 2 now have copies between them."""
        if node in self.pos[1] and x in self.pos[2]:
            return self.block_node(self.mid + 1, self.b1[self.pos[2][x]])
        if node in self.pos[2] and x in self.pos[1]:
            return self.block_node(self.n - 2, x)
        return self.lookup(x)

    def emit_copy(self, node: fx.Node, k: int) -> None:
        if node.op == "placeholder":
            fqn = _renamed(self.graph.param_names[node], self.prefix, self.mid, k)
            new = self.new.placeholder("primals_" + fqn.replace(".", "_"))
            new.meta = dict(node.meta)
            self.params[fqn] = (new, self.graph.param_names[node], k)
        else:
            new = self.new.node_copy(node, lambda x: self.copy_arg(x, k))
            self._repath(new, self.mid, k)
        self.copies[k][node] = new

    def emit_original(self, node: fx.Node) -> None:
        new = self.new.node_copy(node, lambda x: self.original_arg(node, x))
        if node in self.pos[2]:
            self._repath(new, self.mid + 1, self.n - 1)
        fqn = self.graph.param_names.get(node)
        if fqn is not None:
            self.params[_renamed(fqn, self.prefix, self.mid + 1, self.n - 1)] = (new, fqn, None)
        self.env[node] = new

    def _repath(self, new: fx.Node, old: int, k: int) -> None:
        custom = new.meta.get("custom")
        if custom and MODULE_KEY in custom:
            new.meta["custom"] = {**custom, MODULE_KEY: _renamed(custom[MODULE_KEY], self.prefix, old, k)}

    def build(self) -> JointGraph:
        g = self.graph
        order = {node: i for i, node in enumerate(g.nodes)}
        b2_ops = [n for n in self.b2 if n.op != "placeholder"]
        if not b2_ops:
            raise NotRepeating("block 2 has no ops")
        first_b2_op = b2_ops[0]
        params = [n for n in self.b1 if n.op == "placeholder"]
        forward = [n for n in self.b1 if n.op != "placeholder" and order[n] < order[first_b2_op]]
        backward = [n for n in self.b1 if n.op != "placeholder" and order[n] > order[first_b2_op]]
        # Copies go just before traced block 2's first parameter (placeholders), before its first
        # op (forward), and before block 1's first backward op, in reverse (backward).
        anchors: dict[fx.Node, tuple[list[fx.Node], bool]] = {first_b2_op: (forward, False)}
        if params:
            anchors[next(n for n in self.b2 if n.op == "placeholder")] = (params, False)
        if backward:
            anchors[backward[0]] = (backward, True)
        middle = range(self.mid + 1, self.n - 1)
        for node in g.nodes:
            if node in anchors:
                nodes, reverse = anchors[node]
                for k in reversed(middle) if reverse else middle:
                    for b1_node in nodes:
                        self.emit_copy(b1_node, k)
            if node.op == "output":
                continue
            self.emit_original(node)

        grads = {
            fqn: self.lookup(g.grads[traced]) if k is None else self.block_node(k, g.grads[traced])
            for fqn, (_, traced, k) in self.params.items()
            if traced in g.grads
        }
        loss = self.lookup(g.loss)
        input_grads = {i: self.lookup(n) for i, n in g.input_grads.items()}
        self.new.output((loss, *grads.values(), *input_grads.values()))
        gm = tc.lazy_graph_module(g.gm, self.new)
        return JointGraph(
            gm=gm,
            params={fqn: node for fqn, (node, _, _) in self.params.items()},
            buffers={fqn: self.lookup(node) for fqn, node in g.buffers.items()},
            inputs=[self.lookup(n) for n in g.inputs],
            tangents=[self.lookup(n) for n in g.tangents],
            loss=loss,
            grads=grads,
            precision=g.precision,
            input_grads=input_grads,
        )
