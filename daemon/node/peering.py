"""What the node builds for ``[peers]`` and for fetching: the peer tier, the fetcher both kinds of copy share,
and how a session's budget takes memory back from replicas.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ckptstage.daemon.catalog.index import Catalog, Part, TierName
from ckptstage.daemon.config import Config
from ckptstage.daemon.drain.drainer import Drainer
from ckptstage.daemon.drain.fetcher import Fetcher
from ckptstage.daemon.metrics import Metrics
from ckptstage.daemon.peers.tier import PeerTier
from ckptstage.daemon.save.arena import Budget
from ckptstage.daemon.save.memtier import MemoryTier
from ckptstage.daemon.tiers.interface import Tier
from ckptstage.daemon.tiers.loadgate import LoadGate


def open_peers(config: Config, local: Tier, state_dir: Path, owner: str, catalog: Catalog, budget: Budget,
               metrics: Metrics, gate: LoadGate | None = None) -> PeerTier | None:
    """The peer tier ``[peers]`` asks for (None: off); replicas it sends wait at ``gate`` during loads."""
    if not config.peers.enabled:
        return None

    def on_shared(job: str, step: int) -> bool:
        ckpt = catalog.get(job, step)
        return ckpt is not None and ckpt.complete_on(TierName.SHARED)

    return PeerTier(config.peers, local, state_dir, owner, catalog, budget, metrics, on_shared, config.persist.nice,
                    gate=gate)


def reclaimer(budget: Budget, memory: MemoryTier, peers: PeerTier | None
              ) -> Callable[[int, tuple[str, int] | None], None]:
    """What a session short of budget memory asks: the memory tier's kept copies make way first, then the
    replicas kept in memory go to disk."""
    if peers is None:
        return memory.reclaim

    def reclaim(want: int, owner: tuple[str, int] | None) -> None:
        before = budget.used
        memory.reclaim(want, owner)
        short = want - (before - budget.used)
        if short > 0:
            peers.store.spill(short)

    return reclaim


def open_fetcher(drainer: Drainer | None, peers: PeerTier | None, catalog: Catalog, metrics: Metrics,
                 report_corrupt: Callable[[Part, str], None]) -> Fetcher | None:
    """Copies for readers: a shared part onto the local tier (indexed here, counted), another node's part
    into this node's replica store (the peer tier indexes and counts it); None when there is neither to
    fetch from."""
    if drainer is None and peers is None:
        return None

    def copy(part: Part) -> None:
        if part.tier == TierName.PEER:
            assert peers is not None
            peers.pull(part)
        else:
            assert drainer is not None
            local = drainer.fetch(part)
            catalog.add(local)
            metrics.fetched_parts.inc()
            metrics.fetched_bytes.inc(local.nbytes)

    return Fetcher(copy, report_corrupt)
