"""Stopping a run on a signal. Once the steps run (`StopSignals.arm`), a scheduler's signal is
noted while a step runs, and the run checkpoints and raises `Preempted` after it (`train.steps`).
Before that (setting up, planning) there is nothing to save and no step to wait for: a signal
raises `Interrupted` at once, so a rank does not plan on while torchrun stops its peers."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import warnings
from types import TracebackType
from typing import Any


class Preempted(Exception):
    """The run stopped on a scheduler's signal after writing a checkpoint; `signum` names it."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class Interrupted(BaseException):
    """A signal before the steps started: the run stops where it is, having written nothing.
    A BaseException, as KeyboardInterrupt is: no `except Exception` on the way swallows it, and a
    rank that plans for the others passes it on to them (`driver.ranks.on_rank_zero`)."""

    def __init__(self, signum: int):
        super().__init__(signum)  # the only argument: the exception pickles (broadcast to the ranks)
        self.signum = signum

    def __str__(self) -> str:
        return f"autoshard train: stopped by {signal.Signals(self.signum).name} before the first step (nothing written)"


class StopSignals:
    """SIGTERM and SIGUSR1 (what schedulers send before they kill a job) are noted, not obeyed at
    once, after `arm()`: the run finishes its step, checkpoints and stops. Before it, they and
    SIGINT raise `Interrupted` (once: a second signal while stopping is only noted, so the
    clean-up it unwinds through completes). Only the main thread can install them."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
    UNARMED = (signal.SIGINT, *SIGNALS)  # SIGINT is KeyboardInterrupt again once armed
    PEERS_STOP_US = "TORCHELASTIC_RUN_ID"  # set in a torchrun worker: its agent stops it when a peer ends
    GRACE_S = 5.0  # what torchrun takes to notice a worker ended (0.1 s) and signal the others, with room

    def __init__(self):
        self.received = 0
        self.armed = False
        self._previous: dict = {}
        self._unraisable: Any = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.UNARMED}
            self._unraisable, sys.unraisablehook = sys.unraisablehook, self._swallowed
        return self

    def _swallowed(self, info: Any) -> None:
        """An `Interrupted` raised inside a finalizer or weakref callback (the signal landed
        there) is dropped by Python; `arm()` or the exit raises it again, so it is not printed
        as an error on the way."""
        if not isinstance(info.exc_value, Interrupted):
            self._unraisable(info)

    def _handle(self, signum: int, frame) -> None:
        first = not self.received
        self.received = signum
        if not self.armed and first:
            # the trace's backward runs under anomaly mode, which reports an exception passing
            # through it with the forward's stack: a stop is no error to report
            warnings.filterwarnings("ignore", "Error detected in", UserWarning)
            raise Interrupted(signum)

    def arm(self) -> None:
        """The steps start: from now on a scheduler's signal checkpoints after the step. Raises
        `Interrupted` for a signal that came before and was swallowed on its way up."""
        if self.received:
            raise Interrupted(self.received)
        self.armed = True
        if signal.SIGINT in self._previous:
            signal.signal(signal.SIGINT, self._previous.pop(signal.SIGINT))

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if self._previous and not self.armed and exc is not None and not isinstance(exc, Interrupted):
                self._stop_behind(exc)
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            if self._unraisable is not None:
                sys.unraisablehook = self._unraisable

    def _stop_behind(self, exc: BaseException) -> None:
        """Raise `Interrupted` when a stop is behind `exc`, an error before the steps: a signal
        came (its Interrupted was overtaken: a collective broke as the peers stopped too), or, in
        a torchrun worker, a collective broke because a peer stopped (a signal, a crash) and
        torchrun is about to stop this rank too: its SIGTERM raises Interrupted in the wait. With
        neither, `exc` goes on (after the wait)."""
        if not self.received and isinstance(exc, RuntimeError) and self.PEERS_STOP_US in os.environ:
            time.sleep(self.GRACE_S)
        if self.received:
            raise Interrupted(self.received)
