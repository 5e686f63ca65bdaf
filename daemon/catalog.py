"""The daemon's index of committed parts on every tier, rebuilt from disk on start.

Only renamed-into-place parts with a readable manifest are ever indexed, so
everything the catalogue answers (list, latest, locate) is restorable by
construction (invariant 1). Pins are kept in a small JSON file on the local
tier so that they survive restarts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
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


class Catalog:
    """Thread-safe index: job -> step -> rank -> tier -> :class:`Part`."""

    def __init__(self, pins_file: Path) -> None:
        self._lock = threading.Lock()
        self._parts: dict[str, dict[int, dict[int, dict[TierName, Part]]]] = {}
        self._pins_file = pins_file
        self._pins: dict[str, set[int]] = {
            job: set(steps) for job, steps in fsutil.read_json(pins_file, {}).items()}

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

    def add(self, part: Part) -> None:
        with self._lock:
            ranks = self._parts.setdefault(part.job, {}).setdefault(part.step, {})
            ranks.setdefault(part.rank, {})[part.tier] = part

    def remove(self, part: Part) -> None:
        with self._lock:
            steps = self._parts.get(part.job, {})
            tiers = steps.get(part.step, {}).get(part.rank, {})
            tiers.pop(part.tier, None)
            if not tiers:
                steps.get(part.step, {}).pop(part.rank, None)
            if not steps.get(part.step, True):
                steps.pop(part.step, None)

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
