"""How the traced step calls the model and finds its loss, for the call conventions users have.

Our models take positional tensors and return logits. Hugging Face models take keywords
(`input_ids=`, `attention_mask=`, `labels=`) and return a `ModelOutput` (an ordered dict):
`.loss` when given labels, `.logits` for a loss function of one's own. So `input_fn` may return
a dict of keyword inputs, and a `ModelOutput` is read by its fields. The graph's inputs stay a
flat tuple in the dict's order: that is the order the parallel module takes them in.
Models that compute their own loss (nanoGPT's `(logits, loss)`, HF given `labels=`) need no loss
function: the step finds the loss among what they return (`loss_of`).
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
    loss_output: int | str | None = None,
) -> torch.Tensor:
    """`loss_fn(model(*inputs[:k]), *inputs[k:])`, or the loss `model(*inputs)` returns without a
    loss function (`loss_of`); with `names`, the same split passed as keywords. `prepare` sees
    what the loss function gets."""
    if loss_fn is None:
        args, kwargs = _call_args(inputs, names)
        return loss_of(model(*args, **kwargs), loss_output)
    k = n_model_inputs
    args, kwargs = _call_args(inputs[:k], names[:k] if names else None)
    outputs = prepare(loss_input(model(*args, **kwargs)))
    args, kwargs = _call_args(inputs[k:], names[k:] if names else None)
    loss = loss_fn(outputs, *args, **kwargs)
    if not _is_scalar(loss):
        raise ValueError(f"the loss function must return a scalar tensor, got {_what(loss)}")
    return loss


HOW_TO_PASS_A_LOSS = (
    "with loss_fn=None the model must return its loss: a scalar tensor, a tuple holding it "
    "(loss_output=INDEX names which; default the first scalar), or an output with .loss (a Hugging "
    "Face model given labels=); otherwise pass loss_fn=f, called as f(outputs, *inputs[n_model_inputs:])"
)


def loss_of(outputs: Any, loss_output: int | str | None = None) -> torch.Tensor:
    """The loss a model returned: a scalar tensor as it is; a tuple's element `loss_output` (an
    index; default the first scalar tensor, nanoGPT's `(logits, loss)`); a `ModelOutput`'s (or any
    object's) field `loss_output` (default `loss`). Anything else raises one message that says
    how to pass a loss (`HOW_TO_PASS_A_LOSS`)."""
    found: Any = outputs
    if isinstance(outputs, (tuple, list)):
        if isinstance(loss_output, int):
            if not -len(outputs) <= loss_output < len(outputs):
                raise ValueError(f"loss_output={loss_output}, but the model returned {len(outputs)} values")
            found = outputs[loss_output]
        elif loss_output is None:
            found = next((v for v in outputs if _is_scalar(v)), outputs)
    elif isinstance(outputs, Mapping):
        field = loss_output if isinstance(loss_output, str) else "loss"
        found = outputs.get(field)
        if found is None:
            raise ValueError(
                f"the model returned {type(outputs).__name__} without a {field} (fields "
                f"{', '.join(outputs)}): give it labels= among the inputs, or pass a loss_fn"
            )
    elif not isinstance(outputs, torch.Tensor):
        found = getattr(outputs, loss_output if isinstance(loss_output, str) else "loss", outputs)
    if not _is_scalar(found):
        named = "" if loss_output is None else f" (loss_output={loss_output!r})"
        raise ValueError(f"the model returned {_what(outputs)}{named}, not a scalar loss: {HOW_TO_PASS_A_LOSS}")
    return found


def _is_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0


def _what(value: Any) -> str:
    """A short description of what a model or loss returned, for an error."""
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of ({', '.join(_what(v) for v in value)})"
    return type(value).__name__


def loss_input(outputs: Any) -> Any:
    """What a loss function receives: a `ModelOutput`'s logits, anything else as it is."""
    if isinstance(outputs, Mapping) and outputs.get("logits") is not None:
        return outputs["logits"]
    return outputs
