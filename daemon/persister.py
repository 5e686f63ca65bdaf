"""Arena -> local tier: one :class:`Save` per (session, step), written chunk by chunk.

The client streams the image of the part's data file through the session's
arena, reporting how far it has copied. Every complete chunk is hashed and
written with ``pwrite`` by a node-wide pool of writer threads as soon as it is
reported, so persisting overlaps the client's copy; a written chunk's arena
space is released at once, which is what lets a state larger than the arena
stream through it. When the client finishes and the last chunk is written,
the file is fsynced and the part committed through :class:`PartWriter`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptstage.daemon.errors import InvalidRequest, SaveFailed
from ckptstage.daemon.fsutil import DataFile, PartWriter, lower_thread_priority
from ckptstage.protos import layout

if TYPE_CHECKING:
    from ckptstage.daemon.arena import Arena

log = logging.getLogger(__name__)

# Largest data file of one part (one rank's share of one step): 1 PiB. Larger is a client bug.
MAX_PART_BYTES = 1 << 50


@dataclass(frozen=True)
class SaveSpec:
    """What a client asked to save, validated (see :func:`parse_manifest`)."""

    job: str
    step: int
    rank: int
    world_size: int
    data_bytes: int
    manifest: dict[str, Any]
    metrics: dict[str, float] = field(default_factory=dict)


def parse_manifest(raw: bytes, job: str, step: int, rank: int, world_size: int,
                   data_bytes: int, metrics: dict[str, float]) -> SaveSpec:
    """Validates a client's partial manifest against its session and the data size.

    Everything is bounded here, before any file is created: the manifest's
    size and nesting (:func:`layout.decode_manifest`) and the data size.
    """
    if not 0 <= data_bytes <= MAX_PART_BYTES:
        raise InvalidRequest(f"data_bytes {data_bytes} is out of range: one part holds at most "
                             f"{MAX_PART_BYTES} bytes")
    try:
        manifest = layout.decode_manifest(raw, "manifest_json")
    except layout.ManifestError as e:
        raise InvalidRequest(str(e)) from e
    if not isinstance(manifest, dict) or manifest.get("format") != layout.FORMAT:
        raise InvalidRequest(f"manifest_json is not a {layout.FORMAT} manifest")
    expected = {"job": job, "step": step, "rank": rank, "world_size": world_size}
    for key, value in expected.items():
        if manifest.get(key) != value:
            raise InvalidRequest(f"manifest {key}={manifest.get(key)!r} does not match the session's {value!r}")
    try:
        tensors = [layout.TensorEntry.from_json(t) for t in manifest["tensors"]]
        for t in tensors:
            # A negative length would pass the overlap check below and shadow the next tensor.
            if t.nbytes < 0 or any(d < 0 for d in t.shape):
                raise layout.ManifestError(f"tensor {t.name!r} has a negative size "
                                           f"(nbytes {t.nbytes}, shape {list(t.shape)})")
        data_start = int(manifest["data_start"])
        layout.validate_tensor_table(tensors, data_start, data_bytes)
    except layout.ManifestError as e:
        raise InvalidRequest(f"manifest rejected: {e}") from e
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidRequest(f"manifest rejected: malformed tensor table ({e!r})") from e
    if "tree" not in manifest:
        raise InvalidRequest("manifest rejected: missing key 'tree'")
    return SaveSpec(job, step, rank, world_size, data_bytes, manifest, dict(metrics))


class Save:
    """One part in flight from the arena to the local tier."""

    def __init__(self, save_id: str, session_id: str, spec: SaveSpec, arena: Arena, stream_base: int,
                 chunk_bytes: int, writer: PartWriter, direct_io: bool = False) -> None:
        self.id = save_id
        self.session_id = session_id
        self.spec = spec
        self.arena = arena
        self.stream_base = stream_base
        self.chunk_bytes = chunk_bytes
        self.writer = writer
        self.started = time.monotonic()
        self.n_chunks = layout.chunk_count(spec.data_bytes, chunk_bytes)
        self.digests: list[str | None] = [None] * self.n_chunks
        self.scheduled = 0  # chunks handed to the writer pool
        self.inflight = 0   # chunk writes running now; the fd closes only when none are
        self.frontier = 0   # chunks [0, frontier) written; their arena space is free
        self.finished = False  # the client has copied everything
        self.error: str | None = None
        self.local_done = threading.Event()
        self.committed_path: Path | None = None
        self.lock = threading.Lock()
        self.file: DataFile | None = DataFile(writer.path(layout.DATA_FILE), spec.data_bytes, direct_io)

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
        self.writer.abort()

    def chunk_span(self, i: int) -> tuple[int, int]:
        start = i * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.spec.data_bytes)


class Persister:
    """The node-wide writer pool that turns reported chunks into committed parts."""

    def __init__(self, workers: int, on_commit: Callable[[Save], None],
                 on_failure: Callable[[Save], None], on_progress: Callable[[Save], None], nice: int = 0) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="persist",
                                        initializer=lower_thread_priority, initargs=(nice,))
        self._on_commit = on_commit
        self._on_failure = on_failure
        self._on_progress = on_progress

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
        save.writer.abort()
        log.warning("save %s (%s step %d rank %d) failed: %s", save.id, save.spec.job, save.spec.step,
                    save.spec.rank, reason)
        self._on_failure(save)

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
            self.fail(save, f"writing {save.writer.final} chunk {i}: {e}")
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
        with save.arena.view[a:a + (stop - start)] as piece:
            digest = layout.chunk_digest(piece)
            assert save.file is not None, "a chunk write after the data file closed"
            save.file.write(piece, start)
        with save.lock:
            # The digest is published only after the write: frontier == n_chunks
            # then means every byte is in the file.
            save.digests[i] = digest
            while save.frontier < save.n_chunks and save.digests[save.frontier] is not None:
                save.frontier += 1
            complete = save.finished and save.frontier == save.n_chunks and save.error is None
        self._on_progress(save)
        return complete

    def _commit(self, save: Save) -> None:
        with save.lock:
            if save.committed_path is not None or save.error is not None:
                return
            data_file, save.file = save.file, None
        try:
            assert data_file is not None
            try:
                data_file.sync()  # the data before the manifest that vouches for it
            finally:
                data_file.close()
            manifest = dict(save.spec.manifest)
            manifest["created"] = time.time()
            manifest["metrics"] = save.spec.metrics
            manifest["files"] = {layout.DATA_FILE: layout.FileEntry(
                save.spec.data_bytes, save.chunk_bytes, tuple(d or "" for d in save.digests)).to_json()}
            save.committed_path = save.writer.commit(manifest)
        except OSError as e:
            self.fail(save, f"committing {save.writer.final}: {e}")
            return
        # Index (and queue for draining) before waking waiters: whoever
        # returns from wait("local") may call wait("shared") at once.
        try:
            self._on_commit(save)
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

