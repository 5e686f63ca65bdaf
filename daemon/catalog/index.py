"""The daemon's index of committed parts on every tier, rebuilt from disk on start.

Only renamed-into-place parts with a readable manifest are ever indexed, so
everything the catalogue answers (list, latest, locate) is restorable by
construction (invariant 1). Pins, and which local parts have been drained,
are kept in small JSON files on the local tier so that they survive restarts.

*Drained* is remembered apart from the shared copy itself: a local part whose
shared copy was committed and later deleted by the shared tier's own rules
(a shorter ``keep_last`` there) has still been drained. Without the record,
retention would protect it as the only copy forever and the drainer would
copy it again after every restart.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from pathlib import Path

from ckptstage.daemon import fsutil
from ckptstage.daemon.logs import fields
from ckptstage.daemon.catalog.parts import Checkpoint, Part, view as _view
from ckptstage.daemon.catalog.reindex import Reindexer
from ckptstage.daemon.tiers.interface import Tier, TierName
from ckptstage.protos import layout

__all__ = ["Catalog", "Checkpoint", "Part", "TierName"]  # Part, Checkpoint and TierName re-exported

log = logging.getLogger(__name__)


Key = tuple[str, int, int]  # job, step, rank


class Catalog:
    """Thread-safe index: job -> step -> rank -> tier -> :class:`Part`."""

    def __init__(self, pins_file: Path, drained_file: Path | None = None) -> None:
        self._lock = threading.Lock()
        self._persist_lock = threading.Lock()  # one writer of the state files at a time
        self._parts: dict[str, dict[int, dict[int, dict[TierName, Part]]]] = {}
        # job -> step -> tier -> (verified commit record, inode of commit.json)
        self._records: dict[str, dict[int, dict[TierName, tuple[layout.CommitRecord, int]]]] = {}
        self._pins_file = pins_file
        self._pins: dict[str, set[int]] = {
            job: set(steps) for job, steps in fsutil.read_json(pins_file, {}).items()}
        self._drained_file = drained_file or pins_file.with_name("drained.json")
        # (job, step, rank) -> the manifest digest of the local part that reached the shared tier ("": a
        # record of an older daemon, which names no digest and counts for whatever part is there).
        self._drained: dict[Key, str] = {
            (str(e[0]), int(e[1]), int(e[2])): str(e[3]) if len(e) > 3 else ""
            for e in fsutil.read_json(self._drained_file, [])}
        self._reindex = Reindexer()

    def load_tier(self, tier: TierName, source: Tier) -> int:
        """Indexes every committed part and commit record on a tier; returns how many parts."""
        return self._reindex.load_tier(self, tier, source)

    def sync_job(self, tier: TierName, source: Tier, job: str, step: int | None = None,
                 uncommitted: bool = True) -> tuple[int, int]:
        """Re-reads one job on a tier (or one step); returns (parts added, parts dropped). See
        :meth:`Reindexer.sync_job <ckptstage.daemon.catalog.reindex.Reindexer.sync_job>`."""
        return self._reindex.sync_job(self, tier, source, job, step, uncommitted)

    def sync_record(self, tier: TierName, source: Tier, job: str, step: int) -> tuple[int, int]:
        """Re-reads one step for a reader waiting for its commit record; see
        :meth:`Reindexer.sync_record <ckptstage.daemon.catalog.reindex.Reindexer.sync_record>`."""
        return self._reindex.sync_record(self, tier, source, job, step)

    def known_on(self, tier: TierName, job: str, step: int | None
                 ) -> tuple[dict[tuple[int, int], Part], dict[int, tuple[layout.CommitRecord, int]]]:
        """What is indexed of ``job`` (or one step) on ``tier``: (step, rank) -> part, and step -> (record,
        version of its file)."""
        with self._lock:
            parts = {(s, rank): tiers[tier] for s, ranks in self._parts.get(job, {}).items()
                     if step in (None, s) for rank, tiers in ranks.items() if tier in tiers}
            records = {s: tiers[tier] for s, tiers in self._records.get(job, {}).items()
                       if step in (None, s) and tier in tiers}
        return parts, records

    def set_record(self, tier: TierName, record: layout.CommitRecord, ino: int = 0) -> None:
        """Indexes a verified commit record of a step on a tier."""
        with self._lock:
            self._records.setdefault(record.job, {}).setdefault(record.step, {})[tier] = (record, ino)

    def drop_record(self, tier: TierName, job: str, step: int) -> None:
        with self._lock:
            steps = self._records.get(job, {})
            steps.get(step, {}).pop(tier, None)
            if not steps.get(step, True):
                steps.pop(step, None)
            if not steps:
                self._records.pop(job, None)

    def record(self, job: str, step: int, tier: TierName) -> layout.CommitRecord | None:
        with self._lock:
            entry = self._records.get(job, {}).get(step, {}).get(tier)
        return entry[0] if entry else None

    def replace_tier(self, tier: TierName, record: layout.CommitRecord, ino: int, parts: list[Part]) -> None:
        """Puts a replaced step's parts and commit record on ``tier`` in place of what was indexed there,
        in one step under the lock: a reader never finds the step half replaced (no record, or the old
        record with the new parts)."""
        job, step = record.job, record.step
        with self._lock:
            ranks = self._parts.setdefault(job, {}).setdefault(step, {})
            for rank in list(ranks):
                ranks[rank].pop(tier, None)
                if not ranks[rank]:
                    del ranks[rank]
            forget = False
            for part in parts:
                ranks.setdefault(part.rank, {})[tier] = part
                if tier == TierName.LOCAL and (job, step, part.rank) in self._drained:
                    del self._drained[(job, step, part.rank)]  # the old part's drain is not this one's
                    forget = True
            self._records.setdefault(job, {}).setdefault(step, {})[tier] = (record, ino)
        if forget:
            self._write_drained()

    def add(self, part: Part) -> None:
        key = (part.job, part.step, part.rank)
        with self._lock:
            ranks = self._parts.setdefault(part.job, {}).setdefault(part.step, {})
            tiers = ranks.setdefault(part.rank, {})
            old = tiers.get(part.tier)
            tiers[part.tier] = part
            # A local part replaced by another (a later attempt's): the old one's drain is not this one's.
            forget = part.tier == TierName.LOCAL and old is not None and old.digest != part.digest and \
                key in self._drained
            if forget:
                del self._drained[key]
        if forget:
            self._write_drained()

    def remove(self, part: Part) -> None:
        with self._lock:
            steps = self._parts.get(part.job, {})
            tiers = steps.get(part.step, {}).get(part.rank, {})
            indexed = tiers.get(part.tier)
            if indexed is not None and (indexed.path != part.path or indexed.digest != part.digest):
                return  # another copy took its place meanwhile (a prefetch, a later attempt); it stays indexed
            tiers.pop(part.tier, None)
            if not tiers:
                steps.get(part.step, {}).pop(part.rank, None)
            if not steps.get(part.step, True):
                steps.pop(part.step, None)
            if not steps:
                self._parts.pop(part.job, None)
            forget = part.tier == TierName.LOCAL and (part.job, part.step, part.rank) in self._drained
            if forget:
                del self._drained[(part.job, part.step, part.rank)]
        if forget:
            self._write_drained()

    # --- drained ---------------------------------------------------------------------

    def mark_drained(self, job: str, step: int, rank: int, digest: str) -> None:
        """Records that the local part (job, step, rank) with manifest ``digest`` is on the shared tier."""
        key = (job, step, rank)
        with self._lock:
            if self._drained.get(key) == digest:
                return
            self._drained[key] = digest
        self._write_drained()

    def was_drained(self, job: str, step: int, rank: int) -> bool:
        """Whether the local part (job, step, rank) there now, that very part, reached the shared tier.

        The record names the part's manifest digest: a part replaced under the
        same name (a save with overwrite) is not drained because its
        predecessor was, whatever order the replacement and a drain finished in,
        and across a crash between the two.
        """
        key = (job, step, rank)
        with self._lock:
            digest = self._drained.get(key)
            if digest is None:
                return False
            local = self._parts.get(job, {}).get(step, {}).get(rank, {}).get(TierName.LOCAL)
            return digest == "" or (local is not None and local.digest == digest)

    def prune_drained(self) -> int:
        """Forgets drained records of parts no longer on the local tier, or replaced there; returns how many."""
        with self._lock:
            local = {(p.job, p.step, p.rank): p.digest for steps in self._parts.values()
                     for ranks in steps.values() for tiers in ranks.values() for t, p in tiers.items()
                     if t == TierName.LOCAL}
            stale = [k for k, d in self._drained.items() if k not in local or d not in ("", local[k])]
            if not stale:
                return 0
            for k in stale:
                del self._drained[k]
        self._write_drained()
        return len(stale)

    def _write_drained(self) -> None:
        """Writes the drained set as it is now.

        Writers take turns and each snapshots under its turn, so the file
        always ends with the newest state; snapshots taken before the turn
        could land out of order and lose a record.
        """
        try:
            with self._persist_lock:
                with self._lock:
                    snapshot = [[*k, d] for k, d in sorted(self._drained.items())]
                fsutil.write_json_atomic(self._drained_file, snapshot)
        except OSError as e:
            # Only costs a redundant copy after a restart; never a checkpoint.
            log.warning("cannot record drained parts in %s: %s", self._drained_file, e,
                        extra=fields(tier=TierName.LOCAL, error=e))

    def set_peer_tier(self, job: str, parts: list[Part], records: list[layout.CommitRecord]) -> None:
        """Puts what the peer tier holds of ``job`` (and its commit records) in place of what was indexed
        there, in one step (see :mod:`ckptstage.daemon.peers.view`)."""
        peer = TierName.PEER
        with self._lock:
            steps = self._parts.setdefault(job, {})
            for step in list(steps):
                for rank in list(steps[step]):
                    steps[step][rank].pop(peer, None)
                    if not steps[step][rank]:
                        del steps[step][rank]
                if not steps[step]:
                    del steps[step]
            for part in parts:
                steps.setdefault(part.step, {}).setdefault(part.rank, {})[peer] = part
            if not steps:
                del self._parts[job]
            held = self._records.setdefault(job, {})
            for step in list(held):
                held[step].pop(peer, None)
                if not held[step]:
                    del held[step]
            for record in records:
                held.setdefault(record.step, {})[peer] = (record, 0)
            if not held:
                del self._records[job]

    def has(self, job: str, step: int, rank: int) -> bool:
        with self._lock:
            return rank in self._parts.get(job, {}).get(step, {})

    def parts_of(self, job: str, step: int, rank: int) -> dict[TierName, Part]:
        """Every indexed copy of one rank's part, by tier (of whatever attempt)."""
        with self._lock:
            return dict(self._parts.get(job, {}).get(step, {}).get(rank, {}))

    def jobs(self) -> list[str]:
        with self._lock:
            return sorted(self._parts.keys() | self._records.keys())

    def checkpoints(self, job: str) -> list[Checkpoint]:
        """Every step of a job that has a committed part or a commit record, oldest first."""
        with self._lock:
            steps = self._parts.get(job, {})
            records = self._records.get(job, {})
            pins = self._pins.get(job, set())
            return [_view(job, step, steps.get(step, {}), records.get(step, {}), step in pins)
                    for step in sorted(steps.keys() | records.keys())]

    def get(self, job: str, step: int) -> Checkpoint | None:
        with self._lock:
            ranks = self._parts.get(job, {}).get(step, {})
            records = self._records.get(job, {}).get(step, {})
            if not ranks and not records:
                return None
            return _view(job, step, ranks, records, step in self._pins.get(job, set()))

    def newest_part_bytes(self, job: str, rank: int, world_size: int) -> int:
        """The size of ``rank``'s part in the job's newest step saved at ``world_size`` (0: none here).

        What a new session of that rank will most likely save again: the
        daemon sizes its arena from it before the first save asks.
        """
        with self._lock:
            for step in sorted(self._parts.get(job, {}), reverse=True):
                tiers = self._parts[job][step].get(rank, {})
                part = tiers.get(TierName.LOCAL) or tiers.get(TierName.SHARED)
                if part is not None and part.world_size == world_size:
                    return part.nbytes
        return 0

    def latest_complete(self, job: str) -> Checkpoint | None:
        complete = [c for c in self.checkpoints(job) if c.complete]
        return complete[-1] if complete else None

    def all_parts(self, tier: TierName) -> Iterable[Part]:
        with self._lock:
            return [p for steps in self._parts.values() for ranks in steps.values()
                    for tiers in ranks.values() for t, p in tiers.items() if t == tier]

    def set_pin(self, job: str, step: int, pinned: bool) -> None:
        with self._lock:
            steps = self._pins.setdefault(job, set())
            (steps.add if pinned else steps.discard)(step)
        with self._persist_lock:  # as _write_drained: the file ends with the newest pins
            with self._lock:
                snapshot = {j: sorted(s) for j, s in self._pins.items() if s}
            fsutil.write_json_atomic(self._pins_file, snapshot)

    def is_pinned(self, job: str, step: int) -> bool:
        with self._lock:
            return step in self._pins.get(job, set())
