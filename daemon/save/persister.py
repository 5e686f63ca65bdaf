"""Arena -> local tier: one :class:`Save` per (session, step), written chunk by chunk.

The client streams the image of the part's data file through the session's
arena, reporting how far it has copied. Every complete chunk is hashed and
written with ``pwrite`` by a node-wide pool of writer threads as soon as it is
reported, so persisting overlaps the client's copy; a written chunk's arena
space is released at once, which is what lets a state larger than the arena
stream through it. When the client finishes and the last chunk is written,
the file is fsynced and the part committed through :class:`PartWriter`.

What becomes of a save is published on the node's event bus
(:mod:`ckptstage.daemon.events`): :class:`Progressed` after each chunk
written, then :class:`Committed` or :class:`Failed`, exactly one of them.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckptstage.daemon.catalog.chunkstore import ChunkStore, PartChunks
from ckptstage.daemon.errors import InvalidRequest, SaveFailed
from ckptstage.daemon.events import Bus
from ckptstage.daemon.fsutil import lower_thread_priority
from ckptstage.daemon.logs import fields
from ckptstage.daemon.save.manifest_check import SaveSpec
from ckptstage.daemon.tiers.interface import DataSink, PartWriter, TierName
from ckptstage.protos import chunks, layout

if TYPE_CHECKING:
    from ckptstage.daemon.save.arena import Arena

log = logging.getLogger(__name__)

class Save:
    """One part in flight from the arena to the local tier."""

    def __init__(self, save_id: str, session_id: str, spec: SaveSpec, arena: Arena, stream_base: int,
                 chunk_bytes: int, writer: PartWriter | None, direct_io: bool = False,
                 store: ChunkStore | None = None, user_store: bool = False) -> None:
        """Takes ``writer`` over and creates the data file in it; on any error both are gone.

        Without a writer the save is kept in memory only: its chunks are hashed, not written, and its
        "commit" is the manifest (:attr:`memory_manifest`) vouching for the image in the arena. With a
        ``store`` the part is written incrementally: no data file, only the chunks the store lacks
        (:class:`PartChunks`), in its job's chunk store or, with ``user_store``, in the one all the user's
        jobs share (:data:`chunks.USER_STORE`)."""
        self.id = save_id
        self.session_id = session_id
        self.spec = spec
        self.arena = arena
        self.stream_base = stream_base
        self.chunk_bytes = chunk_bytes
        self.writer = writer
        self.started = time.monotonic()
        self.file: DataSink | None = None
        self.chunks: PartChunks | None = None
        try:
            self.n_chunks = layout.chunk_count(spec.data_bytes, chunk_bytes)
            # Digests of written chunks (one per digest block), by chunk index: memory follows the bytes
            # written, not the size declared.
            self.digests: dict[int, list[str]] = {}
            self.scheduled = 0  # chunks handed to the writer pool
            self.inflight = 0   # chunk writes running now; the fd closes only when none are
            self.frontier = 0   # chunks [0, frontier) written; their arena space is free
            self.finished = False  # the client has copied everything
            self.error: str | None = None
            self.local_done = threading.Event()
            self.committed_path: Path | None = None
            self.memory_manifest: bytes | None = None  # a memory-only save's manifest.json, once committed
            self.lock = threading.Lock()
            if writer is not None and store is not None:
                self.chunks = PartChunks(store, chunks.USER_STORE if user_store else spec.job, spec.data_bytes,
                                         [(t["offset"], t["nbytes"]) for t in spec.manifest["tensors"]],
                                         chunk_bytes, writer, direct_io)
            elif writer is not None:
                self.file = writer.create_file(layout.DATA_FILE, spec.data_bytes, direct_io)  # last: opens an fd
        except BaseException:
            self.discard()
            raise

    @property
    def memory_only(self) -> bool:
        return self.writer is None

    @property
    def end(self) -> int:
        return self.stream_base + self.spec.data_bytes

    @property
    def released(self) -> int:
        """Arena stream positions below this are free again."""
        if self.error is not None or self.frontier == self.n_chunks:
            return self.end
        return self.stream_base + self.frontier * self.chunk_bytes

    @property
    def settled(self) -> bool:
        return self.local_done.is_set() or self.error is not None

    def discard(self) -> None:
        """Drops a save that was never registered (refused after its file was created)."""
        if self.file is not None:
            self.file.close()
            self.file = None
        self.release_chunks()
        if self.writer is not None:
            self.writer.abort()

    def release_chunks(self) -> None:
        """Ends the leases on the chunks an incremental part reuses or adds (published, or failed)."""
        if self.chunks is not None:
            self.chunks.release()

    def chunk_span(self, i: int) -> tuple[int, int]:
        start = i * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.spec.data_bytes)


@dataclass(frozen=True)
class Progressed:
    """A chunk of the save is written: its arena space below ``save.released`` is free again."""

    save: Save


@dataclass(frozen=True)
class Committed:
    """The save is committed: its part published on the local tier (``save.committed_path``), or, kept in
    memory only, its manifest vouching for the arena's image (``save.memory_manifest``).

    Handled before ``save.local_done`` is set: whoever waits for that finds the handlers' work done.
    """

    save: Save


@dataclass(frozen=True)
class Failed:
    """The save failed (``save.error`` says why): its temporary is gone and its arena space free."""

    save: Save


class Persister:
    """The node-wide writer pool that turns reported chunks into committed parts."""

    def __init__(self, workers: int, events: Bus, nice: int = 0) -> None:
        """``events``: where :class:`Progressed`, :class:`Committed` and :class:`Failed` are published."""
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="persist",
                                        initializer=lower_thread_priority, initargs=(nice,))
        self._events = events

    def progress(self, save: Save, copied_upto: int, finished: bool = False) -> None:
        """Schedules every chunk the client has completely copied."""
        if copied_upto > save.spec.data_bytes:
            raise InvalidRequest(f"copied_upto {copied_upto} is past the data size {save.spec.data_bytes}")
        with save.lock:
            if save.error is not None:
                raise SaveFailed(save.error)
            if finished:
                if copied_upto != save.spec.data_bytes:
                    raise InvalidRequest(f"finish with {copied_upto} of {save.spec.data_bytes} bytes copied")
                save.finished = True
            ready = save.n_chunks if finished else copied_upto // save.chunk_bytes
            todo = range(save.scheduled, max(save.scheduled, ready))
            save.scheduled = max(save.scheduled, ready)
        for i in todo:
            self._pool.submit(self._write_chunk, save, i)

    def fail(self, save: Save, reason: str) -> None:
        """Marks a save failed, drops its temporary and frees its arena space."""
        with save.lock:
            if save.settled:
                return
            save.error = reason
        self._close_fd(save)
        save.release_chunks()
        if save.writer is not None:
            save.writer.abort()
        spec = save.spec
        log.warning("save %s (%s step %d rank %d) failed: %s", save.id, spec.job, spec.step, spec.rank, reason,
                    extra=fields(job=spec.job, step=spec.step, rank=spec.rank, tier=_tier(save), error=reason))
        self._events.publish(Failed(save))

    def shutdown(self, wait: bool) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=not wait)

    def _write_chunk(self, save: Save, i: int) -> None:
        with save.lock:
            if save.error is not None:
                return
            save.inflight += 1
        try:
            complete = self._hash_and_write(save, i)
        except Exception as e:  # noqa: BLE001 - a save must settle, and its fd close, whatever went wrong
            # Besides I/O errors: the save may have failed under us (its session
            # closed) and its arena been released, which makes the slice a ValueError.
            complete = False
            self.fail(save, f"writing {_where(save)} chunk {i}: {e}")
        finally:
            with save.lock:
                save.inflight -= 1
        if save.error is not None:
            self._close_fd(save)
        elif complete:
            self._commit(save)

    def _hash_and_write(self, save: Save, i: int) -> bool:
        """Writes chunk ``i``; returns True when it was the last one the save needed."""
        start, stop = save.chunk_span(i)
        a = (save.stream_base + start) % save.arena.size
        block = layout.digest_block_bytes(save.chunk_bytes)
        with save.arena.view[a:a + (stop - start)] as piece:
            if save.chunks is not None:
                digests = save.chunks.write(i, piece, start, block)
            else:
                digests = layout.block_digests(piece, block)
                if not save.memory_only:
                    assert save.file is not None, "a chunk write after the data file closed"
                    save.file.write(piece, start)
        with save.lock:
            # The digest is published only after the write: frontier == n_chunks
            # then means every byte is in the file.
            save.digests[i] = digests
            while save.frontier < save.n_chunks and save.frontier in save.digests:
                save.frontier += 1
            complete = save.finished and save.frontier == save.n_chunks and save.error is None
        self._events.publish(Progressed(save))
        return complete

    def _commit(self, save: Save) -> None:
        with save.lock:
            if save.committed_path is not None or save.memory_manifest is not None or save.error is not None:
                return
            data_file, save.file = save.file, None
        try:
            if data_file is not None:
                try:
                    data_file.sync()  # the data before the manifest that vouches for it
                finally:
                    data_file.close()
            manifest = dict(save.spec.manifest)
            manifest["created"] = time.time()
            manifest["metrics"] = save.spec.metrics
            manifest["files"] = {layout.DATA_FILE: layout.FileEntry(
                save.spec.data_bytes, layout.digest_block_bytes(save.chunk_bytes),
                tuple(d for i in range(save.n_chunks) for d in save.digests[i])).to_json()}
            if save.writer is None:
                save.memory_manifest = layout.manifest_file_bytes(manifest)
            else:
                if save.chunks is not None:
                    manifest["chunks"] = {layout.DATA_FILE: save.chunks.publish()}
                    if save.chunks.key == chunks.USER_STORE:
                        manifest[chunks.STORE_FIELD] = "user"
                save.committed_path = save.writer.commit(manifest)
                save.release_chunks()  # published: every later sweep marks its chunks
        except Exception as e:  # noqa: BLE001 - whatever it was, the save fails and its temporary goes
            # Raised here, anything but an OSError would end in the pool's unread future: the save
            # would never settle and its temporary would stay until the daemon restarts.
            self.fail(save, f"committing {_where(save)}: {e}")
            return
        # Handled (indexed, queued for draining) before waiters wake: whoever
        # returns from wait("local") may call wait("shared") at once.
        try:
            self._events.publish(Committed(save))
        finally:
            save.local_done.set()

    @staticmethod
    def _close_fd(save: Save) -> None:
        """Closes the data file once no writer uses it (a reused fd number must never be written)."""
        with save.lock:
            if save.inflight or save.file is None:
                return
            data_file, save.file = save.file, None
        data_file.close()


def _tier(save: Save) -> TierName:
    return TierName.MEMORY if save.memory_only else TierName.LOCAL


def _where(save: Save) -> str:
    """What a save's messages name: its part's final directory, or that it is kept in memory only."""
    spec = save.spec
    return str(save.writer.final) if save.writer is not None else \
        f"{spec.job} step {spec.step} rank {spec.rank} (memory only)"
