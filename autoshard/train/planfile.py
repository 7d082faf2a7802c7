"""A plan.json as the trainer reads it: what planning may reuse (the solution of one problem, and
the micro-batch count, recomputation and resharding its fit chose) and the settings of the run
that wrote it. Read in one place, so a damaged or foreign file is one `UsageError` naming it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoshard.fileio import read_json
from autoshard.options import UsageError


@dataclass(frozen=True)
class PlanFile:
    """One plan.json. `required`: planning must use its solution (`--plan-file`) rather than solve
    afresh when it was made for another problem (a resumed run's own file)."""

    source: str  # how messages name it
    fingerprint: str
    solution: Any
    settings: dict[str, Any]  # the run's settings; empty for a file `plan` wrote
    recompute: bool  # the fit recomputes the repeated blocks
    reshard: bool  # the fit gathers the blocks' parameters again in the backward
    required: bool = False
    data: dict | None = None  # the fingerprint of the run's data (`autoshard.data.fingerprint`), if recorded

    @property
    def micro_batches(self) -> int | None:
        """The micro-batch count the run that wrote it chose (None: not a training run's file)."""
        return self.settings.get("grad_accum")

    @classmethod
    def read(cls, path: Path, source: str, *, required: bool) -> PlanFile:
        """The plan file at `path`; UsageError when it is missing, unreadable or not a plan file."""
        data = read_json(path, name=source, error=UsageError)
        if not isinstance(data, dict) or not isinstance(data.get("fingerprint"), str) or "solution" not in data:
            raise UsageError(
                f"{source}: not a plan file (no fingerprint/solution; write one with "
                "`python -m autoshard plan` or a training run)"
            )
        settings = data.get("settings") or {}
        sections = [data.get(name) or {} for name in ("recompute", "reshard")]
        if not isinstance(settings, dict) or not all(isinstance(s, dict) for s in sections):
            raise UsageError(f"{source}: not a plan file (its settings, recompute or reshard section is damaged)")
        micro = settings.get("grad_accum")
        if micro is not None and (not isinstance(micro, int) or micro < 1):
            raise UsageError(f"{source}: not a plan file (grad_accum {micro!r})")
        fingerprint = data.get("data_fingerprint")
        return cls(
            source,
            data["fingerprint"],
            data["solution"],
            settings,
            recompute=bool(sections[0].get("blocks")),
            reshard=bool(sections[1].get("blocks")),
            required=required,
            data=fingerprint if isinstance(fingerprint, dict) else None,
        )
