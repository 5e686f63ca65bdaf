"""What the job's other nodes hold, in this node's catalogue, and fetching a part from them for a reader.

:meth:`PeerView.fresh` asks each other node of the job what it holds
(``Holdings``: its own committed parts and its replicas) at most once per
``stale_s``, concurrent askers sharing one round, and puts the answer in the
catalogue as parts of the peer tier, beside this node's own replicas. A step
whose every rank has a copy here or on a peer gets a commit record of the
peer tier: the step's own record where a tier holds one (the peer copies
count only where they are the parts it names), else one made from the
parts, of one attempt. That is what makes ``latest()`` return a step no
single tier holds whole after a node is lost.

A node that does not answer is left out of that round and not asked again
for :data:`DOWN_S`, so a lost node's address costs one short timeout, not one
per request.

:meth:`PeerView.pull` copies a part a reader here needs from a node that
holds it (a replica in memory first), checking every block, into this node's
replica store on disk, where the reader opens it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import grpc

from ckptstage.daemon.catalog.index import Catalog
from ckptstage.daemon.catalog.parts import Part
from ckptstage.daemon.errors import DaemonError, SaveFailed
from ckptstage.daemon.logs import fields
from ckptstage.daemon.metrics import Metrics
from ckptstage.daemon.peers.members import Members
from ckptstage.daemon.peers.store import Replica, ReplicaStore
from ckptstage.daemon.peers.transport import CONNECT_TIMEOUT_S, Dialer
from ckptstage.daemon.tiers.interface import TierName
from ckptstage.protos import layout
from ckptstage.protos.v1 import ckptstage_pb2 as pb

log = logging.getLogger(__name__)

DOWN_S = 10.0
REMOTE_ROOT = Path("/.peers-remote")

PartKey = tuple[str, int, int, str]  # job, step, rank, manifest digest


def remote_path(address: str, job: str, step: int, rank: int) -> Path:
    """The name a part another node holds goes by here (no reader can open it: it is fetched first)."""
    return REMOTE_ROOT / address / job / f"step-{step}" / f"rank-{rank}"


class PeerView:
    """The job's other nodes' holdings, kept in the catalogue; fetches from them."""

    def __init__(self, members: Members, dialer: Dialer, store: ReplicaStore, catalog: Catalog, metrics: Metrics,
                 stale_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._members = members
        self._dialer = dialer
        self._store = store
        self._catalog = catalog
        self._metrics = metrics
        self._stale_s = stale_s
        self._clock = clock
        self._lock = threading.Lock()
        self._rounds: dict[str, threading.Lock] = {}
        self._asked: dict[str, float] = {}                         # job -> when its holdings were last asked
        self._down: dict[str, float] = {}                          # address -> not asked again before this
        self._holders: dict[PartKey, list[tuple[str, bool]]] = {}  # -> (address, in memory), memory first
        self._indexed: set[str] = set()                            # jobs the catalogue holds peer parts of

    def invalidate(self, job: str) -> None:
        """What this node holds of ``job`` changed (a replica arrived or went): indexed again at the next ask."""
        with self._lock:
            self._asked.pop(job, None)

    def fresh(self, job: str) -> None:
        """The peer tier's parts and records of ``job`` in the catalogue at most ``stale_s`` old."""
        others = self._members.others(job)
        if not others and job not in self._indexed and not self._store.of_job(job):
            return  # nothing of the job on the peer tier, nobody to ask: a request costs nothing more
        with self._lock:
            round_lock = self._rounds.setdefault(job, threading.Lock())
        with round_lock:
            if self._clock() - self._asked.get(job, float("-inf")) < self._stale_s:
                return
            held = self._ask(job, others)
            self._index(job, held)
            with self._lock:
                self._asked[job] = self._clock()

    def holders(self, job: str, step: int, rank: int, digest: str) -> list[tuple[str, bool]]:
        with self._lock:
            return list(self._holders.get((job, step, rank, digest), ()))

    def in_memory_elsewhere(self, part: Part) -> bool:
        """Whether another node keeps ``part`` in memory (a fetch from it beats a cold read of the shared tier)."""
        return any(memory for _, memory in self.holders(part.job, part.step, part.rank, part.digest))

    def _ask(self, job: str, others: list[str]) -> dict[str, list[pb.HeldPart]]:
        now = self._clock()
        with self._lock:
            asked = [a for a in others if self._down.get(a, 0.0) <= now]
        calls = {a: self._dialer.stub(a).Holdings.future(pb.HoldingsRequest(job=job), timeout=CONNECT_TIMEOUT_S,
                                                         metadata=self._dialer.metadata) for a in asked}
        held: dict[str, list[pb.HeldPart]] = {}
        for address, call in calls.items():
            try:
                held[address] = list(call.result().parts)
            except grpc.RpcError as e:
                with self._lock:
                    first = address not in self._down
                    self._down[address] = self._clock() + DOWN_S
                if first:
                    log.warning("peer %s did not say what it holds of %s (not asked again for %.0fs): %s", address,
                                job, DOWN_S, e.details() if hasattr(e, "details") else e,
                                extra=fields(job=job, peer=address, tier=TierName.PEER))
                continue
            with self._lock:
                self._down.pop(address, None)
        return held

    def _index(self, job: str, held: dict[str, list[pb.HeldPart]]) -> None:
        parts: dict[tuple[int, int], Part] = {}
        holders: dict[PartKey, list[tuple[str, bool]]] = {}
        own = {(r.step, r.rank) for r in self._store.of_job(job)}  # this node's replicas come first
        for replica in self._store.of_job(job):
            parts[(replica.step, replica.rank)] = replica.part()
        for address in sorted(held):
            for h in held[address]:
                holders.setdefault((job, h.step, h.rank, h.digest), []).append((address, h.in_memory))
                found = parts.get((h.step, h.rank))
                if (h.step, h.rank) not in own and (found is None or h.created > found.created):
                    parts[(h.step, h.rank)] = Part(job, h.step, h.rank, h.world_size, TierName.PEER,
                                                   remote_path(address, job, h.step, h.rank), h.bytes, h.created,
                                                   dict(h.metrics), h.attempt, h.digest)
        for where in holders.values():
            where.sort(key=lambda h: not h[1])  # memory first
        with self._lock:
            for key in [k for k in self._holders if k[0] == job]:
                del self._holders[key]
            self._holders.update(holders)
        self._catalog.set_peer_tier(job, list(parts.values()), peer_records(self._catalog, job, parts.values()))
        with self._lock:
            (self._indexed.add if parts else self._indexed.discard)(job)

    # --- fetching --------------------------------------------------------------------------

    def pull(self, part: Part) -> Part:
        """A copy of ``part`` a reader here can open (in the replica store, on disk); raises
        :class:`SaveFailed` when no node that holds it gives a copy that verifies."""
        mine = self._store.get(part.job, part.step, part.rank, part.digest)
        if mine is not None and mine.in_memory:
            mine = self._store.to_disk(mine)
        if mine is not None:
            kept = mine.part()
            self._catalog.add(kept)
            return kept
        failures = []
        for address, _ in self.holders(part.job, part.step, part.rank, part.digest):
            try:
                replica = self._fetch(address, part)
            except (grpc.RpcError, DaemonError, OSError) as e:
                detail = e.details() if isinstance(e, grpc.RpcError) and hasattr(e, "details") else str(e)
                failures.append(f"{address}: {detail}")
                log.warning("cannot fetch %s step %d rank %d from %s: %s", part.job, part.step, part.rank, address,
                            detail, extra=fields(job=part.job, step=part.step, rank=part.rank, peer=address,
                                                 tier=TierName.PEER, error=detail))
                continue
            self._metrics.peer_received_bytes.inc(replica.nbytes)
            kept = replica.part()
            self._catalog.add(kept)
            return kept
        raise SaveFailed(f"cannot fetch {part.job} step {part.step} rank {part.rank} from another node: "
                         + ("; ".join(failures) or "no node holds it now"))

    def _fetch(self, address: str, part: Part) -> Replica:
        stub = self._dialer.stub(address)
        asked = pb.PeerPart(job=part.job, step=part.step, rank=part.rank, digest=part.digest)
        raw = stub.ReadManifest(asked, timeout=CONNECT_TIMEOUT_S * 5, metadata=self._dialer.metadata).manifest
        manifest = layout.parse_manifest_file(raw, remote_path(address, part.job, part.step, part.rank)
                                              / layout.MANIFEST_FILE)
        timeout = 60.0 + part.nbytes / (20 << 20)

        def data() -> Iterator[tuple[str, int, bytes]]:
            for name in layout.manifest_files(manifest):
                for piece in stub.ReadFile(pb.PeerFileRequest(part=asked, name=name), timeout=timeout,
                                           metadata=self._dialer.metadata):
                    yield piece.name, piece.offset, piece.data

        started = time.monotonic()
        replica = self._store.receive(part.job, part.step, part.rank, raw, part.digest, data(), memory=False,
                                      durable=False)
        elapsed = time.monotonic() - started
        log.info("fetched %s step %d rank %d from %s: %d bytes in %.2fs", part.job, part.step, part.rank, address,
                 replica.nbytes, elapsed, extra=fields(job=part.job, step=part.step, rank=part.rank, peer=address,
                                                       tier=TierName.PEER, bytes=replica.nbytes, duration_s=elapsed))
        return replica


def peer_records(catalog: Catalog, job: str, parts: Iterable[Part]) -> list[layout.CommitRecord]:
    """The peer tier's commit records of ``job``: one per step whose every rank has a copy on this node's
    local tier or among ``parts`` (the peer tier's), of the step's committed attempt.

    Where the local or shared tier holds the step's record, that record is the step (the copies must be
    the parts it names, and the peer tier's record is the same commit); else the parts of one attempt
    (the newest part's) make one, the same on every node that sees the same parts.
    """
    by_step: dict[int, dict[int, Part]] = {}
    for part in parts:
        by_step.setdefault(part.step, {})[part.rank] = part
    out = []
    for step, peer in sorted(by_step.items()):
        ckpt = catalog.get(job, step)
        local = {r: tiers[TierName.LOCAL] for r, tiers in ckpt.parts.items() if TierName.LOCAL in tiers} \
            if ckpt is not None else {}
        anchor = None if ckpt is None else ckpt.records.get(TierName.LOCAL) or ckpt.records.get(TierName.SHARED)
        if anchor is not None:
            if all(any(p is not None and p.matches(anchor) for p in (peer.get(r), local.get(r)))
                   for r in range(anchor.world_size)):
                out.append(anchor)
            continue
        newest = max([*peer.values(), *local.values()], key=lambda p: (p.created, p.attempt))
        copies = {r: p for r, p in {**peer, **local}.items() if p.attempt == newest.attempt}
        if set(copies) != set(range(newest.world_size)):
            continue
        out.append(layout.CommitRecord(
            job, step, newest.attempt, newest.world_size, max(p.created for p in copies.values()),
            {r: layout.CommittedPart(p.nbytes, p.digest, p.created, dict(p.metrics)) for r, p in copies.items()}))
    return out
