"""What readers ask of the catalogue: a job's steps, where a step's parts are, and waits for a step.

Every answer about the shared tier is at most about a second old
(:class:`~ckptstage.daemon.drain.sharedsync.SharedSync` re-reads a job's
steps there on demand), and a step kept in memory only is answered from the
memory tier to a reader that can map it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ckptstage.daemon.catalog.commits import Commits
from ckptstage.daemon.catalog.index import Catalog, Checkpoint, Part, TierName
from ckptstage.daemon.catalog.quarantine import Quarantine
from ckptstage.daemon.catalog.storedbytes import ChunkLists
from ckptstage.daemon.config import Config
from ckptstage.daemon.drain.drainer import Drainer
from ckptstage.daemon.drain.indexcopy import IndexCopies
from ckptstage.daemon.drain import sharedsync
from ckptstage.daemon.drain.sharedsync import SharedSync
from ckptstage.daemon.errors import CheckpointNotFound, InvalidRequest
from ckptstage.daemon.node import listing
from ckptstage.daemon.node.incomplete import why_incomplete
from ckptstage.daemon.peers.tier import PeerTier
from ckptstage.daemon.save.memtier import MemoryTier
from ckptstage.daemon.tiers.interface import Tier
from ckptstage.protos import layout


def newest_complete(catalog: Catalog, job: str) -> int | None:
    """The newest step of ``job`` complete on some disk tier."""
    ckpt = catalog.latest_complete(job)
    return ckpt.step if ckpt is not None else None


def committed_digest(catalog: Catalog, job: str, step: int, rank: int) -> str | None:
    """The manifest digest of the part the step's commit names for ``rank`` now (None: no such part)."""
    ckpt = catalog.get(job, step)
    parts = ckpt.committed(rank) if ckpt is not None and ckpt.complete else []
    return parts[0].digest if parts else None


class Lookup:
    """The catalogue as readers see it, the shared tier's index kept fresh for them."""

    def __init__(self, config: Config, catalog: Catalog, commits: Commits, memory: MemoryTier,
                 quarantine: Quarantine, tiers: dict[TierName, Tier], drainer: Drainer | None,
                 shared_sync: SharedSync | None, stopping: threading.Event,
                 index_copies: IndexCopies | None = None, peers: PeerTier | None = None,
                 chunk_lists: ChunkLists | None = None) -> None:
        self._config = config
        self._chunk_lists = chunk_lists or ChunkLists(tiers)
        self._catalog = catalog
        self._commits = commits
        self._memory = memory
        self._quarantine = quarantine
        self._tiers = tiers
        self._drainer = drainer
        self._sync = shared_sync
        self._stopping = stopping
        self._index_copies = index_copies
        self._peers = peers
        # Where a reader here opens each tier's copies: the disk tiers, and replicas on this node's disk.
        self._readers: dict[TierName, listing.Readable] = {**tiers, **({TierName.PEER: peers} if peers else {})}

    def checkpoints(self, job: str) -> list[Checkpoint]:
        layout.check_job(job)
        self.fresh(job)
        # A record whose parts are all gone (a deletion under way) names nothing to list.
        return [c for c in self._catalog.checkpoints(job) if c.parts]

    def drain_state(self, ckpt: Checkpoint) -> str:
        if self._drainer is None:
            return "disabled"
        return self._drainer.checkpoint_state(ckpt)

    def list_checkpoints(self, job: str, memory: bool = False) -> listing.Listing:
        """A job's steps, oldest first, with their drain state and the ranks the memory tier holds; with
        ``memory`` also the steps only the memory tier holds. And the copies of the job quarantined."""
        ckpts = self.checkpoints(job)
        # What each step added on each disk tier, from the chunk lists retention read (never a tier read here).
        added = {tier: self._chunk_lists.added(job, tier, ckpts, read=False)
                 for tier in (TierName.LOCAL, TierName.SHARED) if tier in self._tiers}
        entries = [listing.entry(c, self.drain_state(c), self._memory.ranks(c.job, c.step, c.world_size),
                                 {tier: step_added.get(c.step, 0) for tier, step_added in added.items()})
                   for c in ckpts]
        if memory:
            entries = sorted(entries + [listing.memory_entry(m) for m in self._memory.memory_steps(job)],
                             key=lambda e: e.step)
        return listing.Listing(entries, self._quarantine.moved(job))

    def locate_parts(self, job: str, step: int | None, rank: int, all_ranks: bool = False, memory: bool = False,
                     ranks: Sequence[int] = (), node_copy: bool = False, step_index: bool = False) -> listing.Located:
        """Where a reader finds ``rank``'s part of the complete ``step`` (the newest when None), best copy
        first; with ``all_ranks`` every rank's too (only ``ranks``' when given; a rank outside the step's
        world size has no copies, which is no error: a reader at another world size). ``memory``: the
        reader can read the memory tier, so a step kept in memory only (newer than any on disk, or the one
        asked for) is answered from there, and a part the memory tier holds is listed first.
        ``node_copy`` and ``step_index`` (the path of this node's copy of the step's index is answered:
        :mod:`ckptstage.daemon.drain.indexcopy`): see :func:`listing.located`; only where there is a shared
        tier."""
        if memory:
            kept = self._memory.step_for(job, step)
            if kept is not None:
                return listing.memory_located(kept, rank, all_ranks)
        ckpt, _ = self.locate(job, step, rank, all_ranks)
        index = self._index_copy(ckpt) if step_index and all_ranks else None
        return listing.located(ckpt, rank, all_ranks,
                               lambda r: memory and self._memory.has(ckpt.job, ckpt.step, r), self._readers,
                               ranks, node_copy and self.fetches, index, self._pull_first)

    @property
    def fetches(self) -> bool:
        """Whether this node fetches parts for its readers (from the shared tier, or from other nodes)."""
        return self._drainer is not None or self._peers is not None

    def to_fetch(self, ckpt: Checkpoint, rank: int) -> Part | None:
        """Which copy of ``rank``'s part a prefetch brings to this node (None: one is here)."""
        return listing.to_fetch(ckpt.committed(rank), False, self._readers, self._pull_first, node_copy=True)

    def _pull_first(self, part: Part) -> bool:
        return self._peers is not None and self._peers.prefer_pull(part)

    def _index_copy(self, ckpt: Checkpoint) -> listing.IndexCopy | None:
        """This node's copy of the shared tier's index of ``ckpt``, when it is the commit being read and its
        record names the index's digest."""
        shared = ckpt.records.get(TierName.SHARED)
        if self._index_copies is None or shared is None or not shared.index_digest or \
                not ckpt.complete_on(TierName.SHARED):
            return None
        fingerprint = shared.fingerprint()  # a hash over all W parts: once
        if ckpt.record is None or (ckpt.record is not shared and ckpt.record.fingerprint() != fingerprint):
            return None  # the local tier holds another commit of the step (a replacement not drained yet)
        copy = self._index_copies.path_of(ckpt.job, ckpt.step, fingerprint)
        return listing.IndexCopy(str(copy), shared.index_digest) if copy is not None else None

    def locate(self, job: str, step: int | None, rank: int, all_ranks: bool = False) -> tuple[Checkpoint, list[Part]]:
        """The complete step (the newest when ``step`` is None) and ``rank``'s copies of the committed
        attempt's part, best first. With ``all_ranks`` a rank outside the step's world size gets no
        copies instead of an error (a reader of another world size reads several parts)."""
        layout.check_job(job)
        self.fresh(job, sharedsync.RECORDS)  # a complete step is all a reader gets: its record names its parts
        ckpt = self._catalog.latest_complete(job) if step is None else self._catalog.get(job, step)
        if step is not None and (ckpt is None or not ckpt.complete) and self._sync is not None:
            # Asked for by number, and not complete here: another node may have sealed it since the last
            # re-read, however recent (a job's ranks loading what they have just saved on several nodes).
            # That step is re-read now; ranks asking while it runs wait for that one.
            self._sync.fresh(job, step, max_age_s=0.0, depth=sharedsync.RECORDS)
            ckpt = self._catalog.get(job, step)
        if ckpt is None or not ckpt.complete:
            raise CheckpointNotFound(job, step, "" if ckpt is None else why_incomplete(ckpt))
        parts = ckpt.committed(rank)
        if not parts and not all_ranks:
            raise CheckpointNotFound(job, ckpt.step, f"no part for rank {rank} (world size {ckpt.world_size})")
        return ckpt, parts

    def wait_step(self, job: str, step: int, tier: TierName | None, timeout: float) -> Checkpoint | None:
        """The step once its commit record is on ``tier`` (None: any) with all its parts; None at the timeout."""
        layout.check_job(job)
        layout.check_step(step)
        if tier == TierName.SHARED and self._drainer is None:
            raise InvalidRequest("this daemon has no shared tier ([shared] dir is not set)")
        if tier in (TierName.MEMORY, TierName.PEER):
            raise InvalidRequest(f"a step is not waited for in the {tier.value} tier: wait for each save "
                                 f"(SaveHandle.wait('{tier.value}'))")
        if tier is not None and not self._config.local.persists(step) and self._catalog.get(job, step) is None:
            raise InvalidRequest(f"step {step} is kept in memory only: [local] persist_every = "
                                 f"{self._config.local.persist_every} writes only steps that are multiples of it")
        if tier == TierName.SHARED and not self._config.shared.drains(step):
            ckpt = self._catalog.get(job, step)
            if ckpt is None or not ckpt.complete_on(TierName.SHARED):
                assert self._drainer is not None
                raise InvalidRequest(self._drainer.not_drained(step))
        sync = self._sync
        poll_s = self._commits.poll_s
        refresh = (lambda j, s, wait: sync.fresh(j, s, max_age_s=poll_s, wait_s=wait, depth=sharedsync.RECORDS)) \
            if sync is not None else None
        return self._commits.wait_step(job, step, tier, timeout, refresh, stop=self._stopping)

    def indexed(self, job: str, step: int) -> bool:
        """Whether the catalog has ``step`` of ``job``, once a step only the shared tier has is indexed."""
        if self._catalog.get(job, step) is None and self._sync is not None:
            self._sync.fresh(job, step, max_age_s=0.0)
        return self._catalog.get(job, step) is not None

    def fresh(self, job: str, depth: int = sharedsync.EVERYTHING) -> None:
        """The index of ``job`` on the shared tier at most ~1 s old, or as fresh as a bounded wait gets it;
        ``depth``: how much of it (:data:`sharedsync.RECORDS`: the complete steps)."""
        if self._sync is not None:
            self._sync.fresh(job, depth=depth)
        if self._peers is not None:
            self._peers.fresh(job)
