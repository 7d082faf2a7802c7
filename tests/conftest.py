"""Test-session set-up. Under pytest-xdist each worker computes on one thread: two workers on two
cores with torch's default of one thread per core would oversubscribe them, and OpenMP's spinning
threads then slow every test several-fold. Subprocesses (torchrun, the CLI) inherit the setting.

Tests marked `ranks` start several processes (torchrun): they run one at a time across workers
(`torchrun.one_launch_at_a_time`). Two 4-rank jobs side by side put 8 processes on 2 cores, and gloo ranks
waiting on descheduled peers made such pairs several times slower than the same jobs in turn.

Every plan a test executes (a ParallelModule built here or in a process the test starts) must
shard: a collective on every mesh dim, or the test is marked `replicated_plan` (tests/plan_audit.py).
AUTOSHARD_TEST_PLAN_LOG=FILE appends each test's executed plans to FILE (for a before/after list)."""

import json
import os
import shutil
import tempfile
import uuid

import pytest

import plan_audit
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


AUDIT_DIR, AUDIT_FILE = pytest.StashKey[str](), pytest.StashKey[str]()


def pytest_configure(config):
    from autoshard.runtime.module import ParallelModule

    config.stash[AUDIT_DIR] = tempfile.mkdtemp(prefix="autoshard-plan-audit-")
    plan_audit.record(ParallelModule)  # for this whole process; children: tests/audit_site
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.path.join(os.path.dirname(__file__), "audit_site"), os.environ.get("PYTHONPATH")])
    )


def pytest_unconfigure(config):
    shutil.rmtree(config.stash[AUDIT_DIR], ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any fixture of the test is set up (a module fixture may build a module for it)."""
    path = os.path.join(item.config.stash[AUDIT_DIR], f"{uuid.uuid4().hex}.jsonl")
    item.stash[AUDIT_FILE] = path
    os.environ[plan_audit.AUDIT_ENV] = path


@pytest.fixture(autouse=True)
def executed_plans(request):
    """Yields a function that returns the summaries (`plan_audit.summary`) of the plans the test has
    executed so far, for a test that checks a CLI run's plan with `plan_audit.assert_shards`; then
    fails the test if one of them does not shard and the test is not marked `replicated_plan`."""
    path = request.node.stash[AUDIT_FILE]
    yield lambda: plan_audit.recorded(path)
    plans = plan_audit.recorded(path)
    log = os.environ.get("AUTOSHARD_TEST_PLAN_LOG")
    if log and plans:
        with open(log, "a") as f:
            f.write(json.dumps({"test": request.node.nodeid, "plans": plans}) + "\n")
    if request.node.get_closest_marker("replicated_plan") is None:
        for facts in plans:
            found = plan_audit.problems(facts)
            assert not found, (
                f"{request.node.nodeid} executed a plan that does not shard ({'; '.join(found)}); "
                "force sharding (plan_audit.sharded_plan) or mark the test replicated_plan"
            )


def pytest_collection_modifyitems(items):
    """A `ranks` test's time limit covers its wait for the launch lock too: give it room."""
    for item in items:
        if item.get_closest_marker("ranks") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(1800))
