"""The drain queue: which local parts wait for the shared tier, in what order, and how their drains went.

Order: the newest step of each job first, then the rest oldest first. When
saves arrive faster than the shared file system absorbs them (or after an
outage of the shared tier), the checkpoint a job would restart from after
losing this node is its newest one, so it goes first. The backlog behind it
goes oldest first because that is the order in which local retention frees
space (``keep_last``, ``max_bytes``: oldest drained first): draining the
backlog newest-first would make a full local tier evict the newer checkpoints
and keep the older ones. A part that keeps failing while others succeed
yields its turn, so it cannot block the queue; after any failure no part is
handed out until the tier's backoff (:class:`ckptstage.daemon.tiers.backoff.Backoff`)
has passed.

Health: every failed copy is booked against its job (the error, when, how many
since the job's last successful drain; :meth:`DrainQueue.health_of`), and the tier
counts as degraded while any job's drains fail (:meth:`DrainQueue.tier_health`),
so that ``ckptstage status`` shows a permission error on the shared tier
instead of a tier that answers ``statvfs`` and looks fine.

The janitor, the node's status and the waits of ``SaveHandle.wait("shared")``
read this; the drain workers (:mod:`ckptstage.daemon.drain.drainer`) claim
parts from it and book what became of them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from ckptstage.daemon.catalog.index import Catalog, Checkpoint, Part, TierName
from ckptstage.daemon.config import SharedConfig
from ckptstage.daemon.drain.health import DrainHealth, FailureBook, TierHealth
from ckptstage.daemon.errors import SaveFailed
from ckptstage.daemon.tiers.backoff import Backoff

Key = tuple[str, int, int]  # job, step, rank

# How many drained parts ``wait_part`` remembers after their copies are gone (deleted by retention).
_REMEMBER_DRAINED = 100_000


class DrainQueue:
    """The local parts waiting for the shared tier, those being copied, and what became of the others."""

    def __init__(self, config: SharedConfig, catalog: Catalog, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.catalog = catalog
        self.reachable: bool | None = None  # the shared tier, as the last copy or index found it
        self.stopping = threading.Event()
        self._backoff = Backoff(config.retry_initial_s, config.retry_max_s)
        self._cond = threading.Condition()
        self._parts: dict[Key, Part] = {}      # queued or draining, in the order queued
        self._draining: set[Key] = set()
        self._failed: dict[Key, str] = {}      # permanent failures
        self._attempts: dict[Key, int] = {}    # failed attempts, for the log
        self._strikes: dict[Key, int] = {}     # failed attempts since the last successful drain
        self._latest: dict[str, int] = {}      # newest step queued per job
        self._done: dict[Key, str] = {}        # drained in this daemon's life (-> manifest digest), oldest first
        self._staged: set[Key] = set()         # copied into a replacement that waits for its other ranks
        self._copied: set[Key] = set()         # published on the shared tier, not yet booked (see copied)
        self._settling = 0                     # drains whose Drained event is still being handled
        self._health = FailureBook(clock)
        self._indexed = False

    # --- what the node, retention and the waits ask ----------------------------------

    def enqueue(self, part: Part, off_cadence: bool = False) -> None:
        """Queues a local part for draining, unless it is queued or drained already; ``off_cadence``: also
        a step the ``drain_every`` cadence keeps off the shared tier (a node going away)."""
        key = (part.job, part.step, part.rank)
        if not (off_cadence or self.config.drains(part.step)) or self.on_shared(key) or \
                self.catalog.was_drained(*key):
            return
        with self._cond:
            if key in self._staged:
                return
            if key in self._parts:
                self._parts[key] = part  # a later attempt's part may have replaced the queued one
                return
            self._parts[key] = part
            self._failed.pop(key, None)
            self._latest[part.job] = max(part.step, self._latest.get(part.job, part.step))
            self._cond.notify()

    def forget(self, job: str, step: int, rank: int) -> None:
        """The local part (job, step, rank) was replaced by another attempt's: what was known of the
        old one's drain (done, failed) is not this one's."""
        key = (job, step, rank)
        with self._cond:
            self._done.pop(key, None)
            self._failed.pop(key, None)
            self._staged.discard(key)

    def forget_step(self, job: str, step: int) -> None:
        """The step was deleted: its parts waiting in a replacement here wait for nothing any more."""
        with self._cond:
            self._staged = {k for k in self._staged if k[:2] != (job, step)}
            self._cond.notify_all()

    def drop(self, part: Part, failure: str | None) -> bool:
        """Takes a local part about to be deleted out of the queue; False while it is being copied.

        Retention deletes only drained parts, or stragglers (another attempt's
        parts of a committed step), which must not be copied any more: their
        drain failed, for ``failure``. A user's deletion (``failure`` None) is
        no failure: the part just leaves the queue.
        """
        key = (part.job, part.step, part.rank)
        with self._cond:
            if key in self._draining:
                return False
            if self._parts.pop(key, None) is not None:
                if failure is not None:
                    self._failed[key] = failure
                self._cond.notify_all()
            if not any(k[0] == part.job for k in self._parts):
                self._health.gone(part.job)
            return True

    def health_of(self, names: Iterable[str]) -> dict[str, DrainHealth]:
        """How the drains of each job in ``names`` are going (see :class:`ckptstage.daemon.drain.health.DrainHealth`):
        under one hold of the lock and one pass over the queue, since ``ckptstage jobs``, ``Status`` and
        each metrics scrape ask for every job at once."""
        with self._cond:
            queued: dict[str, list[int]] = {}
            for (job, _, _), part in self._parts.items():
                queued.setdefault(job, []).append(part.nbytes)
            staged = {k[0] for k in self._staged}
            return {job: self._health.job(job, queued.get(job, []), job in staged) for job in names}

    def tier_health(self) -> TierHealth:
        """Degraded while a job's drains fail (since its last success) or the tier cannot be indexed."""
        with self._cond:
            return self._health.tier()

    def pending(self) -> tuple[int, int]:
        with self._cond:
            return len(self._parts), sum(p.nbytes for p in self._parts.values())

    def lag_s(self) -> float:
        with self._cond:
            oldest = min((p.created for p in self._parts.values()), default=None)
        return max(0.0, time.time() - oldest) if oldest is not None else 0.0

    def busy_with(self, part: Part) -> bool:
        with self._cond:
            return (part.job, part.step, part.rank) in self._draining

    def drained(self, job: str, step: int, rank: int) -> bool:
        """Whether the part has been committed on the shared tier (even if retention deleted it since)."""
        key = (job, step, rank)
        with self._cond:
            if self._done_now(key):
                return True
        return self.on_shared(key) or self.catalog.was_drained(*key)

    def checkpoint_state(self, ckpt: Checkpoint) -> str:
        if not self.config.drains(ckpt.step) and not ckpt.ranks_on(TierName.SHARED):
            return "local-only"
        keys = [(ckpt.job, ckpt.step, r) for r in ckpt.ranks_on(TierName.LOCAL)]
        with self._cond:
            if any(k in self._failed for k in keys):
                return "failed"
            if any(k in self._draining or k in self._staged for k in keys):
                return "draining"
            if any(k in self._parts for k in keys):
                return "pending"
        return "drained"

    def wait_part(self, job: str, step: int, rank: int, timeout: float) -> bool:
        """True once the part is on the shared tier; raises if it never can be."""
        key = (job, step, rank)
        with self._cond:
            queued = key in self._parts or key in self._staged
        if not self.config.drains(step) and not queued and not self.drained(job, step, rank):
            raise SaveFailed(self.config.why_not_drained(step))
        with self._cond:
            # The daemon stopping ends the wait too (stop() notifies): its thread must not hold the exit.
            self._cond.wait_for(lambda: self._done_now(key) or key in self._failed or
                                (key not in self._parts and key not in self._staged) or self.stopping.is_set(),
                                timeout)
            if self._done_now(key) or self.on_shared(key) or self.catalog.was_drained(*key):
                return True
            if key in self._failed:
                raise SaveFailed(f"draining {job} step {step} rank {rank} failed: {self._failed[key]}")
            if key not in self._parts and key not in self._staged:
                raise SaveFailed(f"{job} step {step} rank {rank} is neither queued for draining nor on the "
                                 "shared tier (deleted before it drained?)")
            return False

    def wait_idle(self, job: str | None, timeout: float) -> tuple[int, int]:
        """Waits until nothing (of ``job``) is queued and the retention that finished drains trigger has run
        (so what a caller sees next is the drain's whole outcome); returns (still pending, failed)."""
        def counts() -> tuple[int, int]:
            mine = [k for k in self._parts if job in (None, k[0])]
            failed = [k for k in self._failed if job in (None, k[0])]
            return len(mine), len(failed)

        with self._cond:
            self._cond.wait_for(lambda: counts()[0] == 0 and self._settling == 0 or self.stopping.is_set(), timeout)
            return counts()

    def on_shared(self, key: Key) -> bool:
        """Whether the local part ``key`` has its copy on the shared tier (the same attempt's part)."""
        tiers = self.catalog.parts_of(*key)
        local, shared = tiers.get(TierName.LOCAL), tiers.get(TierName.SHARED)
        return shared is not None and (local is None or local.digest == shared.digest)

    # --- what the drain workers book -------------------------------------------------------

    def stop(self) -> None:
        """Ends every wait: the workers', ``wait_part``'s and ``wait_idle``'s."""
        self.stopping.set()
        with self._cond:
            self._cond.notify_all()

    def indexed(self) -> None:
        """The shared tier is indexed: copies may start."""
        with self._cond:
            self._indexed = True
            self._cond.notify_all()  # the workers wait for the index

    def is_indexed(self) -> bool:
        return self._indexed

    def set_tier_error(self, error: str | None) -> None:
        """The shared tier cannot be indexed or re-read (``error``), or can again (None)."""
        with self._cond:
            self._health.set_tier_error(error)

    def claim(self) -> tuple[Key, Part] | None:
        """Blocks until a part may be copied (queued, not being copied, backoff over); claims it. None: the
        drain stops."""
        with self._cond:
            while not self.stopping.is_set():
                if not self._indexed:
                    self._cond.wait(1.0)  # indexed() notifies
                    continue
                wait = self._backoff.remaining()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                ready = [k for k in self._parts if k not in self._draining]
                if ready:
                    key = min(ready, key=self._order)
                    self._draining.add(key)
                    return key, self._parts[key]
                self._cond.wait()
            return None

    def release(self, key: Key) -> None:
        """The copy of ``key`` ended without an outcome (the drain stops, or a replacement took the part's
        place): it stays queued as it is."""
        with self._cond:
            self._draining.discard(key)
            self._cond.notify_all()

    def copied(self, key: Key) -> bool:
        """Books that the part ``key`` is published on the shared tier; True when no other part of its step is
        queued or in copy here: this node's share of the step is there, and it looks once whether every node's
        is. Of two workers publishing a step's last two parts at once, the later under the lock sees True."""
        step = key[:2]
        with self._cond:
            self._copied.add(key)
            return all(k in self._copied for k in self._parts if k[:2] == step)

    def superseded(self, key: Key, part: Part) -> bool:
        """Whether another local part (a replacement) took ``part``'s place in the queue since it was claimed."""
        with self._cond:
            queued = self._parts.get(key)
        return queued is not None and queued is not part

    def failed(self, key: Key, part: Part, error: Exception) -> tuple[int, float]:
        """Books a copy that may work later; returns (the part's failed attempts, the tier's backoff delay)."""
        with self._cond:
            attempt = self._attempts[key] = self._attempts.get(key, 0) + 1
            self._strikes[key] = self._strikes.get(key, 0) + 1
            delay = self._backoff.failed()
            self._draining.discard(key)
            self._copied.discard(key)
            self._health.failed(part.job, str(error), permanent=False)
            self._cond.notify_all()
        self.reachable = False
        return attempt, delay

    def give_up(self, key: Key, reason: str) -> None:
        """Books a copy that can never work: the part leaves the queue, and its waiters get ``reason``."""
        with self._cond:
            self._draining.discard(key)
            self._parts.pop(key, None)
            self._strikes.pop(key, None)
            self._failed[key] = reason
            self._health.failed(key[0], reason, permanent=True)
            self._cond.notify_all()

    def finished(self, key: Key, part: Part, published: bool, drained: list[Part]) -> None:
        """Books a successful copy: ``drained`` are the shared copies that count as their local part's drain;
        none ``published``: the part waits in a replacement for its other ranks. While ``drained`` is not
        empty, :meth:`wait_idle` waits for :meth:`settled`."""
        with self._cond:
            self._draining.discard(key)
            self._copied.discard(key)
            if self._parts.get(key) is part:
                self._parts.pop(key)
                self._attempts.pop(key, None)
                if not published:
                    self._staged.add(key)  # done once the replacement's other ranks are there
            self._strikes.clear()  # the tier works: every part gets its turn in order again
            self._backoff.succeeded()
            self._health.succeeded(part.job)  # the job's drains, and the tier, work again
            for shared in drained:
                done = (shared.job, shared.step, shared.rank)
                self._staged.discard(done)
                self._done[done] = shared.digest
            while len(self._done) > _REMEMBER_DRAINED:
                del self._done[next(iter(self._done))]
            if drained:
                self._settling += 1
            self._cond.notify_all()

    def settled(self) -> None:
        """What follows a drain (the retention it allows) has run: the drain counts as finished."""
        with self._cond:
            self._settling -= 1
            self._cond.notify_all()

    def _order(self, key: Key) -> tuple[int, int, int]:
        """Sort key of the drain order (see the module docstring): fewest recent failures, then
        the job's newest step, then the oldest steps."""
        job, step, _ = key
        newest = step >= self._latest.get(job, step)
        return self._strikes.get(key, 0), 0 if newest else 1, -step if newest else step

    def _done_now(self, key: Key) -> bool:
        """Whether this daemon drained the local part ``key`` that is there now (not one it replaced)."""
        digest = self._done.get(key)
        if digest is None:
            return False
        local = self.catalog.parts_of(*key).get(TierName.LOCAL)
        return local is None or local.digest == digest