"""Find the repeated transformer blocks of a joint graph, so the ILP solves one block for all.

A block is the set of ops (and parameters) whose module path (FQN) lies under `<prefix>.<index>` of a `ModuleList`
(e.g. `layers.7.attention.wq`). Gradient-accumulation nodes carry no module path; each inherits
the block of its most recently computed input (in graph order, so chains of them resolve). Blocks are grouped by a
networkx Weisfeiler-Lehman hash of their internal structure, then checked position by position:
only blocks whose i-th nodes agree on op, relative module path, shapes and internal wiring become
copies of one region. Anything that does not match stays outside, priced and solved on its own.
"""

from __future__ import annotations

import re
import warnings
from collections import defaultdict

import networkx as nx
from torch import fx

from autoshard.capture.trace import JointGraph

_BLOCK = re.compile(r"^(?P<prefix>(?:.*\.)?[A-Za-z_]\w*)\.(?P<index>\d+)(?:\.|$)")


def block_of(path: str) -> tuple[str, int] | None:
    """('layers', 7) for 'layers.7.attention.wq'; None outside any numbered block."""
    match = _BLOCK.match(path)
    return (match["prefix"], int(match["index"])) if match else None


def assign_blocks(graph: JointGraph) -> dict[fx.Node, tuple[str, int]]:
    """Block of every op and parameter placeholder that belongs to one (in graph order)."""
    blocks: dict[fx.Node, tuple[str, int]] = {}
    param_fqn = graph.param_names
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in graph.nodes:
        if node.op == "placeholder" and node in param_fqn:
            block = block_of(param_fqn[node])
        elif node.op == "call_function":
            block = block_of(graph.module_path(node))
        else:
            continue
        if block is None and node.meta.get("is_gradient_acc"):
            # An accumulation adds the gradient arriving from later blocks to the one this block
            # just produced: it belongs to the block of its most recently computed input.
            inherited = [a for a in node.all_input_nodes if a in blocks]
            if inherited:
                block = blocks[max(inherited, key=order.__getitem__)]
        if block is not None:
            blocks[node] = block
    return blocks


def _signature(graph: JointGraph, node: fx.Node, position: dict[fx.Node, int], block) -> tuple:
    """What must agree between the i-th nodes of two copies of a block."""
    val = node.meta.get("val")
    shapes = tuple(tuple(v.shape) for v in (val if isinstance(val, (tuple, list)) else [val]) if hasattr(v, "shape"))
    wiring = []
    for arg in flat_args(node):
        if isinstance(arg, fx.Node):
            # Inputs from outside the block (previous block, parameters) may differ per copy.
            wiring.append(("in", position[arg]) if arg in position else ("ext",))
        else:
            wiring.append(("const", repr(arg)))
    op = "param" if node.op == "placeholder" else str(node.target)
    return (op, _relative_path(graph, node, block), shapes, tuple(wiring))


def _relative_path(graph: JointGraph, node: fx.Node, block: tuple[str, int]) -> str:
    path = _path(graph, node)
    head = f"{block[0]}.{block[1]}"
    return path[len(head) :]


def _path(graph: JointGraph, node: fx.Node) -> str:
    """Module path of an op, or the FQN of a parameter placeholder."""
    if node.op == "placeholder":
        return graph.param_names.get(node, "")
    return graph.module_path(node)


def flat_args(node: fx.Node) -> list:
    """Every leaf of (args, kwargs): graph nodes and constants, in order."""
    flat: list = []
    fx.node.map_aggregate((node.args, node.kwargs), flat.append)
    return flat


def find_repeated_blocks(graph: JointGraph) -> list[list[list[fx.Node]]]:
    """Groups of >= 2 positionally isomorphic blocks; each group is a list of copies (node lists)."""
    members: dict[tuple[str, int], list[fx.Node]] = defaultdict(list)
    for node, block in assign_blocks(graph).items():
        members[block].append(node)

    by_hash: dict[str, list[tuple[str, int]]] = defaultdict(list)
    signatures: dict[tuple[str, int], list[tuple]] = {}
    for block, nodes in members.items():
        position = {n: i for i, n in enumerate(nodes)}
        signatures[block] = [_signature(graph, n, position, block) for n in nodes]
        structure = nx.DiGraph()
        for i, sig in enumerate(signatures[block]):
            structure.add_node(i, label=f"{sig[0]}|{sig[1]}|{sig[2]}")
            for kind, *ref in sig[3]:
                if kind == "in":
                    structure.add_edge(ref[0], i)
        with warnings.catch_warnings():  # networkx notes its hashes changed in 3.5; we only compare within a run
            warnings.simplefilter("ignore", UserWarning)
            key = nx.weisfeiler_lehman_graph_hash(structure, node_attr="label")
        by_hash[key].append(block)

    groups = []
    for blocks in by_hash.values():
        # The WL hash can collide; exact positional signatures decide.
        exact: dict[tuple, list[tuple[str, int]]] = defaultdict(list)
        for block in blocks:
            exact[tuple(signatures[block])].append(block)
        for same in exact.values():
            if len(same) >= 2:
                groups.append([members[b] for b in sorted(same)])
    return groups
