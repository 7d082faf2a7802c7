"""Candidate layouts per graph node: DTensor's registries, our own rules, device-order variants.

strategy.py   `Strategy` (layouts only) and `input_slots`
call.py       `OpCall`: what the sources read off a node; `signature` (the cache key)
layouts.py    even layouts of a shape (`layouts_for`, `LayoutCache`)
expand.py     per-mesh-dim rules -> mesh-wide strategies
registry.py   DTensor's single-dim and multi-dim registries, torch <-> our placements
rules/        our own rules, one module per op family (`@rule(op, ...)`)
order.py      device-order variants of a default-order strategy
catalog.py    `StrategyCatalog`: the entry point and owner of every cache of this stage
"""

from autoshard.strategies.catalog import StrategyCatalog, node_strategies
from autoshard.strategies.layouts import layouts_for
from autoshard.strategies.order import order_variants
from autoshard.strategies.strategy import Strategy, input_slots

__all__ = ["Strategy", "StrategyCatalog", "input_slots", "layouts_for", "node_strategies", "order_variants"]
