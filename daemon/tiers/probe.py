"""How much room each tier has, and whether its file system answers, read without ever waiting on it.

``statvfs`` on a network file system that hangs blocks its caller for as long
as the file system does. ``Status``, the metrics scrape and ``ckptstage status``
must answer anyway, so each tier is probed by a thread of its own, and callers
read the last result: a probe that has not come back after ``hung_after_s``
makes the tier read as unreachable until it does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ckptstage.daemon.logs import fields
from ckptstage.daemon.tiers.interface import Tier, Usage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reading:
    free_bytes: int | None  # None until a probe has succeeded, and on storage with no limit
    reachable: bool | None  # None before the first probe came back
    total_bytes: int | None = None  # the size of the tier's storage; None as free_bytes is
    unbounded: bool = False  # the storage sets no limit (an object store): no free or total bytes


class TierProbe:
    """Probes one tier every ``interval_s`` on its own thread; :meth:`reading` never blocks."""

    def __init__(self, name: str, tier: Tier, interval_s: float = 5.0, hung_after_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``tier`` is the tier's storage; the measurement is its :meth:`Tier.usage`."""
        self.name = name
        self.tier = tier
        self._interval = interval_s
        self._hung_after = hung_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._usage: Usage | None = None
        self._ok: bool | None = None
        self._since: float | None = None  # when the probe now running started
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"probe-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()  # a probe stuck in the kernel stays stuck; the thread is a daemon thread

    def reading(self) -> Reading:
        with self._lock:
            hung = self._since is not None and self._clock() - self._since > self._hung_after
            usage, reachable = self._usage, False if hung else self._ok
        if usage is None or usage.unbounded:
            return Reading(None, reachable, None, usage is not None)
        return Reading(usage.free_bytes, reachable, usage.total_bytes)

    def probe(self) -> None:
        """One measurement, on the calling thread (the probe thread, or a test)."""
        with self._lock:
            self._since = self._clock()
        try:
            usage = self.tier.usage()
        except OSError as e:
            with self._lock:
                was, self._ok, self._since = self._ok, False, None
            if was is not False:
                log.warning("%s tier %s cannot be probed: %s", self.name, self.tier.location, e,
                            extra=fields(tier=self.name, error=e))
            return
        with self._lock:
            self._usage, self._ok, self._since = usage, True, None

    def _loop(self) -> None:
        while True:
            self.probe()
            if self._stop.wait(self._interval):
                return
