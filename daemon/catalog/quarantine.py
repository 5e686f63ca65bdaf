"""Quarantine: a copy is hidden only when the daemon's own read proves it corrupt.

A reader (a trainer's ``load()``, the drainer, a prefetch) that finds a copy
failing verification reports it; the report is a reason to look, never a
verdict. A worker thread re-reads the copy with the daemon's own descriptors
and checks every size and checksum against the verified manifest. Only a
mismatch moves the copy aside (``.corrupt-<rank dir>-<random>`` beside it, kept
for forensics) and drops it from the index; a copy that verifies stays, and a
read that itself fails (EIO, EMFILE, a permission) hides nothing. Either way
the verdict is logged and counted (``ckptstage_corrupt_reports_total{tier,verdict}``).
Reports are handled one at a time and deduplicated per copy, so a burst of
reports costs one read.

What is moved aside is listed (``ckptstage ls``) until retention removes it
(:meth:`Quarantine.expire`): once it is older than ``[retention]
quarantine_keep_s``, and oldest first while a tier's quarantined copies hold
more than ``quarantine_max_bytes``. Those a daemon finds on its tiers (moved
aside before a restart, or by another node on a shared tier) count alike.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ckptstage.daemon.catalog.index import Catalog, Part
from ckptstage.daemon.logs import fields
from ckptstage.daemon.metrics import Metrics
from ckptstage.daemon.tiers.interface import Tier, TierName
from ckptstage.protos import chunks, layout

log = logging.getLogger(__name__)

CORRUPT_PREFIX = layout.CORRUPT_PREFIX


@dataclass(frozen=True)
class Quarantined:
    """A copy moved aside: which (a part: ``step``, ``rank``; a chunk: ``chunk``), where it lies now, and why;
    its bytes and when it was moved (unix time), which retention goes by."""

    job: str
    step: int | None
    rank: int | None
    tier: str
    where: str  # the copy now, as messages name it (a path, or an s3:// URL)
    detail: str
    location: Path | None = None  # the tier's location of it (what is deleted)
    nbytes: int = 0
    since: float = 0.0
    chunk: str = ""


class Quarantine:
    def __init__(self, catalog: Catalog, metrics: Metrics, tiers: Mapping[TierName, Tier],
                 verify: Callable[[Path], None] | None = None, keep_s: float = 7 * 86400,
                 max_bytes: int | None = None, clock: Callable[[], float] = time.time) -> None:
        """``tiers``: each disk tier's storage. ``verify(part)`` replaces the tier's own verification. Copies
        moved aside are kept ``keep_s`` seconds, and at most ``max_bytes`` of them per tier (None: no cap)."""
        self._catalog = catalog
        self._keep_s = keep_s
        self._max_bytes = max_bytes
        self._clock = clock
        self._metrics = metrics
        self._verify = verify
        self._tiers = dict(tiers)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="quarantine")
        self._lock = threading.Lock()
        self._pending: set[Path] = set()
        self._moved: list[Quarantined] = []

    def report(self, part: Part, detail: str) -> None:
        """Schedules a re-verification of ``part`` (returns at once)."""
        with self._lock:
            if part.path in self._pending:
                return
            self._pending.add(part.path)
        log.warning("%s copy of %s step %d rank %d reported corrupt (%s); re-verifying it", part.tier.value,
                    part.job, part.step, part.rank, detail, extra=_fields(part, error=detail))
        self._pool.submit(self._check, part, detail)

    def moved(self, job: str) -> list[Quarantined]:
        """The copies of ``job`` quarantined in this daemon's life, or found quarantined on its tiers."""
        with self._lock:
            return [q for q in self._moved if q.job == job]

    def usage(self, tier: TierName) -> tuple[int, int]:
        """(copies, bytes) quarantined on ``tier`` and not removed yet."""
        with self._lock:
            held = [q for q in self._moved if q.tier == tier.value]
        return len(held), sum(q.nbytes for q in held)

    def load_tier(self, tier: TierName) -> int:
        """Finds the copies moved aside on ``tier`` (before a restart, or by another daemon on a shared tier)
        that are not listed yet; returns how many."""
        storage = self._tiers[tier]
        found = storage.list_quarantined()
        with self._lock:
            known = {q.location for q in self._moved}
            new = [Quarantined(q.job, q.step, q.rank, tier.value, storage.name_of(q.location), "found at start",
                               q.location, q.nbytes, q.since, q.chunk) for q in found if q.location not in known]
            self._moved += new
        return len(new)

    def find_on(self, tier: TierName) -> None:
        """:meth:`load_tier` on a tier that may fail to answer (the shared one): a failure is logged, and the
        next indexing of the tier tries again."""
        try:
            self.load_tier(tier)
        except OSError as e:
            log.warning("cannot list the copies moved aside on the %s tier: %s", tier.value, e,
                        extra=fields(tier=tier, error=e))

    def expire(self, tier: TierName) -> int:
        """Removes the copies moved aside on ``tier`` that are older than ``keep_s``, then the oldest while they
        hold more than ``max_bytes``; returns how many went. One that cannot be removed stays listed (tried
        again at the next pass); one already gone (another node's retention) is dropped from the list."""
        now = self._clock()
        with self._lock:
            held = sorted((q for q in self._moved if q.tier == tier.value), key=lambda q: q.since)
        total = sum(q.nbytes for q in held)
        doomed = []
        for q in held:  # oldest first
            why = self._why_remove(q, now, total)
            if why is not None:
                doomed.append((q, why))
                total -= q.nbytes
        removed = 0
        for q, why in doomed:
            try:
                if q.location is not None:
                    self._tiers[tier].delete_quarantined(q.location)
                log.info("removed the quarantined %s (%d bytes): %s", q.where, q.nbytes, why,
                         extra=fields(job=q.job, step=q.step, rank=q.rank, tier=tier, bytes=q.nbytes))
            except FileNotFoundError:
                pass  # another daemon's retention removed it
            except (OSError, ValueError) as e:
                log.warning("cannot remove the quarantined %s: %s", q.where, e, extra=fields(tier=tier, error=e))
                continue
            with self._lock:
                self._moved = [m for m in self._moved if m is not q]
            removed += 1
        return removed

    def _why_remove(self, q: Quarantined, now: float, total: int) -> str | None:
        """Why ``q`` goes now (``total``: what the tier's quarantined copies still hold), or None."""
        if now - q.since > self._keep_s:
            return f"older than {self._keep_s:g} s ([retention] quarantine_keep_s)"
        if self._max_bytes is not None and total > self._max_bytes:
            return f"{total} bytes quarantined on the tier, more than [retention] quarantine_max_bytes"
        return None

    def _storage(self, part: Part) -> Tier:
        return self._tiers[part.tier]

    def _name(self, part: Part) -> str:
        return self._storage(part).name_of(part.path)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _check(self, part: Part, detail: str) -> None:
        tier = part.tier.value
        try:
            verdict = self._own_verdict(part)
        except OSError as e:
            self._metrics.corrupt_reports.labels(tier, "unreadable").inc()
            log.error("cannot re-verify %s (%s): nothing is hidden", self._name(part), e,
                      extra=_fields(part, error=e))
            return
        finally:
            with self._lock:
                self._pending.discard(part.path)
        if verdict is None:
            self._metrics.corrupt_reports.labels(tier, "intact").inc()
            log.warning("%s verifies: the report (%s) was wrong, the copy stays", self._name(part), detail,
                        extra=_fields(part))
            return
        self._move_aside(part, verdict)
        # Counted once the copy is out of sight: whoever sees the count sees the quarantine done.
        self._metrics.corrupt_reports.labels(tier, "corrupt").inc()
        self._metrics.corrupt.labels(tier).inc()

    def _own_verdict(self, part: Part) -> layout.ManifestError | None:
        """None if the copy verifies; the failure, if the daemon's own read proves it corrupt.

        Raises OSError when the read itself failed: then nothing is known.
        """
        storage = self._storage(part)
        if not storage.has_part(part.path):
            raise FileNotFoundError(f"{self._name(part)} is gone (deleted by retention meanwhile?)")
        try:
            (self._verify or storage.verify_part)(part.path)
            # The copy may verify by itself and still not be the one committed: a manifest rewritten whole.
            # Unless it is another part than the one indexed (a replacement put in place meanwhile).
            if not part.ino or storage.part_version(part.path) == part.ino:
                layout.check_committed_manifest(part.path, storage.read_manifest(part.path)[1], part.digest)
        except layout.ManifestError as e:
            if not layout.is_verification_failure(e):
                assert isinstance(e.__cause__, OSError)
                raise e.__cause__ from e
            return e
        return None

    def _move_aside(self, part: Part, failure: layout.ManifestError) -> None:
        storage = self._storage(part)
        why = f"{storage.name_of(failure.path)}: {failure.detail}" if isinstance(failure, layout.ChecksumMismatch) \
            else str(failure)
        if isinstance(failure, layout.ChecksumMismatch):
            # A corrupt chunk of an incremental part leaves its store: no later save may reuse it, and the
            # next that has its bytes writes them again. A part's own file goes with the part.
            try:
                size = _size_of(storage, failure.path)
                moved = storage.quarantine_chunk(failure.path)
                if moved is not None:
                    size = size or next((q.nbytes for q in storage.list_quarantined() if q.location == moved), 0)
                    self._record(part, moved, why, size, chunk=failure.path.name)  # a chunk's name, or its pack's
                    log.error("quarantined the corrupt chunk %s as %s", storage.name_of(failure.path),
                              storage.name_of(moved),
                              extra=_fields(part, error=why))
            except OSError as e:
                log.error("cannot quarantine the chunk %s: %s", storage.name_of(failure.path), e,
                          extra=_fields(part, error=e))
        # Moved first, dropped from the index after, as a deletion is: a re-read of the tier in between
        # finds the part still indexed or gone, never a part it does not know of, which it would index again
        # (from the step's record, unread) and keep listing once the copy was moved aside.
        try:
            target = storage.quarantine_part(part.path)
        except OSError as e:
            log.error("cannot quarantine %s: %s (it is no longer indexed)", storage.name_of(part.path), e,
                      extra=_fields(part, error=e))
            return
        finally:
            self._catalog.remove(part)
        self._record(part, target, why, part.nbytes)
        log.error("quarantined the %s copy of %s step %d rank %d as %s: %s", part.tier.value, part.job,
                  part.step, part.rank, storage.name_of(target), why, extra=_fields(part, error=why))


    def _record(self, part: Part, moved: Path, why: str, nbytes: int, chunk: str = "") -> None:
        """Lists a copy just moved aside (a chunk: by its name alone; steps share it)."""
        storage = self._storage(part)
        step, rank = (None, None) if chunk else (part.step, part.rank)
        with self._lock:
            self._moved.append(Quarantined(part.job, step, rank, part.tier.value, storage.name_of(moved), why,
                                           moved, nbytes, self._clock(), chunk))


def _size_of(storage: Tier, location: Path) -> int:
    """The bytes of the chunk whose own file is ``location`` (0: not a chunk's own file, or gone)."""
    store = location.parent.parent  # <tier>/<job or the user's store>/chunks
    if not chunks.is_chunk_name(location.name) or store.name != chunks.CHUNKS_DIR:
        return 0
    try:
        return storage.chunk_size(store.parent.name, location.name)
    except OSError:
        return 0


def _fields(part: Part, error: object = None) -> dict[str, object]:
    return fields(job=part.job, step=part.step, rank=part.rank, tier=part.tier, bytes=part.nbytes, error=error)
