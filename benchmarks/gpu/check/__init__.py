"""One GPU's check of autoshard: its training step against plain torch's, and rank 0's program at
scale against the cost model and the dry run.

    python3 -m benchmarks.gpu.check --out gpu-check          # one H100 or H200: a 450 s budget
    python3 -m benchmarks.gpu.check --big --out gpu-check    # also llama3-70b (64, 8): an H200's memory
    python -m benchmarks.gpu.check --tiny --out /tmp/gc      # every part at toy sizes, on CPU
    ... --parts step-eager,rank0 --profile DIR               # some parts; one profiled step each

Parts, each in a process of its own (a CUDA fault or an out-of-memory ends that part, not the
check; the time budget ends a part that outruns it):
- step, eager and compiled: llama3-1b, bf16 compute / fp32 gradient reduction, batch 2, seq 4096,
  a whole step (forward, backward, fused AdamW) on one device: autoshard's plan on mesh (1,) in a
  process group of one (NCCL; gloo on CPU) beside plain torch (the same model and values, the same
  casts as FSDP2's MixedPrecisionPolicy, the same fused AdamW), torch.compile off, then on.
  Tokens/s and MFU (flops as `train` counts them, over the datasheet's dense bf16 peak); goal:
  autoshard >= 0.97x plain torch.
- rank0 (and rank0-big with --big): llama3-8b on (8, 8), batch 8, seq 8192, bf16 / fp32 (70b on
  (64, 8), batch 64), planned as `plan` does; rank 0's program then runs forward and backward on
  real tensors of its local shapes on the device, its collectives on torch's fake process group
  (they return at once; gathers copy the local shard). Compute time (CUDA events, median after
  warm steps; the collectives' local copies included) against the program's modeled compute, and
  `torch.cuda.max_memory_allocated` over a steady step (the AdamW states live) against the dry
  run's peak; goals: within 15% and 10%. On CPU there is no allocator peak: skipped, said so.

Writes gpu_check.json and gpu_check.md under --out, after every part. Runs from the repository's
root; needs torch and this repository (not installed: its solver/ and models/ are found here), and
an ILP backend for planning (pulp; highspy is faster): on a GPU machine without them, carry their
wheels (docs/benchmarks.md). The pieces: driver.py runs each part in a process of its own under
the time budget; parts.py is what each part does; measure.py times and profiles; report.py holds
the cases, the goals and the table.
"""
