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
from enum import Enum
from pathlib import Path

from ckptstage.daemon import fsutil
from ckptstage.protos import layout

log = logging.getLogger(__name__)


class TierName(str, Enum):
    LOCAL = "local"
    SHARED = "shared"


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

    @classmethod
    def from_disk(cls, ref: layout.PartRef, tier: TierName) -> Part:
        manifest = layout.read_manifest(ref.path)
        return cls(ref.job, ref.step, ref.rank, int(manifest["world_size"]), tier, ref.path,
                   layout.part_bytes(manifest), float(manifest.get("created", 0.0)),
                   {str(k): float(v) for k, v in manifest.get("metrics", {}).items()})


@dataclass(frozen=True)
class Checkpoint:
    """A step of a job as the catalogue sees it, across ranks and tiers."""

    job: str
    step: int
    world_size: int
    parts: dict[int, dict[TierName, Part]]
    pinned: bool

    def ranks_on(self, tier: TierName) -> list[int]:
        return sorted(r for r, tiers in self.parts.items() if tier in tiers)

    def on_tier(self, tier: TierName) -> list[Part]:
        return [tiers[tier] for _, tiers in sorted(self.parts.items()) if tier in tiers]

    @property
    def complete(self) -> bool:
        """Every rank's part is committed on some tier this daemon can read."""
        return all(r in self.parts for r in range(self.world_size))

    def complete_on(self, tier: TierName) -> bool:
        return all(tier in self.parts.get(r, {}) for r in range(self.world_size))

    def nbytes(self, tier: TierName | None = None) -> int:
        """Bytes of the parts on ``tier``; with no tier, of one copy of each part."""
        if tier is None:
            return sum(max(p.nbytes for p in tiers.values()) for tiers in self.parts.values())
        return sum(tiers[tier].nbytes for tiers in self.parts.values() if tier in tiers)

    @property
    def created(self) -> float:
        return min(p.created for tiers in self.parts.values() for p in tiers.values())

    @property
    def metrics(self) -> dict[str, float]:
        merged: dict[str, float] = {}
        for _, tiers in sorted(self.parts.items(), reverse=True):
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
        self._pins_file = pins_file
        self._pins: dict[str, set[int]] = {
            job: set(steps) for job, steps in fsutil.read_json(pins_file, {}).items()}
        self._drained_file = drained_file or pins_file.with_name("drained.json")
        self._drained: set[Key] = {
            (str(job), int(step), int(rank)) for job, step, rank in fsutil.read_json(self._drained_file, [])}

    def load_tier(self, tier: TierName, tier_dir: Path) -> int:
        """Indexes every committed part on a tier; returns how many."""
        count = 0
        for ref in layout.scan_tier(tier_dir):
            try:
                self.add(Part.from_disk(ref, tier))
                count += 1
            except (layout.ManifestError, KeyError, ValueError) as e:
                log.error("ignoring part %s: %s", ref.path, e)
        return count

    def sync_job(self, tier: TierName, tier_dir: Path, job: str, step: int | None = None) -> tuple[int, int]:
        """Re-reads one job's directory on a tier (or one step's); returns (parts added, parts dropped).

        Other nodes' daemons write other ranks of the same job to the shared
        tier and delete steps their retention gave up; this brings the index
        in step with them. Known parts are not re-read (their manifests do
        not change once committed).
        """
        # What is known is read before the disk: a part deleted (renamed away, then dropped from
        # the index) between the two reads is then never indexed again.
        with self._lock:
            known = {(s, rank): tiers[tier] for s, ranks in self._parts.get(job, {}).items()
                     if step in (None, s) for rank, tiers in ranks.items() if tier in tiers}
        found = {(ref.step, ref.rank): ref for ref in layout.scan_tier(tier_dir, job, step)}
        added = dropped = 0
        for key, ref in found.items():
            if key not in known or known[key].path != ref.path:
                try:
                    self.add(Part.from_disk(ref, tier))
                    added += 1
                except (layout.ManifestError, KeyError, ValueError) as e:
                    log.error("ignoring part %s: %s", ref.path, e)
        for key, part in known.items():
            if key not in found:
                self.remove(part)
                dropped += 1
        return added, dropped

    def add(self, part: Part) -> None:
        with self._lock:
            ranks = self._parts.setdefault(part.job, {}).setdefault(part.step, {})
            ranks.setdefault(part.rank, {})[part.tier] = part

    def remove(self, part: Part) -> None:
        with self._lock:
            steps = self._parts.get(part.job, {})
            tiers = steps.get(part.step, {}).get(part.rank, {})
            indexed = tiers.get(part.tier)
            if indexed is not None and indexed.path != part.path:
                return  # another copy took its place meanwhile (e.g. a prefetch); it stays indexed
            tiers.pop(part.tier, None)
            if not tiers:
                steps.get(part.step, {}).pop(part.rank, None)
            if not steps.get(part.step, True):
                steps.pop(part.step, None)
            if not steps:
                self._parts.pop(part.job, None)
            forget = part.tier == TierName.LOCAL and (part.job, part.step, part.rank) in self._drained
            if forget:
                self._drained.discard((part.job, part.step, part.rank))
        if forget:
            self._write_drained()

    # --- drained ---------------------------------------------------------------------

    def mark_drained(self, job: str, step: int, rank: int) -> None:
        """Records that the local part (job, step, rank) has been committed on the shared tier."""
        with self._lock:
            if (job, step, rank) in self._drained:
                return
            self._drained.add((job, step, rank))
        self._write_drained()

    def was_drained(self, job: str, step: int, rank: int) -> bool:
        with self._lock:
            return (job, step, rank) in self._drained

    def prune_drained(self) -> int:
        """Forgets drained records of parts no longer on the local tier (after a restart); returns how many."""
        with self._lock:
            local = {(p.job, p.step, p.rank) for steps in self._parts.values() for ranks in steps.values()
                     for tiers in ranks.values() for t, p in tiers.items() if t == TierName.LOCAL}
            stale = self._drained - local
            if not stale:
                return 0
            self._drained &= local
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
                    snapshot = [list(k) for k in sorted(self._drained)]
                fsutil.write_json_atomic(self._drained_file, snapshot)
        except OSError as e:
            # Only costs a redundant copy after a restart; never a checkpoint.
            log.warning("cannot record drained parts in %s: %s", self._drained_file, e)

    def has(self, job: str, step: int, rank: int) -> bool:
        with self._lock:
            return rank in self._parts.get(job, {}).get(step, {})

    def jobs(self) -> list[str]:
        with self._lock:
            return sorted(self._parts)

    def checkpoints(self, job: str) -> list[Checkpoint]:
        """Every step of a job that has at least one committed part, oldest first."""
        with self._lock:
            steps = self._parts.get(job, {})
            pins = self._pins.get(job, set())
            return [self._view(job, step, ranks, step in pins) for step, ranks in sorted(steps.items())]

    def get(self, job: str, step: int) -> Checkpoint | None:
        with self._lock:
            ranks = self._parts.get(job, {}).get(step)
            if not ranks:
                return None
            return self._view(job, step, ranks, step in self._pins.get(job, set()))

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

    @staticmethod
    def _view(job: str, step: int, ranks: dict[int, dict[TierName, Part]], pinned: bool) -> Checkpoint:
        parts = {r: dict(tiers) for r, tiers in ranks.items()}
        world = max(p.world_size for tiers in parts.values() for p in tiers.values())
        return Checkpoint(job, step, world, parts, pinned)
