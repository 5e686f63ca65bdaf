"""Exponential backoff of a tier that fails: when its next operation may start, and a retry loop over it.

The delay after a failure is ``initial_s`` doubled for each failure since the
tier last worked, at most ``max_s``. The backoff is the tier's, not each
operation's: such failures are its storage's (permission denied, no space, a
file system gone), so after one no new operation starts until the delay has
passed (:meth:`Backoff.remaining`), and the first success resets it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Backoff:
    """The backoff of one tier. Not locked: its owner calls it under its own lock (the drain queue's)."""

    def __init__(self, initial_s: float, max_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self._clock = clock
        self._failures = 0   # since the last success
        self._gate = 0.0     # clock time before which no operation starts

    def failed(self) -> float:
        """Books a failure; returns the delay before the next operation may start."""
        self._failures += 1
        delay = min(self.max_s, self.initial_s * 2 ** min(self._failures - 1, 32))
        self._gate = max(self._gate, self._clock() + delay)
        return delay

    def succeeded(self) -> None:
        """The tier works: the next failure waits ``initial_s`` again, and nothing waits now."""
        self._failures = 0
        self._gate = 0.0

    def remaining(self) -> float:
        """Seconds before the next operation may start (0 or less: now)."""
        return self._gate - self._clock()


def retry(attempt: Callable[[], bool], initial_s: float, max_s: float, stop: threading.Event) -> bool:
    """Calls ``attempt`` until it returns True, waiting the backoff's delay after each False; returns False
    when ``stop`` is set while it waits."""
    backoff = Backoff(initial_s, max_s)
    while not attempt():
        if stop.wait(backoff.failed()):
            return False
    return True
