"""Put first on PYTHONPATH by the test suite's child processes (torchrun ranks, the CLI): when
AUTOSHARD_TEST_PLAN_AUDIT names a file, every ParallelModule the process builds is recorded there
(tests/plan_audit.py), so conftest can check that the plans a test executes shard. autoshard is
not imported here: the hook wraps the module when the process itself imports it."""

import importlib.abc
import importlib.machinery
import os
import sys

_TARGET = "autoshard.runtime.module"


class _RecordParallelModules(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_record(module):
            exec_module(module)
            sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
            from plan_audit import record

            record(module.ParallelModule)

        spec.loader.exec_module = exec_and_record
        return spec


if os.environ.get("AUTOSHARD_TEST_PLAN_AUDIT"):
    sys.meta_path.insert(0, _RecordParallelModules())
