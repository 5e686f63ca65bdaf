"""Bringing the catalogue's index of a tier in step with the tier: at start, and as other nodes write to it.

Other nodes' daemons write other ranks of the same job to the shared tier,
write commit records and delete steps their retention gave up; a re-read
brings the index in step with them. What a re-read costs the tier is what a
shared file system's metadata server sees from every node, so it reads no
more than it must: known parts and records are not read again unless their
version changed; a part of a step whose commit record names it is indexed from
the record (:meth:`Part.from_record <ckptstage.daemon.catalog.parts.Part.from_record>`), its manifest
left unopened; and parts of steps nobody committed yet are read only when the
caller wants them (``uncommitted``).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Protocol

from ckptstage.daemon.catalog.parts import Part
from ckptstage.daemon.logs import fields
from ckptstage.daemon.tiers.interface import PartIndex, TierName
from ckptstage.protos import layout

log = logging.getLogger(__name__)


class Indexed(Protocol):
    """What a re-read changes: the catalogue (:class:`ckptstage.daemon.catalog.index.Catalog`)."""

    def known_on(self, tier: TierName, job: str, step: int | None
                 ) -> tuple[dict[tuple[int, int], Part], dict[int, tuple[layout.CommitRecord, int]]]: ...

    def add(self, part: Part) -> None: ...

    def remove(self, part: Part) -> None: ...

    def record(self, job: str, step: int, tier: TierName) -> layout.CommitRecord | None: ...

    def set_record(self, tier: TierName, record: layout.CommitRecord, ino: int = 0) -> None: ...

    def drop_record(self, tier: TierName, job: str, step: int) -> None: ...


class Reindexer:
    """Re-reads a tier into the catalogue (see the module docstring); each call names the catalogue, which
    holds this object (no reference back: the catalogue is freed when its owner lets it go)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._untrusted: dict[Path, int] = {}  # commit records that failed verification, logged once per inode

    def load_tier(self, catalog: Indexed, tier: TierName, source: PartIndex) -> int:
        """Indexes every committed part and commit record on a tier; returns how many parts."""
        return sum(self._sync(catalog, tier, source, job, None)[2] for job in source.list_jobs())

    def sync_job(self, catalog: Indexed, tier: TierName, source: PartIndex, job: str, step: int | None = None,
                 uncommitted: bool = True) -> tuple[int, int]:
        """Re-reads one job's directory on a tier (or one step's); returns (parts added, parts dropped).

        Other nodes' daemons write other ranks of the same job to the shared
        tier, write commit records and delete steps their retention gave up;
        this brings the index in step with them. Known parts and records are
        not re-read unless their inode changed (a part of another attempt
        replaced under the same name). ``uncommitted`` False: parts this
        index does not know yet are read only in steps whose commit record
        names them (what a reader needs, at one file per step), never one
        manifest per part of a step other nodes are still draining.
        """
        added, dropped, _ = self._sync(catalog, tier, source, job, step, uncommitted)
        return added, dropped

    def sync_record(self, catalog: Indexed, tier: TierName, source: PartIndex, job: str, step: int
                    ) -> tuple[int, int]:
        """Re-reads one step for a reader waiting for it to be complete: one look at its commit record (a
        stat, a HEAD), and the step itself (:meth:`sync_job`) only once the record appeared, changed or went.

        Other nodes' parts of a step not committed yet are left unread: a
        waiter needs the record, and once it is there every part is indexed
        from it. N daemons polling a step of W parts while it drains cost
        one call each per poll, not W stats and manifest reads.
        """
        version = source.record_version(source.step_location(job, step))
        had = catalog.known_on(tier, job, step)[1].get(step)
        if version == (had[1] if had is not None else 0):
            return 0, 0
        return self.sync_job(catalog, tier, source, job, step, uncommitted=False)

    def _sync(self, catalog: Indexed, tier: TierName, storage: PartIndex, job: str, step: int | None,
              uncommitted: bool = True) -> tuple[int, int, int]:
        # What is known is read before the disk: a part deleted (renamed away, then dropped from
        # the index) between the two reads is then never indexed again.
        known, known_records = catalog.known_on(tier, job, step)
        # Not reading uncommitted steps' parts, nothing needs checking one by one: a record names its parts.
        steps = list(storage.list_steps(job, step, {p.path: p.ino for p in known.values()}, trust=not uncommitted))
        # Records first: a part of a step whose record names it is indexed from the record, its manifest
        # left unopened (a node learning of a W-part step another node committed opens one file, not W).
        seen_records = set()
        for sref in steps:
            if sref.record_ino is None:
                continue
            seen_records.add(sref.step)
            have = known_records.get(sref.step)
            if have is None or have[1] != sref.record_ino:
                self._read_record(catalog, tier, storage, job, sref)
        for s in known_records.keys() - seen_records:
            catalog.drop_record(tier, job, s)
        found = {(ref.step, ref.rank): ref for sref in steps for ref in sref.parts}
        added = dropped = 0
        for key, ref in found.items():
            old = known.get(key)
            if old is None or old.path != ref.path or (ref.ino and old.ino != ref.ino):
                record = catalog.record(job, ref.step, tier)
                if record is None and not uncommitted and old is None:
                    continue
                try:
                    part = Part.from_record(ref, tier, record) if record is not None else None
                    catalog.add(part or Part.read(ref, tier, storage))
                    added += 1
                except (layout.ManifestError, KeyError, ValueError, TypeError) as e:
                    log.error("ignoring part %s: %s", ref.path, e,
                              extra=fields(job=job, step=ref.step, rank=ref.rank, tier=tier, error=e))
        for key, part in known.items():
            if key not in found:
                catalog.remove(part)
                dropped += 1
        return added, dropped, len(found)

    def _read_record(self, catalog: Indexed, tier: TierName, storage: PartIndex, job: str,
                     sref: layout.StepRef) -> None:
        path = sref.path / layout.COMMIT_FILE
        try:
            record = storage.read_commit_record(sref.path)
            if record is not None and (record.job, record.step) != (job, sref.step):
                raise layout.ManifestError(f"{path}: commit record names {record.job!r} step {record.step}")
        except layout.ManifestError as e:
            with self._lock:
                first = self._untrusted.get(path) != sref.record_ino
                self._untrusted[path] = sref.record_ino or 0
            if first:
                log.error("not trusting the commit record %s (the step is not complete on the %s tier): %s",
                          path, tier.value, e, extra=fields(job=job, step=sref.step, tier=tier, error=e))
            catalog.drop_record(tier, job, sref.step)
            return
        if record is None:
            catalog.drop_record(tier, job, sref.step)
        else:
            catalog.set_record(tier, record, sref.record_ino or 0)
