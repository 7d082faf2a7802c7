"""What torch 2.11 and 2.12 lack or do differently, made up for (drop with their support).

Kept apart so that the other modules read as for torch 2.13 and 2.14 and these shims go in one
deletion. This module only defines them; the module that owns each affected name (or torch patch)
picks the variant for the running torch when it is imported, so every name has one binding.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy
from torch.distributed.tensor._ops import single_dim_strategy as _sds
from torch.distributed.tensor.placement_types import Replicate

TORCH = tuple(int(v) for v in torch.__version__.split(".")[:2])


def single_dim_rules_2_11(info: Any, schema: OpSchema, out_meta: Any) -> list[list[Any]]:
    """torch 2.11 has no _PreparedSingleDimStrategy: the steps its own expanded strategy function
    takes (2.11 asserts that a rule list has no all-Replicate rule yet; 2.13 keeps the one there)."""
    rules = info.func(schema.op, schema.args_meta, schema.kwargs_meta)
    if not any(all(isinstance(p, Replicate) for p in rule) for rule in rules):
        n_out = 0 if out_meta is None else 1 if isinstance(out_meta, TensorMeta) else len(out_meta)
        rules = _sds._insert_single_dim_replication_strategy(rules, n_out, _sds._get_num_tensor_inputs(schema))
    return _sds._fill_single_dim_strategy_placeholders(_sds._get_unique_placements(schema), rules)


def reductions_per_candidate() -> None:
    """2.11's and 2.12's reduction rule lets one input candidate that must be replicated (pending
    another reduction, uneven) replicate every later candidate too; 2.13 judges each alone. DTensor
    passes one candidate, autoshard many: hand them to the rule one at a time."""
    from torch.distributed.tensor._ops import _math_ops

    reduce = _math_ops.common_reduction_strategy

    def each(input_strategy: OpStrategy, *args: Any, **kwargs: Any) -> OpStrategy:
        return OpStrategy(
            [
                out
                for spec in input_strategy.strategies
                for out in reduce(OpStrategy([spec]), *args, **kwargs).strategies
            ]
        )

    _math_ops.common_reduction_strategy = functools.wraps(reduce)(each)


def teach_dynamo_mesh_shape() -> None:
    """2.11's dynamo models a DeviceMesh by a fixed list of attributes without `shape`, which the
    executor reads inside compiled programs (from 2.12 on, dynamo traces a DeviceMesh as an object)."""
    from torch._dynamo.variables import ConstantVariable
    from torch._dynamo.variables.distributed import DeviceMeshVariable

    var_getattr = DeviceMeshVariable.var_getattr

    def with_shape(self: Any, tx: Any, name: str) -> Any:
        return ConstantVariable.create(tuple(self.value.shape)) if name == "shape" else var_getattr(self, tx, name)

    DeviceMeshVariable.var_getattr = with_shape


def mem_tracker_2_12() -> Any:
    """2.11's and 2.12's MemTracker also counts the global-size fake tensors of DTensor's sharding
    propagation (an optimizer's first step seems to allocate whole parameters); 2.13's skips ops
    under a fake mode other than the one at its entry: the same skip."""
    from torch._guards import active_fake_mode
    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(MemTracker):
        def __enter__(self) -> Any:
            self._fake_mode_on_entry = active_fake_mode()
            return super().__enter__()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if active_fake_mode() is not self._fake_mode_on_entry and not any(t is DTensor for t in types):
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    return Tracker()


def dense_input(collective: Any) -> Any:
    """2.11's gather, reduce-scatter and all-to-all kernels refuse a non-contiguous input (2.13's
    take it)."""
    return functools.wraps(collective)(lambda x, *args: collective(x.contiguous(), *args))


def config_logging_without_functions() -> None:
    """2.11's compile metrics log dynamo's config with every set sorted, `ignore_logging_functions`
    too, which `dynamo_capture` fills with Logger methods: functions do not sort, and each capture
    printed an error with a traceback. 2.13 leaves that set out of the log: so does this."""
    from torch._dynamo import utils

    config_for_logging = utils._get_dynamo_config_for_logging

    @functools.wraps(config_for_logging)
    def without_functions() -> Any:
        with torch._dynamo.config.patch(ignore_logging_functions=set()):
            return config_for_logging()

    utils._get_dynamo_config_for_logging = without_functions
