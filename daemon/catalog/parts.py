"""What the catalogue holds: a rank's committed part on a tier, and a step as seen across ranks and tiers."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from ckptstage.daemon.tiers.interface import Manifest, PartIndex, TierName
from ckptstage.protos import layout


# The disk tiers a reader is offered, best first: this node's SSD, a copy on (or fetched from) another node of
# the job, the shared tier.
READ_ORDER = (TierName.LOCAL, TierName.PEER, TierName.SHARED)


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

    @classmethod
    def from_record(cls, ref: layout.PartRef, tier: TierName, record: layout.CommitRecord) -> Part | None:
        """The part at ``ref`` as ``record`` names it, its manifest left unopened; None when the record does
        not say enough (written before records kept when each part was saved) or names no such rank.

        Sound because a record is written only once every part it names was
        read and checked, and a part is never changed under a record: readers
        still verify each manifest against the record's digest when they open it.
        """
        named = record.parts.get(ref.rank)
        if named is None or named.created is None:
            return None
        return cls(ref.job, ref.step, ref.rank, record.world_size, tier, ref.path, named.nbytes, named.created,
                   dict(named.metrics), record.attempt, named.manifest_digest, ref.ino)

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

    # A view is a copy that nothing changes once made (:func:`view`), so what is derived from all its parts is
    # worked out once per view: a reader locating every rank of a W-rank step asks for each rank's copies.

    def complete_on(self, tier: TierName) -> bool:
        return tier in self._complete_tiers

    @cached_property
    def _complete_tiers(self) -> frozenset[TierName]:
        def complete(tier: TierName, record: layout.CommitRecord) -> bool:
            # The peer tier is the job's nodes taken together: this node's own parts count there too.
            counted = (TierName.PEER, TierName.LOCAL) if tier == TierName.PEER else (tier,)
            return all(any(t in self.parts.get(r, {}) and self.parts[r][t].matches(record) for t in counted)
                       for r in range(record.world_size))

        return frozenset(t for t, record in self.records.items() if complete(t, record))

    @property
    def complete(self) -> bool:
        """Its commit record is on some tier this daemon reads, with every part it names."""
        return bool(self._complete_tiers)

    @cached_property
    def record(self) -> layout.CommitRecord | None:
        """The commit record that makes the step complete (the local one first, the peer tier's last), if any."""
        return next((self.records[t] for t in READ_ORDER if self.complete_on(t)), None)

    @cached_property
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

    @cached_property
    def _attempt_parts(self) -> dict[int, dict[TierName, Part]]:
        record, attempt = self.record, self.attempt
        out: dict[int, dict[TierName, Part]] = {}
        for rank, tiers in self.parts.items():
            mine = {t: p for t, p in tiers.items()
                    if (p.matches(record) if record is not None else p.attempt == attempt)}
            if mine:
                out[rank] = mine
        return out

    def committed(self, rank: int) -> list[Part]:
        """The copies of ``rank``'s part a reader may use, best first (local, the peer tier's, shared).

        Only parts of the committed attempt, identical to what its record names;
        none when the step is not complete.
        """
        if self.record is None:
            return []
        tiers = self._attempt_parts.get(rank, {})
        return [tiers[t] for t in READ_ORDER if t in tiers]

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
        return sorted(r for r, tiers in self._attempt_parts.items() if tier in tiers)

    def ranks_missing(self) -> list[int]:
        """Ranks of this step's attempt with no part on any tier this daemon reads."""
        have = self._attempt_parts
        return [r for r in range(self.world_size) if r not in have]

    def on_tier(self, tier: TierName) -> list[Part]:
        """Every part on ``tier``, of any attempt (what deleting the step there removes)."""
        return [tiers[tier] for _, tiers in sorted(self.parts.items()) if tier in tiers]

    def nbytes(self, tier: TierName | None = None) -> int:
        """Bytes of every part on ``tier``; with no tier, of one copy of each part of the step's attempt."""
        if tier is None:
            return sum(max(p.nbytes for p in tiers.values()) for tiers in self._attempt_parts.values())
        return sum(tiers[tier].nbytes for tiers in self.parts.values() if tier in tiers)

    @property
    def created(self) -> float:
        mine = [p.created for tiers in self._attempt_parts.values() for p in tiers.values()]
        return min(mine) if mine else min((r.created for r in self.records.values()), default=0.0)

    @property
    def metrics(self) -> dict[str, float]:
        merged: dict[str, float] = {}
        for _, tiers in sorted(self._attempt_parts.items(), reverse=True):
            for p in tiers.values():
                merged.update(p.metrics)
        return merged


def view(job: str, step: int, ranks: dict[int, dict[TierName, Part]],
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
