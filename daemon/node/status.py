"""What ``Status`` reports about a node, read from memory only.

``Status`` must answer while the shared file system hangs and every RPC
thread is busy, so :class:`StatusReader` reads the catalogue, the session
table, the arena budget, the drain queue's bookkeeping and the tier probes' last
readings, never a disk. The records it returns are plain data for the
servicer to put on the wire.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ckptstage.daemon.save.arena import Budget
from ckptstage.daemon.catalog.index import Catalog, TierName
from ckptstage.daemon.drain.queue import DrainQueue
from ckptstage.daemon.drain.health import TierHealth
from ckptstage.daemon.node.jobs import JobSummary
from ckptstage.daemon.save.memtier import MemoryTier
from ckptstage.daemon.save.sessions import SessionTable
from ckptstage.daemon.tiers.interface import Tier
from ckptstage.daemon.tiers.probe import TierProbe

# TierReport.state values.
OK = "ok"
DEGRADED = "degraded"        # it answers, but drains to it fail (permission denied, no space, ...)
UNREACHABLE = "unreachable"  # its file system does not answer (or not in time)
DISABLED = "disabled"        # not configured


@dataclass(frozen=True)
class TierReport:
    tier: TierName
    dir: str
    enabled: bool
    reachable: bool         # the tier probe's last reading
    used_bytes: int         # of committed parts
    free_bytes: int
    parts: int              # committed parts
    state: str
    last_error: str = ""    # while degraded: the newest failure
    last_error_time: float = 0.0
    unbounded: bool = False  # the storage sets no limit (an object store): free_bytes is 0 and means nothing
    warnings: tuple[str, ...] = ()  # conditions for the operator to act on (a free-space floor out of reach)


@dataclass(frozen=True)
class SessionReport:
    id: str
    job: str
    rank: int
    pid: int
    arena_bytes: int
    saves_in_flight: int


@dataclass(frozen=True)
class NodeStatus:
    pid: int
    uptime_s: float
    arena_budget_bytes: int
    arena_used_bytes: int
    sessions: list[SessionReport]
    tiers: list[TierReport]
    drain_queue: int        # parts waiting for the shared tier
    memory_parts: int
    memory_bytes: int
    jobs: list[JobSummary]


def tier_state(enabled: bool, reachable: bool | None, health: TierHealth | None) -> tuple[str, str, float]:
    """(state, last error, its unix time) of a tier: unreachable beats degraded (the probe fails too)."""
    if not enabled:
        return DISABLED, "", 0.0
    error, when = (health.last_error, health.last_error_time) if health is not None else ("", 0.0)
    if reachable is False:
        return UNREACHABLE, error, when
    if health is not None and health.degraded:
        return DEGRADED, error, when
    return OK, "", 0.0


class StatusReader:
    """Builds :class:`NodeStatus` from the node's parts (injected, so that it reads and never owns them)."""

    def __init__(self, tiers: Mapping[TierName, Tier], catalog: Catalog, sessions: SessionTable,
                 budget: Budget, memory: MemoryTier, drain: DrainQueue | None, probes: Mapping[TierName, TierProbe],
                 jobs: Callable[[], list[JobSummary]], started: float | None = None,
                 warnings: Callable[[TierName], tuple[str, ...]] = lambda tier: ()) -> None:
        """``tiers``: the storage of each disk tier the node has (no shared tier: no entry); ``warnings``:
        a tier's standing warnings, from memory."""
        self._tiers = tiers
        self._catalog = catalog
        self._sessions = sessions
        self._budget = budget
        self._memory = memory
        self._drain = drain
        self._probes = probes
        self._jobs = jobs
        self._warnings = warnings
        self._started = time.monotonic() if started is None else started

    def read(self) -> NodeStatus:
        sessions = [SessionReport(s.id, s.info.job, s.info.rank, s.info.pid, s.arena.size if s.arena else 0,
                                  len(s.saves)) for s in self._sessions.all()]
        return NodeStatus(
            pid=os.getpid(), uptime_s=time.monotonic() - self._started, arena_budget_bytes=self._budget.total,
            arena_used_bytes=self._budget.used, sessions=sessions,
            tiers=[self.tier(TierName.LOCAL), self.tier(TierName.SHARED)],
            drain_queue=self._drain.pending()[0] if self._drain else 0,
            memory_parts=len(self._memory.copies()), memory_bytes=self._memory.bytes_kept, jobs=self._jobs())

    def tier(self, tier: TierName) -> TierReport:
        storage = self._tiers.get(tier)
        parts = list(self._catalog.all_parts(tier))
        probe = self._probes.get(tier)
        reading = probe.reading() if probe is not None else None
        health = self._drain.tier_health() if tier == TierName.SHARED and self._drain else None
        state, error, when = tier_state(storage is not None, reading.reachable if reading else None, health)
        return TierReport(tier, storage.location if storage is not None else "", storage is not None,
                          bool(reading and reading.reachable),
                          sum(p.nbytes for p in parts), (reading.free_bytes or 0) if reading else 0, len(parts),
                          state, error, when, bool(reading and reading.unbounded), self._warnings(tier))
