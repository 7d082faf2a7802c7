"""`autoshard.train.train` with an API user's own parts on 4 gloo ranks, parameters sharded: SGD
instead of AdamW, an iterable of global token batches instead of `--data`, and a logger of their
own, with a row every other step. Reports per rank the logger's rows and the run's losses."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from autoshard.train.loop import train  # noqa: E402
from autoshard.train.parts import Parts  # noqa: E402
from autoshard.train.settings import Settings  # noqa: E402
from autoshard_models import build_model, get_config  # noqa: E402
from autoshard_models.data import MarkovTokens  # noqa: E402
from plan_audit import budget_bytes  # noqa: E402
from torchrun import report_ranks  # noqa: E402

STEPS, BATCH, SEQ = 6, 8, 16


class Rows:
    def __init__(self):
        self.rows, self.closed = [], False

    def log(self, row):
        self.rows.append({k: row[k] for k in ("step", "loss", "lr", "grad_norm")})

    def close(self):
        self.closed = True


def batches():
    """Global (tokens, targets) batches, as one device would see them (offset from the synthetic data)."""
    data = MarkovTokens(get_config("llama3-tiny").vocab_size, seed=7)
    for step in range(STEPS):
        rows = data.batch(step, BATCH, SEQ)
        yield rows.inputs, rows.targets


def main():
    budget = budget_bytes(build_model(get_config("llama3-tiny"), device="meta"), (4,))
    settings = Settings(
        model="llama3-tiny",
        mesh=(2, 2),
        batch=BATCH,
        seq=SEQ,
        steps=STEPS,
        log_every=2,
        memory_budget=budget,
        out=os.environ["AUTOSHARD_PARTS_OUT"],
    )
    logger = Rows()
    parts = Parts(
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        data=batches(),
        loggers=[logger],
    )
    losses = train(settings, parts)
    report_ranks({"rows": logger.rows, "closed": logger.closed, "losses": losses})


if __name__ == "__main__":
    main()
