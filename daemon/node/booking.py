"""What follows a save's commit or failure: the part indexed, sealed, queued for draining, the save settled.

The persister publishes :class:`~ckptstage.daemon.save.persister.Committed`
or ``Failed`` for each save; the node hands it here, on the persister's
thread. The order is the promise ``wait("local")`` makes: by the time a
save settles (and its waiters wake), its part is in the catalogue, the
step's local commit record is written if this was its last rank, and the
part is queued for draining. A part of a replacement (``overwrite=True``)
waits in the staging area until every rank's is there, then the step is
swapped in whole (:mod:`ckptstage.daemon.catalog.overwrite`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ckptstage.daemon.catalog import overwrite
from ckptstage.daemon.catalog.commits import Commits, complete_attempt
from ckptstage.daemon.catalog.index import Catalog, Part, TierName
from ckptstage.daemon.drain.drainer import Drainer
from ckptstage.daemon.logs import fields
from ckptstage.daemon.metrics import Metrics
from ckptstage.daemon.node.saves import SaveTable
from ckptstage.daemon.save.memtier import MemoryTier
from ckptstage.daemon.save.persister import Save
from ckptstage.daemon.tiers.interface import Tier
from ckptstage.protos import layout

log = logging.getLogger(__name__)


class CommitBooking:
    """Books each committed save into the node's state, then settles it in :class:`SaveTable`."""

    def __init__(self, saves: SaveTable, catalog: Catalog, commits: Commits, memory: MemoryTier, metrics: Metrics,
                 local: Tier, drainer: Drainer | None, apply_retention: Callable[..., object],
                 clock: Callable[[], float], persist_every: int,
                 replicate: Callable[[Part], None] | None = None) -> None:
        """``apply_retention(job, trigger=, shared=False)``: the job's local rules, run after each commit;
        ``replicate(part)``: queues a committed local part for the job's other nodes ([peers])."""
        self._saves = saves
        self._catalog = catalog
        self._commits = commits
        self._memory = memory
        self._metrics = metrics
        self._local = local
        self._drainer = drainer
        self._apply_retention = apply_retention
        self._clock = clock
        self._persist_every = persist_every
        self._replicate = replicate

    def committed(self, save: Save) -> None:
        """The persister committed a save: index it, queue it for draining, settle it, apply retention."""
        try:
            self._book(save)
        except Exception as e:
            # Logged here: the persister's pool would keep the exception in a future no one reads.
            log.exception("cannot book the commit of %s step %d rank %d: %s", save.spec.job, save.spec.step,
                          save.spec.rank, e, extra=fields(job=save.spec.job, step=save.spec.step,
                                                          rank=save.spec.rank, tier=TierName.LOCAL, error=e))
            if self._saves.unsettled(save) and save.error is None:  # not indexed, not queued: not done either
                save.error = f"step {save.spec.step} was written but could not be indexed: {e}"
        finally:
            if self._saves.unsettled(save):  # the commit path broke before it settled the save: wake its waiters
                self._saves.settle(save)

    def failed(self, save: Save) -> None:
        self._metrics.saves_failed.inc()
        self._saves.settle(save)

    def _book(self, save: Save) -> None:
        if save.memory_only:
            self._book_memory_only(save)
            return
        assert save.committed_path is not None
        if save.chunks is not None:
            self._metrics.chunks_reused.labels("local").inc(save.chunks.reused_bytes)
        spec = save.spec
        if save.committed_path == self._local.staged_location(spec.job, spec.step, spec.rank):
            self._book_staged(save)
            return
        writer = save.writer
        assert writer is not None  # a save that reached its commit wrote a part
        part = Part(spec.job, spec.step, spec.rank, spec.world_size, TierName.LOCAL, save.committed_path,
                    spec.data_bytes, self._clock(), dict(spec.metrics), layout.manifest_attempt(spec.manifest),
                    writer.manifest_digest, writer.ino)
        replaced = self._catalog.parts_of(spec.job, spec.step, spec.rank).get(TierName.LOCAL)
        self._catalog.add(part)
        if replaced is not None and self._drainer is not None:
            self._drainer.forget(spec.job, spec.step, spec.rank)  # an earlier attempt's part was replaced
        self._metrics.saves_committed.labels("local").inc()
        self._metrics.bytes_persisted.labels("local").inc(spec.data_bytes)
        elapsed = time.monotonic() - save.started
        self._metrics.persist_seconds.observe(elapsed)
        log.info("committed %s step %d rank %d on local: %d bytes in %.2fs", spec.job, spec.step, spec.rank,
                 spec.data_bytes, elapsed, extra=fields(job=spec.job, step=spec.step, rank=spec.rank,
                                                        tier=TierName.LOCAL, bytes=spec.data_bytes, duration_s=elapsed))
        try:
            # Before the save settles: the last rank's wait("local") returns with the step committed here.
            self._commits.seal_local(spec.job, spec.step)
        except OSError as e:
            log.error("cannot write the local commit record of %s step %d: %s (written on restart)", spec.job,
                      spec.step, e, extra=fields(job=spec.job, step=spec.step, tier=TierName.LOCAL, error=e))
        if self._drainer is not None:
            # Queued before the save settles, so that a wait("shared") finds it queued.
            self._drainer.enqueue(part)
        if self._replicate is not None:
            self._replicate(part)  # queued before the save settles, as for the drain: for wait("peer")
        self._saves.owner(save).keep_resident(save)
        self._memory.superseded(spec.job, spec.rank, spec.step)
        self._saves.settle(save)
        # Its waiters go on now: deleting the older steps retention no longer keeps is not theirs to wait for
        # (renames and fsyncs: 0.3-0.9 s per 600 MiB step on the test VM, see docs/ARCHITECTURE.md).
        save.local_done.set()
        self._apply_retention(spec.job, trigger="commit", shared=False)

    def _book_staged(self, save: Save) -> None:
        """A part of a replacement, committed in the staging area."""
        spec = save.spec
        self._metrics.saves_committed.labels("local").inc()
        self._metrics.bytes_persisted.labels("local").inc(spec.data_bytes)
        self._memory.drop_job(spec.job, spec.step)  # the step is being replaced
        try:
            self._swap_in_when_whole(save)
        except OSError as e:
            save.error = f"cannot put the replacement of step {spec.step} in place: {e}"
            log.error("%s %s", spec.job, save.error,
                      extra=fields(job=spec.job, step=spec.step, rank=spec.rank, tier=TierName.LOCAL, error=e))
        self._saves.settle(save)
        self._apply_retention(spec.job, trigger="commit", shared=False)

    def _swap_in_when_whole(self, save: Save) -> None:
        """Swaps the replacement in once every rank's part of it is committed in the staging area."""
        spec = save.spec
        attempt = layout.manifest_attempt(spec.manifest)
        staged = [p for p in overwrite.staged_parts(self._local, TierName.LOCAL, spec.job, spec.step)
                  if p.attempt == attempt]
        found = complete_attempt(staged)
        if found is not None:
            _, world, parts = found
            record = self._commits.replacement_record(spec.job, spec.step, attempt, world, parts)
            for part in self._commits.swap_in(TierName.LOCAL, record, parts):
                if self._drainer is not None:
                    self._drainer.forget(part.job, part.step, part.rank)
                    self._drainer.enqueue(part)
                if self._replicate is not None:
                    self._replicate(part)

    def _book_memory_only(self, save: Save) -> None:
        """A save kept in memory only is complete in the arena: the session's newest image, for a restart."""
        spec = save.spec
        self._metrics.saves_committed.labels("memory").inc()
        log.info("kept %s step %d rank %d in memory only: %d bytes ([local] persist_every = %d)", spec.job,
                 spec.step, spec.rank, spec.data_bytes, self._persist_every,
                 extra=fields(job=spec.job, step=spec.step, rank=spec.rank, tier=TierName.MEMORY,
                              bytes=spec.data_bytes))
        self._saves.owner(save).keep_resident(save)
        self._memory.superseded(spec.job, spec.rank, spec.step)
        self._saves.settle(save)
