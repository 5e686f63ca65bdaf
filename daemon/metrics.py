"""Prometheus metrics. The daemon owns its registry; state gauges are computed at scrape time.

docs/OPERATIONS.md lists every metric with its labels and meaning, and the
alerts built on them. Per-job series carry the training job in the label
``job``. Prometheus keeps ``job`` for the scrape job's name, so with the
default ``honor_labels: false`` it stores the label exported here as
``exported_job``; the alerts and the dashboard select ``exported_job``.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ckptstage.daemon.retention.planner import DELETE_REASONS

if TYPE_CHECKING:
    from ckptstage.daemon.node.jobs import JobSummary
    from ckptstage.daemon.tiers.compression import Figures

_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 150, 300, 900)

# Per-job series are exported for this many jobs at most: those with an open session or a failing drain
# first, then the most recently committed. The rest are summed into one series labelled OTHER_JOB (a
# name no job can have: job names start with a letter or a digit), so that a node that kept checkpoints
# of thousands of finished jobs does not put thousands of series into every scrape.
MAX_JOB_SERIES = 64
OTHER_JOB = "_other"
JOB_LABEL = "job"
FAILING_DRAIN_STATES = frozenset({"retrying", "failed"})


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
    tier_size: Callable[[str], int | None] = lambda tier: None  # the tier probe's last reading; never blocks
    incomplete_steps: Callable[[], int] = lambda: 0
    memory_copies: Callable[[], int] = lambda: 0  # parts the memory tier serves
    memory_bytes: Callable[[], int] = lambda: 0   # shared memory it holds (part of arena_used)
    jobs: Callable[[], Sequence[JobSummary]] = lambda: []  # every job the node knows of
    peer_lag_s: Callable[[], float | None] = lambda: None  # None: no peer tier
    peer_replicas: Callable[[], tuple[int, int, int, int]] = lambda: (0, 0, 0, 0)  # memory n, bytes, disk n, bytes
    loads_in_flight: Callable[[], int] = lambda: 0
    yielded_to_loads_s: Callable[[], float] = lambda: 0.0
    loads_began: Callable[[], int] = lambda: 0
    quarantined: Callable[[str], tuple[int, int]] = lambda tier: (0, 0)  # copies moved aside, their bytes
    tier_stored: Callable[[str], int | None] = lambda tier: None  # chunks shared once (None: not weighed yet)
    compression: Callable[[str], Figures | None] = lambda tier: None  # a tier that may compress chunks: its figures


def package_version() -> str:
    """The installed ckptstage distribution's version ("unknown" when run from a tree not installed)."""
    try:
        return importlib.metadata.version("ckptstage")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None, version: str | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.build = Info("ckptstage_build", "The running daemon's version (the value is always 1).", registry=r)
        self.build.info({"version": version if version is not None else package_version()})
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
        self.fetched_parts = Counter("ckptstage_fetched_parts", "Parts copied from the shared tier onto the local "
                                     "tier for readers (Prefetch, and loads that read another rank's part).",
                                     registry=r)
        self.fetched_bytes = Counter("ckptstage_fetched_bytes", "Bytes of the parts fetched.", registry=r)
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
        self.peer_sent_bytes = Counter("ckptstage_peer_sent_bytes", "Bytes of parts sent to other nodes as "
                                       "replicas ([peers]); of an incremental part sent as the chunks its peer "
                                       "lacked, those.", registry=r)
        self.peer_received_bytes = Counter("ckptstage_peer_received_bytes", "Bytes of replicas received from "
                                           "other nodes, and of replicas fetched from them for a reader.",
                                           registry=r)
        self.peer_failures = Counter("ckptstage_peer_failures", "Sends of a replica that failed (retried while "
                                     "the step is the newest).", registry=r)
        self.peer_dropped = Counter("ckptstage_peer_dropped", "Parts never replicated because a newer step of "
                                    "the job committed first.", registry=r)
        self.peer_refused = Counter("ckptstage_peer_refused", "Calls on the peer port refused, by reason "
                                    "(unauthenticated: no or a wrong token; not_a_member: the sender does not "
                                    "run the job).", ["reason"], registry=r)
        for reason in ("unauthenticated", "not_a_member"):
            self.peer_refused.labels(reason)
        self.sessions_opened = Counter("ckptstage_sessions_opened", "Client sessions opened.", registry=r)
        self.sessions_reaped = Counter("ckptstage_sessions_reaped",
                                       "Sessions closed because the client went away.", registry=r)
        for trigger in ("commit", "drain", "timer", "gc", "start"):
            self.retention_passes.labels(trigger)
        # Every label value known in advance starts at 0, so rate() and increase() see the first event.
        self.saves_committed.labels("memory")
        for tier in ("local", "shared"):
            self.saves_committed.labels(tier)
            self.bytes_persisted.labels(tier)
            self.corrupt.labels(tier)
            self.chunks_swept.labels(tier)
            self.chunk_bytes_swept.labels(tier)
            self.chunks_reused.labels(tier)
            for rule in DELETE_REASONS:
                self.evictions.labels(tier, rule)
            for verdict in ("corrupt", "intact", "unreadable"):
                self.corrupt_reports.labels(tier, verdict)

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
        size = GaugeMetricFamily("ckptstage_tier_size_bytes", "Size of the tier's file system.", labels=["tier"])
        stored_fam = GaugeMetricFamily("ckptstage_tier_stored_bytes", "Bytes the committed checkpoints take on the "
                                   "tier, each chunk of incremental ones once, a compressed one as stored "
                                   "(ckptstage_tier_used_bytes counts every part whole, as saved); as of the last "
                                   "retention pass.", labels=["tier"])
        aside = GaugeMetricFamily("ckptstage_quarantined_copies", "Copies moved aside as corrupt, kept for "
                                  "forensics until [retention] quarantine_keep_s.", labels=["tier"])
        aside_bytes = GaugeMetricFamily("ckptstage_quarantined_bytes", "Their bytes.", labels=["tier"])
        for tier in p.tiers():
            weighed = p.tier_stored(tier)
            stored_fam.add_metric([tier], weighed if weighed is not None else p.tier_used(tier))
            n, b = p.quarantined(tier)
            aside.add_metric([tier], n)
            aside_bytes.add_metric([tier], b)
            used.add_metric([tier], p.tier_used(tier))
            nfree = p.tier_free(tier)
            if nfree is not None:
                free.add_metric([tier], nfree)
            nsize = p.tier_size(tier)
            if nsize is not None:
                size.add_metric([tier], nsize)
        yield used
        yield free
        yield size
        yield stored_fam
        yield aside
        yield aside_bytes
        yield from compression_families({t: f for t in p.tiers() for f in [p.compression(t)] if f is not None})
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
        lag = p.peer_lag_s()
        yield GaugeMetricFamily("ckptstage_peer_replication_lag_seconds",
                                "How long the oldest part waiting for its replicas on other nodes has waited "
                                "(0: none waits, or no peer tier).", value=lag or 0.0)
        if lag is not None:
            mem_n, mem_b, disk_n, disk_b = p.peer_replicas()
            held = GaugeMetricFamily("ckptstage_peer_replicas", "Replicas of other nodes' parts kept here, by "
                                     "where.", labels=["where"])
            held_bytes = GaugeMetricFamily("ckptstage_peer_replica_bytes", "Bytes of those replicas, by where.",
                                           labels=["where"])
            for where, n, b in (("memory", mem_n, mem_b), ("disk", disk_n, disk_b)):
                held.add_metric([where], n)
                held_bytes.add_metric([where], b)
            yield held
            yield held_bytes
        yield GaugeMetricFamily("ckptstage_loads_in_flight", "Checkpoint loads on this node now: drains and "
                                "replicas to peers wait while there are any ([persist] yield_to_loads_s).",
                                value=p.loads_in_flight())
        yield CounterMetricFamily("ckptstage_loads", "Checkpoint loads readers on this node announced.",
                                  value=p.loads_began())
        yield CounterMetricFamily("ckptstage_yielded_to_loads_seconds", "Seconds drains and replicas to peers "
                                  "waited for loads on this node, summed over their threads.",
                                  value=p.yielded_to_loads_s())
        yield from job_families(p.jobs())


@dataclass(frozen=True)
class JobRow:
    """What is exported of one job (or of the jobs folded into OTHER_JOB)."""

    job: str
    checkpoints: int
    latest_step: int | None
    last_commit_time: dict[str, float]
    bytes: dict[str, int]
    sessions: int
    drain_failing: bool
    drain_failures: int
    drain_last_error_time: float
    drain_queue_parts: int
    drain_queue_bytes: int

    @staticmethod
    def of(s: JobSummary) -> JobRow:
        d = s.drain
        failing = d.state in FAILING_DRAIN_STATES
        return JobRow(s.job, s.checkpoints, s.latest_step, dict(s.last_commit_time), dict(s.bytes), s.sessions,
                       failing, d.consecutive_failures, d.last_error_time, d.queued_parts, d.queued_bytes)

    @property
    def active(self) -> bool:
        """A job an operator may be paged about: a trainer is connected, or its drains fail."""
        return self.sessions > 0 or self.drain_failing

    @property
    def newest_commit(self) -> float:
        return max(self.last_commit_time.values(), default=0.0)


def _fold(rows: Sequence[JobRow]) -> JobRow:
    """The jobs beyond the cap as one: counts and bytes summed, times and failure flags their maximum."""
    last: dict[str, float] = {}
    held: dict[str, int] = {}
    for r in rows:
        for tier, t in r.last_commit_time.items():
            last[tier] = max(last.get(tier, 0.0), t)
        for tier, n in r.bytes.items():
            held[tier] = held.get(tier, 0) + n
    return JobRow(OTHER_JOB, sum(r.checkpoints for r in rows), None, last, held, sum(r.sessions for r in rows),
                   any(r.drain_failing for r in rows), max(r.drain_failures for r in rows),
                   max(r.drain_last_error_time for r in rows), sum(r.drain_queue_parts for r in rows),
                   sum(r.drain_queue_bytes for r in rows))


def select_jobs(summaries: Sequence[JobSummary], cap: int = MAX_JOB_SERIES) -> tuple[list[JobRow], int]:
    """The rows to export (at most ``cap`` jobs, plus one OTHER_JOB row for the rest) and how many were folded.

    Jobs with an open session or a failing drain come first, then the most
    recently committed; ties go by name, so the choice is stable between scrapes.
    """
    rows = sorted((JobRow.of(s) for s in summaries), key=lambda r: (not r.active, -r.newest_commit, r.job))
    shown, rest = rows[:cap], rows[cap:]
    if rest:
        shown.append(_fold(rest))
    return shown, len(rest)


def job_families(summaries: Sequence[JobSummary], cap: int = MAX_JOB_SERIES) -> list[Metric]:
    """The per-job metric families, labelled ``job`` (see the module docstring)."""
    rows, folded = select_jobs(summaries, cap)
    jl = [JOB_LABEL]

    def family(name: str, doc: str, labels: list[str] = jl) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=labels)

    jobs = GaugeMetricFamily("ckptstage_jobs", "Jobs this daemon knows of (committed checkpoints, an open "
                             "session or memory-tier copies), whether or not they have series of their own.",
                             value=len(summaries))
    folded_f = GaugeMetricFamily("ckptstage_jobs_folded", f"Jobs beyond the cap of {cap} whose per-job series "
                                 f'are summed into {JOB_LABEL}="{OTHER_JOB}".', value=folded)
    ckpts = family("ckptstage_job_checkpoints", "Complete steps of the job on any tier of this node.")
    latest = family("ckptstage_job_latest_step", "The job's newest complete step.")
    commit = family("ckptstage_last_commit_timestamp_seconds",
                    "Unix time of the job's newest complete step on the tier.", [JOB_LABEL, "tier"])
    nbytes = family("ckptstage_job_bytes", "Bytes the job holds on the tier.", [JOB_LABEL, "tier"])
    sessions = family("ckptstage_job_sessions", "Open client sessions of the job on this node (its trainers).")
    failing = family("ckptstage_job_drain_failing",
                     "1 while copies of the job's parts to the shared tier fail (retrying or failed for good), "
                     "until one succeeds.")
    failures = family("ckptstage_job_drain_consecutive_failures",
                      "Failed copies of the job's parts to the shared tier since its last successful drain.")
    err_time = family("ckptstage_job_drain_last_error_timestamp_seconds",
                      "Unix time of the job's last drain failure since its last successful drain.")
    q_parts = family("ckptstage_job_drain_queue_parts", "The job's parts waiting to reach the shared tier.")
    q_bytes = family("ckptstage_job_drain_queue_bytes", "The job's bytes waiting to reach the shared tier.")
    for r in rows:
        key = [r.job]
        ckpts.add_metric(key, r.checkpoints)
        if r.latest_step is not None:
            latest.add_metric(key, r.latest_step)
        for tier, t in sorted(r.last_commit_time.items()):
            if t > 0:
                commit.add_metric([r.job, tier], t)
        for tier, n in sorted(r.bytes.items()):
            nbytes.add_metric([r.job, tier], n)
        sessions.add_metric(key, r.sessions)
        failing.add_metric(key, 1 if r.drain_failing else 0)
        failures.add_metric(key, r.drain_failures)
        if r.drain_last_error_time > 0:
            err_time.add_metric(key, r.drain_last_error_time)
        q_parts.add_metric(key, r.drain_queue_parts)
        q_bytes.add_metric(key, r.drain_queue_bytes)
    return [jobs, folded_f, ckpts, latest, commit, nbytes, sessions, failing, failures, err_time, q_parts, q_bytes]


def compression_families(figures: Mapping[str, Figures]) -> Iterator[Metric]:
    """What the tiers that may keep chunks compressed did, and what "auto" decides from (its figures)."""
    chunks = CounterMetricFamily("ckptstage_compression_chunks", "New chunks written to the tier, by how they were "
                                 "kept ([shared] compression).", labels=["tier", "kept"])
    nbytes = CounterMetricFamily("ckptstage_compression_bytes", "Their bytes, as saved (logical) and as written "
                                 "(stored).", labels=["tier", "form"])
    stream = GaugeMetricFamily("ckptstage_compression_stream_bytes_per_second", "One write stream's recent speed "
                               "to the tier, a rate limit's waits included (\"auto\" compresses when the codec's "
                               "speed times the share it saves beats it).", labels=["tier"])
    codec = GaugeMetricFamily("ckptstage_compression_codec_bytes_per_second", "The codec's recent speed on this "
                              "node's data, bytes in.", labels=["tier"])
    share = GaugeMetricFamily("ckptstage_compression_stored_share", "The recent share of its bytes a compressed "
                              "chunk kept.", labels=["tier"])
    for tier, f in figures.items():
        chunks.add_metric([tier, "compressed"], f.compressed)
        chunks.add_metric([tier, "raw"], f.raw)
        nbytes.add_metric([tier, "logical"], f.logical_bytes)
        nbytes.add_metric([tier, "stored"], f.stored_bytes)
        for family, value in ((stream, f.stream_bytes_per_s), (codec, f.codec_bytes_per_s), (share, f.stored_share)):
            if value is not None:
                family.add_metric([tier], value)
    if figures:
        yield from (chunks, nbytes, stream, codec, share)
