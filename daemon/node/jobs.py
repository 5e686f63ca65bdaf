"""What the daemon tells operators about each job and about its drains: plain records, no logic.

The drainer fills :class:`ckptstage.daemon.drain.health.DrainHealth`; the node
builds one :class:`JobSummary` per job (``Node.job_summaries``, with
:func:`summarize`), which the ``Status`` and ``ListJobs`` RPCs and the metrics
read. At run time nothing here imports the rest of the daemon, so every layer
may use these types.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptstage.daemon.drain.health import DrainHealth
from ckptstage.daemon.peers.health import JobPeers

if TYPE_CHECKING:
    from ckptstage.daemon.catalog.index import Checkpoint
    from ckptstage.daemon.save.memtier import MemoryCopy, MemoryStep

@dataclass(frozen=True)
class JobSummary:
    """One job on this node: its checkpoints, the bytes it holds per tier, its sessions and its drains.

    ``last_commit_time`` and ``bytes`` are keyed by tier value ("memory",
    "local", "shared"); a tier the job has nothing on is absent.
    """

    job: str
    checkpoints: int             # complete steps on any tier (the memory tier's whole steps included)
    latest_step: int | None      # the newest of them
    last_commit_time: dict[str, float]
    bytes: dict[str, int]
    sessions: int                # open client sessions of the job on this node
    drain: DrainHealth
    peers: JobPeers | None = None  # its replication to other nodes ([peers]); None: no peer tier


def summarize(job: str, checkpoints: Iterable[Checkpoint], memory: Iterable[MemoryCopy],
              memory_steps: Iterable[MemoryStep], sessions: int, drain: DrainHealth,
              peers: JobPeers | None = None) -> JobSummary:
    """One job's summary from what the catalogue and the memory tier hold of it.

    ``checkpoints``: every step of the job the catalogue knows (complete or
    not: bytes count every part); ``memory``: the memory tier's copies of the
    job's parts; ``memory_steps``: its steps kept whole in memory only.
    """
    steps: set[int] = set()
    last: dict[str, float] = {}
    held: dict[str, int] = {}
    for ckpt in checkpoints:
        for tiers in ckpt.parts.values():
            for tier, part in tiers.items():
                held[tier.value] = held.get(tier.value, 0) + part.nbytes
        for tier, record in ckpt.records.items():
            if ckpt.complete_on(tier):
                steps.add(ckpt.step)
                last[tier.value] = max(last.get(tier.value, 0.0), record.created)
    for copy in memory:
        held["memory"] = held.get("memory", 0) + copy.resident.size
        last["memory"] = max(last.get("memory", 0.0), copy.created)
    steps.update(m.step for m in memory_steps)
    return JobSummary(job, len(steps), max(steps) if steps else None, last, held, sessions, drain, peers)
