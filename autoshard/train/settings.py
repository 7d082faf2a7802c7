"""One training run's settings: how to plan (`PlanConfig`, inherited) and how to train. Every field
is a command-line option of `train` (`autoshard.options.setting`): a new setting is one field."""

from __future__ import annotations

import os
from dataclasses import dataclass

from autoshard.driver.config import PlanConfig
from autoshard.options import BATCH, INIT_FROM, MODEL, OUT, SEQ, run_name, setting


RESUME_MODES = ("auto", "yes", "no", "force")
CHECKPOINT_WRITES = ("auto", "async", "sync")


@dataclass(frozen=True)
class Settings(PlanConfig):
    """`PlanConfig` (mesh, profiles, precision, memory...) plus the run. A bad value raises
    ValueError naming the flag when the settings are made. Without `mesh`, one data-parallel dim
    over the world torchrun launched (a world of 1 without torchrun); without `out`,
    `runs/<model>-<mesh>` (`run_name`)."""

    model: str = setting("llama3-debug", MODEL)
    batch: int = setting(8, BATCH)
    seq: int = setting(64, SEQ)
    steps: int = setting(50, type=int, help="train until this step")
    lr: float = setting(3e-3, type=float, help="AdamW learning rate")
    seed: int = setting(
        0,
        type=int,
        help="the run's seed: weight init, and what random ops (dropout) draw from, "
        "the same on every rank holding a value",
    )
    init_from: str | None = setting(None, INIT_FROM)
    data_seed: int = setting(
        0, type=int, help="seed of the training data (the batch of step N is a pure function of it and N)"
    )
    compile: bool = setting(
        False,
        help="run the program's forward and backward through torch.compile (inductor) "
        "from step 2 on (step 1 runs checked, uncompiled; the next unmetered step "
        "compiles)",
    )
    plan_file: str | None = setting(None, help="reuse a plan.json written by an earlier run or `plan`")
    recipe: str | None = setting(
        None,
        choices=("fsdp-tp", "fsdp", "ddp"),
        help="pin the parameters to a hand-written recipe's layouts (autoshard.problem.recipes), "
        "at its own parameter bytes per rank: to measure it beside autoshard's plan",
    )
    prefetch: int = setting(
        1,
        type=int,
        help="launch bucketed parameter gathers and gradient reductions up to N "
        "buckets ahead of their use, overlapping compute (0: wait on each "
        "where it is launched)",
    )
    bucket_cap_mb: float = setting(
        25.0,
        type=float,
        metavar="MIB",
        help="gradient all-reduces of replicated parameters run in buckets of at most "
        "this many MiB, each launched as soon as its last gradient exists (DDP's "
        "bucket_cap_mb; default 25)",
    )
    checkpoint_every: int = setting(0, type=int, help="checkpoint every K steps (0: never)")
    keep_checkpoints: int = setting(
        3, type=int, help="keep the newest K complete checkpoints, deleting older ones (0: keep all)"
    )
    checkpoint_writes: str = setting(
        "auto",
        choices=CHECKPOINT_WRITES,
        help="async: write checkpoints in the background while the next steps run "
        "(one at a time); sync: before the next step; auto: async on GPUs, sync "
        "on CPU (where the writing competes with the step for the cores)",
    )
    resume: str = setting(
        "auto",
        nargs="?",
        const="yes",
        choices=RESUME_MODES,
        help="auto: continue from the newest checkpoint in --out that loads, if there is one (also "
        "what a torchrun restart does); yes (or a bare --resume): there must be one; no: start "
        "over, refusing to mix with an earlier run's checkpoints. A resume refuses another --model, "
        "--seq, --batch or --data-seed than the run's unless force (recorded in metrics.jsonl); "
        "--lr applies to the restored optimizer",
    )
    overwrite: bool = setting(
        False,
        help="start over in an --out that holds an earlier run, deleting its metrics, plan, report and "
        "checkpoints (without it such a start refuses; a torchrun restart of this job resumes as usual)",
    )
    wire_step: int = setting(
        0, type=int, help="meter step K's collectives into its metrics row (slows that step; 0: never)"
    )
    memory_step: int = setting(
        0,
        type=int,
        help="measure step K's live tensor memory on every rank with torch's "
        "MemTracker into its metrics row, beside the dry run's estimate "
        "(K >= 2: AdamW states exist; slows that step; 0: never)",
    )
    out: str | None = setting(None, OUT, help="run directory (default: runs/<model>-<mesh>)")

    def __post_init__(self) -> None:
        if self.mesh is None:  # a data-parallel dim over every rank torchrun started
            object.__setattr__(self, "mesh", (int(os.environ.get("WORLD_SIZE", "1")),))
        super().__post_init__()
        if self.out is None:
            object.__setattr__(self, "out", os.path.join("runs", run_name(self.model, self.mesh)))
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        self.check_batch(self.batch)
        if self.resume not in RESUME_MODES:
            raise ValueError(f"--resume must be one of {', '.join(RESUME_MODES)}, got {self.resume!r}")
        if self.overwrite and self.resume in ("yes", "force"):
            raise ValueError(f"--overwrite starts over: it cannot be combined with --resume {self.resume}")
        for name in ("checkpoint_every", "keep_checkpoints", "wire_step", "memory_step", "prefetch"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"--bucket-cap-mb must be positive, got {self.bucket_cap_mb}")
