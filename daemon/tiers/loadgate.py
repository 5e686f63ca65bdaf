"""A gate background copies pass through: closed while a checkpoint is being loaded on this node.

A restore is what a restarted job waits on; a drain, a replica sent to a
peer or a repack can wait. Each load holds a *lease* (taken by the reader
when it starts, renewed while it reads, ended when it is done, and expiring
on its own when the reader dies). A background writer takes the gate's
tokens before each slice it writes, at the same seam as the rate limiter
(:class:`~ckptstage.daemon.tiers.limiter.LimitedTier`), and waits while any
lease is held: its reads of the local disk stop with its writes, since each
copy reads only a piece ahead of what it wrote.

A node that loads without a pause must still drain: one *episode* (from the
first lease taken while none was held to the last one ending) holds
background copies back at most ``max_pause_s``; past that they go on, and
the episode is logged once. ``max_pause_s = 0`` never holds them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ckptstage.daemon.errors import InvalidRequest

log = logging.getLogger(__name__)

MAX_LEASE_CHARS = 128
MAX_TTL_S = 600.0


class LoadGate:
    """Leases of the loads in flight on this node; :meth:`acquire` is the pacer background writers call."""

    def __init__(self, max_pause_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_pause_s = max_pause_s
        self._clock = clock
        self._cond = threading.Condition()
        self._leases: dict[str, float] = {}  # lease -> when it expires (clock)
        self._episode: float | None = None   # when the leases held now began to be held
        self._overdue_logged = False
        self._open = max_pause_s <= 0        # open for good: never holds anything back
        self._waited_s = 0.0                 # by writers done waiting
        self._waiting: dict[int, float] = {} # writer (thread id) -> since when it waits
        self._began = 0                      # leases taken, renewals not counted

    # --- the readers' side -------------------------------------------------------------

    def announce(self, lease: str, ttl_s: float, done: bool) -> None:
        """What a reader says on the wire: :meth:`hold` (``ttl_s`` in (0, 600]) or, ``done``, :meth:`release`.
        A lease is 1 to 128 characters; anything else is refused (InvalidRequest) naming it."""
        if not lease or len(lease) > MAX_LEASE_CHARS:
            raise InvalidRequest(f"a load's lease must be 1 to {MAX_LEASE_CHARS} characters, not {len(lease)}")
        if done:
            self.release(lease)
        elif not 0 < ttl_s <= MAX_TTL_S:
            raise InvalidRequest(f"a load's ttl_s must be in (0, {MAX_TTL_S:g}] seconds, not {ttl_s!r}")
        else:
            self.hold(lease, ttl_s)

    def hold(self, lease: str, ttl_s: float) -> None:
        """Takes (or renews) ``lease`` for ``ttl_s`` seconds from now."""
        with self._cond:
            now = self._clock()
            self._expire(now)
            if not self._leases:
                self._episode, self._overdue_logged = now, False
            if lease not in self._leases:
                self._began += 1
            self._leases[lease] = now + ttl_s

    def release(self, lease: str) -> None:
        """Ends ``lease`` (unknown or expired: nothing to do); the last one opens the gate."""
        with self._cond:
            self._leases.pop(lease, None)
            self._expire(self._clock())
            self._cond.notify_all()

    def open_for_good(self) -> None:
        """From now on nothing waits (the daemon is stopping: the last drain goes before any load)."""
        with self._cond:
            self._open = True
            self._cond.notify_all()

    # --- what is measured --------------------------------------------------------------

    def loads(self) -> int:
        """The leases held now."""
        with self._cond:
            self._expire(self._clock())
            return len(self._leases)

    def began(self) -> int:
        """Loads announced since the daemon started."""
        with self._cond:
            return self._began

    def waited_s(self) -> float:
        """Seconds background writers have spent waiting here, summed over them (those waiting now too)."""
        with self._cond:
            now = self._clock()
            return self._waited_s + sum(now - since for since in self._waiting.values())

    # --- the background writers' side --------------------------------------------------

    def acquire(self, nbytes: int) -> None:
        """Returns once no load is in flight, the episode has held writers back ``max_pause_s``, or the gate is
        open for good. ``nbytes`` (what the caller is about to write) does not matter here: any write waits."""
        with self._cond:
            me = threading.get_ident()
            while not self._open:
                now = self._clock()
                self._expire(now)
                if not self._leases or self._episode is None:
                    break
                left = self._episode + self.max_pause_s - now
                if left <= 0:
                    if not self._overdue_logged:
                        self._overdue_logged = True
                        log.warning("loads have been in flight for %.0f s: background copies go on beside them "
                                    "([persist] yield_to_loads_s = %g)", now - self._episode, self.max_pause_s)
                    break
                self._waiting.setdefault(me, now)
                self._cond.wait(min(left, min(self._leases.values()) - now))
            started = self._waiting.pop(me, None)
            if started is not None:
                self._waited_s += self._clock() - started

    def _expire(self, now: float) -> None:
        for lease in [k for k, until in self._leases.items() if until <= now]:
            del self._leases[lease]
        if not self._leases:
            self._episode = None
