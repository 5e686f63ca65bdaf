"""Retention passes after commits and drains, coalesced: at most one running and one waiting per job and tier.

Every rank's commit, and every part's drain, asks for a pass over its job's
steps. A node of hundreds of ranks commits hundreds of parts of one step
within a second; run one after another, those passes each plan over the
whole job and queue behind the janitor's lock, and the last rank's save is
booked seconds late. A pass that has not started yet sees everything
committed before it starts, so a request that finds one waiting adds
nothing: it returns at once. A request that finds one running waits and
runs after it (the running one may have planned before its commit).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable


class PassGate:
    """Runs ``run()`` for a key unless a run of the same key is already waiting to start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._running: set[Hashable] = set()
        self._waiting: set[Hashable] = set()

    def run(self, key: Hashable, run: Callable[[], object]) -> bool:
        """Runs ``run`` (after the key's running pass, if any); False when a waiting pass stands in for it."""
        with self._lock:
            if key in self._waiting:
                return False
            if key in self._running:
                self._waiting.add(key)
                while key in self._running:
                    self._done.wait()
                self._waiting.discard(key)
            self._running.add(key)
        try:
            run()
        finally:
            with self._lock:
                self._running.discard(key)
                self._done.notify_all()
        return True
