"""Torch-free ILP that picks one choice per node: node costs + pairwise edge costs + constraints.

p = Problem()
p.add_node("a", ["R", "S0"]); p.add_node("b", ["R", "S0"])
p.add_edge("a", "b", [[0, 3], [5, 0]])
sol = solve(p)          # sol.choice == {"a": 0, "b": 0}, sol.label("a") == "R"
"""

from .constraints import Allowed, Constraint, EdgeMemory, Fixed, MemoryBudget, RepeatedRegion, SameChoice
from .model import available_backends
from .problem import Choice, Edge, InfeasibleError, Node, Problem
from .solve import NoBetterError, Solution, SolveError, SolveStats, solve

__all__ = [
    "Allowed",
    "Choice",
    "Constraint",
    "Edge",
    "EdgeMemory",
    "Fixed",
    "InfeasibleError",
    "MemoryBudget",
    "Node",
    "NoBetterError",
    "Problem",
    "RepeatedRegion",
    "SameChoice",
    "Solution",
    "SolveError",
    "SolveStats",
    "available_backends",
    "solve",
]
