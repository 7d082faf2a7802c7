"""Train a model (ours, or `hf:PATH`; `--init-from` safetensors weights) with an autoshard plan under torchrun.

    torchrun --standalone --nproc_per_node=4 -m autoshard train --model llama3-debug --mesh 2x2 \\
        --steps 50 --out runs/debug

Every rank traces the step and builds the ILP (cheap, deterministic); rank 0 solves it, or takes the
solution from `--plan-file` when that file was made for the same problem (same fingerprint: graph,
mesh, profiles, constraints), and broadcasts it; every rank checks it traced the same problem.
The plan must fit `--memory-limit` per rank (default: the device profile's capacity less 10%; `none`:
no limit), as in `plan`: every rank runs the fit beside the others, rank 0 solving its budgeted
problems and dry-running the candidates, so every rank takes the same decisions; the ranks then
check that they hold the same plan.
Rank 0 dry-runs its program on fake tensors (every rank holds the same local shapes) and logs the
peak memory per rank, then writes `sharding.log`, `report.html` and `plan.json` (reusable as
`--plan-file`, with that memory section), one `metrics.jsonl` row every `--log-every` steps (the only
steps that read the device), and distributed
checkpoints every `--checkpoint-every` steps (asynchronously, written to a temporary directory and
renamed when complete; the newest `--keep-checkpoints` kept); at the end it rewrites report.html
with the loss and tokens/s curves. A run whose --out holds checkpoints continues from the newest one
that loads (`--resume auto`, the default; a torchrun restart does the same) with the losses an
uninterrupted run would have had: the data is a pure function of (seed, step). SIGTERM or SIGUSR1
finishes the step, checkpoints it and exits with 128 + the signal's number; a non-finite loss stops
the run with one error line naming the newest good checkpoint.
`--wire-step K` meters step K's collectives on every rank (`autoshard.runtime.wire`: ring-model bytes per
rank, measured the same way as any other program) and adds them to that step's metrics row;
`--memory-step K` measures step K's live memory on every rank with torch's MemTracker, beside the
dry run's estimate. `--compile` runs the program through torch.compile from step 2 on (step 1 is the
checked run); the step that compiles logs its compile time and carries `compile_s` in its row.
AdamW's lr follows `--lr-schedule` after `--warmup-steps` (torch's lr schedulers; a resume continues
it at its step), `--weight-decay` applies to matrices only, and `--grad-clip` clips by the global
gradient norm, which every row logs (`grad_norm`) beside `lr`, `mfu` and tokens/s per device; the
rows also go to TensorBoard (`--out`/tensorboard, when installed) and W&B (`--wandb PROJECT`).
Run without torchrun, it trains on one process (a world of 1). From Python: `autoshard.train.train`,
with your own optimizer, data or loggers through `autoshard.train.Parts` (docs/api.md).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

from autoshard.cli.args import RaisingArgumentParser, add_dataclass_arguments
from autoshard.options import UsageError, from_values
from autoshard.train.loop import train
from autoshard.train.settings import Settings
from autoshard.train.signals import Interrupted, Preempted


def train_parser() -> argparse.ArgumentParser:
    """Every flag of `train`, generated from the fields of Settings."""
    parser = RaisingArgumentParser(
        prog="python -m autoshard train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    return add_dataclass_arguments(parser, Settings)


def _parse(argv: list[str] | None) -> Settings:
    values = vars(train_parser().parse_args(argv))
    try:
        return from_values(Settings, values)
    except ValueError as err:
        raise UsageError(str(err)) from None


def print_once_per_host(line: str, folder: str | None = None) -> None:
    """Print `line` to stderr once per torchrun launch and host: every rank checks its input alike,
    and whichever fails first may be the only one left to say why (torchrun ends the others, rank 0
    included, as soon as one exits). The first rank of the launch to claim the line prints it. A
    launch is its torchrun agent (the workers' parent process), so a relaunch with the same
    --rdzv-id still says its line; the claims of launches whose agent has ended are removed."""
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    if job is not None:
        folder = folder or tempfile.gettempdir()
        _remove_ended_claims(folder)
        agent = os.getppid()
        key = hashlib.sha256(f"{job}\n{line}".encode()).hexdigest()[:24]
        try:
            os.close(os.open(os.path.join(folder, f"{CLAIM}{agent}-{key}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # a rank of this launch on this host said it
    print(line, file=sys.stderr, flush=True)


CLAIM = "autoshard-said-"  # the claims' file name prefix, before the agent's pid


def _remove_ended_claims(folder: str) -> None:
    for path in Path(folder).glob(f"{CLAIM}*-*"):
        pid = path.name[len(CLAIM) :].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level  # train configures logging for its run; put it back
    try:
        train(_parse(argv))
    except (Preempted, Interrupted) as stop:  # checkpointed, or stopped while planning: the same command resumes
        if int(os.environ.get("RANK", "0")) == 0:
            print(stop, file=sys.stderr)
        return 128 + stop.signum  # the shell's code for "ended by this signal": not a finished run
    except UsageError as e:  # bad input, found alike on every rank; any other error is a bug: its traceback
        print_once_per_host(f"error: {e}")
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        root.handlers[:] = handlers  # in-process callers keep their own: none left writing to our stderr
        root.setLevel(level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
