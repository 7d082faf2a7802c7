"""Presolve: shrink a Problem to the small core that actually needs the ILP.

Nodes tied together (SameChoice groups, positions of a RepeatedRegion) become one *class* with one
set of variables; their node costs add up, and parallel edges between two classes add up into one
matrix, so 32 copies of a block cost no more variables than one. An edge whose endpoints fall in the
same class can only take its diagonal, which becomes a node cost. Then, to a fixpoint:

- choices with no finite partner on some edge are removed (arc consistency on `inf` entries);
- dominated choices are removed (dead-end elimination: another choice is no worse whatever
  the neighbours choose, and needs no more memory);
- classes with a single choice are fixed and their edge rows folded into the neighbours' costs;
- classes with at most two neighbours (and no say in a memory budget) are eliminated exactly by
  min-sum dynamic programming, remembering the best choice for each neighbour assignment;
- edges whose cost splits as a[k] + b[l] are folded into the two node costs (a budget's memory on
  an edge likewise into the two classes' memory; an edge that still carries some stays).

Every step keeps at least one optimal assignment, so solving the core and back-substituting
(`Reduction.assign`) gives an optimum of the original problem.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import numpy as np

from .constraints import Allowed, EdgeMemory, Fixed, MemoryBudget
from .problem import Edge, Problem, tie_classes


class Conflict(Exception):
    """A class lost its last choice (or a budget cannot be met); `cause` says what removed it."""

    def __init__(self, node: str | None, cause):
        super().__init__(node, cause)
        self.node = node
        self.cause = cause


@dataclass
class Counts:
    classes: int = 0  # variable groups after sharing (SameChoice + regions)
    removed_inf: int = 0  # choices removed because an edge forbids all their partners
    removed_dominated: int = 0
    fixed: int = 0  # classes left with a single choice
    eliminated: int = 0  # classes removed by dynamic programming (degree <= 2)
    folded_edges: int = 0  # separable edges folded into node costs


@dataclass
class Arrays:
    """A problem's numbers as numpy arrays, converted once for repeated reductions (never
    modified in place). costs=False keeps only what is forbidden (inf): every finite cost
    becomes 0, which presolves a feasibility question down to almost nothing."""

    cost: list[np.ndarray]  # per node, per choice
    memory: list[np.ndarray]
    edges: list[np.ndarray]  # per edge, [src choice, dst choice]

    @classmethod
    def of(cls, problem: Problem, costs: bool = True) -> "Arrays":
        def keep(m):
            return m if costs else np.where(np.isfinite(m), 0.0, m)

        shared: dict[int, np.ndarray] = {}  # edges holding the same matrix object share one array
        per_list: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # so do nodes holding one choice list

        def edge_array(e: Edge) -> np.ndarray:
            m = shared.get(id(e.cost))
            if m is None:
                m = shared[id(e.cost)] = keep(np.array(e.cost, float))
            return m

        def node_arrays(choices: list) -> tuple[np.ndarray, np.ndarray]:
            got = per_list.get(id(choices))
            if got is None:
                got = per_list[id(choices)] = (
                    keep(np.array([c.cost for c in choices], float)),
                    np.array([c.memory for c in choices], float),
                )
            return got

        nodes = [node_arrays(n.choices) for n in problem.nodes]
        return cls([cost for cost, _ in nodes], [memory for _, memory in nodes], [edge_array(e) for e in problem.edges])


@dataclass
class Budget:
    """A MemoryBudget in class space: bytes per choice of each class whose choice matters, bytes
    per choice pair of class pairs (a < b, a's choices as rows), and what is left of the limit
    once classes with a fixed load are taken off."""

    constraint: MemoryBudget
    memory: dict[int, np.ndarray]
    edges: dict[tuple[int, int], np.ndarray]
    limit: float

    def copy(self) -> "Budget":
        return Budget(self.constraint, dict(self.memory), dict(self.edges), self.limit)

    def oriented(self, a: int, b: int) -> np.ndarray | None:
        """Edge memory between classes a and b with a's choices as rows (None: none)."""
        m = self.edges.get((min(a, b), max(a, b)))
        return None if m is None else m if a < b else m.T

    def around(self) -> dict[int, list[tuple[int, np.ndarray]]]:
        """Class -> (neighbour, edge memory oriented from the class) for every budget edge."""
        out: dict[int, list[tuple[int, np.ndarray]]] = {}
        for (a, b), m in self.edges.items():
            out.setdefault(a, []).append((b, m))
            out.setdefault(b, []).append((a, m.T))
        return out

    def load(self, choice: dict[int, int]) -> float:
        """Bytes of an assignment of (at least) every class this budget names."""
        nodes = sum(float(m[choice[c]]) for c, m in self.memory.items())
        return nodes + sum(float(m[choice[a], choice[b]]) for (a, b), m in self.edges.items())


class Reduction:
    """Class-space view of a Problem under a given subset of constraints and regions."""

    def __init__(self, problem: Problem, constraints, regions, *, reduce: bool = True, arrays: Arrays | None = None):
        """reduce=False only shares variables and applies pins (to test the ILP on its own)."""
        arrays = arrays or Arrays.of(problem)
        self.counts = Counts()
        index = problem.index()
        self.names = [n.name for n in problem.nodes]
        self.node_class = tie_classes(problem, constraints, regions)
        self.members: dict[int, list[int]] = {}
        for i, c in enumerate(self.node_class):
            self.members.setdefault(c, []).append(i)
        self.counts.classes = len(self.members)

        self.cost = {c: np.zeros(len(problem.nodes[c].choices)) for c in self.members}
        for i, row in enumerate(arrays.cost):
            self.cost[self.node_class[i]] += row
        self.alive = {c: np.ones(len(v), bool) for c, v in self.cost.items()}
        self.adj: dict[int, set[int]] = {c: set() for c in self.members}
        self.mat: dict[tuple[int, int], np.ndarray] = {}
        self.origin: dict[tuple[int, int], object] = {}  # an original Edge, for messages
        self.fixed: dict[int, int] = {}
        self.elim: list[tuple[int, tuple[int, ...], np.ndarray]] = []

        for c, v in self.cost.items():
            self._restrict(c, np.isfinite(v), "every choice has infinite cost")
        for con in constraints:
            if isinstance(con, (Fixed, Allowed)):
                ids = [con.choice_index] if isinstance(con, Fixed) else con.indices
                c = self.node_class[index[con.node]]
                mask = np.zeros(len(self.alive[c]), bool)
                mask[list(ids)] = True
                self._restrict(c, mask, con)
        for e, m in zip(problem.edges, arrays.edges):
            a, b = self.node_class[index[e.src]], self.node_class[index[e.dst]]
            if a == b:  # both ends share variables: only the diagonal can happen
                self.cost[a] += np.diagonal(m)
                self._restrict(a, np.isfinite(self.cost[a]), e)
            else:
                self._add_edge(a, b, m, e)

        self.budgets: list[Budget] = []
        arrays_of: dict[int, np.ndarray] = {}  # id(memory matrix) -> its array: repeated blocks share matrices
        for con in constraints:
            if isinstance(con, MemoryBudget):
                budget = Budget(con, {}, {}, con.limit)
                mem = budget.memory
                for n in dict.fromkeys(con.nodes):
                    i = index[n]
                    c = self.node_class[i]
                    row = arrays.memory[i] if con.memory is None else np.array(con.memory[n], float)
                    mem[c] = mem[c] + row if c in mem else row
                for pair in con.edges:
                    if id(pair.memory) not in arrays_of:
                        arrays_of[id(pair.memory)] = np.array(pair.memory, float)
                    self._add_budget_edge(budget, pair, arrays_of[id(pair.memory)], index)
                self.budgets.append(budget)
        if reduce:
            self._reduce()

    # ---- results ----------------------------------------------------------------------------
    @property
    def core(self) -> list[int]:
        """Classes the ILP still has to decide."""
        return sorted(self.adj)

    def narrowed(self, keep: dict[int, np.ndarray], forbid=None) -> "Reduction":
        """A copy with the choices outside keep[c] removed and the edge entries where
        forbid[(a, b)] is True made inf, presolved again: what is left of the problem once
        those are ruled out (usually much smaller). Raises Conflict if nothing is left."""
        sub = copy.copy(self)
        sub.counts = dataclasses.replace(self.counts)
        sub.alive, sub.cost, sub.mat = dict(self.alive), dict(self.cost), dict(self.mat)
        sub.origin, sub.fixed, sub.elim = dict(self.origin), dict(self.fixed), list(self.elim)
        sub.adj = {c: set(nbrs) for c, nbrs in self.adj.items()}
        sub.budgets = [budget.copy() for budget in self.budgets]
        for key, mask in (forbid or {}).items():
            sub.mat[key] = np.where(mask, np.inf, sub.mat[key])
        for c, mask in keep.items():
            sub._restrict(c, mask, "ruled out")
        sub._reduce()
        return sub

    def oriented(self, a: int, b: int) -> np.ndarray:
        """Edge matrix between classes a and b with a's choices as rows."""
        return self.mat[(a, b)] if a < b else self.mat[(b, a)].T

    def assign(self, core_choice: dict[int, int]) -> dict[str, int]:
        """Back-substitute fixed and eliminated classes; return node name -> choice index."""
        choice = dict(self.fixed)
        choice.update(core_choice)
        for c, nbrs, table in reversed(self.elim):
            choice[c] = int(table[tuple(choice[n] for n in nbrs)])
        return {name: choice[self.node_class[i]] for i, name in enumerate(self.names)}

    # ---- building blocks --------------------------------------------------------------------
    def _restrict(self, c: int, mask: np.ndarray, cause) -> bool:
        """alive[c] &= mask; raise Conflict if nothing is left. Returns whether it changed."""
        new = self.alive[c] & mask
        removed = int(self.alive[c].sum() - new.sum())
        if removed:
            self.alive[c] = new
            if isinstance(cause, Edge):
                self.counts.removed_inf += removed
            if not new.any():
                raise Conflict(self.names[c], cause)
        return bool(removed)

    def _add_edge(self, a: int, b: int, m: np.ndarray, origin) -> None:
        if a > b:
            a, b, m = b, a, m.T
        key = (a, b)
        if key in self.mat:
            self.mat[key] = self.mat[key] + m
        else:
            self.mat[key] = m
            self.origin[key] = origin
            self.adj[a].add(b)
            self.adj[b].add(a)

    def _add_budget_edge(self, budget: Budget, pair: EdgeMemory, m: np.ndarray, index: dict[str, int]) -> None:
        """A budget's edge memory (`m`: `pair.memory` as an array, never changed in place) in class
        space: on the diagonal where both ends share a class, else beside a (possibly zero-cost)
        edge, so that the ILP has the pair's variables."""
        a, b = self.node_class[index[pair.src]], self.node_class[index[pair.dst]]
        if a == b:
            row = np.diagonal(m)
            budget.memory[a] = budget.memory[a] + row if a in budget.memory else row.copy()
            return
        if a > b:
            a, b, m = b, a, m.T
        if (a, b) not in self.mat:
            self._add_edge(a, b, np.zeros_like(m), pair)
        budget.edges[(a, b)] = budget.edges[(a, b)] + m if (a, b) in budget.edges else m

    def _drop_edge(self, a: int, b: int) -> None:
        key = (min(a, b), max(a, b))
        del self.mat[key], self.origin[key]
        self.adj[a].discard(b)
        self.adj[b].discard(a)

    def _drop_class(self, c: int) -> None:
        for nb in list(self.adj[c]):
            self._drop_edge(c, nb)
        del self.adj[c]

    def _affects_budget(self, c: int) -> bool:
        """Whether c's choice changes some budget's load (constant loads come off the limit; edge
        memory that splits into the two ends' goes to them)."""
        alive = self.alive[c]
        varying = False
        for budget in self.budgets:
            for nb in [nb for nb in self.adj[c] if budget.oriented(c, nb) is not None]:
                varying |= not self._fold_budget_edge(budget, c, nb)
            mem = budget.memory
            if c in mem:
                m = mem[c][alive]
                if m.max() > m.min():
                    varying = True
                else:
                    budget.limit -= m[0]
                    del mem[c]
        return varying

    def _fold_budget_edge(self, budget: Budget, c: int, nb: int) -> bool:
        """Fold the budget's memory on edge c-nb into the two classes' if it splits as
        a[k] + b[l] over the live choices; whether it did."""
        ic, inb = np.flatnonzero(self.alive[c]), np.flatnonzero(self.alive[nb])
        edge = budget.oriented(c, nb)
        assert edge is not None, "only an edge the budget counts is folded"
        block = edge[np.ix_(ic, inb)]
        a, b = block[:, 0], block[0, :] - block[0, 0]
        if np.abs(block - a[:, None] - b[None, :]).max() > 1e-12 * max(float(np.abs(block).max()), 1.0):
            return False
        for cls, idx, part in ((c, ic, a), (nb, inb, b)):
            row = np.zeros(len(self.alive[cls]))
            row[idx] = part
            budget.memory[cls] = budget.memory[cls] + row if cls in budget.memory else row
        del budget.edges[(min(c, nb), max(c, nb))]
        return True

    # ---- the fixpoint -----------------------------------------------------------------------
    def _reduce(self) -> None:
        dirty = set(self.adj)
        while dirty:
            c = dirty.pop()
            if c not in self.adj:
                continue
            touched = self._step(c)
            dirty.update(touched)
        for budget in self.budgets:
            least = sum(m[self.alive[c]].min() for c, m in budget.memory.items()) + sum(
                m[np.ix_(self.alive[a], self.alive[b])].min() for (a, b), m in budget.edges.items()
            )
            if least > budget.limit * (1 + 1e-12) + 1e-9:
                raise Conflict(None, budget.constraint)

    def _step(self, c: int) -> set[int]:
        """Apply every reduction to class c; return the classes whose neighbourhood changed."""
        before = int(self.alive[c].sum())
        for nb in list(self.adj[c]):
            m = self.oriented(c, nb)
            ok = np.isfinite(m[:, self.alive[nb]]).any(axis=1)
            self._restrict(c, ok, self.origin[(min(c, nb), max(c, nb))])
        if self.alive[c].sum() > 1:
            self._dominance(c)
        nbrs = set(self.adj[c])
        changed = int(self.alive[c].sum()) != before
        if self.alive[c].sum() == 1:
            self._fix(c)
        elif len(nbrs) <= 2 and not self._affects_budget(c):
            self._eliminate(c, sorted(nbrs))
        else:
            for nb in nbrs:
                if self._fold_separable(c, nb):
                    changed = True
            return nbrs | {c} if changed else set()
        return nbrs

    def _dominance(self, c: int) -> None:
        """Dead-end elimination (Goldstein): drop choice k if some j is no worse in every context,
        i.e. cost[k] - cost[j] + sum over edges of min_l (M[k, l] - M[j, l]) >= 0 and j needs
        no more memory. Ties go to the lower index, so no two choices remove each other."""
        idx = np.flatnonzero(self.alive[c])
        cost = self.cost[c][idx]
        gain = cost[:, None] - cost[None, :]  # gain[k, j]: least saving when switching k -> j
        scale = float(np.abs(cost).max())
        for nb in self.adj[c]:
            m = self.oriented(c, nb)[idx][:, self.alive[nb]]
            with np.errstate(invalid="ignore"):
                diff = m[:, None, :] - m[None, :, :]
            diff[np.isnan(diff)] = np.inf  # l forbidden for both: a context that cannot happen
            gain += diff.min(axis=2)
            scale += float(np.abs(m, where=np.isfinite(m), out=np.zeros_like(m)).max())
        for budget in self.budgets:
            # more[k, j]: the most memory switching k -> j can add, whatever the neighbours choose
            load = budget.memory[c][idx] if c in budget.memory else np.zeros(len(idx))
            more = load[None, :] - load[:, None]
            for nb in self.adj[c]:
                edge = budget.oriented(c, nb)
                if edge is not None:
                    m = edge[idx][:, self.alive[nb]]
                    more = more + (m[None, :, :] - m[:, None, :]).max(axis=2)
            gain[more > 0] = -np.inf
        tol = 1e-12 * scale
        order = np.arange(len(idx))
        beats = (gain > tol) | ((gain >= -tol) & (order[None, :] < order[:, None]))
        np.fill_diagonal(beats, False)
        dead = beats.any(axis=1)
        if dead.any():
            mask = self.alive[c].copy()
            mask[idx[dead]] = False
            self.alive[c] = mask
            self.counts.removed_dominated += int(dead.sum())

    def _fix(self, c: int) -> None:
        k = int(np.flatnonzero(self.alive[c])[0])
        self.fixed[c] = k
        self.counts.fixed += 1
        for budget in self.budgets:
            for nb in self.adj[c]:
                m = budget.oriented(c, nb)
                if m is not None:
                    budget.memory[nb] = budget.memory[nb] + m[k] if nb in budget.memory else m[k].copy()
                    del budget.edges[(min(c, nb), max(c, nb))]
            if c in budget.memory:
                budget.limit -= budget.memory.pop(c)[k]
        for nb in list(self.adj[c]):
            row = self.oriented(c, nb)[k]
            origin = self.origin[(min(c, nb), max(c, nb))]
            self.cost[nb] = self.cost[nb] + row
            self._drop_edge(c, nb)
            self._restrict(nb, np.isfinite(row), origin)
        del self.adj[c]

    def _eliminate(self, c: int, nbrs: list[int]) -> None:
        """Min out class c given its (at most two) neighbours' choices."""
        idx = np.flatnonzero(self.alive[c])
        cost = self.cost[c][idx]
        self.counts.eliminated += 1
        if not nbrs:
            self.fixed[c] = int(idx[np.argmin(cost)])
        elif len(nbrs) == 1:
            (a,) = nbrs
            table = cost[:, None] + self.oriented(c, a)[idx]  # [c choice, a choice]
            origin = self.origin[(min(a, c), max(a, c))]
            self.elim.append((c, (a,), idx[table.argmin(axis=0)]))
            best = table.min(axis=0)
            self.cost[a] = self.cost[a] + best
            self._restrict(a, np.isfinite(best), origin)
        else:
            a, b = nbrs
            left = self.oriented(a, c)[:, idx] + cost[None, :]  # [a, c]
            right = self.oriented(c, b)[idx]  # [c, b]
            table = left[:, :, None] + right[None, :, :]  # [a, c, b]
            self.elim.append((c, (a, b), idx[table.argmin(axis=1)]))
            self._add_edge(a, b, table.min(axis=1), self.origin[(min(a, c), max(a, c))])
        self._drop_class(c)

    def _fold_separable(self, c: int, nb: int) -> bool:
        """Fold an edge whose live block is a[k] + b[l] (incl. constant) into node costs (not one
        whose budget memory does not split so: its variables are the budget's too)."""
        if any(
            budget.oriented(c, nb) is not None and not self._fold_budget_edge(budget, c, nb) for budget in self.budgets
        ):
            return False
        ic, inb = np.flatnonzero(self.alive[c]), np.flatnonzero(self.alive[nb])
        block = self.oriented(c, nb)[np.ix_(ic, inb)]
        if not np.isfinite(block).all():
            return False
        a, b = block[:, 0], block[0, :] - block[0, 0]
        scale = max(float(np.abs(block).max()), 1.0)
        if np.abs(block - a[:, None] - b[None, :]).max() > 1e-12 * scale:
            return False
        self.cost[c] = self.cost[c].copy()  # arrays may be shared with a restricted() copy
        self.cost[c][ic] += a
        self.cost[nb] = self.cost[nb].copy()
        self.cost[nb][inb] += b
        self._drop_edge(c, nb)
        self.counts.folded_edges += 1
        return True
