"""autoshard's own strategy rules, one module per op family, for ops DTensor's registries lack
or handle too narrowly. Add a family: a module whose functions carry `@rule(op, ...)`, listed in
`_MODULES`. `RULES` (op -> rule) is assembled from them once, at import, and is read-only.
"""

from __future__ import annotations

from autoshard.strategies.rules import attention, experts, factories, loss, pointwise
from autoshard.strategies.rules.base import RuleFn, collect, rule

_MODULES = (attention, experts, factories, loss, pointwise)

RULES = collect(_MODULES)

__all__ = ["RULES", "RuleFn", "rule"]
