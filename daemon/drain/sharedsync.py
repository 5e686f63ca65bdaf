"""Keeping this daemon's view of the shared tier fresh, without ever waiting long on it.

Every node's daemon drains its ranks to the one shared tier and writes commit
records there, so what one daemon answers about a job (list, latest, Locate,
prefetch, a step wait) depends on what other daemons wrote. This module
bounds how stale that view can be:

* **On demand.** A request that names a job calls :meth:`SharedSync.fresh`:
  when the job was last re-read more than ``max_age_s`` ago, a re-read
  starts (one at a time per job, on a thread of its own) and the request
  waits for it at most ``wait_s`` past the moment that re-read began. A
  shared file system that hangs therefore costs the first request ``wait_s``
  once, and the ones after it nothing: they answer from the index.
* **Periodically.** A discovery thread lists the tier's job directories
  every ``interval_s`` and re-reads jobs it has never seen and jobs asked
  about recently, so a daemon that never saw a job (a fresh node, a restart
  on another node) learns of it and of steps committed after it started.

With the defaults (1 s, 0.75 s) an answer reflects the shared tier as it was
at most about 1-2 s before. Nothing on the local commit path calls this.

What a re-read costs the shared tier: a job's is one listing of the job and
one of each step; a part is read only where the step's commit record names
it (from the record: one file per step, never one per part) or where this
daemon asked for that one step by name. A step wait's re-read is one listing
of the step until its record appears. So N daemons watching a job of W ranks
cost the tier O(steps) listings a second each, whatever W is, and other
nodes' parts of a step still draining are never read by every node.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ckptstage.daemon.catalog.index import Catalog, TierName
from ckptstage.daemon.logs import fields
from ckptstage.daemon.tiers.interface import Tier

log = logging.getLogger(__name__)

# How deep a re-read goes: the commit records (and the parts they name), or also the parts of steps not
# committed yet (other nodes' drains under way: what a listing of the job shows, what deleting a step needs).
RECORDS, EVERYTHING = 0, 1
Key = tuple[str, int | None, int]  # job; one step or None for the whole job; RECORDS or EVERYTHING


@dataclass
class _Sync:
    started: float
    done: threading.Event


class SharedSync:
    def __init__(self, catalog: Catalog, shared: Tier, max_age_s: float = 1.0, wait_s: float = 0.75,
                 interval_s: float = 1.0, watch_s: float = 60.0, max_threads: int = 8,
                 watched: Callable[[], set[str]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.catalog = catalog
        self.shared = shared
        self.max_age_s = max_age_s
        self.wait_s = wait_s
        self.interval_s = interval_s
        self.watch_s = watch_s
        self.max_threads = max_threads
        self._watched = watched or set
        self._clock = clock
        self._lock = threading.Lock()
        self._synced: dict[Key, float] = {}   # when the last successful re-read of a key began
        self._running: dict[Key, _Sync] = {}
        self._asked: dict[str, float] = {}    # job -> when a request last named it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._discover, name="shared-discovery", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def fresh(self, job: str, step: int | None = None, max_age_s: float | None = None,
              wait_s: float | None = None, depth: int = EVERYTHING) -> bool:
        """Brings the index of ``job`` (or of one step) to at most ``max_age_s`` behind the shared tier,
        waiting at most ``wait_s`` from when that re-read began; True when it is, False when it did not
        answer in time (the caller answers from the index). ``depth`` :data:`RECORDS`: what a reader of
        complete steps needs (see :meth:`Catalog.sync_record` and ``sync_job(uncommitted=False)``)."""
        max_age = self.max_age_s if max_age_s is None else max_age_s
        wait = self.wait_s if wait_s is None else min(wait_s, self.wait_s)
        key = (job, step, depth)
        now = self._clock()
        with self._lock:
            self._asked[job] = now
            if now - self._last(key) <= max_age:
                return True
        sync = self._kick(key)
        if sync is None:
            return False
        return sync.done.wait(max(0.0, min(sync.started + self.wait_s, now + wait) - self._clock())) and \
            self._clock() - self._last(key) <= max_age + self.wait_s

    def _last(self, key: Key) -> float:
        """When the newest re-read that answers ``key`` began: of the whole job or of that step, at least as
        deep."""
        job, step, depth = key
        return max((self._synced.get((job, s, d), float("-inf")) for s in {None, step}
                    for d in (RECORDS, EVERYTHING) if d >= depth), default=float("-inf"))

    def _kick(self, key: Key) -> _Sync | None:
        """Starts a re-read of ``key`` unless one runs; returns the one running (None: too many hang)."""
        with self._lock:
            running = self._running.get(key)
            if running is not None:
                return running
            if len(self._running) >= self.max_threads:
                return None  # that many re-reads stuck: the tier hangs; answer from the index
            sync = self._running[key] = _Sync(self._clock(), threading.Event())
        threading.Thread(target=self._run, args=(key, sync), name="shared-sync", daemon=True).start()
        return sync

    def _run(self, key: Key, sync: _Sync) -> None:
        job, step, depth = key
        try:
            if step is not None and depth == RECORDS:
                added, dropped = self.catalog.sync_record(TierName.SHARED, self.shared, job, step)
            else:
                added, dropped = self.catalog.sync_job(TierName.SHARED, self.shared, job, step,
                                                       uncommitted=depth == EVERYTHING)
            if added or dropped:
                log.debug("shared tier: %s%s: %d parts appeared, %d vanished", job,
                          "" if step is None else f" step {step}", added, dropped,
                          extra=fields(job=job, step=step, tier=TierName.SHARED))
            with self._lock:
                self._synced[key] = max(self._synced.get(key, float("-inf")), sync.started)
                if step is None:  # the whole job re-read: its older one-step re-reads say nothing more
                    for old in [k for k, t in self._synced.items() if k[0] == job and k[1] is not None
                                and k[2] <= depth and t <= sync.started]:
                        del self._synced[old]
        except OSError as e:
            log.warning("cannot re-read %s on the shared tier %s: %s", job, self.shared.location, e,
                        extra=fields(job=job, step=step, tier=TierName.SHARED, error=e))
        except Exception:  # noqa: BLE001 - a re-read must always settle, or its key would stay "running"
            log.exception("re-reading %s on the shared tier failed", job, extra=fields(job=job, tier=TierName.SHARED))
        finally:
            with self._lock:
                self._running.pop(key, None)
            sync.done.set()

    def _discover(self) -> None:
        """Every ``interval_s``: re-read jobs that appeared on the tier and jobs asked about lately."""
        while not self._stop.wait(self.interval_s):
            try:
                known = set(self.catalog.jobs())
                on_tier = set(self.shared.list_jobs())  # may hang: only this thread waits
                now = self._clock()
                with self._lock:
                    asked = {j for j, t in self._asked.items() if now - t <= self.watch_s}
                    for j in [j for j, t in self._asked.items() if now - t > self.watch_s]:
                        del self._asked[j]
                for job in sorted((on_tier - known) | ((asked | self._watched()) & on_tier)):
                    self._kick((job, None, RECORDS))
            except OSError as e:
                log.debug("shared tier discovery: %s", e, extra=fields(tier=TierName.SHARED, error=e))
            except Exception:  # noqa: BLE001 - the thread must outlive one bad pass
                log.exception("shared tier discovery pass failed", extra=fields(tier=TierName.SHARED))
