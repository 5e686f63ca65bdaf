"""Sending each committed part to the nodes placement names, on threads of its own, newest step first.

A part committed on the local tier is queued here (:meth:`Replicator.committed`)
and the save goes on: nothing a trainer, the persister, the drain or the
memory tier waits for ever waits on a peer. The queue is per job and holds
one step: a part of a newer step drops the older step's parts still queued
(a replica of a step that is no longer the newest protects little, and a slow
peer must not build a backlog), and an older part arriving after a newer one
is dropped at once. Sends are paced by ``[peers] max_bandwidth`` across jobs;
a send that fails is retried with backoff for as long as its step is the
newest. ``wait`` answers ``SaveHandle.wait("peer")``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from ckptstage.daemon import fsutil
from ckptstage.daemon.catalog.parts import Part
from ckptstage.daemon.errors import DaemonError, SaveFailed
from ckptstage.daemon.logs import fields
from ckptstage.daemon.metrics import Metrics
from ckptstage.daemon.peers import placement
from ckptstage.daemon.peers.health import PeerHealth
from ckptstage.daemon.peers.members import Members
from ckptstage.daemon.peers.sendchunks import send_chunks
from ckptstage.daemon.peers.replicaio import part_pieces
from ckptstage.daemon.peers.store import parse_header
from ckptstage.daemon.peers.transport import Dialer
from ckptstage.daemon.tiers.interface import TierName
from ckptstage.daemon.tiers.limiter import Pacer, Pacers, RateLimiter
from ckptstage.daemon.tiers.loadgate import LoadGate
from ckptstage.protos import layout
from ckptstage.protos.v1 import ckptstage_pb2 as pb

log = logging.getLogger(__name__)

WORKERS = 2
RETRY_INITIAL_S = 0.5
RETRY_MAX_S = 30.0
MIN_SEND_RATE = 20 << 20  # bytes/s below which a send is taken as stuck (its deadline)
MAX_OUTCOMES = 4096       # settled parts remembered for late waits

Key = tuple[str, int, int]  # job, step, rank


@dataclass
class _Pending:
    part: Part
    targets: list[str]
    queued: float = field(default_factory=time.monotonic)
    not_before: float = 0.0
    delay_s: float = RETRY_INITIAL_S


class Replicator:
    """The queue of parts to replicate and the threads that send them."""

    def __init__(self, members: Members, dialer: Dialer, replicas: int, max_bandwidth: int | None,
                 metrics: Metrics, nice: int = 0, clock: Callable[[], float] = time.time,
                 gate: LoadGate | None = None) -> None:
        """``gate``: where each piece sent waits while a checkpoint is being loaded on this node (its reads of the
        local disk stop with it); a send's deadline allows for one such wait."""
        self._members = members
        self._dialer = dialer
        self._replicas = replicas
        limiter = RateLimiter(max_bandwidth)
        self._limiter: Pacer = Pacers([gate, limiter]) if gate is not None else limiter
        self._yield_s = gate.max_pause_s if gate is not None else 0.0
        self._metrics = metrics
        self._clock = clock
        self._nice = nice  # as the drain's threads: under contention the trainer and the control plane first
        self._cond = threading.Condition()
        self._queue: dict[str, dict[Key, _Pending]] = {}  # job -> its newest step's parts waiting to go
        self._sending: set[Key] = set()
        self._outcomes: OrderedDict[tuple[Key, str], str] = OrderedDict()  # (key, digest) -> "" done, or why not
        self._health: dict[str, PeerHealth] = {}
        self._replicated: dict[str, int] = {}  # job -> newest step all of whose parts here reached their peers
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, name=f"replicate-{i}", daemon=True)
                         for i in range(WORKERS)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t.is_alive():
                t.join(max(0.0, deadline - time.monotonic()))

    # --- what the node tells it ----------------------------------------------------------

    def committed(self, part: Part) -> None:
        """A part committed on the local tier: queued for its peers (nothing when the job has none)."""
        targets = placement.targets(self._members.nodes(part.job), self._members.me, self._replicas)
        if not targets:
            return
        key = (part.job, part.step, part.rank)
        with self._cond:
            queued = self._queue.setdefault(part.job, {})
            newest = max((k[1] for k in queued), default=None)
            if newest is not None and part.step < newest:
                self._settle(key, part.digest, f"step {part.step} was not replicated: step {newest} of the job "
                                               "committed before it was sent")
                return
            for older in [k for k in queued if k[1] < part.step]:
                dropped = queued.pop(older)
                self._settle(older, dropped.part.digest, f"a newer step ({part.step}) committed before it was sent")
                self._metrics.peer_dropped.inc()
            queued[key] = _Pending(part, targets)
            self._outcomes.pop((key, part.digest), None)
            self._cond.notify()

    def wait(self, job: str, step: int, rank: int, digest: str, timeout: float) -> bool:
        """True once the part's replicas are committed on every node placement names; raises
        :class:`SaveFailed` when they will not be (the job has no other node, a newer step took its turn)."""
        key = (job, step, rank)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                outcome = self._outcomes.get((key, digest))
                if outcome is not None:
                    if outcome:
                        raise SaveFailed(f"{job} step {step} rank {rank} has no replica: {outcome}")
                    return True
                queued = key in self._queue.get(job, {}) or key in self._sending
                if not queued:
                    if not placement.targets(self._members.nodes(job), self._members.me, self._replicas):
                        raise SaveFailed(f"{job} step {step} rank {rank} has no replica: the job runs on no other "
                                         "node this daemon knows of (its clients gather their daemons' peer "
                                         "addresses when they start)")
                    raise SaveFailed(f"{job} step {step} rank {rank} is not being replicated (not committed on "
                                     "this node's local tier, or replicated long ago)")
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 1.0))

    # --- what status reads -----------------------------------------------------------------

    def health(self, job: str) -> list[PeerHealth]:
        targets = placement.targets(self._members.nodes(job), self._members.me, self._replicas)
        with self._cond:
            return [self._health.get(a, PeerHealth(a)) for a in targets]

    def job_state(self, job: str) -> tuple[int | None, float, int]:
        """(newest step replicated whole from here, seconds the oldest queued part has waited, parts queued)."""
        now = time.monotonic()
        with self._cond:
            queued = self._queue.get(job, {})
            lag = max((now - p.queued for p in queued.values()), default=0.0)
            return self._replicated.get(job), lag, len(queued)

    def lag_s(self) -> float:
        """How long the oldest part queued for any job has waited (0: nothing queued)."""
        now = time.monotonic()
        with self._cond:
            return max((now - p.queued for q in self._queue.values() for p in q.values()), default=0.0)

    # --- the workers ---------------------------------------------------------------------

    def _take(self) -> _Pending | None:
        with self._cond:
            while not self._stop.is_set():
                now = time.monotonic()
                ready = [p for q in self._queue.values() for k, p in q.items()
                         if k not in self._sending and p.not_before <= now]
                if ready:
                    pending = min(ready, key=lambda p: (-p.part.step, p.queued))
                    self._sending.add((pending.part.job, pending.part.step, pending.part.rank))
                    return pending
                wake = min((p.not_before for q in self._queue.values() for p in q.values()), default=now + 1.0)
                self._cond.wait(max(0.01, min(1.0, wake - now)))
        return None

    def _work(self) -> None:
        fsutil.lower_thread_priority(self._nice)
        while (pending := self._take()) is not None:
            part = pending.part
            key = (part.job, part.step, part.rank)
            error = ""
            permanent = False
            for target in list(pending.targets):
                try:
                    self._send(part, target)
                    pending.targets.remove(target)
                    self._healthy(target)
                except _Gone as e:
                    error, permanent = str(e), True
                    break
                except (grpc.RpcError, OSError) as e:
                    error = _describe(e)
                    self._failing(target, error, part)
            with self._cond:
                self._sending.discard(key)
                queued = self._queue.get(part.job, {})
                if queued.get(key) is not pending:
                    continue  # dropped meanwhile (a newer step): settled then
                if not pending.targets or permanent:
                    del queued[key]
                    self._settle(key, part.digest, error if permanent else "")
                    if not permanent and not any(k[1] == part.step for k in queued):
                        self._replicated[part.job] = max(part.step, self._replicated.get(part.job, -1))
                else:
                    pending.not_before = time.monotonic() + pending.delay_s
                    pending.delay_s = min(RETRY_MAX_S, pending.delay_s * 2)
                self._cond.notify_all()

    def _send(self, part: Part, target: str) -> None:
        try:
            raw = (part.path / layout.MANIFEST_FILE).read_bytes()
        except FileNotFoundError:
            raise _Gone("the local copy was removed before it was sent") from None
        try:
            manifest = parse_header(part.job, part.step, part.rank, raw, part.digest)
        except DaemonError as e:
            raise _Gone(str(e)) from None
        started = time.monotonic()
        timeout = 30.0 + part.nbytes / MIN_SEND_RATE + self._yield_s
        stub = self._dialer.stub(target)
        sent = send_chunks(stub, self._dialer.metadata, part, raw, manifest, self._members.me, self._limiter.acquire,
                           self._stop.is_set, timeout)
        if sent is None:
            stub.PutReplica(self._messages(part, raw, manifest), timeout=timeout, metadata=self._dialer.metadata)
        elapsed = time.monotonic() - started
        nbytes = part.nbytes if sent is None else sent
        self._metrics.peer_sent_bytes.inc(nbytes)
        log.info("replicated %s step %d rank %d to %s: %d bytes in %.2fs%s", part.job, part.step, part.rank, target,
                 nbytes, elapsed, "" if sent is None else f" (the chunks it lacked, of {part.nbytes})",
                 extra=fields(job=part.job, step=part.step, rank=part.rank, tier=TierName.PEER, bytes=nbytes,
                              duration_s=elapsed, peer=target))

    def _messages(self, part: Part, raw: bytes, manifest: dict[str, object]) -> Iterator[pb.ReplicaChunk]:
        yield pb.ReplicaChunk(header=pb.ReplicaHeader(job=part.job, step=part.step, rank=part.rank,
                                                      sender=self._members.me, manifest=raw, digest=part.digest))
        for name in layout.manifest_files(manifest):
            offset = 0
            # The persister wrote it around the page cache: what this read puts there goes again.
            for piece in part_pieces(part.path, manifest, name, drop_cache=True):
                if self._stop.is_set():
                    raise OSError("the daemon is stopping")
                self._limiter.acquire(len(piece))
                yield pb.ReplicaChunk(data=pb.FileData(name=name, offset=offset, data=piece))
                offset += len(piece)

    def _settle(self, key: Key, digest: str, outcome: str) -> None:
        """Records how a part's replication ended ("": done); with the condition held."""
        self._outcomes[(key, digest)] = outcome
        self._outcomes.move_to_end((key, digest))
        while len(self._outcomes) > MAX_OUTCOMES:
            self._outcomes.popitem(last=False)
        self._cond.notify_all()

    def _healthy(self, target: str) -> None:
        with self._cond:
            health = self._health.setdefault(target, PeerHealth(target))
            health.state, health.last_error, health.last_ok = "ok", "", self._clock()

    def _failing(self, target: str, error: str, part: Part) -> None:
        with self._cond:
            health = self._health.setdefault(target, PeerHealth(target))
            first = health.state != "failing"
            health.state, health.last_error = "failing", error
        self._metrics.peer_failures.inc()
        if first:
            log.warning("cannot replicate %s step %d rank %d to %s (retrying while it is the newest step): %s",
                        part.job, part.step, part.rank, target, error,
                        extra=fields(job=part.job, step=part.step, rank=part.rank, tier=TierName.PEER, peer=target,
                                     error=error))


class _Gone(Exception):
    """The part cannot be sent any more (its local copy went)."""


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.RpcError):
        code = error.code()  # type: ignore[attr-defined]  # grpc.Call
        return f"{code.name if code else 'error'}: {error.details()}"  # type: ignore[attr-defined]
    return str(error)
