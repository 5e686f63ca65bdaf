"""Indexing the shared tier for the drain: at start (retrying until it answers), then on the node's timer.

Copies start only once the shared tier is indexed (:meth:`DrainQueue.claim`
waits for it), since whether a local part still needs draining is read from
that index. Indexing runs on a thread of its own: a shared file system that
hangs must not keep the node from taking saves.
"""

from __future__ import annotations

import logging
import threading

from ckptstage.daemon.catalog.commits import Commits
from ckptstage.daemon.catalog.index import Catalog, TierName
from ckptstage.daemon.config import SharedConfig
from ckptstage.daemon.drain.queue import DrainQueue
from ckptstage.daemon.logs import fields
from ckptstage.daemon.tiers import backoff
from ckptstage.daemon.tiers.interface import Tier
from ckptstage.protos import layout

log = logging.getLogger(__name__)


class SharedIndexer:
    """Keeps the catalogue's index of the shared tier, and the drain queue, up to date with that tier."""

    def __init__(self, config: SharedConfig, shared: Tier, catalog: Catalog, queue: DrainQueue,
                 commits: Commits, stop: threading.Event) -> None:
        self.config = config
        self.shared = shared
        self.catalog = catalog
        self.queue = queue
        self._commits = commits
        self._stop = stop

    def recover(self) -> bool:
        """Cleans this node's shared temporaries and indexes the shared tier, retrying until it answers.

        Then queues what is missing there and writes the commit records a crash
        kept from being written. False: the drain stopped before the tier answered.
        """
        if not backoff.retry(lambda: self._index(clean=True), self.config.retry_initial_s, self.config.retry_max_s,
                             self._stop):
            return False
        self.requeue()
        try:
            self._commits.seal_all(TierName.SHARED)
        except (OSError, layout.ManifestError) as e:
            log.warning("cannot complete the shared tier's commit records: %s", e,
                        extra=fields(tier=TierName.SHARED, error=e))
        return True

    def refresh(self) -> None:
        """Brings the index of the shared tier up to date (run by the node's shared-tier timer).

        Re-reads the directories of the jobs this daemon knows, where other
        nodes add their ranks and delete steps, then queues any local part
        that is neither drained nor queued. Before the tier was first indexed
        it does nothing: :meth:`recover` is still retrying.
        """
        if self.queue.is_indexed():
            failed = False
            for job in self.catalog.jobs():
                try:
                    added, dropped = self.catalog.sync_job(TierName.SHARED, self.shared, job)
                except OSError as e:
                    self.queue.reachable = False
                    failed = True
                    self.queue.set_tier_error(f"cannot re-read {job} on the shared tier {self.shared.location}: {e}")
                    log.warning("cannot re-read %s on the shared tier %s: %s", job, self.shared.location, e,
                                extra=fields(job=job, tier=TierName.SHARED, error=e))
                    continue
                if added or dropped:
                    log.debug("shared tier: %s: %d parts appeared, %d vanished", job, added, dropped,
                              extra=fields(job=job, tier=TierName.SHARED))
            if not failed:
                self.queue.set_tier_error(None)
        self.requeue()

    def requeue(self) -> None:
        """Queues every local part not yet drained (a no-op for those already queued)."""
        for part in self.catalog.all_parts(TierName.LOCAL):
            self.queue.enqueue(part)

    def _index(self, clean: bool) -> bool:
        try:
            self.shared.prepare()
            if clean:
                self.shared.recover_staged()  # before the temporaries go
            removed = self.shared.clean_temporaries() if clean else 0
            n = self.catalog.load_tier(TierName.SHARED, self.shared)
        except OSError as e:
            self.queue.reachable = False
            self.queue.set_tier_error(f"cannot index the shared tier {self.shared.location}: {e}")
            log.error("shared tier %s unreachable: %s (draining will retry)", self.shared.location, e,
                      extra=fields(tier=TierName.SHARED, error=e))
            return False
        self.queue.indexed()
        self.queue.reachable = True
        self.queue.set_tier_error(None)
        log.info("shared tier %s: %d committed parts, %d temporaries removed", self.shared.location, n, removed,
                 extra=fields(tier=TierName.SHARED, parts=n, temporaries_removed=removed))
        return True
