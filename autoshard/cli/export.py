"""`python -m autoshard export RUN_DIR --hf OUT`: a training run's checkpoint as a Hugging Face model
directory (safetensors in the run's dtype or --dtype, config.json, the tokenizer's files) that
`transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads; a LoRA run's, its adapter in peft's
format (`PeftModel.from_pretrained(base, OUT)`), or with --merge the base model with it merged.
Bad input (not a run directory, no such checkpoint, a crafted checkpoint, weights that are NaN or
inf or that overflow --dtype, OUT not writable or not empty) is one `error: ...` line, exit code 2,
and nothing is written.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from autoshard.cli.args import arg_type, fail
from autoshard.options import parse_bytes, positive_int


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a directory written by train (with checkpoints)")
    parser.add_argument(
        "--hf",
        type=Path,
        required=True,
        metavar="OUT",
        help="write a Hugging Face model directory here (must not exist, or be empty)",
    )
    parser.add_argument("--step", type=arg_type(positive_int), help="the checkpoint of this step (default: the newest)")
    parser.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        help="the weights' dtype (default: bf16 when the run computed in bf16, else fp32); "
        "weights it cannot hold (fp16 past 65504) are an error",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run (train --lora): write the base model with the adapter merged into its weights "
        "(default: the adapter alone, in peft's format: adapter_config.json, adapter_model.safetensors)",
    )
    parser.add_argument(
        "--max-shard-size",
        type=arg_type(parse_bytes),
        default=5e9,
        metavar="BYTES",
        help="split the weights into files of at most this size, with an index (default 5GB)",
    )


def run_export(args: argparse.Namespace) -> int:
    from autoshard.train.export import export_hf

    try:
        done = export_hf(
            args.run_dir,
            args.hf,
            step=args.step,
            max_shard_bytes=int(args.max_shard_size),
            dtype=args.dtype,
            merge=args.merge,
        )
    except ValueError as err:
        fail(str(err))
    print(
        f"exported step {done.step} of {args.run_dir}: {done.tensors} tensors, {done.bytes / 2**20:.1f} MiB of "
        f"{done.dtype} in {len(done.files)} file(s), with {', '.join(done.others)}, to {done.path}"
    )
    return 0
