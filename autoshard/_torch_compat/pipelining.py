"""The order in which torch's multi-stage pipeline schedules run each rank's work, read from the
schedule itself (its `pipeline_order`, built from private action types) so the cost model prices
the schedule torch will run rather than a formula for it.
"""

from __future__ import annotations

from typing import Any

Order = tuple[tuple[tuple[str, int, int], ...], ...]  # per pp rank: (kind, chunk, micro-batch), in order

_KINDS = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B"}


class _Placeholder:
    """What a schedule reads of a stage while it orders the work: no module, no process group."""

    def __init__(self, index: int, chunks: int, ranks: int):
        self.stage_index, self.num_stages = index, chunks
        self.group_size, self.group_rank = ranks, index % ranks
        self.is_first, self.is_last = index == 0, index == chunks - 1
        self.submod: Any = None


def schedule_order(class_name: str, ranks: int, virtual: int, micro_batches: int) -> Order | None:
    """Each pp rank's forwards (F), backwards (B) and backward halves (I: the input's gradient,
    W: the weights') under torch's schedule `class_name` with `virtual` chunks per rank, chunk j
    on rank j mod `ranks`. None for a single-stage schedule (GPipe, 1F1B), which keeps no order
    of all ranks, or where this torch's schedules keep none."""
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, class_name)
    multi = getattr(schedules, "PipelineScheduleMulti", None)
    if multi is None or not issubclass(cls, multi):
        return None
    stages = [_Placeholder(k * ranks, ranks * virtual, ranks) for k in range(virtual)]  # rank 0's
    order = getattr(cls(stages, micro_batches, loss_fn=_no_loss), "pipeline_order", None)
    if not order:
        return None
    return tuple(
        tuple(
            (_KINDS[a.computation_type.name], a.stage_index, a.microbatch_index)
            for a in order[rank]
            if a is not None and a.computation_type.name in _KINDS
        )
        for rank in range(ranks)
    )


def _no_loss(output: Any, target: Any) -> Any:
    return output
