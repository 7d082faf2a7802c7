"""Test-session set-up. Under pytest-xdist each worker computes on one thread: two workers on two
cores with torch's default of one thread per core would oversubscribe them, and OpenMP's spinning
threads then slow every test several-fold. Subprocesses (torchrun, the CLI) inherit the setting.

Tests marked `ranks` start several processes (torchrun): they run one at a time across workers
(`torchrun.one_launch_at_a_time`). Two 4-rank jobs side by side put 8 processes on 2 cores, and gloo ranks
waiting on descheduled peers made such pairs several times slower than the same jobs in turn."""

import os

import pytest

from torchrun import one_launch_at_a_time

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _ranks_one_at_a_time(request):
    if request.node.get_closest_marker("ranks") is None:
        yield
        return
    with one_launch_at_a_time():
        yield


def pytest_collection_modifyitems(items):
    """A `ranks` test's time limit covers its wait for the launch lock too: give it room."""
    for item in items:
        if item.get_closest_marker("ranks") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(1800))
