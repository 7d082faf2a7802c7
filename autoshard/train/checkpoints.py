"""Distributed checkpoints of a training run (torch's DCP): `RUN/checkpoints/step-NNNNNN/`, written to
a temporary directory and renamed when complete, so a checkpoint directory is either complete or
absent."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch.distributed as dist

_CKPT = re.compile(r"^step-(\d+)$")


def latest_checkpoint(out: Path) -> tuple[int, Path] | None:
    """(step, directory) of the newest complete checkpoint in run directory `out`."""
    found = [(int(m.group(1)), p) for p in (out / "checkpoints").glob("step-*") if (m := _CKPT.match(p.name))]
    return max(found) if found else None


def save_checkpoint(out: Path, step: int, pmodel, optim) -> None:
    """Every rank calls this: the model's and the optimizer's state at `step`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = out / "checkpoints" / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(pmodel, optim)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        (tmp / "step.json").write_text(json.dumps({"step": step}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # a checkpoint directory is either complete or absent
    dist.barrier()


def load_checkpoint(path: Path, pmodel, optim) -> None:
    """Every rank calls this: the model's and the optimizer's state from checkpoint `path`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(pmodel, optim)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(pmodel, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
