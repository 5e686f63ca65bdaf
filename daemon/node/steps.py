"""What operators and readers do to a committed step: pin it, delete it, prefetch it, report a corrupt copy.

Each checks the step exists first (a step only the shared tier has is
indexed before the answer), and none lets a save still in flight commit a
part after it: a deletion waits for the step's saves to settle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from ckptstage.daemon.catalog.commits import Commits
from ckptstage.daemon.catalog.index import Catalog, TierName
from ckptstage.daemon.catalog.quarantine import Quarantine
from ckptstage.daemon.drain.fetcher import Fetcher
from ckptstage.daemon.errors import CheckpointNotFound, InvalidRequest, StepPinned
from ckptstage.daemon.logs import fields
from ckptstage.daemon.node.lookup import Lookup
from ckptstage.daemon.node.saves import SaveTable
from ckptstage.daemon.retention.janitor import Deleted, Janitor
from ckptstage.daemon.save.memtier import MemoryTier
from ckptstage.protos import layout

log = logging.getLogger(__name__)


class StepOps:
    """Pins, deletions, prefetches and reports of corrupt copies, for one node."""

    def __init__(self, catalog: Catalog, lookup: Lookup, saves: SaveTable, memory: MemoryTier, janitor: Janitor,
                 quarantine: Quarantine, commits: Commits, fetcher: Fetcher | None,
                 drop_replica: Callable[[str, int, int, str], object] | None = None) -> None:
        self._catalog = catalog
        self._lookup = lookup
        self._saves = saves
        self._memory = memory
        self._janitor = janitor
        self._quarantine = quarantine
        self._commits = commits
        self._fetcher = fetcher
        self._drop_replica = drop_replica  # the peer tier's: a replica kept here that failed a reader's check
        self._pins_lock = threading.Lock()  # a pin's check and change, one caller at a time

    def set_pin(self, job: str, step: int, pinned: bool) -> bool:
        """Pins or unpins a step; False when it already was (nothing changed)."""
        layout.check_job(job)
        layout.check_step(step)
        known = self._lookup.indexed(job, step)
        with self._pins_lock:
            # A pin left on a step that is gone may still be lifted; any other unknown step is an error
            # (a typo'd step must not look done to a script).
            if not known and (pinned or not self._catalog.is_pinned(job, step)):
                raise CheckpointNotFound(job, step)
            if self._catalog.is_pinned(job, step) == pinned:
                return False
            self._catalog.set_pin(job, step, pinned)
        log.info("%s %s step %d", "pinned" if pinned else "unpinned", job, step,
                 extra=fields(job=job, step=step, pinned=pinned))
        return True

    def delete(self, job: str, step: int, settle_wait_s: float) -> Deleted:
        """Deletes a step from the local tier and the shared tier; refuses a pinned one.

        Saves of the step still in flight here are waited for (up to
        ``settle_wait_s``), so that none commits a part after the deletion.
        """
        layout.check_job(job)
        layout.check_step(step)
        if not self._lookup.indexed(job, step):
            copies, nbytes = self._memory.drop_job(job, step)  # a step kept in memory only
            if copies:
                return Deleted(copies, nbytes, (TierName.MEMORY,))
            raise CheckpointNotFound(job, step)
        if self._catalog.is_pinned(job, step):
            raise StepPinned(job, step)
        deadline = time.monotonic() + settle_wait_s
        for save in self._saves.in_flight():
            if save.spec.job == job and save.spec.step == step and \
                    not self._saves.wait_settled(save, max(0.0, deadline - time.monotonic())):
                raise InvalidRequest(f"step {step} of job {job!r} is still being saved; delete it once the save "
                                     "is committed (SaveHandle.wait)")
        self._memory.drop_job(job, step)
        return self._janitor.delete_step(job, step)

    def prefetch(self, job: str, step: int | None, ranks: Sequence[int] = ()) -> tuple[int, int]:
        """Copies the parts of a checkpoint this node holds no copy of (``ranks``' only, when given) onto the
        local tier, or, from another node of the job, into its replica store; returns (step, parts copied).
        See :mod:`ckptstage.daemon.drain.fetcher` and :mod:`ckptstage.daemon.peers.view`.

        The copies are verified against the shared manifests as they are
        read; a shared copy that fails is reported corrupt and the prefetch
        fails. Local retention still applies to what was fetched: prefetch
        the newest checkpoint (the one a restart reads), or pin an older one.
        """
        if self._fetcher is None:
            raise InvalidRequest("this daemon has no shared tier or peers to prefetch from")
        ckpt, _ = self._lookup.locate(job, step, 0, all_ranks=True)
        for rank in ranks:
            if not 0 <= rank < ckpt.world_size:
                raise InvalidRequest(f"rank {rank} is not a rank of {job} step {ckpt.step} "
                                     f"(world size {ckpt.world_size})")
        wanted = sorted(set(ranks)) if ranks else range(ckpt.world_size)
        todo = [part for rank in wanted for part in [self._lookup.to_fetch(ckpt, rank)] if part is not None]
        copied = self._fetcher.fetch(todo) if todo else 0
        self._commits.seal_local(job, ckpt.step)  # when every part is here now, the step exists locally too
        if todo:
            log.info("prefetched %s step %d: %d parts copied to the local tier", job, ckpt.step, copied,
                     extra=fields(job=job, step=ckpt.step, tier=TierName.LOCAL, parts=copied))
        return ckpt.step, copied

    def report_corrupt(self, job: str, step: int, rank: int, tier: TierName, detail: str) -> None:
        """A reader found a copy that fails verification: the daemon re-reads it and hides it only if its
        own read fails too (see :mod:`ckptstage.daemon.catalog.quarantine`). Returns at once.

        A memory copy is verified when kept, so one that fails a reader's check is memory gone bad: it is
        dropped, and the disk copies remain.
        """
        layout.check_job(job)
        if tier == TierName.MEMORY:
            log.error("memory copy of %s step %d rank %d failed a reader's verification: %s", job, step, rank,
                      detail, extra=fields(job=job, step=step, rank=rank, tier=TierName.MEMORY, error=detail))
            self._memory.drop_job(job, step)
            return
        if tier == TierName.PEER:
            # Checked on arrival: one that fails now went bad here. Dropped; another copy is read.
            log.error("replica of %s step %d rank %d failed a reader's verification: %s", job, step, rank, detail,
                      extra=fields(job=job, step=step, rank=rank, tier=TierName.PEER, error=detail))
            if self._drop_replica is not None:
                self._drop_replica(job, step, rank, f"it failed a reader's verification: {detail[:200]}")
            return
        ckpt = self._catalog.get(job, step)
        part = ckpt.parts.get(rank, {}).get(tier) if ckpt else None
        if part is not None:
            self._quarantine.report(part, detail[:1000])
