"""Test-session set-up. Under pytest-xdist each worker computes on one thread: two workers on two
cores with torch's default of one thread per core would oversubscribe them, and OpenMP's spinning
threads then slow every test several-fold. Subprocesses (torchrun, the CLI) inherit the setting."""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
