"""Benchmark solver/ on synthetic sharding-like problems.

    python -m benchmarks.planning.solver [--quick] [--json PATH]

Choices are the 16 layouts of a 2D (8 x 8) mesh ({R, S0, S1, P} per mesh dim). Edge costs are
alpha-beta redistribution costs from the producer's output layout to the layout the consumer's
strategy requires (creating a Partial is forbidden: inf); node costs are compute divided by the
shards. Node kinds: pointwise (P forbidden), linear (P allowed), matmul (second input with the
weight's layout rule) and reductions. Shapes: chains, DAGs with residual skip edges, and a
32-layer model whose layer (275 nodes: a forward DAG, a backward DAG, saved activations feeding
the backward half, links to the neighbouring layers) is one RepeatedRegion, also solved unshared.
gap = (objective - proven lower bound) / objective; 0 when solved to optimality.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import time
from pathlib import Path

from autoshard_solver import Choice, Problem, available_backends, solve

MESH = (8, 8)
ALPHA = (2e-5, 5e-6)  # latency per collective, dp and tp dims (s)
BETA = (1 / 25e9, 1 / 200e9)  # seconds per byte
FLOPS = 100e12
PLACEMENTS = ("S0", "S1", "P", "R")
LAYOUTS = list(itertools.product(PLACEMENTS, repeat=2))
INDEX = {lay: i for i, lay in enumerate(LAYOUTS)}
# matmul Y = X @ W, per mesh dim: Y S0 <- X S0; Y S1 <- W S1; Y P <- X S1, W S0; Y R <- all R
MATMUL_X = {"S0": "S0", "S1": "R", "P": "S1", "R": "R"}
MATMUL_W = {"S0": "R", "S1": "S1", "P": "S0", "R": "R"}
SUM_DIM0 = {"S0": "P", "S1": "S1", "P": "P", "R": "R"}  # a reduction over tensor dim 0


def shards(layout, kinds=("S0", "S1")) -> int:
    return math.prod(n for p, n in zip(layout, MESH) if p in kinds)


def redistribute(src, dst):
    """Alpha-beta cost of turning layout src into dst as (seconds, seconds per global byte)."""
    alpha = beta = 0.0
    for d, (a, b) in enumerate(zip(src, dst)):
        n = MESH[d]
        if a == b or a == "R":  # replicate -> shard is a local slice
            continue
        if b == "P":  # nothing turns into a pending sum
            return math.inf, math.inf
        alpha += ALPHA[d]
        if a == "P":  # all-reduce or reduce-scatter
            beta += (n - 1) / n * BETA[d] * (2 if b == "R" else 1)
        elif b == "R":  # all-gather
            beta += (n - 1) * BETA[d]
        else:  # shard dim change: all-to-all
            beta += (n - 1) / n * BETA[d]
    return alpha, beta / shards(src)


COMM = [[redistribute(a, b) for b in LAYOUTS] for a in LAYOUTS]


class Builder:
    """Random nodes of four kinds; choices are the 16 output layouts of each node."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.p = Problem()
        self.info = {}  # name -> (tensor bytes, input layout index per choice, per input slot)

    def node(self, name: str, template=None):
        """Add a node (a fresh random kind, or a copy of `template`); return its template."""
        if template is None:
            template = self._template()
        nbytes, flops, needs, linear, _ = template
        self.info[name] = list(template[:3]) + [0]
        choices = []
        for lay in LAYOUTS:
            work = shards(lay, ("S0", "S1", "P") if len(needs) > 1 else ("S0", "S1"))
            ok = linear or "P" not in lay
            choices.append(
                Choice("".join(lay), flops / FLOPS / work + 1e-6 if ok else math.inf, memory=nbytes / shards(lay))
            )
        self.p.add_node(name, choices)
        return template

    def _template(self):
        rng = self.rng
        nbytes = 2 ** rng.uniform(20, 28)
        kind = rng.choices(("pointwise", "linear", "matmul", "sum"), (45, 20, 25, 10))[0]
        if kind == "matmul":
            needs = [[INDEX[tuple(m[p] for p in lay)] for lay in LAYOUTS] for m in (MATMUL_X, MATMUL_W)]
            return nbytes, nbytes * 4096, needs, True, kind
        if kind == "sum":
            needs = [[INDEX[tuple(SUM_DIM0[p] if p != "P" else "P" for p in lay)] for lay in LAYOUTS]]
            return nbytes, nbytes, needs, True, kind
        return nbytes, nbytes, [list(range(16))], kind == "linear", kind

    def edge(self, src: str, dst: str) -> None:
        nbytes = self.info[src][0]
        needs, slot = self.info[dst][2], self.info[dst][3]
        need = needs[min(slot, len(needs) - 1)]
        self.info[dst][3] += 1
        self.p.add_edge(src, dst, [[COMM[o][n][0] + nbytes * COMM[o][n][1] for n in need] for o in range(16)])

    def dag(self, names: list[str], skip: float = 0.2) -> None:
        """Chain `names`, plus residual-like skip edges back 2..8 nodes with probability `skip`."""
        for i in range(1, len(names)):
            self.edge(names[i - 1], names[i])
            if i >= 2 and self.rng.random() < skip:
                self.edge(names[i - self.rng.randint(2, min(i, 8))], names[i])


def chain(n: int, seed: int = 0) -> Problem:
    b = Builder(seed)
    names = [f"v{i}" for i in range(n)]
    for name in names:
        b.node(name)
    b.dag(names, skip=0.0)
    return b.p


def dag(n: int, seed: int = 0) -> Problem:
    b = Builder(seed)
    names = [f"v{i}" for i in range(n)]
    for name in names:
        b.node(name)
    b.dag(names)
    return b.p


def layered(layers: int = 32, per_layer: int = 275, seed: int = 0, regions: bool = True) -> Problem:
    """A model of identical layers (forward half then backward half), plus embedding/head."""
    b = Builder(seed)
    b.node("embed")
    b.node("freqs")
    half = per_layer // 2
    templates, copies = [], []
    for c in range(layers):
        names = [f"l{c}.{i}" for i in range(per_layer)]
        for i, name in enumerate(names):
            if c == 0:
                templates.append(b.node(name))
            else:
                b.node(name, templates[i])
        b.rng.seed(seed + 1)  # same internal wiring in every layer
        b.dag(names[:half])
        b.dag(names[half:])
        for i in range(0, half, 7):  # saved activations feed the backward half
            b.edge(names[i], names[per_layer - 1 - i])
        b.edge("freqs", names[3])
        b.edge("freqs", names[per_layer - 4])
        copies.append(names)
    b.edge("embed", copies[0][0])
    for prev, nxt in zip(copies, copies[1:]):
        b.edge(prev[half - 1], nxt[0])  # forward: layer c -> c+1
        b.edge(prev[half - 1], nxt[half - 2])  # residual stream
        b.edge(nxt[-1], prev[half])  # backward: layer c+1 -> c
    b.node("head")
    b.edge(copies[-1][half - 1], "head")
    b.edge("head", copies[-1][half])
    if regions:
        b.p.add_region(copies)
    return b.p


def run(name: str, problem: Problem, backend: str, time_limit: float) -> dict:
    t0 = time.perf_counter()
    sol = solve(problem, backend=backend, time_limit=time_limit)
    total = time.perf_counter() - t0
    s = sol.stats
    gap = (sol.objective - s.bound) / sol.objective if sol.objective else 0.0
    return {
        "problem": name,
        "backend": backend,
        "nodes": s.nodes,
        "classes": s.classes,
        "core": s.core,
        "variables": s.variables,
        "triangles": s.triangles,
        "presolve_s": s.presolve_s,
        "build_s": s.build_s,
        "solve_s": s.solve_s,
        "total_s": total,
        "objective": sol.objective,
        "gap": gap,
        "status": sol.status,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes only")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    ap.add_argument("--time-limit", type=float, default=60.0, help="per solve (default 60 s)")
    args = ap.parse_args()
    sizes = [500] if args.quick else [500, 2000, 8000]
    layers = 2 if args.quick else 32
    cases = [(f"chain N={n}", lambda n=n: chain(n)) for n in sizes]
    cases += [(f"dag N={n}", lambda n=n: dag(n)) for n in sizes]
    cases += [
        (f"{layers}-layer shared", lambda: layered(layers)),
        (f"{layers}-layer unshared", lambda: layered(layers, regions=False)),
    ]
    cols = (
        "problem",
        "backend",
        "nodes",
        "classes",
        "core",
        "variables",
        "triangles",
        "presolve_s",
        "build_s",
        "solve_s",
        "total_s",
        "objective",
        "gap",
        "status",
    )
    widths = [18, 7, 6, 7, 5, 9, 9, 10, 8, 8, 8, 10, 8, 8]
    print(" ".join(f"{c:>{w}}" for c, w in zip(cols, widths)))
    rows = []
    for name, make in cases:
        problem = make()
        for backend in available_backends():
            row = run(name, problem, backend, args.time_limit)
            rows.append(row)
            print(
                " ".join(
                    f"{row[c]:>{w}.3g}" if isinstance(row[c], float) else f"{row[c]:>{w}}" for c, w in zip(cols, widths)
                ),
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
