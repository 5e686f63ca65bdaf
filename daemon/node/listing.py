"""What readers are told about a job's checkpoints: the listing (``ListCheckpoints``) and where a step's
parts lie (``Locate``). Plain records and the pure functions that build them from the catalogue's views and
the memory tier's; the node gathers the inputs, the servicer puts the records on the wire.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ckptstage.daemon.catalog.index import Checkpoint, Part, TierName
from ckptstage.daemon.errors import CheckpointNotFound
from ckptstage.daemon.save.memtier import MemoryStep
from ckptstage.daemon.catalog.quarantine import Quarantined

MEMORY_ONLY = "memory-only"  # the drain state of a step only the memory tier holds


class Readable(Protocol):
    """What says where a reader on this node opens a tier's part (a :class:`Tier`, the peer tier)."""

    def readable_path(self, part: Path) -> Path | None: ...


@dataclass(frozen=True)
class CheckpointEntry:
    """One step of a job as ``ckptstage ls`` and ``Client.list`` show it."""

    job: str
    step: int
    world_size: int
    ranks_local: list[int]
    ranks_shared: list[int]
    ranks_memory: list[int]
    ranks_missing: list[int]
    nbytes: int
    created: float
    complete: bool
    committed_local: bool
    committed_shared: bool
    pinned: bool
    drain_state: str
    metrics: dict[str, float]
    attempt: str
    ranks_peer: list[int] = field(default_factory=list)
    committed_peer: bool = False
    stored: dict[TierName, int] = field(default_factory=dict)  # per disk tier: the bytes the step added there


@dataclass(frozen=True)
class Listing:
    checkpoints: list[CheckpointEntry]
    quarantined: list[Quarantined]


@dataclass(frozen=True)
class Location:
    """A copy of a part: a committed directory on a disk tier, or the memory tier (``dir`` None: the
    reader fetches it through the daemon's handoff socket, which only the server knows)."""

    tier: TierName
    dir: str | None
    digest: str = ""  # of its manifest.json, as the commit record names it


@dataclass(frozen=True)
class Located:
    step: int
    world_size: int
    attempt: str
    commit: str                  # the fingerprint of the commit the answer comes from
    locations: list[Location]    # the asked rank's copies, best first
    parts: dict[int, list[Location]] = field(default_factory=dict)  # with all_ranks: every rank's
    # The asked parts that no reader can open where they are (only an object store holds them): rank -> bytes.
    fetch: dict[int, int] = field(default_factory=dict)
    index: IndexCopy | None = None  # this node's copy of the step's index, when asked for and there is one


@dataclass(frozen=True)
class IndexCopy:
    """This node's copy of a step's index (a file on the local tier), and its digest as the record names it."""

    path: str
    digest: str


def entry(ckpt: Checkpoint, drain_state: str, ranks_memory: list[int],
          stored: dict[TierName, int] | None = None) -> CheckpointEntry:
    """``stored``: per disk tier, what the step added there (see :mod:`ckptstage.daemon.catalog.storedbytes`)."""
    return CheckpointEntry(
        job=ckpt.job, step=ckpt.step, world_size=ckpt.world_size, ranks_local=ckpt.ranks_on(TierName.LOCAL),
        ranks_shared=ckpt.ranks_on(TierName.SHARED), ranks_memory=ranks_memory, ranks_missing=ckpt.ranks_missing(),
        nbytes=ckpt.nbytes(), created=ckpt.created, complete=ckpt.complete,
        committed_local=ckpt.complete_on(TierName.LOCAL), committed_shared=ckpt.complete_on(TierName.SHARED),
        pinned=ckpt.pinned, drain_state=drain_state, metrics=ckpt.metrics, attempt=ckpt.attempt,
        ranks_peer=ckpt.ranks_on(TierName.PEER), committed_peer=ckpt.complete_on(TierName.PEER),
        stored=stored or {})


def memory_entry(kept: MemoryStep) -> CheckpointEntry:
    """A step kept whole in memory only ([local] persist_every above 1): every rank's part in the memory tier."""
    ranks = list(range(kept.world_size))
    return CheckpointEntry(
        job=kept.job, step=kept.step, world_size=kept.world_size, ranks_local=[], ranks_shared=[],
        ranks_memory=ranks, ranks_missing=[], nbytes=kept.nbytes, created=kept.created, complete=True,
        committed_local=False, committed_shared=False, pinned=False, drain_state=MEMORY_ONLY, metrics={},
        attempt=kept.attempt)


def locations(parts: Sequence[Part], in_memory: bool, tiers: Mapping[TierName, Readable]) -> list[Location]:
    """One rank's copies, best first: the memory tier's (when it holds the committed part), then the
    directories where a reader on this node opens the local and shared tiers' copies (a copy of a tier
    that cannot be read directly is left out: see :meth:`Tier.readable_path`)."""
    out = [Location(p.tier, str(path), p.digest) for p in parts if p.tier in tiers
           for path in [tiers[p.tier].readable_path(p.path)] if path is not None]
    return [Location(TierName.MEMORY, None)] + out if parts and in_memory else out


def to_fetch(parts: Sequence[Part], in_memory: bool, tiers: Mapping[TierName, Readable],
             pull_first: Callable[[Part], bool], node_copy: bool) -> Part | None:
    """Which of a rank's copies (``parts``, best first) to bring to this node before a reader here reads it;
    None when the reader opens one where it is.

    Nothing when this node holds one (the memory tier, the local tier, a replica on its disk). Else a copy
    another node keeps in memory (``pull_first``: faster than a cold read of the shared tier); else
    nothing when the reader can open a copy where it is, unless ``node_copy`` (several ranks of this node
    read it: one copy for them all); else the shared tier's copy, else another node's.
    """
    readable = [p for p in parts if p.tier in tiers and tiers[p.tier].readable_path(p.path) is not None]
    if in_memory or any(p.tier in (TierName.LOCAL, TierName.PEER) for p in readable):
        return None
    peer = next((p for p in parts if p.tier == TierName.PEER), None)
    if peer is not None and pull_first(peer):
        return peer
    if readable and not node_copy:
        return None
    return next((p for p in parts if p.tier == TierName.SHARED), peer)


def located(ckpt: Checkpoint, rank: int, all_ranks: bool, in_memory: Callable[[int], bool],
            tiers: Mapping[TierName, Readable], ranks: Sequence[int] = (), node_copy: bool = False,
            index: IndexCopy | None = None, pull_first: Callable[[Part], bool] = lambda part: False) -> Located:
    """Where the committed step's parts are (``rank``'s; with ``all_ranks``, those of ``ranks``, or every
    rank's); ``in_memory(rank)``: whether the memory tier serves that rank's; ``tiers``: the storage of each
    disk tier, which says where its parts are read. Named in :attr:`Located.fetch`: what :func:`to_fetch`
    says is to be brought here first. ``index`` (the node's copy of the step's index): the reader plans from it and asks
    for the parts it reads, so only ``rank``'s (or ``ranks``') are answered and nothing is named for
    fetching: a thousand-rank step's answer does not list a thousand parts."""
    if index is not None:
        asked: Sequence[int] = [r for r in ranks or [rank] if r < ckpt.world_size]
    else:
        asked = (ranks or range(ckpt.world_size)) if all_ranks else [rank]
    committed = {r: ckpt.committed(r) for r in asked}
    found = {r: locations(parts, in_memory(r), tiers) for r, parts in committed.items()}
    fetch = {r: parts[0].nbytes for r, parts in committed.items()
             if to_fetch(parts, in_memory(r), tiers, pull_first, node_copy) is not None} if index is None else {}
    record = ckpt.record
    return Located(ckpt.step, ckpt.world_size, ckpt.attempt, record.fingerprint() if record else "",
                   found.get(rank, []), found if all_ranks else {}, fetch, index)


def memory_located(kept: MemoryStep, rank: int, all_ranks: bool) -> Located:
    """Where the parts of a step kept in memory only are: in the memory tier, every rank's."""
    if not all_ranks and rank >= kept.world_size:
        raise CheckpointNotFound(kept.job, kept.step, f"no part for rank {rank} (world size {kept.world_size})")
    here = [Location(TierName.MEMORY, None)]
    every = {r: here for r in range(kept.world_size)} if all_ranks else {}
    return Located(kept.step, kept.world_size, kept.attempt, f"memory:{kept.attempt}", here, every)
