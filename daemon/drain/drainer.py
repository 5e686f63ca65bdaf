"""Local tier -> shared tier, in the background, bounded, rate-limited, retried and verified.

Order: the newest step of each job first, then the rest oldest first. When
saves arrive faster than the shared file system absorbs them (or after an
outage of the shared tier), the checkpoint a job would restart from after
losing this node is its newest one, so it goes first. The backlog behind it
goes oldest first because that is the order in which local retention frees
space (``keep_last``, ``max_bytes``: oldest drained first): draining the
backlog newest-first would make a full local tier evict the newer checkpoints
and keep the older ones. Nothing leaves the local tier before its shared copy is committed
(retention sees undrained parts as protected), so a backlog costs local disk,
never a checkpoint; ``ckptstage_drain_queue_*`` and ``ckptstage_drain_lag_seconds``
make it visible. Older parts are still drained, even when the shared tier's
rules will delete them at once: the invariant is that a part leaves the local
tier only once it was committed on the shared tier, and the drainer does not
second-guess retention.

Each copy reads every source chunk once, checks it against the local
manifest's checksum, writes it under the shared tier's ``.tmp/<node>/`` and
publishes with the same commit protocol as the local tier.

Failures: an ``OSError`` on the shared tier (permission denied, no space,
directory gone) is retried with exponential backoff, forever, at most
``retry_max_s`` apart; the local copy stays meanwhile. The backoff is the
tier's, not each part's: such failures are the file system's, so after one,
no new copy starts until the delay has passed, and the first success resets
it. The order above then resumes where it was (a part that keeps failing
while others succeed yields its turn, so it cannot block the queue). A local copy that fails
its own checksums, or a different part already published under the same name
on the shared tier, is a permanent failure: retrying cannot fix it, and
``SaveHandle.wait("shared")`` raises.

Health: every failed copy is booked against its job (the error, when, how many
since the job's last successful drain; :meth:`Drainer.health`), and the tier
counts as degraded while any job's drains fail (:meth:`Drainer.tier_health`),
so that ``ckptstage status`` shows a permission error on the shared tier
instead of a tier that answers ``statvfs`` and looks fine.
"""

from __future__ import annotations

import errno
import logging
import mmap
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ckptstage.daemon import fsutil
from ckptstage.daemon.catalog import overwrite
from ckptstage.daemon.drain import health
from ckptstage.daemon.catalog.index import Catalog, Checkpoint, Part, TierName
from ckptstage.daemon.catalog.chunkstore import ChunkStore
from ckptstage.daemon.catalog.commits import Commits
from ckptstage.daemon.config import SharedConfig
from ckptstage.daemon.errors import SaveFailed, ShuttingDown
from ckptstage.daemon.events import Bus
from ckptstage.daemon.drain.health import DrainHealth, TierHealth
from ckptstage.daemon.logs import fields
from ckptstage.daemon.metrics import Metrics
from ckptstage.daemon.tiers.interface import ChunkBatch, Manifest, PartWriter, Tier
from ckptstage.protos import chunks, layout

log = logging.getLogger(__name__)

Key = tuple[str, int, int]  # job, step, rank


class RateLimiter:
    """A token bucket shared by the drain workers (``[shared] max_bandwidth``).

    ``acquire(n)`` takes ``n`` tokens, going into debt when there are too few
    and sleeping the debt off, so concurrent workers share the rate. The
    bucket holds ``burst_s`` seconds of tokens, or one request if that is
    more: the time a worker spent reading and writing its last chunk must
    count towards the next one (with a 10 MiB bucket and 64 MiB chunks, every
    chunk paid its I/O time on top of n / rate, and a 200 MiB/s cap drained
    at 116-146 MiB/s).
    """

    def __init__(self, rate: int | None, burst_s: float = 0.05,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], object] = time.sleep) -> None:
        self.rate = rate
        self._burst = (rate or 0) * burst_s
        self._tokens = self._burst
        self._clock, self._sleep = clock, sleep
        self._last = clock()
        self._lock = threading.Lock()

    def acquire(self, n: int) -> None:
        if not self.rate:
            return
        with self._lock:
            now = self._clock()
            # The bucket holds at least one request: tokens earned while the
            # previous chunk was read and written count towards this one, else
            # every request would pay its I/O time on top of n / rate.
            self._tokens = min(max(self._burst, n), self._tokens + (now - self._last) * self.rate) - n
            self._last = now
            debt = -self._tokens
        if debt > 0:
            self._sleep(debt / self.rate)


class CorruptSource(Exception):
    """The local copy fails its own manifest: draining it would spread corruption."""


class Conflict(Exception):
    """A different part is already committed under the same name on the target tier."""


class _Stopping(Exception):
    """The drainer is stopping; the copy is abandoned (its temporary removed) and resumes on restart."""


@dataclass
class _Failures:
    """A job's failed copies since its last successful drain."""

    count: int = 0
    error: str = ""
    when: float = 0.0       # unix seconds
    gave_up: bool = False   # one of them was permanent (see the module docstring)


def _created(manifest: dict[str, object]) -> float:
    value = manifest.get("created", 0.0)
    return float(value) if isinstance(value, (int, float)) else 0.0


# Chunks of an incremental part copied at once (each one read, checked against its name, written).
_CHUNK_COPIERS = 4
# Bytes the drainer reads, checks and writes at a time (whole digest blocks).
_PIECE_BYTES = 64 << 20
# How many drained parts ``wait_part`` remembers after their copies are gone (deleted by retention).
_REMEMBER_DRAINED = 100_000


@dataclass(frozen=True)
class Drained:
    """A local part is committed on the shared tier (``part``: the shared copy) and marked drained.

    Handled before the drain counts as finished (:meth:`Drainer.wait_idle`): whoever waits for that sees
    what the handlers did (the retention the drain allows)."""

    part: Part


@dataclass(frozen=True)
class CorruptCopy:
    """The local copy ``part`` fails its own checksums (``detail``): its drain is given up."""

    part: Part
    detail: str


@dataclass(frozen=True)
class Indexed:
    """The shared tier is indexed (at start, or once it answered), and the commit records a crash kept
    from being written are written: the shared tier's rules may run."""


class Drainer:
    def __init__(self, config: SharedConfig, catalog: Catalog, metrics: Metrics, commits: Commits, events: Bus,
                 chunk_stores: dict[TierName, ChunkStore] | None = None, nice: int = 0,
                 clock: Callable[[], float] = time.time, *, tiers: Mapping[TierName, Tier]) -> None:
        """``tiers``: the local and shared tiers' storage. ``commits`` writes the shared tier's commit records as
        parts arrive there, and swaps replacements in; ``events`` is where :class:`Drained`, :class:`CorruptCopy` and :class:`Indexed` are
        published."""
        self.tiers = dict(tiers)
        self.shared = self.tiers[TierName.SHARED]
        self._clock = clock  # wall time of failures (what operators read)
        self._chunk_stores = chunk_stores or {}  # where incremental parts' chunks land, per destination tier
        self._nice = nice  # added to the drain threads' niceness ([persist] nice)
        self.config = config
        self.shared_location = self.shared.location  # what the log names
        self.catalog = catalog
        self.metrics = metrics
        self.reachable: bool | None = None
        self._commits = commits
        self._events = events
        self._stop = threading.Event()
        self._limiter = RateLimiter(config.max_bandwidth, sleep=self._stop.wait)
        self._cond = threading.Condition()
        self._parts: dict[Key, Part] = {}      # queued or draining, in the order queued
        self._draining: set[Key] = set()
        self._failed: dict[Key, str] = {}      # permanent failures
        self._attempts: dict[Key, int] = {}    # failed attempts, for the log
        self._strikes: dict[Key, int] = {}     # failed attempts since the last successful drain
        self._latest: dict[str, int] = {}      # newest step queued per job
        self._gate = 0.0                       # monotonic time before which no copy starts (backoff)
        self._tier_failures = 0                # failed attempts since the last success
        self._done: dict[Key, str] = {}       # drained in this daemon's life (-> manifest digest), oldest first
        self._staged: set[Key] = set()         # copied into a replacement that waits for its other ranks
        self._settling = 0                     # drains whose Drained event is still being handled
        self._health: dict[str, _Failures] = {}  # per job, since its last successful drain
        self._tier_error: tuple[str, float] | None = None  # the shared tier cannot be indexed / re-read
        self._shared_indexed = False
        self._threads: list[threading.Thread] = []

    # --- life cycle -----------------------------------------------------------------

    def recover(self) -> None:
        """Cleans this node's shared temporaries and indexes the shared tier, retrying until it answers.

        Runs on a thread of its own (see :meth:`start`): the daemon serves
        meanwhile, and copies start only once the tier is indexed. Then queues
        what is missing there, writes the commit records a crash kept from being
        written, and publishes :class:`Indexed`.
        """
        delay = self.config.retry_initial_s
        while not self._index_shared(clean=True):
            if self._stop.wait(delay):
                return
            delay = min(self.config.retry_max_s, delay * 2)
        self.requeue()
        with self._cond:
            self._cond.notify_all()  # the workers wait for the index
        try:
            self._commits.seal_all(TierName.SHARED)
        except (OSError, layout.ManifestError) as e:
            log.warning("cannot complete the shared tier's commit records: %s", e,
                        extra=fields(tier=TierName.SHARED, error=e))
        self._events.publish(Indexed())

    def refresh(self) -> None:
        """Brings the index of the shared tier up to date (run by the node's shared-tier timer).

        Re-reads the directories of the jobs this daemon knows, where other
        nodes add their ranks and delete steps, then queues any local part
        that is neither drained nor queued. Before the tier was first indexed
        it does nothing: :meth:`recover` is still retrying.
        """
        if self._shared_indexed:
            failed = False
            for job in self.catalog.jobs():
                try:
                    added, dropped = self.catalog.sync_job(TierName.SHARED, self.shared, job)
                except OSError as e:
                    self.reachable = False
                    failed = True
                    self._set_tier_error(f"cannot re-read {job} on the shared tier {self.shared_location}: {e}")
                    log.warning("cannot re-read %s on the shared tier %s: %s", job, self.shared_location, e,
                                extra=fields(job=job, tier=TierName.SHARED, error=e))
                    continue
                if added or dropped:
                    log.debug("shared tier: %s: %d parts appeared, %d vanished", job, added, dropped,
                              extra=fields(job=job, tier=TierName.SHARED))
            if not failed:
                self._set_tier_error(None)
        self.requeue()

    def requeue(self) -> None:
        """Queues every local part not yet drained (a no-op for those already queued)."""
        for part in self.catalog.all_parts(TierName.LOCAL):
            self.enqueue(part)

    def _index_shared(self, clean: bool) -> bool:
        try:
            self.shared.prepare()
            if clean:
                self.shared.recover_staged()  # before the temporaries go
            removed = self.shared.clean_temporaries() if clean else 0
            n = self.catalog.load_tier(TierName.SHARED, self.shared)
        except OSError as e:
            self.reachable = False
            self._set_tier_error(f"cannot index the shared tier {self.shared_location}: {e}")
            log.error("shared tier %s unreachable: %s (draining will retry)", self.shared_location, e,
                      extra=fields(tier=TierName.SHARED, error=e))
            return False
        self._shared_indexed = True
        self.reachable = True
        self._set_tier_error(None)
        log.info("shared tier %s: %d committed parts, %d temporaries removed", self.shared_location, n, removed,
                 extra=fields(tier=TierName.SHARED, parts=n, temporaries_removed=removed))
        return True

    def start(self) -> None:
        """Indexes the shared tier on a thread of its own (see :meth:`recover`) and starts the copy workers."""
        t = threading.Thread(target=self._recover_in_background, name="drain-index", daemon=True)
        t.start()
        self._threads.append(t)
        for i in range(self.config.max_concurrent):
            t = threading.Thread(target=self._work, name=f"drain-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    # --- queue -------------------------------------------------------------------------

    def enqueue(self, part: Part, off_cadence: bool = False) -> None:
        """Queues a local part for draining, unless it is queued or drained already; ``off_cadence``: also
        a step the ``drain_every`` cadence keeps off the shared tier (a node going away)."""
        key = (part.job, part.step, part.rank)
        if not (off_cadence or self.config.drains(part.step)) or self._on_shared(key) or \
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
            health = self._health.get(part.job)
            if health is not None and not health.gave_up and not self._queued(part.job):
                del self._health[part.job]  # what kept failing is gone: nothing of the job waits for the tier
            return True

    def health_of(self, names: Iterable[str]) -> dict[str, DrainHealth]:
        """How the drains of each job in ``names`` are going (see :class:`ckptstage.daemon.drain.health.DrainHealth`):
        under one hold of the lock and one pass over the queue, since ``ckptstage jobs``, ``Status`` and
        each metrics scrape ask for every job at once."""
        with self._cond:
            queued: dict[str, list[Part]] = {}
            for (job, _, _), part in self._parts.items():
                queued.setdefault(job, []).append(part)
            staged = {k[0] for k in self._staged}
            out = {}
            for job in names:
                waiting = queued.get(job, [])
                failures = self._health.get(job) or _Failures()
                if failures.gave_up:
                    state = health.FAILED
                elif failures.count and waiting:
                    state = health.RETRYING
                elif waiting or job in staged:
                    state = health.DRAINING
                else:
                    state = health.IDLE
                out[job] = DrainHealth(state, len(waiting), sum(p.nbytes for p in waiting), failures.error,
                                       failures.when, failures.count)
            return out

    def tier_health(self) -> TierHealth:
        """Degraded while a job's drains fail (since its last success) or the tier cannot be indexed."""
        with self._cond:
            errors = [(f.when, f.error) for f in self._health.values() if f.count]
            if self._tier_error is not None:
                errors.append((self._tier_error[1], self._tier_error[0]))
        if not errors:
            return TierHealth(False)
        when, error = max(errors)
        return TierHealth(True, error, when)

    def _queued(self, job: str) -> list[Part]:
        return [p for k, p in self._parts.items() if k[0] == job]

    def _set_tier_error(self, error: str | None) -> None:
        with self._cond:
            self._tier_error = None if error is None else (error, self._clock())

    def _book_failure(self, job: str, error: str, permanent: bool) -> None:
        """Called under ``_cond``: one more failed copy of ``job``'s since its last success."""
        failures = self._health.setdefault(job, _Failures())
        failures.count += 1
        failures.error = error
        failures.when = self._clock()
        failures.gave_up = failures.gave_up or permanent

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
        return self._on_shared(key) or self.catalog.was_drained(*key)

    def _done_now(self, key: Key) -> bool:
        """Whether this daemon drained the local part ``key`` that is there now (not one it replaced)."""
        digest = self._done.get(key)
        if digest is None:
            return False
        local = self.catalog.parts_of(*key).get(TierName.LOCAL)
        return local is None or local.digest == digest

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
            raise SaveFailed(self.not_drained(step))
        with self._cond:
            # The daemon stopping ends the wait too (stop() notifies): its thread must not hold the exit.
            self._cond.wait_for(lambda: self._done_now(key) or key in self._failed or
                                (key not in self._parts and key not in self._staged) or self._stop.is_set(), timeout)
            if self._done_now(key) or self._on_shared(key) or self.catalog.was_drained(*key):
                return True
            if key in self._failed:
                raise SaveFailed(f"draining {job} step {step} rank {rank} failed: {self._failed[key]}")
            if key not in self._parts and key not in self._staged:
                raise SaveFailed(f"{job} step {step} rank {rank} is neither queued for draining nor on the "
                                 "shared tier (deleted before it drained?)")
            return False

    def not_drained(self, step: int) -> str:
        return (f"step {step} does not go to the shared tier: only steps that are multiples of "
                f"[shared] drain_every = {self.config.drain_every} do")

    def wait_idle(self, job: str | None, timeout: float) -> tuple[int, int]:
        """Waits until nothing (of ``job``) is queued and the retention that finished drains trigger has run
        (so what a caller sees next is the drain's whole outcome); returns (still pending, failed)."""
        def counts() -> tuple[int, int]:
            mine = [k for k in self._parts if job in (None, k[0])]
            failed = [k for k in self._failed if job in (None, k[0])]
            return len(mine), len(failed)

        with self._cond:
            self._cond.wait_for(lambda: counts()[0] == 0 and self._settling == 0 or self._stop.is_set(), timeout)
            return counts()

    # --- copies ----------------------------------------------------------------------------

    def fetch(self, part: Part) -> Part:
        """Copies a shared part onto the local tier (prefetch before a restart).

        The local copy counts as drained: it came from the shared tier.
        Raises :class:`CorruptSource` if the shared copy fails its checksums.
        """
        try:
            local = self._copy(part, TierName.LOCAL, rate_limited=False)
        except _Stopping:
            raise ShuttingDown() from None
        self.catalog.mark_drained(part.job, part.step, part.rank, local.digest)
        return local

    def _recover_in_background(self) -> None:
        try:
            self.recover()
        except Exception:  # noqa: BLE001 - logged; the timer's refresh cannot index, so say it loudly
            log.exception("indexing the shared tier %s failed; draining is stopped", self.shared_location,
                          extra=fields(tier=TierName.SHARED))

    def _work(self) -> None:
        fsutil.lower_thread_priority(self._nice)
        while not self._stop.is_set():
            key = self._next()
            if key is None:
                continue
            with self._cond:
                part = self._parts.get(key)
            if part is None:
                continue
            try:
                self._drain_one(key, part)
            except Exception as e:  # a worker must survive anything one part does
                log.exception("unexpected error draining %s step %d rank %d", *key, extra=_fields(part, error=e))
                self._retry(key, part, e)

    def _drain_one(self, key: Key, part: Part) -> None:
        started = time.monotonic()
        try:
            published = self._publish(part)
        except _Stopping:
            with self._cond:
                self._draining.discard(key)  # stays queued; resumes after a restart
            return
        except (CorruptSource, Conflict, OSError, layout.ManifestError) as e:
            if self._superseded(key, part):
                # A replacement (save with overwrite) took the part's place while it was copied: its
                # files changed under the copy. Nothing is wrong with either; the new part is queued.
                log.info("%s step %d rank %d was replaced while it drained (%s); draining the new part",
                         *key, e, extra=_fields(part, error=e))
                with self._cond:
                    self._draining.discard(key)
                    self._cond.notify_all()
                return
            self._failed_drain(key, part, e)
            return
        self._published(key, part, published, time.monotonic() - started)

    def _failed_drain(self, key: Key, part: Part, error: Exception) -> None:
        if isinstance(error, CorruptSource):
            self._give_up(key, f"local copy is corrupt: {error}")
            self._events.publish(CorruptCopy(part, str(error)))
        elif isinstance(error, Conflict):
            self._give_up(key, str(error))
        else:
            self._retry(key, part, error)

    def _superseded(self, key: Key, part: Part) -> bool:
        """Whether another local part (a replacement) took ``part``'s place in the queue since it was taken."""
        with self._cond:
            queued = self._parts.get(key)
        return queued is not None and queued is not part

    def _published(self, key: Key, part: Part, published: list[Part], elapsed: float) -> None:
        """Books a successful copy: the catalogue, drained marks, waiters, retention.

        A shared part counts as the drain of a local part only if the local
        tier still holds that very part (same manifest digest): a replacement
        that took its place meanwhile (a save with overwrite) drains in its turn.
        """
        self.reachable = True
        self.metrics.drain_seconds.observe(elapsed)
        self.metrics.saves_committed.labels("shared").inc()
        self.metrics.bytes_persisted.labels("shared").inc(part.nbytes)
        if elapsed > 0:
            self.metrics.drain_bandwidth.set(part.nbytes / elapsed)
        drained = []
        for shared in published:
            self.catalog.add(shared)
            # The drain of the local part only if that very part (same manifest) is still the local one.
            local = self.catalog.parts_of(shared.job, shared.step, shared.rank).get(TierName.LOCAL)
            if local is not None and local.digest == shared.digest:
                self.catalog.mark_drained(shared.job, shared.step, shared.rank, shared.digest)
                drained.append(shared)
        if published:
            try:
                # Other nodes' ranks of this step, and the step's commit record once all are there.
                self._commits.seal_shared(part.job, part.step)
            except OSError as e:
                if not self._removed_on_shared(part, e):
                    # The parts are there and the record is not (a full or failing tier): drain the part
                    # again, with the tier's backoff. Its copy is reused, and the record written once it fits.
                    self._retry(key, part, OSError(e.errno, f"cannot seal {part.job} step {part.step} on "
                                                            f"the shared tier: {e.strerror}"))
                    return
                log.info("%s step %d rank %d reached the shared tier, whose retention removed the step "
                         "before its record was written: drained", part.job, part.step, part.rank,
                         extra=fields(job=part.job, step=part.step, rank=part.rank, tier=TierName.SHARED))
            except layout.ManifestError as e:
                log.warning("cannot re-read %s step %d on the shared tier: %s", part.job, part.step, e,
                            extra=fields(job=part.job, step=part.step, tier=TierName.SHARED, error=e))
        with self._cond:
            self._draining.discard(key)
            if self._parts.get(key) is part:
                self._parts.pop(key)
                self._attempts.pop(key, None)
                if not published:
                    self._staged.add(key)  # done once the replacement's other ranks are there (see _publish)
            self._strikes.clear()  # the tier works: every part gets its turn in order again
            self._tier_failures = 0
            self._gate = 0.0
            self._health.pop(part.job, None)  # the job's drains work again
            self._tier_error = None
            for shared in drained:
                done = (shared.job, shared.step, shared.rank)
                self._staged.discard(done)
                self._done[done] = shared.digest
            while len(self._done) > _REMEMBER_DRAINED:
                del self._done[next(iter(self._done))]
            if drained:
                self._settling += 1
            self._cond.notify_all()
        log.info("drained %s step %d rank %d to %s (%d bytes, %.2fs)%s", part.job, part.step, part.rank,
                 self.shared_location, part.nbytes, elapsed,
                 "" if published else "; it replaces the step there once every rank's part has arrived",
                 extra=_fields(part, duration_s=elapsed))
        try:
            for shared in drained:
                try:
                    self._events.publish(Drained(shared))
                except Exception as e:  # e.g. retention after it: the drain itself succeeded, no retry
                    log.exception("after draining %s step %d rank %d: %s", shared.job, shared.step, shared.rank,
                                  e, extra=_fields(shared, error=e))
        finally:
            if drained:
                with self._cond:
                    self._settling -= 1
                    self._cond.notify_all()

    def _removed_on_shared(self, part: Part, error: OSError) -> bool:
        """Whether sealing failed because the part just published is gone from the shared tier again:
        an older step that the tier's retention deleted as superseded there (or a user deleted) before
        its record was written. Drained, then: copying it again would only have it deleted again."""
        return (error.errno == errno.ENOENT
                and TierName.SHARED not in self.catalog.parts_of(part.job, part.step, part.rank))

    def _next(self) -> Key | None:
        """Blocks until a part may be copied (queued, not being copied, backoff over); claims it."""
        with self._cond:
            while not self._stop.is_set():
                if not self._shared_indexed:
                    self._cond.wait(1.0)  # recover() notifies once the shared tier is indexed
                    continue
                wait = self._gate - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                ready = [k for k in self._parts if k not in self._draining]
                if ready:
                    key = min(ready, key=self._order)
                    self._draining.add(key)
                    return key
                self._cond.wait()
            return None

    def _order(self, key: Key) -> tuple[int, int, int]:
        """Sort key of the drain order (see the module docstring): fewest recent failures, then
        the job's newest step, then the oldest steps."""
        job, step, _ = key
        newest = step >= self._latest.get(job, step)
        return self._strikes.get(key, 0), 0 if newest else 1, -step if newest else step

    def _retry(self, key: Key, part: Part, error: Exception) -> None:
        with self._cond:
            attempt = self._attempts[key] = self._attempts.get(key, 0) + 1
            self._strikes[key] = self._strikes.get(key, 0) + 1
            self._tier_failures += 1
            delay = min(self.config.retry_max_s,
                        self.config.retry_initial_s * 2 ** min(self._tier_failures - 1, 32))
            self._gate = max(self._gate, time.monotonic() + delay)
            self._draining.discard(key)
            self._book_failure(part.job, str(error), permanent=False)
            self._cond.notify_all()
        self.reachable = False
        self.metrics.drain_retries.inc()
        log.warning("drain of %s step %d rank %d failed (attempt %d): %s; retrying in %.1fs; the local copy "
                    "stays", part.job, part.step, part.rank, attempt, error, delay,
                    extra=_fields(part, error=error, attempt=attempt, retry_in_s=delay))

    def _give_up(self, key: Key, reason: str) -> None:
        log.error("not draining %s step %d rank %d: %s", *key, reason,
                  extra=fields(job=key[0], step=key[1], rank=key[2], tier=TierName.SHARED, error=reason))
        with self._cond:
            self._draining.discard(key)
            self._parts.pop(key, None)
            self._strikes.pop(key, None)
            self._failed[key] = reason
            self._book_failure(key[0], reason, permanent=True)
            self._cond.notify_all()

    def _on_shared(self, key: Key) -> bool:
        """Whether the local part ``key`` has its copy on the shared tier (the same attempt's part)."""
        tiers = self.catalog.parts_of(*key)
        local, shared = tiers.get(TierName.LOCAL), tiers.get(TierName.SHARED)
        return shared is not None and (local is None or local.digest == shared.digest)

    def _publish(self, part: Part) -> list[Part]:
        """Drains one local part; returns the parts this made committed on the shared tier, in place.

        Usually that is the part itself. A part of a step replaced here (a save
        with overwrite) whose old version the shared tier still holds goes into
        the replacement being assembled there instead (:mod:`ckptstage.daemon.catalog.overwrite`):
        [] until every rank's part has arrived, then all of them, swapped in.
        """
        record = self._replacement_of(part)
        if record is None:
            return [self._copy(part, TierName.SHARED, rate_limited=True)]
        staged = self.shared.staged_location(part.job, part.step, part.rank)
        self._copy(part, TierName.SHARED, rate_limited=True, final=staged)
        parts = {p.rank: p for p in overwrite.staged_parts(self.shared, TierName.SHARED, part.job, part.step)
                 if p.matches(record)}
        if set(parts) != set(range(record.world_size)):
            return []
        return self._commits.swap_in(TierName.SHARED, record, parts)

    def _replacement_of(self, part: Part) -> layout.CommitRecord | None:
        """The local commit record that names ``part`` and replaces the step the shared tier holds, if so.

        Only a replacement of exactly the commit there (its fingerprint is in the
        local record's ``replaces``) may take its place: anything else is a
        straggler (:class:`Conflict` in :meth:`_copy`), e.g. a crashed run's step
        that its successor committed again on another node.
        """
        there = _record_on(self.shared, self.shared.step_location(part.job, part.step))
        if there is None or part.matches(there):
            return None
        local = self.catalog.record(part.job, part.step, TierName.LOCAL)
        if local is None or not part.matches(local) or there.fingerprint() not in local.replaces:
            return None
        return local

    def _copy(self, part: Part, tier: TierName, rate_limited: bool, final: Path | None = None) -> Part:
        """Copies one part to ``tier`` with the commit protocol; returns the committed copy.

        A part of another attempt already there is replaced when the step has
        no commit record on that tier (:meth:`Commits.replacer`); a step
        committed by another attempt is a :class:`Conflict` (this part is a
        straggler of a run that did not complete it).
        """
        source, dest = self.tiers[part.tier], self.tiers[tier]
        manifest, digest = source.read_manifest(part.path)
        try:
            layout.check_committed_manifest(part.path, digest, part.digest)  # never spread a rewritten manifest
        except layout.ChecksumMismatch as e:
            raise CorruptSource(f"{source.name_of(e.path)}: {e.detail}") from None
        attempt = layout.manifest_attempt(manifest)
        final = final or dest.part_location(part.job, part.step, part.rank)
        committed = _record_on(dest, final.parent)
        if committed is not None and committed.attempt != attempt:
            raise Conflict(f"{part.job} step {part.step} is committed on {dest.location} by attempt "
                           f"{committed.attempt!r}; this part of attempt {attempt!r} is a straggler and is not "
                           "copied")
        if dest.has_part(final) and not _replaceable(dest, final, manifest):
            return _reuse(dest, final, manifest, part, tier)
        writer = dest.begin_part(part.job, part.step, part.rank,
                                 replace=lambda f: _replaceable(dest, f, manifest), final=final)
        names = chunks.referenced(manifest)
        store = self._chunk_store(tier, names)
        leased: list[set[str]] = []
        try:
            if names:
                leased.append(names)
                self._copy_chunks(part, store, tier, names, rate_limited)
            else:
                for name, entry in layout.manifest_files(manifest).items():
                    self._copy_file(source, part.path, name, writer, entry, rate_limited)
            try:
                published = writer.commit(manifest)
            except OSError:
                if dest.has_part(final):  # published meanwhile (by ourselves before a crash, or a race)
                    return _reuse(dest, final, manifest, part, tier)
                raise
            # Another node's sweep may have taken a chunk this part relied on before the part was
            # published (see chunkstore): put back what it took, before anyone commits the step.
            for _ in range(3):
                gone = dest.missing_chunks(part.job, names) if names else []
                if not gone:
                    break
                leased.append(set(gone))
                self._copy_chunks(part, store, tier, set(gone), rate_limited)
            else:
                raise OSError(f"chunks of {published} keep vanishing from {dest.location}: is another daemon sweeping "
                              "with a shorter [persist] chunk_grace_s?")
            return Part(part.job, part.step, part.rank, part.world_size, tier, published, part.nbytes, part.created,
                        part.metrics, attempt, writer.manifest_digest, writer.ino)
        finally:
            for held in leased:
                store.release(part.job, held)
            writer.abort()

    def _chunk_store(self, tier: TierName, names: set[str]) -> ChunkStore:
        store = self._chunk_stores.get(tier)
        if names and store is None:
            raise OSError(f"an incremental part cannot be copied to the {tier.value} tier: no chunk store for it")
        return store  # type: ignore[return-value]  # only used when names is not empty

    def _copy_chunks(self, part: Part, store: ChunkStore, tier: TierName, names: set[str],
                     rate_limited: bool) -> None:
        """Copies the chunks among ``names`` that ``store`` lacks from the part's own store (each checked
        against its name, the xxh3-128 of its bytes), touching those it holds; leases them all."""
        batch = store.new_chunks(part.job)
        try:
            self._copy_missing(part, store, batch, names, rate_limited, tier)
        finally:
            batch.discard()

    def _copy_missing(self, part: Part, store: ChunkStore, batch: ChunkBatch, names: set[str],
                      rate_limited: bool, tier: TierName) -> None:
        """Touches the chunks ``store`` holds, copies the others on :data:`_CHUNK_COPIERS` threads, then
        makes them durable together (:meth:`ChunkBatch.publish`)."""
        source = self.tiers[part.tier]
        reused = 0
        todo = []
        for name in sorted(names):
            if store.reuse(part.job, name):
                reused += store.tier.chunk_size(part.job, name)
            else:
                todo.append(name)

        def copy(name: str) -> None:
            if self._stop.is_set():
                raise _Stopping()
            src = source.chunk_location(part.job, name)
            try:
                with source.open_chunk(part.job, name) as f:
                    size = f.size
                    buf = mmap.mmap(-1, max(size, 1))  # page-aligned: the write can go O_DIRECT
                    view = memoryview(buf)[:size]
                    try:
                        if f.readinto(view) != size:
                            raise CorruptSource(f"{source.name_of(src)}: shorter than its size (a chunk of "
                                                f"{source.name_of(part.path)})")
                        if chunks.digest(view) != name:
                            raise CorruptSource(f"{source.name_of(src)}: its bytes do not hash to its name (a chunk "
                                                f"of {source.name_of(part.path)})")
                        if rate_limited:
                            self._limiter.acquire(size)
                        batch.write(name, view, direct_io=True)
                    finally:
                        view.release()
                        buf.close()
            except FileNotFoundError as e:
                raise CorruptSource(f"{source.name_of(src)}: a chunk of {source.name_of(part.path)} is missing") from e

        if todo:
            with ThreadPoolExecutor(min(_CHUNK_COPIERS, len(todo)), "drain-chunk",
                                    initializer=fsutil.lower_thread_priority, initargs=(self._nice,)) as pool:
                for f in [pool.submit(copy, n) for n in todo]:
                    f.result()
        batch.publish()
        self.metrics.chunks_reused.labels(tier.value).inc(reused)

    def _copy_file(self, source: Tier, part: Path, name: str, writer: PartWriter, entry: layout.FileEntry,
                   rate_limited: bool) -> None:
        """Reads piece i+1 while piece i is written: one read, one check per digest block, one write.

        Pieces are whole digest blocks, about :data:`_PIECE_BYTES` each; two
        page-aligned buffers; the destination takes aligned pieces with
        O_DIRECT where the tier allows (see :class:`fsutil.DataFile`).
        Every block is checked against the local manifest before it is written.
        """
        src = part / name
        block = entry.chunk_bytes
        blocks_per_piece = max(1, _PIECE_BYTES // block)
        bufs = [mmap.mmap(-1, block * blocks_per_piece) for _ in range(2)]
        out = writer.create_file(name, entry.size, direct_io=True)
        try:
            with source.open_file(part, name) as fin, \
                    ThreadPoolExecutor(1, "drain-write", initializer=fsutil.lower_thread_priority,
                                       initargs=(self._nice,)) as pool:
                pending: Future[None] | None = None
                total = 0
                for k, first in enumerate(range(0, len(entry.digests), blocks_per_piece)):
                    if self._stop.is_set():
                        raise _Stopping()
                    count = min(blocks_per_piece, len(entry.digests) - first)
                    piece = memoryview(bufs[k % 2])[:block * count]
                    n = fin.readinto(piece) or 0
                    piece = piece[:n]
                    for j in range(count):
                        data = piece[j * block:(j + 1) * block]
                        try:
                            layout.verify_block(data, entry, first + j, src)
                        except layout.ChecksumMismatch as e:
                            raise CorruptSource(f"{source.name_of(src)}: {e.detail}") from None
                        if rate_limited:  # per block: a whole piece's credit at once would overshoot the cap
                            self._limiter.acquire(len(data))
                    if pending is not None:
                        pending.result()  # the other buffer is free again
                    pending = pool.submit(out.write, piece, total)
                    total += n
                if pending is not None:
                    pending.result()
                if total != entry.size or fin.read(1):
                    raise CorruptSource(f"{source.name_of(src)}: size differs from its manifest ({entry.size} bytes)")
            out.sync()
        finally:
            out.close()


def _fields(part: Part, duration_s: float | None = None, error: object = None, **more: object) -> dict[str, object]:
    """The log fields of a drain of ``part`` (to the shared tier)."""
    return fields(job=part.job, step=part.step, rank=part.rank, tier=TierName.SHARED, bytes=part.nbytes,
                  duration_s=duration_s, error=error, **more)


def _record_on(storage: Tier, step: Path) -> layout.CommitRecord | None:
    """The step's trusted commit record on a tier (None: none, or one that fails verification)."""
    try:
        return storage.read_commit_record(step)
    except layout.ManifestError:
        return None


def _replaceable(storage: Tier, final: Path, manifest: Manifest) -> bool:
    """Whether the part at ``final`` is an earlier save's, in a step with no commit record there.

    An earlier attempt's (a crashed run's leftovers), or this attempt's own
    earlier version of the part (replaced in place by a save with
    overwrite), even one with the very same bytes: the manifest is part of
    the part (its digest is what a commit record names), so a re-save of
    an unchanged state must still take the old one's place. Earlier, not
    merely other: a crashed attempt's part whose drain resumes after the
    restart must never replace the part its successor already drained (the
    successor's local copy counts as drained and may go).
    """
    if storage.has_commit_record(final.parent):
        return False
    try:
        theirs = storage.read_manifest(final)[0]
    except layout.ManifestError:
        return False  # judged by _reuse: a Conflict, never silently replaced
    return theirs != manifest and _created(theirs) < _created(manifest)


def _reuse(storage: Tier, final: Path, manifest: Manifest, part: Part, tier: TierName) -> Part:
    """A part already committed at ``final``: ours if its files match, else a :class:`Conflict`.

    It is ours when a crash came after the rename but before the index
    learnt of it. A different part under the same name (a job name reused
    with a stale checkpoint left on the shared tier) must never be taken
    for this one: the local copy would be deleted as drained.
    """
    theirs, digest = storage.read_manifest(final)
    if theirs.get("files") != manifest.get("files"):
        raise Conflict(f"{final} already holds a different checkpoint under the same job, step and rank; "
                       "move it away (or use a new job name) to drain this one")
    return Part(part.job, part.step, part.rank, part.world_size, tier, final, part.nbytes, part.created,
                part.metrics, layout.manifest_attempt(theirs), digest, storage.part_version(final))
