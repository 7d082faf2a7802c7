"""JSON round trip for Problem and Solution, so plans can be saved, diffed and re-solved.

JSON has no infinity: `inf` is written as the string "inf" (null is accepted on read too).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict

from .problem import (Allowed, Choice, Edge, Fixed, MemoryBudget, Node, Problem, RepeatedRegion,
                      SameChoice)
from .solve import Solution, SolveStats

FORMAT = 1
_KINDS = {"fixed": Fixed, "allowed": Allowed, "same_choice": SameChoice,
          "memory_budget": MemoryBudget}


def _enc(v: float):
    return "inf" if v == math.inf else v


def _dec(v) -> float:
    return math.inf if v is None or v == "inf" else float(v)


def problem_to_json(problem: Problem, **kwargs) -> str:
    kind_of = {cls: kind for kind, cls in _KINDS.items()}
    data = {
        "format": FORMAT,
        "nodes": [{"name": n.name,
                   "choices": [{"label": c.label, "cost": _enc(c.cost), "memory": c.memory,
                                "tags": list(c.tags)} for c in n.choices]}
                  for n in problem.nodes],
        "edges": [{"src": e.src, "dst": e.dst, "cost": [[_enc(v) for v in row] for row in e.cost]}
                  for e in problem.edges],
        "constraints": [_constraint(kind_of[type(c)], asdict(c)) for c in problem.constraints],
        "regions": [r.copies for r in problem.regions],
    }
    return json.dumps(data, **kwargs)


def _constraint(kind: str, fields: dict) -> dict:
    if "limit" in fields:
        fields["limit"] = _enc(fields["limit"])
    if "memory" in fields and fields["memory"] is None:  # a budget over the choices' own memory
        del fields["memory"]
    return {"kind": kind, **fields}


def problem_from_json(text: str) -> Problem:
    data = json.loads(text)
    if data.get("format") != FORMAT:
        raise ValueError(f"unsupported problem format {data.get('format')!r}")
    nodes = [Node(n["name"], [Choice(c["label"], _dec(c["cost"]), float(c["memory"]),
                                     tuple(c["tags"])) for c in n["choices"]])
             for n in data["nodes"]]
    edges = [Edge(e["src"], e["dst"], [[_dec(v) for v in row] for row in e["cost"]])
             for e in data["edges"]]
    constraints = []
    for c in data["constraints"]:
        c = dict(c)
        kind = c.pop("kind")
        if kind not in _KINDS:
            raise ValueError(f"unknown constraint kind {kind!r}")
        if "limit" in c:
            c["limit"] = _dec(c["limit"])
        constraints.append(_KINDS[kind](**c))
    problem = Problem(nodes, edges, constraints, [RepeatedRegion(r) for r in data["regions"]])
    problem.validate()
    return problem


def solution_to_json(solution: Solution, **kwargs) -> str:
    data = asdict(solution)
    data["format"] = FORMAT
    return json.dumps(data, **kwargs)


def solution_from_json(text: str) -> Solution:
    data = json.loads(text)
    if data.pop("format", None) != FORMAT:
        raise ValueError("unsupported solution format")
    data["stats"] = SolveStats(**data["stats"])
    return Solution(**data)
