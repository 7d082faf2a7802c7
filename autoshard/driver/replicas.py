"""3D meshes in seconds: decide a `dp_replicate` dim's placements first, then solve the rest.

On a `dp_replicate` dim every replica runs the same plan on its own slice of the batch: parameters
are replicated across it, activations are split along the batch, gradients reduced over it. So
the placements on that dim are those of plain data parallelism, and they can be found alone: a
1D problem on that dim (every parameter pinned Replicate), solved in a fraction of a second.
The full problem then keeps, per node, only the strategies with those placements on that dim
(`FixedMeshDim`): a (4, 2, 8) mesh plans like a (2, 8) one, with the replicate dim's gradient
reductions and batch splits still priced exactly by the planner. What this gives up against the
exact 3D ILP under the same roles is measured by `benchmarks/planning/hsdp.py` (docs/multi-node.md).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import replace

from torch import fx

import autoshard_solver as solver
from autoshard.capture.trace import JointGraph
from autoshard.layout import Layout, R, S
from autoshard.pricing.planner import Planner
from autoshard.problem.build import FixedMeshDim, ProblemSpec, build_problem, dim_placements
from autoshard.profiles.device import DeviceProfile
from autoshard.profiles.network import NetworkProfile

Solve = Callable[[solver.Problem], solver.Solution]


def fix_replicate_dim(
    graph: JointGraph,
    mesh_shape: tuple[int, ...],
    mesh_dim: int,
    network: NetworkProfile,
    device: DeviceProfile,
    spec: ProblemSpec,
    solve: Solve,
    *,
    repeated: list[list[list[fx.Node]]] | None = None,
) -> FixedMeshDim:
    """The data-parallel placements of every node on `mesh_dim` (a `dp_replicate` dim), from a
    1D problem on that dim alone priced with that dim's links: inputs split along dim 0 (the
    batch), parameters Replicate, unless the user constrained them (their placement on that dim
    counts). `repeated`: the graph's repeated blocks, when the caller has them (found otherwise)."""
    one = lambda layout: Layout((layout.placements[mesh_dim],))  # noqa: E731
    pins = {}
    for fqn in graph.params:
        user = [
            Layout.parse(lay) if isinstance(lay, str) else lay
            for pattern, lay in spec.pins.items()
            if fnmatch.fnmatchcase(fqn, pattern)
        ]
        pins[fqn] = one(user[0]) if user else Layout((R,))
    inputs = {i: Layout((S(0),)) for i in range(len(graph.inputs))}  # the batch splits over the replicas
    inputs.update({i: one(lay) for i, lay in spec.input_layouts.items()})
    spec_1d = replace(
        spec,
        input_layouts=inputs,
        output_layouts={i: one(lay) for i, lay in spec.output_layouts.items()},
        pins=pins,
        param_memory_bytes=float("inf"),
        fixed_dim=None,
    )
    size = (mesh_shape[mesh_dim],)
    sharding = build_problem(
        graph, size, Planner(size, network.restricted_to(mesh_dim)), device, spec_1d, repeated=repeated
    )
    solution = solve(sharding.problem)
    return FixedMeshDim(
        mesh_dim, {name: dim_placements(sharding.strategies[name][index]) for name, index in solution.choice.items()}
    )
