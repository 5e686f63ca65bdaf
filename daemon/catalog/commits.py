"""Commit records: one commit per step, across ranks and nodes.

A step is complete when every rank's part of ONE attempt (one run of the job,
agreed by all its ranks) is committed. On each tier the step's commit record,
``<tier>/<job>/step-N/commit.json`` (:class:`layout.CommitRecord`), is
written last and atomically once that is so, and a step exists on a tier if
and only if its record is there with every part it names
(:meth:`Checkpoint.complete_on`).

* Local tier: this daemon is the tier's only writer, so the record is written
  from the index when the last part of an attempt commits here (a single-node
  job, or a prefetch), and on restart for a step whose record a crash
  prevented.
* Shared tier: written exactly once, by whichever node's drain finishes the
  set last (:meth:`Tier.create_commit_record`: ``link()`` on a file system):
  of two daemons racing, one creates it and the other finds it.

The rules for saving a step again live here too: a step with a commit record
is never overwritten; an earlier attempt's part of an incomplete step is
replaced by a later attempt's; a committed step is replaced whole
(:mod:`ckptstage.daemon.catalog.overwrite`).

Waiting for a step (:meth:`Commits.wait_step`) sleeps on the records this
daemon indexes: every record written here, or swapped in, wakes the waits at
once; the shared tier, where other nodes' daemons write, is re-read on a poll.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ckptstage.daemon.catalog.index import Catalog, Checkpoint, Part, TierName
from ckptstage.daemon.errors import AlreadyExists
from ckptstage.daemon.logs import fields
from ckptstage.daemon.catalog.overwrite import Swapper
from ckptstage.daemon.catalog.sealing import SharedSeal, complete_attempt  # noqa: F401 - re-exported
from ckptstage.daemon.tiers.interface import Tier
from ckptstage.protos import layout

log = logging.getLogger(__name__)

# How often a step wait looks again by default ([shared] step_poll_s; the shared tier is re-read at this pace).
POLL_S = 0.25


def committed_parts(parts: dict[int, Part]) -> dict[int, layout.CommittedPart]:
    """What a commit record says of each rank's part: enough to index it without opening its manifest."""
    return {r: layout.CommittedPart(p.nbytes, p.digest, p.created, p.metrics) for r, p in parts.items()}


class Commits:
    """Writes commit records, and judges whether a (job, step, rank) may be saved again."""

    def __init__(self, catalog: Catalog, local: Tier, shared: Tier | None,
                 clock: Callable[[], float] = time.time, poll_s: float = POLL_S) -> None:
        """``local`` and ``shared`` are the tiers' storage (no shared tier: None); ``poll_s``: how often a step
        wait re-reads the shared tier."""
        self.poll_s = poll_s
        self.catalog = catalog
        self.tiers = {TierName.LOCAL: local}
        if shared is not None:
            self.tiers[TierName.SHARED] = shared
        self.clock = clock
        self._swapper = Swapper(catalog, self.tiers)
        # Notified whenever a commit record is indexed here: what wait_step sleeps on.
        self._recorded = threading.Condition()

    # --- saving a step again ----------------------------------------------------------

    def check_begin(self, job: str, step: int, rank: int, attempt: str, overwrite: bool = False) -> bool:
        """Refuses a save of (job, step, rank) that would overwrite a committed step or the same attempt's part;
        returns whether the save replaces a committed step (see :mod:`ckptstage.daemon.catalog.overwrite`).

        Allowed: a step nobody saved, or one whose only parts for this rank
        belong to another attempt and that has no commit record on any tier
        (a crashed run's leftovers: they are replaced at commit). With
        ``overwrite``, anything: a committed step is replaced whole, a part of
        an incomplete step in place.
        """
        ckpt = self.catalog.get(job, step)
        if ckpt is None:
            return False
        if ckpt.records:
            if overwrite:
                return True
            record = next(iter(ckpt.records.values()))
            raise AlreadyExists(f"step {step} of job {job!r} is committed (attempt {record.attempt!r}, "
                                f"{record.world_size} ranks); rank {rank} cannot save it again: save a new step, "
                                "or save with overwrite=True to replace it")
        for tier, part in sorted(ckpt.parts.get(rank, {}).items()):
            if part.attempt == attempt and not overwrite:
                raise AlreadyExists(f"step {step} of job {job!r} rank {rank} is already committed on the "
                                    f"{tier.value} tier by this attempt ({attempt!r}); save a new step, or save "
                                    "with overwrite=True to replace it")
        return False

    def replacer(self, tier: TierName, job: str, step: int, attempt: str,
                 overwrite: bool = False) -> Callable[[Path], bool]:
        """The ``replace`` policy of a :class:`PartWriter <ckptstage.daemon.tiers.interface.PartWriter>` committing a
        part of ``attempt`` to ``tier``.

        A part already at the destination may be replaced only when the step
        has no commit record, neither on that tier nor in the index (any
        tier), and the part belongs to another attempt (or ``overwrite``).
        """
        storage = self.tiers[tier]

        def may_replace(final: Path) -> bool:
            if storage.has_commit_record(final.parent):
                return False
            ckpt = self.catalog.get(job, step)
            if ckpt is not None and ckpt.records:
                return False
            try:
                theirs: str | None = layout.manifest_attempt(storage.read_manifest(final)[0])
            except layout.ManifestError:
                theirs = None  # an unreadable part of a step nobody committed: nothing to keep
            if theirs == attempt and not overwrite:
                return False
            log.info("replacing %s (attempt %r) by attempt %r's part: the step has no commit record", final,
                     theirs, attempt, extra=fields(job=job, step=step, attempt=attempt))
            return True

        return may_replace

    # --- writing records ------------------------------------------------------------------

    def swap_in(self, tier: TierName, record: layout.CommitRecord, parts: dict[int, Part]) -> list[Part]:
        """Puts a whole staged replacement in place of its step on ``tier`` with ``record`` (see
        :class:`overwrite.Swapper <ckptstage.daemon.catalog.overwrite.Swapper>`); returns the new parts, [] when
        another thread swapped it in already."""
        moved = self._swapper.swap_in(tier, record, parts)
        if moved:
            self.wake()
        return moved

    def replacement_record(self, job: str, step: int, attempt: str, world: int,
                           parts: dict[int, Part]) -> layout.CommitRecord:
        """The commit record of a replacement of (job, step): its parts, and what it replaces on any tier."""
        ckpt = self.catalog.get(job, step)
        old = [ckpt.records[t] for t in (TierName.LOCAL, TierName.SHARED) if ckpt and t in ckpt.records]
        chain: list[str] = []
        for fp in [r.fingerprint() for r in old] + [fp for r in old for fp in r.replaces]:
            if fp not in chain:
                chain.append(fp)
        return layout.CommitRecord(job, step, attempt, world, self.clock(), committed_parts(parts),
                                   tuple(chain[:layout.MAX_REPLACES]))

    def seal_local(self, job: str, step: int) -> layout.CommitRecord | None:
        """Writes the local record when every rank's part of one attempt is committed on the local tier.

        Judged from the index: this daemon is the local tier's only writer.
        Returns the record on the tier (new or already there), or None.
        """
        ckpt = self.catalog.get(job, step)
        if ckpt is None:
            return None
        if TierName.LOCAL in ckpt.records:
            self.wake()  # its parts may have just come back (a prefetch): the step may be complete again
            return ckpt.records[TierName.LOCAL]
        found = complete_attempt(ckpt.on_tier(TierName.LOCAL))
        if found is None:
            return None
        return self._publish(TierName.LOCAL, job, step, *found)

    def seal_shared(self, job: str, step: int, world: int | None = None) -> layout.CommitRecord | None:
        """After this node published its parts of (job, step) on the shared tier: writes the step's record
        there if every part of one attempt is there and no record is (exactly once across nodes); see
        :class:`sealing.SharedSeal <ckptstage.daemon.catalog.sealing.SharedSeal>`. ``world``: the job's world
        size as this node's parts say (None: recovery at start, which seals whatever is whole).

        Runs on a drain thread; raises OSError when the shared tier fails.
        """
        # Made per call: held here, its callbacks into this object would make a cycle the collector frees late.
        sealer = SharedSeal(self.catalog, self.tiers[TierName.SHARED], self._publish_shared, self._replaced_here)
        return sealer.seal(job, step, world)

    def _replaced_here(self, job: str, step: int, attempt: str, shared: dict[int, Part]) -> list[int]:
        """Ranks whose shared part this node holds a different local part of, same attempt (a part saved
        again with overwrite whose new version has not drained yet): sealing now would mix versions."""
        ckpt = self.catalog.get(job, step)
        if ckpt is None:
            return []
        return [r for r, part in sorted(shared.items())
                if (local := ckpt.parts.get(r, {}).get(TierName.LOCAL)) is not None
                and local.attempt == attempt and local.digest != part.digest]

    def seal_all(self, tier: TierName) -> int:
        """Writes every record a crash prevented (restart is recovery); returns how many were written."""
        written = 0
        for job in self.catalog.jobs():
            for ckpt in self.catalog.checkpoints(job):
                if tier in ckpt.records or complete_attempt(ckpt.on_tier(tier)) is None:
                    continue
                storage = self.tiers.get(tier)
                if storage is not None and storage.has_commit_record(storage.step_location(job, ckpt.step)):
                    continue  # there but not trusted: left for a person to look at
                sealed = self.seal_local(job, ckpt.step) if tier == TierName.LOCAL else \
                    self.seal_shared(job, ckpt.step)
                if sealed is not None:
                    written += 1
                    log.info("wrote the missing %s commit record of %s step %d (attempt %r)", tier.value, job,
                             ckpt.step, sealed.attempt, extra=fields(job=job, step=ckpt.step, tier=tier))
        return written

    def _publish_shared(self, job: str, step: int, attempt: str, world: int, parts: dict[int, Part],
                        index: str = "") -> layout.CommitRecord | None:
        return self._publish(TierName.SHARED, job, step, attempt, world, parts, index)

    def _publish(self, tier: TierName, job: str, step: int, attempt: str, world: int,
                 parts: dict[int, Part], index: str = "") -> layout.CommitRecord | None:
        """Writes the step's record on ``tier`` (naming the digest of the step's ``index`` written there)."""
        record = layout.CommitRecord(job, step, attempt, world, self.clock(), committed_parts(parts), index_digest=index)
        storage = self.tiers[tier]
        where = storage.step_location(job, step)
        final = where / layout.COMMIT_FILE  # what the log names
        if storage.create_commit_record(where, record):
            self.catalog.set_record(tier, record, storage.record_version(where))
            self.wake()
            log.info("committed %s step %d on the %s tier: %d ranks of attempt %r", job, step, tier.value, world,
                     attempt, extra=fields(job=job, step=step, tier=tier, world_size=world, attempt=attempt))
            return record
        # Another writer (another node's drain, or a racing commit here) created it first.
        try:
            theirs = storage.read_commit_record(where)
        except layout.ManifestError as e:
            log.error("the %s commit record %s is not trusted: %s", tier.value, final, e,
                      extra=fields(job=job, step=step, tier=tier, error=e))
            return None
        if theirs is None:
            return None
        if theirs.attempt != attempt:
            log.warning("%s step %d is committed on the %s tier by attempt %r; the parts of attempt %r there "
                        "are stragglers", job, step, tier.value, theirs.attempt, attempt,
                        extra=fields(job=job, step=step, tier=tier, attempt=attempt))
        self.catalog.set_record(tier, theirs, storage.record_version(where))
        self.wake()
        return theirs

    # --- waiting for a step ---------------------------------------------------------------

    def wait_step(self, job: str, step: int, tier: TierName | None, timeout: float,
                  refresh: Callable[[str, int, float], object] | None = None,
                  stop: threading.Event | None = None) -> Checkpoint | None:
        """The step once it is complete on ``tier`` (None: any tier); None at the timeout or once ``stop`` is set.

        A record this daemon indexes (a commit here, a replacement swapped
        in, a shared record its drain wrote) ends the wait at once. Records
        other nodes' daemons write are noticed by ``refresh(job, step,
        wait_s)``, called every ``poll_s`` unless the wait is for the
        local tier, which only this daemon writes; it waits at most ``wait_s``
        (see :class:`SharedSync`). ``stop`` (the daemon shutting down, which
        then calls :meth:`wake`) ends the wait: the thread that runs it must
        not hold the process's exit.
        """
        deadline = time.monotonic() + timeout
        stop = stop or threading.Event()
        poll = refresh if tier != TierName.LOCAL else None
        while True:
            if poll is not None:
                poll(job, step, max(0.0, deadline - time.monotonic()))
            next_poll = time.monotonic() + self.poll_s
            with self._recorded:  # checked under the lock the notifier takes: no wake-up is lost
                while True:
                    if stop.is_set():
                        return None
                    ckpt = self.catalog.get(job, step)
                    if ckpt is not None and (ckpt.complete if tier is None else ckpt.complete_on(tier)):
                        return ckpt
                    now = time.monotonic()
                    if now >= deadline:
                        return None
                    if poll is not None and now >= next_poll:
                        break  # the shared tier is read again
                    self._recorded.wait(min(deadline, next_poll) - now if poll is not None else deadline - now)

    def wake(self) -> None:
        """Wakes every step wait to look again: a record was indexed, or the daemon is stopping."""
        with self._recorded:
            self._recorded.notify_all()
