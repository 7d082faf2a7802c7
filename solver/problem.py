"""Problem description: nodes with choices, pairwise edge costs, constraints and repeated regions
(their types: `constraints.py`), and the problem's JSON round trip and digest.

Plain dataclasses holding numbers and names only; the solver never sees tensors. `math.inf` in an
edge matrix (or as a choice cost) forbids that combination (or that choice).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

import numpy as np

from .constraints import (
    Allowed,
    Constraint,
    EdgeMemory,
    Fixed,
    MemoryBudget,
    RepeatedRegion,
    SameChoice,
    check_cost,
    validate_constraint,
)


@dataclass
class Choice:
    """One option of a node: its own cost, its memory (bytes per rank) and free-form tags."""

    label: str
    cost: float = 0.0
    memory: float = 0.0
    tags: tuple[str, ...] = ()


@dataclass
class Node:
    name: str
    choices: list[Choice]


@dataclass
class Edge:
    """Pairwise cost between producer `src` and consumer `dst`: cost[src choice][dst choice]."""

    src: str
    dst: str
    cost: list[list[float]]


class InfeasibleError(ValueError):
    """No assignment satisfies the problem; the message names the conflicting pieces.

    `constraints` holds the conflicting constraints/regions (an irreducible set), `node`/`edge`
    the node left without choices and the edge that forbade them when the conflict is structural.
    """

    def __init__(self, message: str, constraints=(), node: str | None = None, edge=None):
        super().__init__(message)
        self.constraints = list(constraints)
        self.node = node
        self.edge = edge


@dataclass
class Problem:
    nodes: list[Node] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    constraints: list[Constraint] = field(default_factory=list)
    regions: list[RepeatedRegion] = field(default_factory=list)
    _converted: dict = field(default_factory=dict, repr=False, compare=False)  # id(matrix) -> (matrix, floats)

    # ---- building helpers -------------------------------------------------------------------
    def copy(self) -> Problem:
        """A problem sharing this one's nodes, edges and their matrices, with lists of its own:
        constraints added to the copy leave this problem as it is."""
        return Problem(list(self.nodes), list(self.edges), list(self.constraints), list(self.regions))

    def add_node(self, name: str, choices: Sequence[Choice | str]) -> Node:
        """Nodes passed the same list of Choice objects share it, as edges share matrices:
        validation and presolve convert a shared list once (the list must not change after)."""
        if isinstance(choices, list) and all(isinstance(c, Choice) for c in choices):
            node = Node(name, choices)
        else:
            node = Node(name, [c if isinstance(c, Choice) else Choice(c) for c in choices])
        self.nodes.append(node)
        return node

    def add_edge(self, src: str, dst: str, cost: Sequence[Sequence[float]]) -> Edge:
        """Edges passed the same matrix object share one converted copy: repeated blocks pass the
        same matrices thousands of times (the matrix must not be changed after it is added)."""
        edge = Edge(src, dst, self._floats(cost))
        self.edges.append(edge)
        return edge

    def fix(self, node: str, choice_index: int) -> Fixed:
        return self._add(Fixed(node, choice_index))

    def allow(self, node: str, indices: Sequence[int]) -> Allowed:
        return self._add(Allowed(node, list(indices)))

    def same_choice(self, nodes: Sequence[str], name: str = "") -> SameChoice:
        return self._add(SameChoice(list(nodes), name))

    def memory_budget(
        self,
        nodes: Sequence[str],
        limit: float,
        name: str = "",
        memory: Mapping[str, Sequence[float]] | None = None,
        edges: Mapping[tuple[str, str], Sequence[Sequence[float]]] | None = None,
    ) -> MemoryBudget:
        """`edges`: (src, dst) -> bytes per choice pair, counted beside the nodes' (`EdgeMemory`)."""
        table = None if memory is None else {n: [float(m) for m in memory[n]] for n in nodes}
        pairs = [EdgeMemory(src, dst, self._floats(m)) for (src, dst), m in (edges or {}).items()]
        return self._add(MemoryBudget(list(nodes), float(limit), name, table, pairs))

    def add_region(self, copies: Sequence[Sequence[str]]) -> RepeatedRegion:
        region = RepeatedRegion([list(c) for c in copies])
        self.regions.append(region)
        return region

    def _floats(self, matrix: Sequence[Sequence[float]]) -> list[list[float]]:
        """`matrix` as lists of floats, converted once per matrix object (repeated blocks pass the
        same one thousands of times; it must not be changed after it is added)."""
        held = self._converted.get(id(matrix))
        if held is None or held[0] is not matrix:
            held = self._converted[id(matrix)] = (matrix, [list(map(float, row)) for row in matrix])
        return held[1]

    def _add(self, constraint):
        self.constraints.append(constraint)
        return constraint

    # ---- queries ----------------------------------------------------------------------------
    def index(self) -> dict[str, int]:
        """Node name -> position in `nodes`."""
        return {n.name: i for i, n in enumerate(self.nodes)}

    def cost(self, choice: dict[str, int]) -> tuple[float, float]:
        """(node cost, edge cost) of a full assignment name -> choice index."""
        nodes = sum(n.choices[choice[n.name]].cost for n in self.nodes)
        edges = sum(e.cost[choice[e.src]][choice[e.dst]] for e in self.edges)
        return nodes, edges

    def tied(self, node: str) -> list[str]:
        """Every node that must take the same choice index as `node` (itself included, in problem
        order): SameChoice groups and the same position in every copy of a repeated region,
        followed transitively (`tie_classes`). Pinning `node` pins all of them."""
        index = self.index()
        if node not in index:
            raise ValueError(f"unknown node {node!r}")
        classes = tie_classes(self, self.constraints, self.regions)
        return [n.name for n, c in zip(self.nodes, classes) if c == classes[index[node]]]

    # ---- variants ---------------------------------------------------------------------------
    def restricted(self, fixed: Mapping[str, int]) -> "Problem":
        """This problem with `node -> choice index` pins added (as Fixed constraints), e.g. to ask
        "what is the best plan if this node takes that choice?". Nodes tied to a pinned node
        (`tied`) follow it. The copy shares the nodes, edge matrices and regions with this one
        (only the lists are new; nothing is converted again), so it is cheap to make, and this
        problem is left as it was."""
        index = self.index()
        pins = []
        for name, k in fixed.items():
            if name not in index:
                raise ValueError(f"restricted: unknown node {name!r}")
            if not 0 <= k < len(self.nodes[index[name]].choices):
                raise ValueError(
                    f"restricted: choice {k} of node {name!r} is out of range "
                    f"0..{len(self.nodes[index[name]].choices) - 1}"
                )
            pins.append(Fixed(name, int(k)))
        return Problem(
            list(self.nodes), list(self.edges), [*self.constraints, *pins], list(self.regions), self._converted
        )

    # ---- validation -------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the first malformed piece of input."""
        count = {n.name: len(n.choices) for n in self.nodes}
        if len(count) != len(self.nodes):
            seen: set[str] = set()
            for node in self.nodes:
                if node.name in seen:
                    raise ValueError(f"duplicate node name {node.name!r}")
                seen.add(node.name)
        first: dict[int, Node] = {}  # choice lists shared by nodes (repeated blocks) are checked once
        for node in self.nodes:
            first.setdefault(id(node.choices), node)
        for node in first.values():
            if not node.choices:
                raise ValueError(f"node {node.name!r} has no choices")
            for c in node.choices:
                if not (c.cost >= 0 and 0 <= c.memory < math.inf):  # False for NaN too
                    check_cost(c.cost, f"node {node.name!r} choice {c.label!r} cost")
                    raise ValueError(
                        f"node {node.name!r} choice {c.label!r}: memory must be finite and >= 0, got {c.memory!r}"
                    )

        def known(name, what):
            if name not in count:
                raise ValueError(f"{what} refers to unknown node {name!r}")
            return count[name]

        self._validate_edges(known)
        for con in self.constraints:
            validate_constraint(con, known)
        for region in self.regions:
            what = region.describe()
            if not region.copies or len({len(c) for c in region.copies}) != 1:
                raise ValueError(f"{what}: copies must be non-empty and of equal length")
            for pos, names in enumerate(zip(*region.copies)):
                try:
                    sizes = {count[n] for n in names}
                except KeyError as missing:
                    known(missing.args[0], what)  # raises, naming it
                if len(sizes) > 1:
                    raise ValueError(
                        f"{what}: position {pos} ({names[0]!r}...) has different numbers of choices {sizes}"
                    )

    def _validate_edges(self, known) -> None:
        """Cost matrices sized by their nodes' choices, every entry >= 0 (`known(name, what)`: a
        node's number of choices, or the error naming `what` for an unknown node)."""
        width: dict[int, int | None] = {}  # shared matrices are checked once: their rows' length (None: ragged)
        for e in self.edges:
            what = f"edge {e.src!r}->{e.dst!r}"
            rows, cols = known(e.src, what), known(e.dst, what)
            seen = id(e.cost) in width
            if not seen:
                lengths = {len(r) for r in e.cost}
                width[id(e.cost)] = lengths.pop() if len(lengths) == 1 else None
            if len(e.cost) != rows or width[id(e.cost)] != cols:
                shape = f"{len(e.cost)}x{[len(r) for r in e.cost]}"
                raise ValueError(f"{what}: cost matrix must be {rows}x{cols}, got {shape}")
            if seen:
                continue
            m = np.asarray(e.cost, dtype=float)
            if not (m >= 0).all():  # also catches NaN
                check_cost(float(m[~(m >= 0)][0]), f"{what} cost")

    # ---- JSON -------------------------------------------------------------------------------
    def to_json(self, **kwargs) -> str:
        return problem_to_json(self, **kwargs)

    @classmethod
    def from_json(cls, text: str) -> "Problem":
        return problem_from_json(text)


def tie_classes(problem: Problem, constraints: Sequence, regions: Sequence[RepeatedRegion]) -> list[int]:
    """Node index -> the index of its class's representative: nodes that must take the same choice
    (a SameChoice group, one position in every copy of a repeated region), joined transitively.
    Presolve solves one variable group per class; `Problem.tied` lists a node's class."""
    index = problem.index()
    parent = list(range(len(problem.nodes)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(names):
        roots = [find(index[n]) for n in names]
        for r in roots[1:]:
            if r != roots[0]:
                parent[r] = roots[0]

    for con in constraints:
        if isinstance(con, SameChoice):
            union(con.nodes)
    for region in regions:
        for names in zip(*region.copies):
            union(names)
    return [find(i) for i in range(len(parent))]


# ---- JSON round trip, so problems can be saved, diffed and re-solved -------------------------------
# JSON has no infinity: `inf` is written as the string "inf" (null is accepted on read too).
FORMAT = 1
_KINDS = {"fixed": Fixed, "allowed": Allowed, "same_choice": SameChoice, "memory_budget": MemoryBudget}
_KIND_OF = {cls: kind for kind, cls in _KINDS.items()}


def encode_float(v: float):
    return "inf" if v == math.inf else v


def decode_float(v) -> float:
    return math.inf if v is None or v == "inf" else float(v)


def problem_to_json(problem: Problem, **kwargs) -> str:
    data = {
        "format": FORMAT,
        "nodes": [
            {
                "name": n.name,
                "choices": [
                    {"label": c.label, "cost": encode_float(c.cost), "memory": c.memory, "tags": list(c.tags)}
                    for c in n.choices
                ],
            }
            for n in problem.nodes
        ],
        "edges": [
            {"src": e.src, "dst": e.dst, "cost": [[encode_float(v) for v in row] for row in e.cost]}
            for e in problem.edges
        ],
        "constraints": [_constraint(c) for c in problem.constraints],
        "regions": [r.copies for r in problem.regions],
    }
    return json.dumps(data, **kwargs)


def problem_digest(problem: Problem) -> str:
    """sha256 (hex) of everything `problem_to_json` writes, streamed: no JSON text of the whole
    problem is built (on a mid-size model that text and its pieces are tens of MB, transient on
    every rank). A matrix or a choice list shared by many edges or nodes (repeated blocks) is
    hashed once and stands in as its own digest."""
    total = hashlib.sha256(f"autoshard-problem {FORMAT}\n".encode())
    shared: dict[int, tuple[object, bytes]] = {}  # id -> (the object, kept alive; its digest)

    def digest(obj: object, encode) -> bytes:
        held = shared.get(id(obj))
        if held is None or held[0] is not obj:
            held = shared[id(obj)] = (obj, hashlib.sha256(encode(obj)).digest())
        return held[1]

    def choices(cs: list[Choice]) -> bytes:
        return json.dumps([[c.label, encode_float(c.cost), c.memory, list(c.tags)] for c in cs]).encode()

    def matrix(rows: list[list[float]]) -> bytes:
        return f"{len(rows)}x{len(rows[0]) if rows else 0}".encode() + np.asarray(rows, dtype=np.float64).tobytes()

    def put(text: str, *parts: bytes) -> None:
        total.update(text.encode() + b"\0")
        for part in parts:
            total.update(part)

    for n in problem.nodes:
        put(f"node {n.name}", digest(n.choices, choices))
    for e in problem.edges:
        put(f"edge {e.src} {e.dst}", digest(e.cost, matrix))
    for c in problem.constraints:
        put("constraint " + json.dumps(_constraint(c)))
    for r in problem.regions:
        put("region " + json.dumps(r.copies))
    return total.hexdigest()


def _constraint(constraint: Constraint) -> dict:
    """A constraint as JSON data: its kind and its fields."""
    fields = asdict(constraint)
    if "limit" in fields:
        fields["limit"] = encode_float(fields["limit"])
    if "memory" in fields and fields["memory"] is None:  # a budget over the choices' own memory
        del fields["memory"]
    if "edges" in fields and not fields["edges"]:
        del fields["edges"]
    return {"kind": _KIND_OF[type(constraint)], **fields}


def problem_from_json(text: str) -> Problem:
    data = json.loads(text)
    if data.get("format") != FORMAT:
        raise ValueError(f"unsupported problem format {data.get('format')!r}")
    nodes = [
        Node(
            n["name"],
            [Choice(c["label"], decode_float(c["cost"]), float(c["memory"]), tuple(c["tags"])) for c in n["choices"]],
        )
        for n in data["nodes"]
    ]
    edges = [Edge(e["src"], e["dst"], [[decode_float(v) for v in row] for row in e["cost"]]) for e in data["edges"]]
    constraints = []
    for c in data["constraints"]:
        c = dict(c)
        kind = c.pop("kind")
        if kind not in _KINDS:
            raise ValueError(f"unknown constraint kind {kind!r}")
        if "limit" in c:
            c["limit"] = decode_float(c["limit"])
        if "edges" in c:
            c["edges"] = [EdgeMemory(**e) for e in c["edges"]]
        constraints.append(_KINDS[kind](**c))
    problem = Problem(nodes, edges, constraints, [RepeatedRegion(r) for r in data["regions"]])
    problem.validate()
    return problem
