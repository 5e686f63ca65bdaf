"""The node seen from outside: one summary per job, and the state the metrics read at scrape time.

Both are read from memory only (the catalogue, the sessions, the memory
tier, the drain queue and the tier probes), never from a tier, so neither
``Status`` nor a scrape can hang on a file system that does not answer.
"""

from __future__ import annotations

from collections.abc import Callable

from ckptstage.daemon.catalog.index import Catalog, TierName
from ckptstage.daemon.catalog.quarantine import Quarantine
from ckptstage.daemon.catalog.storedbytes import ChunkLists
from ckptstage.daemon.drain.drainer import Drainer
from ckptstage.daemon.drain.health import NO_DRAIN
from ckptstage.daemon.metrics import StateProbe
from ckptstage.daemon.node import jobs
from ckptstage.daemon.node.incomplete import IncompleteSteps
from ckptstage.daemon.peers.tier import PeerTier
from ckptstage.daemon.save.arena import Budget
from ckptstage.daemon.save.memtier import MemoryTier
from ckptstage.daemon.save.sessions import SessionTable
from ckptstage.daemon.tiers.compression import Figures
from ckptstage.daemon.tiers.interface import Tier
from ckptstage.daemon.tiers.loadgate import LoadGate
from ckptstage.daemon.tiers.probe import TierProbe


def job_summaries(catalog: Catalog, sessions: SessionTable, memory: MemoryTier,
                  drainer: Drainer | None, peers: PeerTier | None = None) -> list[jobs.JobSummary]:
    """Every job this node knows of (catalogued, with a session, or kept in memory), sorted by name; with
    ``peers``, how each job's replication goes."""
    open_jobs = [s.info.job for s in sessions.all() if not s.closed.is_set()]
    copies = memory.copies()
    names = sorted(set(catalog.jobs()) | set(open_jobs) | {c.resident.job for c in copies})
    health = drainer.health_of(names) if drainer is not None else {}
    return [jobs.summarize(job, catalog.checkpoints(job), [c for c in copies if c.resident.job == job],
                           memory.memory_steps(job), open_jobs.count(job), health.get(job, NO_DRAIN),
                           peers.job_state(job) if peers is not None else None)
            for job in names]


def state_probe(budget: Budget, sessions: SessionTable, catalog: Catalog, tier_probes: dict[TierName, TierProbe],
                drainer: Drainer | None, incomplete: IncompleteSteps, memory: MemoryTier,
                summaries: Callable[[], list[jobs.JobSummary]], peers: PeerTier | None = None,
                gate: LoadGate | None = None, quarantine: Quarantine | None = None,
                chunk_lists: ChunkLists | None = None) -> StateProbe:
    """What :class:`~ckptstage.daemon.metrics.Metrics` reads of the node at each scrape."""
    def tier_used(tier: str) -> int:
        return sum(p.nbytes for p in catalog.all_parts(TierName(tier)))

    def tier_free(tier: str) -> int | None:
        return tier_probes[TierName(tier)].reading().free_bytes

    def tier_size(tier: str) -> int | None:
        return tier_probes[TierName(tier)].reading().total_bytes

    d = drainer
    return StateProbe(
        arena_used=lambda: budget.used, arena_total=lambda: budget.total,
        sessions=lambda: len(sessions.all()), tiers=lambda: [t.value for t in tier_probes],
        tier_used=tier_used, tier_free=tier_free, tier_size=tier_size,
        drain_queue=(lambda: d.pending()) if d else (lambda: (0, 0)),
        drain_lag_s=(lambda: d.lag_s()) if d else (lambda: 0.0),
        shared_reachable=(lambda: d.reachable) if d else (lambda: None),
        incomplete_steps=lambda: len(incomplete.stuck()),
        memory_copies=lambda: len(memory.copies()), memory_bytes=lambda: memory.bytes_kept,
        jobs=summaries,
        peer_lag_s=(lambda: peers.replicator.lag_s()) if peers else (lambda: None),
        peer_replicas=(lambda: peers.store.usage()) if peers else (lambda: (0, 0, 0, 0)),
        loads_in_flight=gate.loads if gate else (lambda: 0),
        yielded_to_loads_s=gate.waited_s if gate else (lambda: 0.0),
        loads_began=gate.began if gate else (lambda: 0),
        quarantined=(lambda tier: quarantine.usage(TierName(tier))) if quarantine else (lambda tier: (0, 0)),
        tier_stored=(lambda tier: chunk_lists.total(TierName(tier), catalog.jobs())) if chunk_lists
        else (lambda tier: None),
        compression=lambda tier: compression_figures(tier_probes[TierName(tier)].tier))


def compression_figures(tier: Tier) -> Figures | None:
    """What the tier's compression did and measured; None where it never compresses."""
    figures = tier.compression.figures()
    return figures if figures.mode != "none" else None
