"""A torchrun worker whose agent died is supervised by nobody: killed with -9, the agent leaves its
workers training, and a new launch into the same run directory would meet them. A watcher thread
notices the parent change and stops the worker as a scheduler would (SIGTERM: the run checkpoints
at the end of its step and exits), and ends it outright if that takes longer than the grace time."""

from __future__ import annotations

import os
import signal
import threading
from types import TracebackType


class AgentWatch:
    """Under torchrun, stop this worker when its agent (the parent process) is gone."""

    def __init__(self, period_s: float = 2.0, grace_s: float = 45.0):
        self.period_s, self.grace_s = period_s, grace_s
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> AgentWatch:
        if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: its parent is the agent
            parent = os.getppid()
            self._thread = threading.Thread(
                target=self._watch, args=(parent,), name="autoshard-agent-watch", daemon=True
            )
            self._thread.start()
        return self

    def _watch(self, parent: int) -> None:
        while not self._done.wait(self.period_s):
            if os.getppid() != parent:  # reparented: the agent died
                os.kill(os.getpid(), signal.SIGTERM)
                if not self._done.wait(self.grace_s):
                    os._exit(128 + signal.SIGKILL)  # checkpoints are written aside and renamed: none is torn
                return

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._done.set()
