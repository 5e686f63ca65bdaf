"""The peer tier as the node uses it: the job's nodes, the replicas kept here, replication out, and the view in.

:class:`PeerTier` wires :mod:`members`, :mod:`store`, :mod:`replicator` and
:mod:`view` and answers both sides: the node (a part committed, a job's
nodes joined, a wait, a fetch for a reader) and the job's other nodes (the
``Peer`` service: a replica put, holdings, a part read back).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ckptstage.daemon.catalog.index import Catalog
from ckptstage.daemon.catalog.parts import Part
from ckptstage.daemon.configpeers import DISK_SHARE, PeersConfig
from ckptstage.daemon.errors import CheckpointNotFound, DaemonError, InvalidRequest
from ckptstage.daemon.logs import fields
from ckptstage.daemon.metrics import Metrics
from ckptstage.daemon.peers.members import Members
from ckptstage.daemon.peers.health import JobPeers
from ckptstage.daemon.peers.replicator import Replicator
from ckptstage.daemon.peers.replicaio import checked, part_pieces
from ckptstage.daemon.peers.store import ReplicaStore
from ckptstage.daemon.peers.transport import Dialer
from ckptstage.daemon.peers.view import PeerView
from ckptstage.daemon.save.arena import Budget
from ckptstage.daemon.tiers.interface import Tier, TierName
from ckptstage.daemon.tiers.loadgate import LoadGate
from ckptstage.protos import layout

log = logging.getLogger(__name__)

STORE_DIR = ".peers"  # under the local tier: the replicas kept on disk (not a job name: tier scans skip it)
MEMBERS_FILE = "peers.json"  # under the local tier's state directory
MAX_CHUNKS_ASKED = 1 << 20  # chunks one MissingChunks names: 32 MiB of names, a part of 8 TiB in 8 MiB chunks


class NotAMember(DaemonError):
    """A replica from a node this daemon does not know runs the job."""


@dataclass(frozen=True)
class Held:
    """A part this node holds of a job: its own committed part, or a replica it keeps."""

    part: Part
    replica: bool
    in_memory: bool


class PeerTier:
    """Everything ``[peers]`` does on one node."""

    def __init__(self, config: PeersConfig, local: Tier, state_dir: Path, owner: str, catalog: Catalog,
                 budget: Budget, metrics: Metrics, on_shared: Callable[[str, int], bool], nice: int = 0,
                 gate: LoadGate | None = None) -> None:
        """``gate``: where replicas being sent wait while a checkpoint is being loaded on this node."""
        self.address = config.address
        self._catalog = catalog
        self._metrics = metrics
        self._local = local
        self.members = Members(state_dir / MEMBERS_FILE, self.address)
        self.dialer = Dialer(config)
        self.store = ReplicaStore(local.root / STORE_DIR, owner, budget, config.keep, self._disk_room, on_shared)
        self.replicator = Replicator(self.members, self.dialer, config.replicas, config.max_bandwidth, metrics,
                                     nice, gate=gate)
        self.view = PeerView(self.members, self.dialer, self.store, catalog, metrics)
        self.store.on_change = self.view.invalidate
        self._refused: set[tuple[str, str]] = set()  # (job, sender) refused and logged, until accepted

    def start(self) -> None:
        found = self.store.recover()
        for job in self.store.jobs():
            self.view.fresh(job)
        if found:
            log.info("%d replica(s) of other nodes' parts found on disk", found, extra=fields(tier=TierName.PEER))
        self.replicator.start()

    def stop(self) -> None:
        self.replicator.stop()
        self.dialer.close()
        self.store.close()

    def _disk_room(self) -> int:
        try:
            usage = self._local.usage()
        except OSError:
            return 0
        held = self.store.usage()[3]
        return max(0, min(int(usage.total_bytes * DISK_SHARE) - held, usage.free_bytes))

    # --- what the node asks ----------------------------------------------------------------

    def join(self, job: str, nodes: list[str]) -> list[str]:
        others = self.members.join(job, nodes)
        self.view.invalidate(job)
        return others

    def committed(self, part: Part) -> None:
        if part.tier == TierName.LOCAL:
            self.replicator.committed(part)

    def wait(self, job: str, step: int, rank: int, digest: str, timeout: float) -> bool:
        return self.replicator.wait(job, step, rank, digest, timeout)

    def fresh(self, job: str) -> None:
        self.view.fresh(job)

    def pull(self, part: Part) -> Part:
        return self.view.pull(part)

    def prefer_pull(self, part: Part) -> bool:
        """Whether a reader here should get ``part`` from another node rather than read the shared tier:
        another node keeps it in memory."""
        return self.view.in_memory_elsewhere(part)

    def readable_path(self, part: Path) -> Path | None:
        """Where a reader on this node opens a part of the peer tier: a replica on this node's disk only."""
        root = self.store.disk.root
        return part if part.is_relative_to(root) else None

    def drop_replica(self, job: str, step: int, rank: int, why: str) -> None:
        self.store.drop(job, step, rank, why)

    def job_state(self, job: str) -> JobPeers:
        step, lag, queued = self.replicator.job_state(job)
        return JobPeers(self.replicator.health(job), step, lag, queued)

    # --- what the job's other nodes ask ----------------------------------------------------

    def put_replica(self, job: str, step: int, rank: int, sender: str, manifest_raw: bytes, digest: str,
                    data: Iterable[tuple[str, int, bytes]], chunks_only: bool = False) -> str:
        """Keeps a replica sent by ``sender`` (``chunks_only``: as the chunks this node lacked, see
        :meth:`ReplicaStore.receive`); returns where ("memory" or "disk")."""
        layout.check_job(job)
        nodes = self.members.nodes(job)
        if sender not in nodes or sender == self.address:
            self._metrics.peer_refused.labels("not_a_member").inc()
            # Once per sender and job until it is accepted: the sender retries with backoff.
            level = logging.DEBUG if (job, sender) in self._refused else logging.WARNING
            self._refused.add((job, sender))
            log.log(level, "refused a replica of %s step %d rank %d from %s: it is not a node of the job here (%s)",
                        job, step, rank, sender, ", ".join(nodes) or "no session of the job has been here",
                        extra=fields(job=job, step=step, rank=rank, peer=sender, tier=TierName.PEER))
            raise NotAMember(f"{sender!r} is not a node of {job} as this daemon knows it: a replica is accepted "
                             "only from a node the job's clients named (and only by a node that has had a "
                             "session of the job)")
        self._refused.discard((job, sender))
        arrived = 0

        def counted() -> Iterator[tuple[str, int, bytes]]:
            nonlocal arrived
            for name, offset, piece in data:
                arrived += len(piece)
                yield name, offset, piece

        replica = self.store.receive(job, step, rank, manifest_raw, digest, counted(), chunks_only=chunks_only)
        self._metrics.peer_received_bytes.inc(arrived)
        self._catalog.add(replica.part())
        where = "memory" if replica.in_memory else "disk"
        log.info("kept a replica of %s step %d rank %d from %s on %s (%d bytes%s)", job, step, rank, sender, where,
                 replica.nbytes, f", {arrived} of them sent: the chunks this node lacked" if chunks_only else "",
                 extra=fields(job=job, step=step, rank=rank, peer=sender, tier=TierName.PEER, bytes=arrived))
        return where

    def missing_chunks(self, job: str, key: str, names: list[str]) -> list[str]:
        """The chunks among ``names`` (of store ``key``) that a replica of ``job`` sent here next must carry."""
        layout.check_job(job)
        if len(names) > MAX_CHUNKS_ASKED:
            raise InvalidRequest(f"{len(names)} chunks asked about at once: at most {MAX_CHUNKS_ASKED}")
        return self.store.missing_chunks(key, names)

    def holdings(self, job: str) -> list[Held]:
        layout.check_job(job)
        held = [Held(r.part(), True, r.in_memory) for r in self.store.of_job(job)]
        for ckpt in self._catalog.checkpoints(job):
            held += [Held(p, False, False) for p in ckpt.on_tier(TierName.LOCAL)]
        return held

    def read_manifest(self, job: str, step: int, rank: int, digest: str) -> bytes:
        replica = self.store.get(job, step, rank, digest)
        if replica is not None:
            return replica.manifest_raw
        return (self._own(job, step, rank, digest).path / layout.MANIFEST_FILE).read_bytes()

    def read_file(self, job: str, step: int, rank: int, digest: str, name: str) -> Iterator[bytes]:
        """A file of a part this node holds, every block checked as it is read."""
        replica = self.store.get(job, step, rank, digest)
        if replica is not None:
            return self.store.read_file(replica, name)
        return _verified_file(self._own(job, step, rank, digest).path, name)

    def _own(self, job: str, step: int, rank: int, digest: str) -> Part:
        layout.check_job(job)
        part = self._catalog.parts_of(job, step, rank).get(TierName.LOCAL)
        if part is None or part.digest != digest:
            raise CheckpointNotFound(job, step, f"this node holds no part of rank {rank} with manifest {digest}")
        return part


def _verified_file(part: Path, name: str) -> Iterator[bytes]:
    manifest = layout.read_manifest(part)
    entry = layout.manifest_files(manifest).get(name)
    if entry is None:
        raise CheckpointNotFound(str(manifest.get("job")), int(manifest.get("step", 0)), f"no file {name!r}")
    yield from checked(part_pieces(part, manifest, name), entry, part / name)
