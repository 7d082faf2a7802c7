"""How the traced step calls the model and finds its loss, for the call conventions users have.

Our models take positional tensors and return logits. Hugging Face models take keywords
(`input_ids=`, `attention_mask=`, `labels=`) and return a `ModelOutput` (an ordered dict):
`.loss` when given labels, `.logits` for a loss function of one's own. So `input_fn` may return
a dict of keyword inputs, and a `ModelOutput` is read by its fields. The graph's inputs stay a
flat tuple in the dict's order: that is the order the parallel module takes them in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch


def step_inputs(raw: Any) -> tuple[tuple[Any, ...], tuple[str, ...] | None]:
    """(inputs in order, their keyword names or None) from what `input_fn` returned: a tuple or
    list (positional), a dict (keywords, in its order) or one tensor."""
    if isinstance(raw, Mapping):
        if not all(isinstance(k, str) for k in raw):
            raise TypeError(f"input_fn returned a dict with non-string keys {list(raw)}: keys are keyword names")
        return tuple(raw.values()), tuple(raw)
    if isinstance(raw, (tuple, list)):
        return tuple(raw), None
    return (raw,), None


def _call_args(values: tuple, names: tuple[str, ...] | None) -> tuple[tuple, dict[str, Any]]:
    return ((), dict(zip(names, values))) if names is not None else (values, {})


def run_step(
    model: Callable,
    loss_fn: Callable | None,
    inputs: tuple,
    names: tuple[str, ...] | None,
    n_model_inputs: int,
    prepare: Callable[[Any], Any] = lambda outputs: outputs,
) -> torch.Tensor:
    """`loss_fn(model(*inputs[:k]), *inputs[k:])`, or `model(*inputs)` without a loss function;
    with `names`, the same split passed as keywords. `prepare` sees what the loss function gets."""
    if loss_fn is None:
        args, kwargs = _call_args(inputs, names)
        return loss_of(model(*args, **kwargs))
    k = n_model_inputs
    args, kwargs = _call_args(inputs[:k], names[:k] if names else None)
    outputs = prepare(loss_input(model(*args, **kwargs)))
    args, kwargs = _call_args(inputs[k:], names[k:] if names else None)
    return loss_fn(outputs, *args, **kwargs)


def loss_of(outputs: Any) -> Any:
    """The loss a model returned: a tensor as it is, a `ModelOutput`'s `loss` field."""
    if isinstance(outputs, Mapping):
        loss = outputs.get("loss")
        if loss is None:
            raise ValueError(
                f"the model returned {type(outputs).__name__} without a loss (fields "
                f"{', '.join(outputs)}): give it labels= among the inputs, or pass a loss_fn"
            )
        return loss
    return outputs


def loss_input(outputs: Any) -> Any:
    """What a loss function receives: a `ModelOutput`'s logits, anything else as it is."""
    if isinstance(outputs, Mapping) and outputs.get("logits") is not None:
        return outputs["logits"]
    return outputs
