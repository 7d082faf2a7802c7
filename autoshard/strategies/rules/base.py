"""The `@rule(op, ...)` decorator and how rule modules become one mapping.

The decorator only marks a function with the ops it covers; it writes no registry. The package
(`rules/__init__.py`) reads the marks of its modules once, at import, into a read-only mapping.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from autoshard.strategies.call import OpCall
from autoshard.strategies.layouts import LayoutCache
from autoshard.strategies.strategy import Found

# A rule: the strategies of one call, as (output layouts, input layouts) on the whole mesh, in
# default shard order; or None when the rule does not apply to this call (the registry is asked).
RuleFn = Callable[[OpCall, LayoutCache], list[Found] | None]

_MARK = "_autoshard_rule_ops"


def rule(*ops: Any) -> Callable[[RuleFn], RuleFn]:
    """Mark `fn(call, layouts)` as our own strategy rule for `ops` (aten overloads). Our rules take
    precedence over DTensor's registries."""
    if not ops:
        raise TypeError("rule() needs at least one op")

    def mark(fn: RuleFn) -> RuleFn:
        setattr(fn, _MARK, tuple(ops))
        return fn

    return mark


def collect(modules: Iterable[types.ModuleType]) -> Mapping[Any, RuleFn]:
    """op -> rule, from the functions marked by `@rule` in `modules`, read-only. One op claimed by
    two rules is an error."""
    found: dict[Any, RuleFn] = {}
    for module in modules:
        for fn in vars(module).values():
            if getattr(fn, "__module__", None) != module.__name__:
                continue  # imported, not defined here
            for op in getattr(fn, _MARK, ()):
                if op in found:
                    raise ValueError(f"two strategy rules for {op}: {found[op].__qualname__} and {fn.__qualname__}")
                found[op] = fn
    return types.MappingProxyType(found)
