"""Stopping a run on a scheduler's signal: the signal is noted while a step runs, and the run
checkpoints and raises `Preempted` after it (`loop._steps`)."""

from __future__ import annotations

import signal
import threading


class Preempted(Exception):
    """The run stopped on a scheduler's signal after writing a checkpoint; `signum` names it."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class StopSignals:
    """SIGTERM and SIGUSR1 (what schedulers send before they kill a job) are noted, not obeyed at
    once: the run finishes its step, checkpoints and stops. Only the main thread can install them."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.received = 0
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._note) for sig in self.SIGNALS}
        return self

    def _note(self, signum: int, frame) -> None:
        self.received = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
