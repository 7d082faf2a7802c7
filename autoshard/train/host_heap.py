"""The C heap of a training process: glibc's malloc, tuned for a loop that frees and allocates
the same large blocks every step. Elsewhere (another libc, Windows) these do nothing."""

from __future__ import annotations

import ctypes
from typing import Any

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 2**20  # the largest glibc takes on 64-bit hosts (half its heap size)
NEVER_TRIM = 2**31 - 1  # mallopt's value is an int


def _libc(name: str) -> Any:
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError, TypeError):  # not glibc (Windows: no process handle)
        return None


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (`malloc_trim`). Rank 0 solves on a thread,
    whose malloc arena the main thread's tensors never reuse: what the solver freed there would
    stay resident through training."""
    trim = _libc("malloc_trim")
    if trim is not None:
        trim(0)


def keep_freed_for_next_step() -> None:
    """Let each step reuse the memory the previous one freed. By default glibc raises its mmap
    threshold to the largest block freed and gives the heap's top back to the OS past twice that,
    so a step that frees a gradient bucket of tens of MB and allocates it again in the next step
    page-faults it in anew, page by page, every other step (thousands of faults a step on CPU,
    where DDP's buckets, allocated once, fault none). Fixed thresholds (mmap only past 32 MiB,
    never trim) keep what a step freed for the next; resident memory stays at the steps' peak,
    which it reaches anyway. Call it after the weights load."""
    mallopt = _libc("mallopt")
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
        mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)
