"""The process group of a command under torchrun (nccl on GPUs, gloo on CPU), or a world of one
process without it: what `train` and `calibrate` both start from."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist


def start_process_group() -> str:
    """Start the default process group and return the device type it runs on ("cuda" or "cpu")."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "nccl" if device == "cuda" else "gloo"
    if "RANK" not in os.environ:
        alone = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="autoshard-"), "store"), 1)
        dist.init_process_group(backend, store=alone, rank=0, world_size=1)
        return device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    store = _restart_store()
    if store is None:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=_world())
    return device


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _restart_store() -> dist.Store | None:
    """The store of a torchrun restart on one node: torchrun (torch 2.13) hands restarted workers
    the store of the first attempt, where the process group would read the dead workers' addresses
    (gloo: "connection refused"); keys under the attempt's own prefix avoid them. None otherwise:
    a first attempt, or several nodes, whose restart counts differ (torch's store as it is)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    one_node = os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")
    if attempt == 0 or not one_node or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    return dist.PrefixStore(f"autoshard/attempt-{attempt}", store)
