"""One training run's settings: how to plan (`PlanConfig`, inherited) and how to train. Every field
is a command-line option of `train` (`autoshard.options.setting`): a new setting is one field."""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, fields

from autoshard.data.files import DTYPES as DATA_DTYPES
from autoshard.driver.config import PlanConfig
from autoshard.options import BATCH, FREEZE, INIT_FROM, LORA, MODEL, OUT, SEQ, positive_int, run_name, setting
from autoshard.problem.recipes import RECIPES, recipe_pins
from autoshard.train.optimizer import LR_SCHEDULES, OptimizerConfig, ScheduleConfig
from autoshard.workloads.finetune import FineTune

RESUME_MODES = ("auto", "yes", "no", "force")
CHECKPOINT_WRITES = ("auto", "async", "sync")
# what a run on a pp mesh dim does not take: the search chooses the stages' layouts, and the stages
# run uncompiled, unmetered, with no validation pass
PIPELINE_REFUSES = (
    "compile",
    "plan_file",
    "recipe",
    "lora",
    "freeze",
    "eval_every",
    "wire_step",
    "memory_step",
    "recompute",
    "reshard_after_forward",
    "memory_budget",
    "prefetch",
    "bucket_cap_mb",
)


def parse_betas(text: str) -> tuple[float, float]:
    """'0.9,0.95' -> (0.9, 0.95): AdamW's betas (their range is `OptimizerConfig`'s to check)."""
    try:
        betas = tuple(float(b) for b in text.split(","))
    except ValueError:
        betas = ()
    if len(betas) != 2:
        raise ValueError(f"bad betas {text!r}: expected two numbers B1,B2, e.g. 0.9,0.95")
    return betas[0], betas[1]


@dataclass(frozen=True)
class Settings(PlanConfig):
    """`PlanConfig` (mesh, profiles, precision, memory...) plus the run. A bad value raises
    ValueError naming the flag when the settings are made. Without `mesh`, one data-parallel dim
    over the world torchrun launched (a world of 1 without torchrun); without `out`,
    `runs/<model>-<mesh>` (`run_name`)."""

    model: str = setting("llama3-debug", MODEL)
    batch: int = setting(8, BATCH)
    grad_accum: int | None = setting(
        None,
        type=positive_int,
        metavar="K",
        help="run each step as K micro-batches of --batch/K rows (the plan is made for one): gradients "
        "of replicated parameters are all-reduced once per step, sharded ones reduce-scattered every "
        "micro-batch (default: 1, or when the batch does not fit the memory limit at all, the fastest "
        "modeled of 2, 4, ... micro-batches that fits; a resumed run keeps its own)",
    )
    seq: int = setting(64, SEQ)
    steps: int = setting(50, type=int, help="train until this step")
    lr: float = setting(3e-3, type=float, help="AdamW's (peak) learning rate")
    lr_schedule: str = setting(
        "constant",
        choices=LR_SCHEDULES,
        help="the lr over the steps after --warmup-steps: constant; cosine or linear from --lr down to "
        "--min-lr at the last step; wsd (warmup-stable-decay): --lr, then a linear decay to --min-lr "
        "over the last --decay-fraction of the steps",
    )
    warmup_steps: int = setting(
        0, type=int, help="raise the lr linearly over the first N steps, from lr/(N+1) at step 1 to --lr at step N+1"
    )
    min_lr: float = setting(0.0, type=float, help="the lr cosine, linear and wsd decay to at the last step")
    decay_fraction: float = setting(
        0.2, type=float, metavar="F", help="wsd: decay over the last F of the steps (default 0.2)"
    )
    weight_decay: float = setting(
        0.0,
        type=float,
        help="AdamW's decoupled weight decay, on matrices (parameters of 2+ dims) only: norms and biases never decay",
    )
    betas: tuple[float, float] = setting((0.9, 0.999), type=parse_betas, metavar="B1,B2", help="AdamW's betas")
    grad_clip: float | None = setting(
        None,
        type=float,
        metavar="MAX_NORM",
        help="scale the gradients down to this global L2 norm when it is larger (torch's clip_grad_norm_); "
        "the norm is logged every step (grad_norm) with or without it",
    )
    wandb: str | None = setting(
        None,
        metavar="PROJECT",
        help="log every step to this Weights & Biases project too (needs wandb: pip install -e '.[wandb]'; "
        "WANDB_MODE=offline writes it under --out/wandb without a network)",
    )
    seed: int = setting(
        0,
        type=int,
        help="the run's seed: weight init, and what random ops (dropout) draw from, "
        "the same on every rank holding a value",
    )
    init_from: str | None = setting(None, INIT_FROM)
    lora: str | None = setting(None, LORA)
    freeze: tuple[str, ...] | None = setting(None, FREEZE)
    data_seed: int = setting(
        0, type=int, help="seed of the training data (the batch of step N is a pure function of it and N)"
    )
    # --data: train on files (autoshard.data, docs/data.md); without it, the synthetic Markov tokens
    data: tuple[str, ...] | None = setting(
        None,
        action="append",
        metavar="PATH",
        help="train on these files instead of synthetic tokens (repeatable): a file, a directory or a glob "
        "of token files (.bin, .npy) or text (.txt, .jsonl, .parquet: with --tokenizer); see docs/data.md",
    )
    data_dtype: str = setting(
        "auto",
        choices=DATA_DTYPES,
        help="the token type of flat .bin files (auto: llm.c's header says, else uint16 when the vocabulary "
        "has at most 65536 tokens, else uint32)",
    )
    tokenizer: str | None = setting(
        None,
        metavar="PATH",
        help="a tokenizer.json, or a Hugging Face model directory with one (local files): tokenizes text "
        "--data with its EOS token between documents; a llama3 model takes its vocabulary size",
    )
    data_cache: str | None = setting(
        None, metavar="DIR", help="where tokenized text is cached, keyed by content (default ~/.cache/autoshard/tokens)"
    )
    vocab_size: int | None = setting(
        None,
        type=positive_int,
        help="a llama3 model's vocabulary size (default: its config's, or with --tokenizer the tokenizer's)",
    )
    val_data: tuple[str, ...] | None = setting(
        None, action="append", metavar="PATH", help="validation files, as --data (repeatable)"
    )
    val_fraction: float = setting(
        0.0,
        type=float,
        metavar="F",
        help="hold out a random set of documents of --data for validation: each with this probability, "
        "drawn from --data-seed (about this fraction of its tokens; documents end at --tokenizer's EOS token)",
    )
    eval_every: int = setting(
        0, type=int, metavar="K", help="every K steps, the validation loss and perplexity into the metrics row"
    )
    eval_batches: int = setting(8, type=positive_int, metavar="N", help="validation batches per evaluation")
    loss_on: str | None = setting(
        None,
        choices=("all", "completion"),
        help="the tokens the loss trains on: completion (the default for instruction data: the assistant's turns "
        "of messages records, or the completion of prompt/completion ones) or all (plain text and tokens: always)",
    )
    instruction_layout: str | None = setting(
        None,
        choices=("pack", "pad"),
        help="instruction data into rows of --seq: pack several examples to a row, none attending to another "
        "(the model takes each token's position in its example: llama3 models and transformers causal LMs; "
        "their default), or pad one to a row (the default for other models)",
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
        choices=RECIPES,
        help="pin the parameters to a hand-written recipe's layouts (autoshard.problem.recipes), "
        "at its own parameter bytes per rank: to measure it beside autoshard's plan",
    )
    prefetch: int = setting(
        1,
        type=int,
        help="launch the parameter gathers of up to N blocks ahead of their use, and up to N "
        "gradient reduction buckets ahead of their waits, overlapping compute (0: wait on each "
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
        "--seq, --batch, --vocab-size, --val-fraction or --data-seed than the run's, or other data (files "
        "and tokenizer compared by content), unless force (recorded in metrics.jsonl); "
        "--lr, --betas, --weight-decay, the lr schedule and --grad-clip apply from the resumed step on",
    )
    overwrite: bool = setting(
        False,
        help="start over in an --out that holds an earlier run, deleting its metrics, plan, report and "
        "checkpoints (without it such a start refuses; a torchrun restart of this job resumes as usual)",
    )
    log_every: int = setting(
        1,
        type=positive_int,
        metavar="K",
        help="a metrics row every K steps and at the last (also on evaluation and checkpoint steps): the "
        "loss, gradient norm, memory and stop signals are read from the device only then, so the steps "
        "between never wait on it; a non-finite loss or a stop signal is seen at the next row",
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
        if self.grad_accum is not None and self.batch % self.grad_accum:
            raise ValueError(f"--grad-accum {self.grad_accum} does not divide --batch {self.batch}")
        try:
            self.check_batch(self.micro_batch)
        except ValueError:
            raise ValueError(
                f"--grad-accum {self.grad_accum}: a micro-batch of {self.micro_batch} rows (--batch {self.batch} / "
                f"{self.grad_accum}) does not split over the data-parallel mesh dims; use a smaller --grad-accum"
            ) from None
        if self.resume not in RESUME_MODES:
            raise ValueError(f"--resume must be one of {', '.join(RESUME_MODES)}, got {self.resume!r}")
        if self.overwrite and self.resume in ("yes", "force"):
            raise ValueError(f"--overwrite starts over: it cannot be combined with --resume {self.resume}")
        for name in ("checkpoint_every", "keep_checkpoints", "wire_step", "memory_step", "prefetch"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"--bucket-cap-mb must be positive, got {self.bucket_cap_mb}")
        self._check_optimizer()
        self._check_data()
        if self.pipeline_ranks is not None:
            self._check_pipeline()
        if self.recipe is not None:
            recipe_pins(self.recipe, len(self.mesh))  # fsdp-tp names the mesh it needs
        if self.freeze is not None:  # argparse appends to a list
            object.__setattr__(self, "freeze", tuple(self.freeze))
        self.fine_tune  # noqa: B018 (a bad --lora names itself now)

    def _check_pipeline(self) -> None:
        """A pp dim: the pipeline search chooses each stage's layouts, recomputation and sharding,
        and the stages run uncompiled; the flags that would set those are refused, not ignored."""
        defaults = {f.name: f.default for f in fields(Settings)}
        taken = [name for name in PIPELINE_REFUSES if getattr(self, name) != defaults[name]]
        if taken:
            flags = ", ".join("--" + name.replace("_", "-") for name in taken)
            raise ValueError(
                f"a mesh with a pp dim does not take {flags} yet: the pipeline search chooses each stage's "
                "layouts, sharding and recomputation, and the stages run uncompiled, unmetered, with no validation"
            )

    @property
    def fine_tune(self) -> FineTune:
        """What --lora and --freeze ask (empty: train every parameter)."""
        return FineTune.from_flags(self.lora, self.freeze, self.precision.param_dtype)

    @property
    def micro_batch(self) -> int:
        """The rows of one micro-batch: what the plan is made for (--grad-accum not chosen yet: the batch)."""
        return self.batch // (self.grad_accum or 1)

    def _check_optimizer(self) -> None:
        """The optimizer, schedule and logging flags: each bad value names its flag (the optimizer's
        and the schedule's own configs check theirs)."""
        object.__setattr__(self, "betas", OptimizerConfig.from_settings(self).betas)
        ScheduleConfig.from_settings(self)
        if self.grad_clip is not None and not 0 < self.grad_clip < math.inf:
            raise ValueError(f"--grad-clip must be positive (leave it out to not clip), got {self.grad_clip:g}")
        if self.wandb is not None and importlib.util.find_spec("wandb") is None:
            raise ValueError(f"--wandb {self.wandb}: wandb is not installed (pip install -e '.[wandb]')")

    def _check_data(self) -> None:
        """The data flags: each bad value or combination names its flags."""
        for name in ("data", "val_data"):
            if getattr(self, name) is not None:  # argparse appends to a list
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must be >= 0, got {self.eval_every}")
        if self.val_data and self.val_fraction:
            raise ValueError("--val-data and --val-fraction both say what to validate on: give one")
        given = (("--tokenizer", self.tokenizer), ("--val-data", self.val_data), ("--loss-on", self.loss_on))
        needs_data = [f for f, v in (*given, ("--instruction-layout", self.instruction_layout)) if v]
        needs_data += ["--val-fraction"] if self.val_fraction else []
        if needs_data and not self.data:
            raise ValueError(f"{', '.join(needs_data)} without --data: the synthetic tokens need none")
        if bool(self.eval_every) != bool(self.val_data or self.val_fraction):
            raise ValueError(
                "--eval-every K needs validation data (--val-data or --val-fraction)"
                if self.eval_every
                else "validation data (--val-data, --val-fraction) needs --eval-every K"
            )
        if self.val_fraction and not self.tokenizer:
            raise ValueError("--val-fraction holds out by document: it needs --tokenizer (its EOS token ends one)")
