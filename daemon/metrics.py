"""Prometheus metrics. The daemon owns its registry; state gauges are computed at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 150, 300, 900)


@dataclass(frozen=True)
class StateProbe:
    """What the scrape-time collector reads from the daemon (injected, so tests can fake it)."""

    arena_used: Callable[[], int]
    arena_total: Callable[[], int]
    sessions: Callable[[], int]
    tiers: Callable[[], list[str]]               # enabled tiers
    tier_used: Callable[[str], int]
    tier_free: Callable[[str], int | None]       # the tier probe's last reading; never blocks
    drain_queue: Callable[[], tuple[int, int]]   # (parts, bytes)
    drain_lag_s: Callable[[], float]
    shared_reachable: Callable[[], bool | None]
    incomplete_steps: Callable[[], int] = lambda: 0
    memory_copies: Callable[[], int] = lambda: 0  # parts the memory tier serves
    memory_bytes: Callable[[], int] = lambda: 0   # shared memory it holds (part of arena_used)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.saves_started = Counter("ckptstage_saves_started", "Saves begun by clients.", registry=r)
        self.saves_committed = Counter("ckptstage_saves_committed", "Parts committed, by tier.",
                                       ["tier"], registry=r)
        self.saves_failed = Counter("ckptstage_saves_failed", "Saves that failed or were aborted.", registry=r)
        self.bytes_persisted = Counter("ckptstage_persisted_bytes", "Bytes committed, by tier.",
                                       ["tier"], registry=r)
        self.persist_seconds = Histogram("ckptstage_persist_duration_seconds",
                                         "BeginSave to local commit.", buckets=_DURATION_BUCKETS, registry=r)
        self.drain_seconds = Histogram("ckptstage_drain_duration_seconds",
                                       "Copy of one part to the shared tier, verified and committed.",
                                       buckets=_DURATION_BUCKETS, registry=r)
        self.drain_retries = Counter("ckptstage_drain_retries", "Drain attempts that failed and will be retried.",
                                     registry=r)
        self.drain_bandwidth = Gauge("ckptstage_drain_bandwidth_bytes_per_second",
                                     "Bandwidth of the last part drained (bytes over its copy's duration).",
                                     registry=r)
        self.retention_passes = Counter("ckptstage_retention_passes", "Retention passes run, by trigger.",
                                        ["trigger"], registry=r)
        self.evictions = Counter("ckptstage_evictions", "Parts deleted by retention, by tier and rule.",
                                 ["tier", "rule"], registry=r)
        self.chunks_swept = Counter("ckptstage_chunks_swept", "Chunks of incremental parts removed because no "
                                    "part on the tier refers to them any more, by tier.", ["tier"], registry=r)
        self.chunk_bytes_swept = Counter("ckptstage_chunk_bytes_swept", "Bytes of the chunks swept, by tier.",
                                         ["tier"], registry=r)
        self.chunks_reused = Counter("ckptstage_chunk_bytes_reused", "Bytes of parts written incrementally that "
                                     "a tier held already (not written again), by tier.", ["tier"], registry=r)
        self.corrupt = Counter("ckptstage_corrupt_parts", "Parts that failed verification, by tier.",
                               ["tier"], registry=r)
        self.corrupt_reports = Counter("ckptstage_corrupt_reports",
                                       "Reports of a corrupt copy, by tier and the daemon's own verdict on "
                                       "re-reading it (corrupt: quarantined; intact; unreadable: hidden nothing).",
                                       ["tier", "verdict"], registry=r)
        self.memory_handouts = Counter("ckptstage_memory_handouts",
                                       "Memory-tier copies handed to a reader (a restarted trainer).", registry=r)
        self.sessions_opened = Counter("ckptstage_sessions_opened", "Client sessions opened.", registry=r)
        self.sessions_reaped = Counter("ckptstage_sessions_reaped",
                                       "Sessions closed because the client went away.", registry=r)
        for trigger in ("commit", "drain", "timer", "gc"):
            self.retention_passes.labels(trigger)
        for tier in ("local", "shared"):
            self.saves_committed.labels(tier)
            self.bytes_persisted.labels(tier)
            self.corrupt.labels(tier)

    def add_state(self, probe: StateProbe) -> None:
        self.registry.register(_StateCollector(probe))


class _StateCollector(Collector):
    def __init__(self, probe: StateProbe) -> None:
        self.p = probe

    def collect(self) -> Iterable[Metric]:
        p = self.p
        yield GaugeMetricFamily("ckptstage_arena_used_bytes", "Shared memory granted to sessions.",
                                value=p.arena_used())
        yield GaugeMetricFamily("ckptstage_arena_budget_bytes", "The [arena] max_bytes budget.",
                                value=p.arena_total())
        yield GaugeMetricFamily("ckptstage_sessions", "Open client sessions.", value=p.sessions())
        used = GaugeMetricFamily("ckptstage_tier_used_bytes", "Bytes of committed checkpoints.", labels=["tier"])
        free = GaugeMetricFamily("ckptstage_tier_free_bytes", "Free bytes on the tier's file system.",
                                 labels=["tier"])
        for tier in p.tiers():
            used.add_metric([tier], p.tier_used(tier))
            nfree = p.tier_free(tier)
            if nfree is not None:
                free.add_metric([tier], nfree)
        yield used
        yield free
        parts, nbytes = p.drain_queue()
        yield GaugeMetricFamily("ckptstage_drain_queue_parts", "Parts waiting to reach the shared tier.",
                                value=parts)
        yield GaugeMetricFamily("ckptstage_drain_queue_bytes", "Bytes waiting to reach the shared tier.",
                                value=nbytes)
        yield GaugeMetricFamily("ckptstage_drain_lag_seconds",
                                "Age of the oldest part not yet on the shared tier.", value=p.drain_lag_s())
        yield GaugeMetricFamily("ckptstage_incomplete_steps",
                                "Steps with some ranks' parts committed but not all, for longer than "
                                "[retention] incomplete_after_s.", value=p.incomplete_steps())
        yield GaugeMetricFamily("ckptstage_memory_parts",
                                "Parts kept in memory for a restart on this node (the memory tier).",
                                value=p.memory_copies())
        yield GaugeMetricFamily("ckptstage_memory_bytes",
                                "Shared memory the memory tier holds (counted in ckptstage_arena_used_bytes).",
                                value=p.memory_bytes())
        reachable = p.shared_reachable()
        if reachable is not None:
            yield GaugeMetricFamily("ckptstage_shared_tier_up", "1 when the last shared-tier operation worked.",
                                    value=1 if reachable else 0)
