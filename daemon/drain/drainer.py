"""Local tier -> shared tier, in the background: the drain workers, over the queue, the copier and the index.

Every part committed on the local tier is queued (:mod:`ckptstage.daemon.drain.queue`,
which also says in what order parts go), copied by one of
``[shared] max_concurrent`` workers (:mod:`ckptstage.daemon.drain.copier`, at
most ``max_bandwidth``: :mod:`ckptstage.daemon.tiers.limiter`), and booked:
the catalogue, the step's commit record on the shared tier, the waiters, then
the retention the drain allows (:class:`Drained`). Nothing leaves the local
tier before its shared copy is committed (retention sees undrained parts as
protected), so a backlog costs local disk, never a checkpoint;
``ckptstage_drain_queue_*`` and ``ckptstage_drain_lag_seconds`` make it
visible. Older parts are still drained, even when the shared tier's rules
will delete them at once: the invariant is that a part leaves the local tier
only once it was committed on the shared tier, and the drainer does not
second-guess retention.

Failures: an ``OSError`` on the shared tier (permission denied, no space,
directory gone) is retried with the tier's exponential backoff
(:mod:`ckptstage.daemon.tiers.backoff`), forever, at most ``retry_max_s``
apart; the local copy stays meanwhile. A local copy that fails its own
checksums, or a different part already published under the same name on the
shared tier, is a permanent failure: retrying cannot fix it, and
``SaveHandle.wait("shared")`` raises.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ckptstage.daemon import fsutil
from ckptstage.daemon.catalog.chunkstore import ChunkStore
from ckptstage.daemon.catalog.commits import Commits
from ckptstage.daemon.catalog.index import Catalog, Checkpoint, Part, TierName
from ckptstage.daemon.config import SharedConfig
from ckptstage.daemon.drain.copier import Conflict, CorruptSource, PartCopier, Stopping
from ckptstage.daemon.drain.health import DrainHealth
from ckptstage.daemon.drain.indexer import SharedIndexer
from ckptstage.daemon.drain.queue import DrainQueue, Key
from ckptstage.daemon.events import Bus
from ckptstage.daemon.logs import fields
from ckptstage.daemon.metrics import Metrics
from ckptstage.daemon.tiers import limiter
from ckptstage.daemon.tiers.interface import Tier
from ckptstage.protos import layout

log = logging.getLogger(__name__)


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
    """The drain workers: each claims a part from :attr:`queue`, copies it, and books what became of it."""

    def __init__(self, config: SharedConfig, catalog: Catalog, metrics: Metrics, commits: Commits, events: Bus,
                 chunk_stores: dict[TierName, ChunkStore] | None = None, nice: int = 0,
                 clock: Callable[[], float] = time.time, *, tiers: Mapping[TierName, Tier],
                 gate: limiter.Pacer | None = None) -> None:
        """``tiers``: the local and shared tiers' storage; ``gate``: where copies to the shared tier wait while a
        checkpoint is being loaded on this node. ``commits`` writes the shared tier's commit records as
        parts arrive there, and swaps replacements in; ``events`` is where :class:`Drained`, :class:`CorruptCopy`
        and :class:`Indexed` are published."""
        self.config = config
        self.catalog = catalog
        self.metrics = metrics
        self.shared = tiers[TierName.SHARED]
        self.queue = DrainQueue(config, catalog, clock)
        self._stop = self.queue.stopping
        self._nice = nice  # added to the drain threads' niceness ([persist] nice)
        self._commits = commits
        self._events = events
        paced = {**tiers, TierName.SHARED: limiter.limited(self.shared, config.max_bandwidth, sleep=self._stop.wait,
                                                                  gate=gate)}
        self.copier = PartCopier(paced, catalog, commits, metrics, chunk_stores or {}, nice, self._stop)
        self.indexer = SharedIndexer(config, self.shared, catalog, self.queue, commits, self._stop)
        self._threads: list[threading.Thread] = []

    # --- what the node calls ----------------------------------------------------------

    def start(self) -> None:
        """Indexes the shared tier on a thread of its own (see :meth:`SharedIndexer.recover`) and starts the
        copy workers."""
        t = threading.Thread(target=self._recover_in_background, name="drain-index", daemon=True)
        t.start()
        self._threads.append(t)
        for i in range(self.config.max_concurrent):
            t = threading.Thread(target=self._work, name=f"drain-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float) -> None:
        self.queue.stop()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    @property
    def reachable(self) -> bool | None:
        return self.queue.reachable

    def refresh(self) -> None:
        self.indexer.refresh()

    def fetch(self, part: Part) -> Part:
        return self.copier.fetch(part)

    def enqueue(self, part: Part, off_cadence: bool = False) -> None:
        self.queue.enqueue(part, off_cadence)

    def forget(self, job: str, step: int, rank: int) -> None:
        self.queue.forget(job, step, rank)

    def wait_part(self, job: str, step: int, rank: int, timeout: float) -> bool:
        return self.queue.wait_part(job, step, rank, timeout)

    def wait_idle(self, job: str | None, timeout: float) -> tuple[int, int]:
        return self.queue.wait_idle(job, timeout)

    def checkpoint_state(self, ckpt: Checkpoint) -> str:
        return self.queue.checkpoint_state(ckpt)

    def not_drained(self, step: int) -> str:
        return self.config.why_not_drained(step)

    def health_of(self, names: Iterable[str]) -> dict[str, DrainHealth]:
        return self.queue.health_of(names)

    def pending(self) -> tuple[int, int]:
        return self.queue.pending()

    def lag_s(self) -> float:
        return self.queue.lag_s()

    # --- the workers ------------------------------------------------------------------

    def _recover_in_background(self) -> None:
        try:
            if self.indexer.recover():
                self._events.publish(Indexed())
        except Exception:  # noqa: BLE001 - logged; the timer's refresh cannot index, so say it loudly
            log.exception("indexing the shared tier %s failed; draining is stopped", self.shared.location,
                          extra=fields(tier=TierName.SHARED))

    def _work(self) -> None:
        fsutil.lower_thread_priority(self._nice)
        while not self._stop.is_set():
            claimed = self.queue.claim()
            if claimed is None:
                continue
            key, part = claimed
            try:
                self._drain_one(key, part)
            except Exception as e:  # a worker must survive anything one part does
                log.exception("unexpected error draining %s step %d rank %d", *key, extra=_fields(part, error=e))
                self._retry(key, part, e)

    def _drain_one(self, key: Key, part: Part) -> None:
        started = time.monotonic()
        try:
            published = self.copier.publish(part)
        except Stopping:
            self.queue.release(key)  # stays queued; resumes after a restart
            return
        except (CorruptSource, Conflict, OSError, layout.ManifestError) as e:
            if self.queue.superseded(key, part):
                # A replacement (save with overwrite) took the part's place while it was copied: its
                # files changed under the copy. Nothing is wrong with either; the new part is queued.
                log.info("%s step %d rank %d was replaced while it drained (%s); draining the new part",
                         *key, e, extra=_fields(part, error=e))
                self.queue.release(key)
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

    def _published(self, key: Key, part: Part, published: list[Part], elapsed: float) -> None:
        """Books a successful copy: the catalogue, drained marks, waiters, retention.

        A shared part counts as the drain of a local part only if the local
        tier still holds that very part (same manifest digest): a replacement
        that took its place meanwhile (a save with overwrite) drains in its turn.
        """
        self.queue.reachable = True
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
        if published and self.queue.copied(key) and not self._seal(key, part):
            return
        self.queue.finished(key, part, bool(published), drained)
        log.info("drained %s step %d rank %d to %s (%d bytes, %.2fs)%s", part.job, part.step, part.rank,
                 self.shared.location, part.nbytes, elapsed,
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
                self.queue.settled()

    def _seal(self, key: Key, part: Part) -> bool:
        """Writes the commit record of the step ``part`` reached, once every rank's part is there (other
        nodes' ranks too); False when that failed and the part is queued again to try once more.

        Called once this node has no other part of the step queued or in copy
        (:meth:`DrainQueue.copied`): the last node to publish its share seals."""
        try:
            self._commits.seal_shared(part.job, part.step, part.world_size)
        except OSError as e:
            if not self._removed_on_shared(part, e):
                # The parts are there and the record is not (a full or failing tier): drain the part
                # again, with the tier's backoff. Its copy is reused, and the record written once it fits.
                self._retry(key, part, OSError(e.errno, f"cannot seal {part.job} step {part.step} on "
                                                        f"the shared tier: {e.strerror}"))
                return False
            log.info("%s step %d rank %d reached the shared tier, whose retention removed the step "
                     "before its record was written: drained", part.job, part.step, part.rank,
                     extra=fields(job=part.job, step=part.step, rank=part.rank, tier=TierName.SHARED))
        except layout.ManifestError as e:
            log.warning("cannot re-read %s step %d on the shared tier: %s", part.job, part.step, e,
                        extra=fields(job=part.job, step=part.step, tier=TierName.SHARED, error=e))
        return True

    def _removed_on_shared(self, part: Part, error: OSError) -> bool:
        """Whether sealing failed because the part just published is gone from the shared tier again:
        an older step that the tier's retention deleted as superseded there (or a user deleted) before
        its record was written. Drained, then: copying it again would only have it deleted again."""
        return (error.errno == errno.ENOENT
                and TierName.SHARED not in self.catalog.parts_of(part.job, part.step, part.rank))

    def _retry(self, key: Key, part: Part, error: Exception) -> None:
        attempt, delay = self.queue.failed(key, part, error)
        self.metrics.drain_retries.inc()
        log.warning("drain of %s step %d rank %d failed (attempt %d): %s; retrying in %.1fs; the local copy "
                    "stays", part.job, part.step, part.rank, attempt, error, delay,
                    extra=_fields(part, error=error, attempt=attempt, retry_in_s=delay))

    def _give_up(self, key: Key, reason: str) -> None:
        log.error("not draining %s step %d rank %d: %s", *key, reason,
                  extra=fields(job=key[0], step=key[1], rank=key[2], tier=TierName.SHARED, error=reason))
        self.queue.give_up(key, reason)


def _fields(part: Part, duration_s: float | None = None, error: object = None, **more: object) -> dict[str, object]:
    """The log fields of a drain of ``part`` (to the shared tier)."""
    return fields(job=part.job, step=part.step, rank=part.rank, tier=TierName.SHARED, bytes=part.nbytes,
                  duration_s=duration_s, error=error, **more)
