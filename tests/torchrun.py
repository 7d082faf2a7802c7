"""Running a tests/dist_*.py script on 4 gloo ranks and handing its per-rank results back: the
launcher side (`run_ranks`, in a test) and the script side (`report_ranks`, on every rank)."""

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "RESULT "


@contextlib.contextmanager
def one_launch_at_a_time():
    """Hold this test run's lock on multi-process launches (shared by its xdist workers)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))
    with open(os.path.join(tempfile.gettempdir(), f"autoshard-tests-{run}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a process a test starts (torchrun, the CLI): one thread, the repository
    importable, and the plan audit's hook (tests/audit_site) first on the path."""
    path = os.pathsep.join([str(ROOT / "tests" / "audit_site"), str(ROOT)])
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, **extra)


def torchrun_command(*args: str, nproc: int = 4) -> list[str]:
    """The command that starts `args` (a script, or `-m module ...`) on `nproc` ranks under torchrun."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]


def run_ranks(script: str, timeout: int, nproc: int = 4, args: Sequence[str] = ()) -> list[dict]:
    """torchrun `tests/<script> args` on `nproc` ranks (one thread each); every rank's result dict,
    in rank order. Fails the test with the tail of both streams when torchrun does."""
    cmd = torchrun_command(str(ROOT / "tests" / script), *args, nproc=nproc)
    start = time.time()
    out = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (
        f"torchrun failed after {time.time() - start:.0f}s:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    )
    (line,) = [x for x in out.stdout.splitlines() if x.startswith(PREFIX)]
    return json.loads(line[len(PREFIX) :])


def report_ranks(result: dict) -> None:
    """Gather every rank's `result` to rank 0, which prints them for `run_ranks`; then leave the
    process group together and end the process without finalizing the interpreter."""
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, result)
    if dist.get_rank() == 0:
        print(PREFIX + json.dumps(every), flush=True)
    dist.barrier()  # nobody tears the process group down while a peer still talks (a gloo abort)
    dist.destroy_process_group()
    leave(0)


def leave(code: int) -> NoReturn:
    """Exit with `code` without finalizing the interpreter, as `python -m autoshard` does: gloo's
    worker threads can outlive the process group, and a rank that frees them while Python tears
    down now and then aborts ("terminate called without an active exception") after its work is
    done, failing a launch that succeeded."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
