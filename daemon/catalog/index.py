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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ckptstage.daemon import fsutil
from ckptstage.daemon.logs import fields
from ckptstage.daemon.tiers.interface import Manifest, PartIndex, Tier, TierName
from ckptstage.protos import layout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Part:
    """One rank's committed share of one step on one tier."""

    job: str
    step: int
    rank: int
    world_size: int
    tier: TierName
    path: Path
    nbytes: int
    created: float
    metrics: dict[str, float] = field(default_factory=dict)
    attempt: str = ""  # the run that saved it (see docs/FORMAT.md, attempts)
    digest: str = ""   # xxh3-64 of its manifest.json file: what a commit record names
    ino: int = 0       # of its directory: a part replaced under the same name has another

    @classmethod
    def read(cls, ref: layout.PartRef, tier: TierName, storage: PartIndex) -> Part:
        """The part at ``ref`` on ``storage``, its manifest read (and verified) from there."""
        return cls.from_manifest(ref, tier, *storage.read_manifest(ref.path))

    @classmethod
    def from_manifest(cls, ref: layout.PartRef, tier: TierName, manifest: Manifest, digest: str) -> Part:
        return cls(ref.job, ref.step, ref.rank, int(manifest["world_size"]), tier, ref.path,
                   layout.part_bytes(manifest), float(manifest.get("created", 0.0)),
                   {str(k): float(v) for k, v in manifest.get("metrics", {}).items()},
                   layout.manifest_attempt(manifest), digest, ref.ino)

    def matches(self, record: layout.CommitRecord) -> bool:
        """Whether this part is the one ``record`` names for its rank (same attempt, same manifest)."""
        named = record.parts.get(self.rank)
        return named is not None and self.attempt == record.attempt and self.digest == named.manifest_digest


@dataclass(frozen=True)
class Checkpoint:
    """A step of a job as the catalogue sees it, across ranks, tiers and attempts.

    A step exists on a tier when that tier's commit record is there and every
    part it names is indexed on that tier, unchanged (:meth:`complete_on`):
    a record whose parts are not all here does not count. ``parts`` holds
    every part found, of any attempt; the ``committed`` views hold only the
    parts of the committed attempt.
    """

    job: str
    step: int
    world_size: int
    parts: dict[int, dict[TierName, Part]]
    pinned: bool
    records: dict[TierName, layout.CommitRecord] = field(default_factory=dict)

    def complete_on(self, tier: TierName) -> bool:
        record = self.records.get(tier)
        if record is None:
            return False
        return all(r in self.parts and tier in self.parts[r] and self.parts[r][tier].matches(record)
                   for r in range(record.world_size))

    @property
    def complete(self) -> bool:
        """Its commit record is on some tier this daemon reads, with every part it names."""
        return any(self.complete_on(t) for t in self.records)

    @property
    def record(self) -> layout.CommitRecord | None:
        """The commit record that makes the step complete (the local one first), if any."""
        return next((self.records[t] for t in (TierName.LOCAL, TierName.SHARED) if self.complete_on(t)), None)

    @property
    def attempt(self) -> str:
        """The committed attempt; for an incomplete step, the attempt of its newest part."""
        record = self.record
        if record is not None:
            return record.attempt
        newest = max((p for tiers in self.parts.values() for p in tiers.values()), default=None,
                     key=lambda p: (p.created, p.attempt))
        if newest is not None:
            return newest.attempt
        return next(iter(self.records.values())).attempt if self.records else ""

    def _of_attempt(self) -> dict[int, dict[TierName, Part]]:
        record, attempt = self.record, self.attempt
        out: dict[int, dict[TierName, Part]] = {}
        for rank, tiers in self.parts.items():
            mine = {t: p for t, p in tiers.items()
                    if (p.matches(record) if record is not None else p.attempt == attempt)}
            if mine:
                out[rank] = mine
        return out

    def committed(self, rank: int) -> list[Part]:
        """The copies of ``rank``'s part a reader may use, best first (local, then shared).

        Only parts of the committed attempt, identical to what its record names;
        none when the step is not complete.
        """
        if self.record is None:
            return []
        tiers = self._of_attempt().get(rank, {})
        return [tiers[t] for t in (TierName.LOCAL, TierName.SHARED) if t in tiers]

    def stragglers(self) -> list[Part]:
        """Parts a complete step's record does not name (an earlier attempt's, left by a crashed run).

        Judged per tier: a tier where the step is complete keeps what its own
        record names (a step replaced on one tier is still the old one on the
        other until its replacement arrives there).
        """
        record = self.record
        if record is None:
            return []
        out = []
        for tiers in self.parts.values():
            for tier, part in tiers.items():
                mine = self.records[tier] if self.complete_on(tier) else record
                if not part.matches(mine):
                    out.append(part)
        return out

    def ranks_on(self, tier: TierName) -> list[int]:
        """Ranks of this step's attempt (:attr:`attempt`) with a part on ``tier``."""
        return sorted(r for r, tiers in self._of_attempt().items() if tier in tiers)

    def ranks_missing(self) -> list[int]:
        """Ranks of this step's attempt with no part on any tier this daemon reads."""
        have = self._of_attempt()
        return [r for r in range(self.world_size) if r not in have]

    def on_tier(self, tier: TierName) -> list[Part]:
        """Every part on ``tier``, of any attempt (what deleting the step there removes)."""
        return [tiers[tier] for _, tiers in sorted(self.parts.items()) if tier in tiers]

    def nbytes(self, tier: TierName | None = None) -> int:
        """Bytes of every part on ``tier``; with no tier, of one copy of each part of the step's attempt."""
        if tier is None:
            return sum(max(p.nbytes for p in tiers.values()) for tiers in self._of_attempt().values())
        return sum(tiers[tier].nbytes for tiers in self.parts.values() if tier in tiers)

    @property
    def created(self) -> float:
        mine = [p.created for tiers in self._of_attempt().values() for p in tiers.values()]
        return min(mine) if mine else min((r.created for r in self.records.values()), default=0.0)

    @property
    def metrics(self) -> dict[str, float]:
        merged: dict[str, float] = {}
        for _, tiers in sorted(self._of_attempt().items(), reverse=True):
            for p in tiers.values():
                merged.update(p.metrics)
        return merged


Key = tuple[str, int, int]  # job, step, rank


class Catalog:
    """Thread-safe index: job -> step -> rank -> tier -> :class:`Part`."""

    def __init__(self, pins_file: Path, drained_file: Path | None = None) -> None:
        self._lock = threading.Lock()
        self._persist_lock = threading.Lock()  # one writer of the state files at a time
        self._parts: dict[str, dict[int, dict[int, dict[TierName, Part]]]] = {}
        # job -> step -> tier -> (verified commit record, inode of commit.json)
        self._records: dict[str, dict[int, dict[TierName, tuple[layout.CommitRecord, int]]]] = {}
        self._untrusted: dict[Path, int] = {}  # commit records that failed verification, logged once per inode
        self._pins_file = pins_file
        self._pins: dict[str, set[int]] = {
            job: set(steps) for job, steps in fsutil.read_json(pins_file, {}).items()}
        self._drained_file = drained_file or pins_file.with_name("drained.json")
        # (job, step, rank) -> the manifest digest of the local part that reached the shared tier ("": a
        # record of an older daemon, which names no digest and counts for whatever part is there).
        self._drained: dict[Key, str] = {
            (str(e[0]), int(e[1]), int(e[2])): str(e[3]) if len(e) > 3 else ""
            for e in fsutil.read_json(self._drained_file, [])}

    def load_tier(self, tier: TierName, source: Tier) -> int:
        """Indexes every committed part and commit record on a tier; returns how many parts."""
        return sum(self._sync(tier, source, job, None)[2] for job in source.list_jobs())

    def sync_job(self, tier: TierName, source: Tier, job: str, step: int | None = None) -> tuple[int, int]:
        """Re-reads one job's directory on a tier (or one step's); returns (parts added, parts dropped).

        Other nodes' daemons write other ranks of the same job to the shared
        tier, write commit records and delete steps their retention gave up;
        this brings the index in step with them. Known parts and records are
        not re-read unless their inode changed (a part of another attempt
        replaced under the same name).
        """
        added, dropped, _ = self._sync(tier, source, job, step)
        return added, dropped

    def _sync(self, tier: TierName, storage: PartIndex, job: str, step: int | None) -> tuple[int, int, int]:
        # What is known is read before the disk: a part deleted (renamed away, then dropped from
        # the index) between the two reads is then never indexed again.
        with self._lock:
            known = {(s, rank): tiers[tier] for s, ranks in self._parts.get(job, {}).items()
                     if step in (None, s) for rank, tiers in ranks.items() if tier in tiers}
            known_records = {s: tiers[tier] for s, tiers in self._records.get(job, {}).items()
                             if step in (None, s) and tier in tiers}
        steps = list(storage.list_steps(job, step))
        found = {(ref.step, ref.rank): ref for sref in steps for ref in sref.parts}
        added = dropped = 0
        for key, ref in found.items():
            old = known.get(key)
            if old is None or old.path != ref.path or (ref.ino and old.ino != ref.ino):
                try:
                    self.add(Part.read(ref, tier, storage))
                    added += 1
                except (layout.ManifestError, KeyError, ValueError, TypeError) as e:
                    log.error("ignoring part %s: %s", ref.path, e,
                              extra=fields(job=job, step=ref.step, rank=ref.rank, tier=tier, error=e))
        for key, part in known.items():
            if key not in found:
                self.remove(part)
                dropped += 1
        seen_records = set()
        for sref in steps:
            if sref.record_ino is None:
                continue
            seen_records.add(sref.step)
            have = known_records.get(sref.step)
            if have is None or have[1] != sref.record_ino:
                self._read_record(tier, storage, job, sref)
        for s in known_records.keys() - seen_records:
            self.drop_record(tier, job, s)
        return added, dropped, len(found)

    def _read_record(self, tier: TierName, storage: PartIndex, job: str, sref: layout.StepRef) -> None:
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
            self.drop_record(tier, job, sref.step)
            return
        if record is None:
            self.drop_record(tier, job, sref.step)
        else:
            self.set_record(tier, record, sref.record_ino or 0)

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


def _view(job: str, step: int, ranks: dict[int, dict[TierName, Part]],
          records: dict[TierName, tuple[layout.CommitRecord, int]], pinned: bool) -> Checkpoint:
    """A step as the catalogue holds it, copied (the index changes under it). Its world size is its commit
    record's; without one, the largest its parts of :attr:`Checkpoint.attempt` name."""
    parts = {r: dict(tiers) for r, tiers in ranks.items()}
    view = Checkpoint(job, step, 0, parts, pinned, {t: rec for t, (rec, _) in records.items()})
    record, attempt = view.record, view.attempt
    if record is not None:
        world = record.world_size
    else:
        sizes = [p.world_size for tiers in parts.values() for p in tiers.values() if p.attempt == attempt]
        world = max(sizes) if sizes else max((rec.world_size for rec, _ in records.values()), default=1)
    return Checkpoint(job, step, world, parts, pinned, view.records)
