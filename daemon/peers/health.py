"""How a job's replication goes, as status and the metrics read it: plain records, importing nothing of the daemon."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PeerHealth:
    """One node this node sends a job's replicas to."""

    address: str
    state: str = "ok"          # "ok" | "failing"
    last_error: str = ""
    last_ok: float = 0.0       # unix seconds of the last replica it took; 0: none yet


@dataclass(frozen=True)
class JobPeers:
    """A job's replication from this node: its peers, the newest step replicated whole, the wait, the queue."""

    peers: list[PeerHealth]
    replicated_step: int | None
    lag_s: float
    queued: int
