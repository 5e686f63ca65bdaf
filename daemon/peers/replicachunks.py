"""Incremental replicas on a node's disk: their data files kept as chunks of the replica store's own chunk stores.

A part written incrementally (:mod:`ckptstage.protos.chunks`) travels to a
peer as its files' bytes, as any part does, and is checked block by block
as it arrives. On the peer's disk it is kept as it was on its own node: its
manifest in the part's directory, its chunks in packs of
``<local>/.peers/<job>/chunks/``, so a reader opens it as it opens any
incremental part. Each chunk is checked against its name before it is kept
(chunks are reused by name: one kept under a wrong name would corrupt every
later replica that names it), and one the store already holds (a base
model's weights, an earlier step's unchanged state) is not written again.
When replicas go, :meth:`ReplicaChunks.sweep` removes the chunks no replica
left refers to (:class:`~ckptstage.daemon.catalog.chunkstore.ChunkStore`:
a chunk leased by a replica being received is never taken).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from ckptstage.daemon.catalog.chunkstore import ChunkStore, MarkFailed
from ckptstage.daemon.errors import DaemonError, InvalidRequest
from ckptstage.daemon.logs import fields
from ckptstage.daemon.tiers.fs import FsTier
from ckptstage.daemon.tiers.interface import Manifest, PartWriter, TierName
from ckptstage.protos import chunks, layout

log = logging.getLogger(__name__)


class WrongChunk(DaemonError):
    """Bytes of a replica that are not the chunk its manifest names there."""


class ChunksMissing(DaemonError):
    """A replica sent as the chunks this node lacked lacks some: a sweep took one after the sender asked
    (:meth:`ReplicaChunks.missing`), or the sender left one out. It sends the whole part instead."""


class ChunkSink:
    """The chunked files of one replica being received: each chunk, as its last byte arrives, checked against its
    name, then reused (leased) or written into a pack staged with the part. :meth:`publish` before the manifest is
    committed; :meth:`close` always, after it is committed or failed."""

    def __init__(self, store: ChunkStore, manifest: Manifest, writer: PartWriter, where: Path) -> None:
        self._store = store
        self.key = chunks.store_key(manifest)  # its job's store, or the user's, as on its own node
        self._where = where
        self._lists = {name: listed for name in layout.manifest_files(manifest)
                       if (listed := chunks.manifest_chunks(manifest, name)) is not None}
        self._next = dict.fromkeys(self._lists, 0)         # file -> index of the chunk being filled
        self._pending = {name: bytearray() for name in self._lists}  # file -> that chunk's bytes so far
        self._leased: set[str] = set()
        self._wanted: dict[str, int] | None = None  # by name (:meth:`expect`): chunk -> its length, until it came
        self._arriving: dict[str, bytearray] = {}
        self._batch = store.new_chunks(self.key, writer)
        self._published = False
        self.reused_bytes = 0
        self.written_bytes = 0

    def takes(self, name: str) -> bool:
        """Whether the manifest keeps file ``name`` as chunks (else the part's directory holds it whole)."""
        return name in self._lists

    def expect(self) -> None:
        """For a replica whose data are the chunks this node lacks, by name (:meth:`write_chunk`): leases every
        chunk the manifest names now; the ones the store lacks must then arrive."""
        self._wanted = {}
        for listed in self._lists.values():
            for chunk in listed:
                if self._held(chunk):
                    self.reused_bytes += chunk.nbytes
                else:
                    self._wanted[chunk.name] = chunk.nbytes

    def write_chunk(self, name: str, offset: int, data: bytes) -> None:
        """Bytes from ``offset`` of chunk ``name``, one this node lacks (each chunk's bytes in order)."""
        wanted = self._wanted if self._wanted is not None else {}
        length = wanted.get(name)
        if length is None:
            raise WrongChunk(f"{self._where}: chunk {name[:40]!r} was not asked for (the manifest does not name it, "
                             "this node holds it, or it came already)")
        held = self._arriving.setdefault(name, bytearray())
        if offset != len(held) or offset + len(data) > length:
            raise WrongChunk(f"{self._where}: bytes {offset}..{offset + len(data)} of chunk {name} arrived where "
                             f"{len(held)} was expected (it has {length})")
        held += data
        if len(held) < length:
            return
        if chunks.digest(held) != name:
            raise WrongChunk(f"{self._where}: the bytes sent as chunk {name} are not it (their hash differs)")
        self._batch.write(name, memoryview(held), direct_io=False)
        self.written_bytes += length
        del wanted[name], self._arriving[name]

    def write(self, name: str, data: bytes) -> None:
        """The next ``data`` of chunked file ``name`` (its bytes arrive in order, each once)."""
        listed = self._lists[name]
        held = self._pending[name]
        view = memoryview(data)
        while view:
            at = self._next[name]
            if at >= len(listed):
                raise WrongChunk(f"{self._where / name}: more bytes than its {len(listed)} chunks hold")
            chunk = listed[at]
            if not held and len(view) >= chunk.nbytes:  # the whole chunk in this piece: no copy
                self._keep(name, chunk, view[:chunk.nbytes])
                view = view[chunk.nbytes:]
                continue
            take = min(len(view), chunk.nbytes - len(held))
            held += view[:take]
            view = view[take:]
            if len(held) == chunk.nbytes:
                self._keep(name, chunk, memoryview(held))
                held.clear()

    def _keep(self, name: str, chunk: chunks.Chunk, data: memoryview) -> None:
        if chunks.digest(data) != chunk.name:
            raise WrongChunk(f"{self._where / name}: bytes {chunk.lo}..{chunk.hi} are not chunk {chunk.name} "
                             "(their hash differs from the name the manifest gives them)")
        self._next[name] += 1
        if self._held(chunk):
            self.reused_bytes += chunk.nbytes
            return
        self._batch.write(chunk.name, data, direct_io=False)
        self.written_bytes += chunk.nbytes

    def _held(self, chunk: chunks.Chunk) -> bool:
        """Leases ``chunk`` (once per part); True when the store holds it, or the part named it before (the same
        bytes twice in one part: zeroed optimizer state)."""
        if chunk.name in self._leased:
            return True
        self._leased.add(chunk.name)
        return chunk.name in self._store.reuse(self.key, [chunk.name])

    def publish(self) -> None:
        """The new chunks into the store, durably (every chunked file arrived whole)."""
        if self._wanted:
            raise ChunksMissing(f"{self._where}: {len(self._wanted)} of its chunks are neither held here nor sent "
                                f"({next(iter(self._wanted))}, ...)")
        short = [name for name, listed in self._lists.items() if self._next[name] != len(listed)] \
            if self._wanted is None else []
        if short:
            raise WrongChunk(f"{self._where / short[0]}: {self._next[short[0]]} of its "
                             f"{len(self._lists[short[0]])} chunks arrived")
        self._batch.publish()
        self._published = True

    def close(self) -> None:
        """Ends the leases; drops what was not published."""
        if not self._published:
            self._batch.discard()
        self._store.release(self.key, self._leased)
        self._leased = set()


class ReplicaChunks:
    """The chunk stores of the replica store's disk (one per job, and the user's): sinks for replicas arriving,
    sweeps when replicas go, and the bytes they hold."""

    def __init__(self, disk: FsTier) -> None:
        # Grace 0: only this daemon writes here, and its leases cover every chunk a replica being received reuses.
        self._store = ChunkStore(disk, grace_s=0.0)
        self._disk = disk
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}  # store key -> bytes its packs hold

    def sink(self, manifest: Manifest, writer: PartWriter, where: Path) -> ChunkSink:
        return ChunkSink(self._store, manifest, writer, where)

    def missing(self, key: str, names: list[str]) -> list[str]:
        """The chunks among ``names`` that store ``key`` lacks (what a replica sent next must carry)."""
        bad = next((n for n in names if not chunks.is_chunk_name(n)), None)
        if bad is not None:
            raise InvalidRequest(f"{bad[:40]!r} is not a chunk's name (32 hex digits)")
        try:
            return self._disk.missing_chunks(chunks.check_store_key(key), names)
        except layout.InvalidName as e:
            raise InvalidRequest(str(e)) from None

    def sweep(self, job: str) -> None:
        """Removes the chunks no replica on disk refers to any more from the stores replicas of ``job`` use (its
        own, and the user's); never raises (a failed sweep leaves chunks for the next one)."""
        self.sweep_stores([job, chunks.USER_STORE])

    def sweep_stores(self, keys: list[str]) -> None:
        """:meth:`sweep` of the stores ``keys`` names."""
        for key in keys:
            try:
                self._store.sweep(key)
            except (OSError, MarkFailed, layout.ManifestError) as e:
                log.warning("cannot sweep the chunks of the replicas of %s: %s", key, e,
                            extra=fields(job=key, tier=TierName.PEER, error=e))
            self.count(key)

    def count(self, key: str) -> None:
        """Takes the bytes store ``key`` holds again (after a replica arrived or a sweep)."""
        try:
            held = sum(p.nbytes for p in self._disk.list_packs(key)) if self._disk.has_chunk_store(key) else 0
        except OSError:
            return
        with self._lock:
            self._held[key] = held

    def held_bytes(self) -> int:
        with self._lock:
            return sum(self._held.values())
