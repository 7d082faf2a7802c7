"""What every file-backed feed shares: its position as checkpointable state, and the validation
loss over held-out rows."""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import numpy as np
import torch

log = logging.getLogger("autoshard")


class Position:
    """The steps a feed has served, as its checkpointable state (the batches themselves are a pure
    function of the seed and the step: a resumed run continues at the step its checkpoint says)."""

    served = 0

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.served}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.served = int(state.get("steps", 0))


def validation_loss(
    pmodel: Any, config: Any, micro_batches: int, held: int, local: Callable[[Callable], tuple], step: int
) -> dict[str, float]:
    """The mean loss over `eval_batches` batches of the `held` held-out rows (in order, wrapping),
    run through the parallel module without gradients, and its perplexity. `local(ids)` is this
    rank's inputs of the rows `ids(rows)` names (rows of the micro-batch -> held-out rows)."""
    drawn = pmodel.random.step  # the next step's random ops draw as if no evaluation had run
    micro = config.batch // micro_batches  # the rows the program takes
    count = config.eval_batches * micro_batches
    total = 0.0
    with torch.no_grad():
        for k in range(count):
            ids: Callable[[np.ndarray], np.ndarray] = lambda rows, k=k: (k * micro + rows) % held  # noqa: E731
            total += float(pmodel(*local(ids)).item())
    pmodel.random.step = drawn
    loss = total / count
    ppl = math.exp(loss) if loss < 700 else math.inf
    log.info("step %4d  val loss %.4f  val ppl %.2f", step, loss, ppl)
    return {"val_loss": loss, "val_ppl": ppl}
