"""The replicas this node keeps of other nodes' parts: in memory when the arena budget has room, else on SSD.

A replica arrives as its part's manifest (byte for byte: its digest is what
the step's commit names) and then its files in order; every block is checked
against the manifest as it arrives (:class:`layout.BlockVerifier`) and again
as it is read back, and a replica is kept only once every file is whole.

Where a replica lives:

- **memory**: anonymous memory taken from the arena budget only where it is
  free (:meth:`Budget.take` never evicts anything for a replica). A session
  that needs the room later gets it: :meth:`ReplicaStore.spill` moves the
  oldest memory replicas to the SSD (or drops them, where the SSD has no
  room), and the daemon going away takes them with it;
- **disk**: a part directory under ``<local>/.peers/`` (a file-system tier of
  its own, with the local tier's commit protocol; an incremental part's
  chunks in that tier's chunk stores, :mod:`.replicachunks`), at most
  :data:`~ckptstage.daemon.configpeers.DISK_SHARE` of the local file system,
  found again when the daemon restarts.

What is kept: the newest ``keep`` steps of each job; an older step's replica
goes once a newer one is here, and sooner when the shared tier holds that
step. A replica of the same rank and step replaces the one before (a
replaced step, a later attempt).
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ckptstage.daemon.catalog.parts import Part
from ckptstage.daemon.errors import DaemonError, InvalidRequest
from ckptstage.daemon.logs import fields
from ckptstage.daemon.peers.replicachunks import ReplicaChunks, WrongChunk
from ckptstage.daemon.peers.replicaio import (
    READ_BYTES,
    CorruptReplica,
    assemble,
    checked,
    memory_pieces,
    part_pieces,
    write_files,
)
from ckptstage.daemon.save.arena import Budget
from ckptstage.daemon.tiers.fs import FsTier
from ckptstage.daemon.tiers.interface import Manifest, TierName
from ckptstage.protos import chunks, layout

log = logging.getLogger(__name__)

Key = tuple[str, int, int]  # job, step, rank
_POPULATED = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


class NoRoom(DaemonError):
    """Neither the arena budget nor the SSD share for replicas has room for this one."""


@dataclass
class Replica:
    """One part of another node (or fetched from one), as this node keeps it."""

    job: str
    step: int
    rank: int
    world_size: int
    attempt: str
    digest: str
    nbytes: int
    created: float
    manifest_raw: bytes
    manifest: Manifest
    path: Path | None = None                 # on disk: the part's directory
    buffers: dict[str, mmap.mmap] = field(default_factory=dict)  # in memory: each file's bytes
    arrived: float = field(default_factory=time.time)

    @property
    def key(self) -> Key:
        return self.job, self.step, self.rank

    @property
    def in_memory(self) -> bool:
        return self.path is None

    @property
    def chunked(self) -> bool:
        """An incremental part: on disk, its chunks are in the replica store's chunk store of its job."""
        return "chunks" in self.manifest

    def part(self) -> Part:
        """The replica as a catalogue part of the peer tier (a memory replica has no directory)."""
        return Part(self.job, self.step, self.rank, self.world_size, TierName.PEER,
                    self.path or memory_path(self.job, self.step, self.rank), self.nbytes, self.created,
                    {str(k): float(v) for k, v in self.manifest.get("metrics", {}).items()}, self.attempt,
                    self.digest)


def memory_path(job: str, step: int, rank: int) -> Path:
    """The name a replica held in memory goes by (no file is there)."""
    return Path("/.peers-memory") / job / f"step-{step}" / f"rank-{rank}"


def parse_header(job: str, step: int, rank: int, manifest_raw: bytes, digest: str) -> Manifest:
    """The replica's manifest, verified, naming this job, step and rank, its digest ``digest``; raises
    :class:`InvalidRequest` (or :class:`CorruptReplica` for bytes that do not match their digest)."""
    layout.check_job(job)
    where = Path(f"{job}/step-{step}/rank-{rank}") / layout.MANIFEST_FILE
    try:
        manifest = layout.parse_manifest_file(manifest_raw, where)
    except layout.ChecksumMismatch as e:
        raise CorruptReplica(str(e)) from None
    except layout.ManifestError as e:
        raise InvalidRequest(str(e)) from None
    if layout.chunk_digest(manifest_raw) != digest:
        raise CorruptReplica(f"{where}: its digest is not {digest}")
    if (manifest.get("job"), manifest.get("step"), manifest.get("rank")) != (job, step, rank):
        raise InvalidRequest(f"{where}: the manifest is of {manifest.get('job')!r} step {manifest.get('step')!r} "
                             f"rank {manifest.get('rank')!r}")
    try:
        chunks.referenced(manifest)  # an incremental part's chunk list tiles its data file
    except layout.ManifestError as e:
        raise InvalidRequest(str(e)) from None
    return manifest


class ReplicaStore:
    """Every replica this node keeps, by (job, step, rank)."""

    def __init__(self, root: Path, owner: str, budget: Budget, keep: int, disk_room: Callable[[], int],
                 on_shared: Callable[[str, int], bool] = lambda job, step: False) -> None:
        self.disk = FsTier(root, owner)
        self._chunks = ReplicaChunks(self.disk)
        self._budget = budget
        self._keep = keep
        self._disk_room = disk_room          # bytes the SSD share still allows
        self._on_shared = on_shared
        self._lock = threading.Lock()
        self._replicas: dict[Key, Replica] = {}
        # Told the job whenever a replica of it arrives, moves or goes (what the catalogue indexes changed).
        self.on_change: Callable[[str], object] = lambda job: None

    # --- life cycle ---------------------------------------------------------------------

    def recover(self) -> int:
        """Indexes the replicas a previous run left on disk (temporaries removed); returns how many."""
        self.disk.prepare()
        self.disk.clean_temporaries()
        found = 0
        for job in self.disk.list_jobs():
            for ref in self.disk.list_steps(job):
                for part in ref.parts:
                    try:
                        raw = (part.path / layout.MANIFEST_FILE).read_bytes()
                        manifest = parse_header(job, part.step, part.rank, raw, layout.chunk_digest(raw))
                        lost = chunks.missing(chunks.store_of(part.path, manifest), chunks.referenced(manifest))
                        if lost:
                            raise CorruptReplica(f"{len(lost)} of its chunks are missing ({lost[0]}, ...)")
                    except (OSError, DaemonError) as e:
                        log.warning("dropping the replica at %s: %s", part.path, e)
                        self._remove_dir(part.path)
                        continue
                    self._put(_replica(job, part.step, part.rank, raw, manifest, path=part.path))
                    found += 1
        for job in {k[0] for k in self._replicas}:
            self._trim(job)
        # The chunks of replicas dropped just before a crash, or cut short by one: every store once.
        self._chunks.sweep_stores([*self.disk.list_jobs(), chunks.USER_STORE])
        return found

    def close(self) -> None:
        """Lets go of the replicas in memory (the daemon is stopping); those on disk stay for its successor."""
        with self._lock:
            held = [r for r in self._replicas.values() if r.in_memory]
            self._replicas.clear()
        for replica in held:
            self._free(replica)

    # --- what is kept ---------------------------------------------------------------------

    def get(self, job: str, step: int, rank: int, digest: str = "") -> Replica | None:
        with self._lock:
            replica = self._replicas.get((job, step, rank))
        return replica if replica is not None and digest in ("", replica.digest) else None

    def of_job(self, job: str) -> list[Replica]:
        with self._lock:
            return sorted((r for r in self._replicas.values() if r.job == job), key=lambda r: r.key)

    def jobs(self) -> list[str]:
        with self._lock:
            return sorted({k[0] for k in self._replicas})

    def usage(self) -> tuple[int, int, int, int]:
        """(replicas in memory, their bytes, replicas on disk, the bytes they hold there: whole files, and the
        chunks of incremental ones, each once)."""
        with self._lock:
            mem = [r.nbytes for r in self._replicas.values() if r.in_memory]
            whole = [r.nbytes for r in self._replicas.values() if not r.in_memory and not r.chunked]
            on_disk = sum(1 for r in self._replicas.values() if not r.in_memory)
        return len(mem), sum(mem), on_disk, sum(whole) + self._chunks.held_bytes()

    def missing_chunks(self, key: str, names: list[str]) -> list[str]:
        """The chunks among ``names`` that this node's replicas' store ``key`` lacks (:meth:`receive`'s
        ``chunks_only``)."""
        return self._chunks.missing(key, names)

    def drop(self, job: str, step: int, rank: int, why: str) -> bool:
        dropped = self._drop(job, step, rank, why)
        if dropped:
            self._chunks.sweep(job)
        return dropped

    def _drop(self, job: str, step: int, rank: int, why: str) -> bool:
        with self._lock:
            replica = self._replicas.pop((job, step, rank), None)
        if replica is None:
            return False
        self._free(replica)
        self.on_change(job)
        log.info("dropped the replica of %s step %d rank %d: %s", job, step, rank, why,
                 extra=fields(job=job, step=step, rank=rank, tier=TierName.PEER))
        return True

    # --- receiving ---------------------------------------------------------------------

    def receive(self, job: str, step: int, rank: int, manifest_raw: bytes, digest: str,
                data: Iterable[tuple[str, int, bytes]], memory: bool = True, durable: bool = True,
                chunks_only: bool = False) -> Replica:
        """Keeps a replica whose files arrive as ``data`` ((file, offset, bytes), each file in order),
        every block checked as it arrives. ``memory``: in memory if the budget has room (else on disk);
        ``durable``: a replica on disk has its data fsynced before its manifest (a copy fetched for a
        reader about to open it need not be: a crash before the page cache is written back leaves a copy
        that fails its checks, and the holders still have theirs). ``chunks_only``: an incremental part
        whose ``data`` are only the chunks this node lacked ((chunk name, offset in it, bytes), each checked
        against its name), kept on disk beside the chunks it holds.
        Raises :class:`CorruptReplica`, :class:`InvalidRequest`, :class:`NoRoom` or :class:`ChunksMissing`;
        nothing is kept then."""
        manifest = parse_header(job, step, rank, manifest_raw, digest)
        nbytes = layout.part_bytes(manifest)
        entries = layout.manifest_files(manifest)
        # Older replicas make room first; their chunks stay until this one is kept, which may well reuse them.
        trimmed = self._trim(job, incoming=step)
        in_memory = memory and not chunks_only and self._budget.take(nbytes)
        try:
            if in_memory:
                replica = self._receive_memory(job, step, rank, manifest_raw, manifest, entries, data)
            else:
                replica = self._receive_disk(job, step, rank, manifest_raw, manifest, entries, data, nbytes,
                                             durable, chunks_only)
        except BaseException:
            if in_memory:
                self._budget.release(nbytes)
            raise
        replaced = self._put(replica)
        if self._trim(job) or trimmed or replaced:
            self._chunks.sweep(job)
        self.on_change(job)
        return replica

    def _receive_memory(self, job: str, step: int, rank: int, raw: bytes, manifest: Manifest,
                        entries: dict[str, layout.FileEntry], data: Iterable[tuple[str, int, bytes]]) -> Replica:
        # Pages mapped up front in one call: faulting them one by one as bytes arrive costs more than the copy.
        buffers = {name: mmap.mmap(-1, max(1, e.size), flags=_POPULATED) for name, e in entries.items()}
        try:
            assemble(entries, data, lambda name, offset, chunk: _put_bytes(buffers[name], offset, chunk),
                      memory_path(job, step, rank))
        except BaseException:
            for buf in buffers.values():
                buf.close()
            raise
        return _replica(job, step, rank, raw, manifest, buffers=buffers)

    def _receive_disk(self, job: str, step: int, rank: int, raw: bytes, manifest: Manifest,
                      entries: dict[str, layout.FileEntry], data: Iterable[tuple[str, int, bytes]],
                      nbytes: int, durable: bool = True, chunks_only: bool = False) -> Replica:
        if nbytes > self._disk_room():
            raise NoRoom(f"no room for a replica of {job} step {step} rank {rank} ({nbytes} bytes): the arena "
                         "budget is in use and the SSD share for replicas is full")
        final = self.disk.part_location(job, step, rank)
        writer = self.disk.begin_part(job, step, rank, replace=lambda f: True)
        chunked = self._chunks.sink(manifest, writer, final) if "chunks" in manifest else None
        try:
            write_files(writer, entries, data, final, durable, chunked, chunks_only)
            path = writer.commit(manifest)
            if writer.manifest_digest != layout.chunk_digest(raw):
                self._remove_dir(path)
                raise CorruptReplica(f"{path}: the manifest written differs from the one received")
        except WrongChunk as e:
            raise CorruptReplica(str(e)) from None
        finally:
            if chunked is not None:
                chunked.close()
                self._chunks.count(chunked.key)
            writer.abort()
        return _replica(job, step, rank, raw, manifest, path=path)

    # --- reading back -------------------------------------------------------------------

    def read_file(self, replica: Replica, name: str) -> Iterator[bytes]:
        """The file's bytes in pieces, every block checked; a replica that fails is dropped and
        :class:`CorruptReplica` raised."""
        entry = layout.manifest_files(replica.manifest).get(name)
        if entry is None:
            raise InvalidRequest(f"{replica.job} step {replica.step} rank {replica.rank} has no file {name!r}")
        where = (replica.path or memory_path(*replica.key)) / name
        pieces = memory_pieces(replica.buffers[name], entry.size) if replica.path is None \
            else part_pieces(replica.path, replica.manifest, name)
        try:
            yield from checked(pieces, entry, where)
        except layout.ChecksumMismatch as e:
            self.drop(replica.job, replica.step, replica.rank, f"it fails its checksums: {e.detail}")
            raise CorruptReplica(f"the replica of {replica.job} step {replica.step} rank {replica.rank}: "
                                 f"{e.detail}") from None

    # --- room ---------------------------------------------------------------------------

    def spill(self, want: int) -> int:
        """Gives back at least ``want`` bytes of the arena budget: memory replicas, oldest first, go to disk
        (or are dropped where the disk share has no room). Returns the bytes given back."""
        freed = 0
        with self._lock:
            oldest = sorted((r for r in self._replicas.values() if r.in_memory), key=lambda r: r.arrived)
        for replica in oldest:
            if freed >= want:
                break
            self.to_disk(replica)
            freed += replica.nbytes
        return freed

    def to_disk(self, replica: Replica) -> Replica | None:
        """Moves a memory replica to disk (where a reader on this node can open it); None when it could not
        go there, and is dropped."""
        moved = None
        try:
            moved = self._receive_disk(replica.job, replica.step, replica.rank, replica.manifest_raw,
                                       replica.manifest, layout.manifest_files(replica.manifest),
                                       _contents(replica), replica.nbytes)
        except (OSError, DaemonError) as e:
            log.warning("dropping the replica of %s step %d rank %d from memory (it cannot go to disk: %s)",
                        replica.job, replica.step, replica.rank, e,
                        extra=fields(job=replica.job, step=replica.step, rank=replica.rank, error=e))
        with self._lock:
            if self._replicas.get(replica.key) is replica:
                if moved is not None:
                    self._replicas[replica.key] = moved
                else:
                    del self._replicas[replica.key]
        self._free(replica)
        self.on_change(replica.job)
        return moved

    def _trim(self, job: str, incoming: int | None = None) -> bool:
        """Keeps the newest ``keep`` steps of ``job`` (counting ``incoming``, a step arriving); of those,
        drops the ones older than the newest whose step the shared tier holds. True when it dropped any (their
        chunks are still there)."""
        with self._lock:
            steps = sorted({k[1] for k in self._replicas if k[0] == job} | ({incoming} if incoming is not None
                                                                             else set()), reverse=True)
        if not steps:
            return False
        dropped = False
        kept = set(steps[:self._keep])
        newest = steps[0]
        for step in steps:
            if step not in kept:
                why = f"only the newest {self._keep} step(s) of the job are kept as replicas"
            elif step != newest and self._on_shared(job, step):
                why = "a newer replica is here and the shared tier holds this step"
            else:
                continue
            for replica in [r for r in self.of_job(job) if r.step == step]:
                dropped |= self._drop(job, step, replica.rank, why)
        return dropped

    def _put(self, replica: Replica) -> bool:
        """Keeps ``replica``; True when it replaced one of the same key (whose chunks are still there)."""
        with self._lock:
            old = self._replicas.get(replica.key)
            self._replicas[replica.key] = replica
        if old is not None and old is not replica:
            self._free(old, keep_dir=old.path == replica.path)
            return True
        return False

    def _free(self, replica: Replica, keep_dir: bool = False) -> None:
        if replica.in_memory:
            for buf in replica.buffers.values():
                buf.close()
            replica.buffers.clear()
            self._budget.release(replica.nbytes)
        elif replica.path is not None and not keep_dir:
            self._remove_dir(replica.path)

    def _remove_dir(self, path: Path) -> None:
        try:
            self.disk.remove_part(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("cannot remove the replica at %s: %s", path, e, extra=fields(error=e))


def _replica(job: str, step: int, rank: int, raw: bytes, manifest: Manifest, path: Path | None = None,
             buffers: dict[str, mmap.mmap] | None = None) -> Replica:
    return Replica(job, step, rank, int(manifest["world_size"]), layout.manifest_attempt(manifest),
                   layout.chunk_digest(raw), layout.part_bytes(manifest), float(manifest.get("created", 0.0)),
                   raw, manifest, path, buffers or {})


def _put_bytes(buf: mmap.mmap, offset: int, chunk: bytes) -> None:
    buf[offset:offset + len(chunk)] = chunk


def _contents(replica: Replica) -> Iterator[tuple[str, int, bytes]]:
    """A memory replica's files as :meth:`ReplicaStore.receive` takes them."""
    for name, entry in layout.manifest_files(replica.manifest).items():
        for at, piece in enumerate(memory_pieces(replica.buffers[name], entry.size)):
            yield name, at * READ_BYTES, piece
