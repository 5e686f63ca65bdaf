"""Chunk packs on a file-system tier: a batch of new chunks written as one pack, and packs condemned, put
back or removed as a whole by the chunk store's sweep (:mod:`ckptstage.daemon.catalog.chunkstore`).

A batch writes its chunks at page-aligned offsets of one file in its
staging directory (the part's temporary: an abort removes it), from any
number of threads, through :class:`fsutil.DataFile` (aligned chunks with
``O_DIRECT``); on a tier that keeps chunks compressed
(:mod:`ckptstage.daemon.tiers.compression`), each chunk as its tier chooses,
a compressed one as its codec frame (an index entry of four).
:meth:`FsPackBatch.publish` makes the file durable, writes its
index, and renames the pack, then its index, into ``<store>/packs/``: the
index publishes it (:mod:`ckptstage.protos.packs`). A crash between the two
renames leaves a pack with no index, which no reader sees and the sweep
removes once it is older than the grace period.

A sweep condemns a pack (its index, then its file, into ``.condemned/``)
only when none of its chunks is named or leased; it puts it back (file,
then index) if one is named again before it is deleted.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from ckptstage.daemon import fsutil
from ckptstage.daemon.tiers.compression import Compression
from ckptstage.daemon.tiers.fsread import open_place
from ckptstage.daemon.tiers.interface import Pack
from ckptstage.protos import chunks, layout, packs


# A pack's blocks are reserved this much at a time while its writers fill it (see fsutil.DataFile.reserve);
# what is left over goes back when it is published.
_RESERVE_BYTES = 256 << 20


class FsPackBatch:
    """New chunks written into one pack under ``staging``, then published into ``store``; ``compression``:
    whether each is kept compressed (None: none is)."""

    def __init__(self, root: Path, store: Path, staging: Path, compression: Compression | None = None) -> None:
        self._root = root
        self._store = store
        self._staging = staging
        self._compression = compression if compression is not None and compression.mode != "none" else None
        self._pace: Callable[[int], None] = lambda n: None
        self._id = uuid.uuid4().hex[:16]
        self._lock = threading.Lock()
        self._file: fsutil.DataFile | None = None
        self._next = 0    # where the next write goes
        self._end = 0     # where the pack's last byte written ends
        self._entries: list[packs.Entry] = []

    def pace_with(self, pace: Callable[[int], None]) -> None:
        """``pace(n)`` before each write of ``n`` bytes (a rate limit counting what is stored, a compressed chunk's
        frame, not what the chunks hold)."""
        self._pace = pace

    def write(self, name: str, data: memoryview, direct_io: bool) -> None:
        """Writes one new chunk at the pack's next page, compressed where the tier says so (several threads at
        once; each its own range)."""
        frame = self._compression.encode(data) if self._compression is not None else None
        if frame is None:
            self._append(((name, 0, len(data)),), data, direct_io)
            return
        buf = mmap.mmap(-1, len(frame))  # page-aligned: the frame's whole pages go O_DIRECT too
        try:
            buf[:] = frame
            with memoryview(buf) as view:
                self._append(((name, 0, len(frame)),), view, direct_io, size=data.nbytes)
        finally:
            buf.close()

    def write_run(self, held: Sequence[tuple[str, int, int]], data: memoryview, direct_io: bool) -> None:
        """Writes ``data`` at the pack's next page: it holds the chunks ``held`` (name, offset in ``data``,
        length; page-aligned offsets stay page-aligned in the pack). One write, unless chunks may be kept
        compressed: then each chunk is written as :meth:`write` does."""
        if self._compression is not None:
            for name, offset, length in held:
                self.write(name, data[offset:offset + length], direct_io)
            return
        self._append(held, data, direct_io)

    def _append(self, held: Sequence[tuple[str, int, int]], data: memoryview, direct_io: bool, size: int = 0) -> None:
        """One write of ``data`` (paced, and timed where the tier weighs compressing) at the pack's next page;
        ``size`` > 0: it is one chunk's frame, which decodes to that many bytes."""
        with self._lock:
            if self._file is None:
                self._file = fsutil.DataFile(self._staging / f"{self._id}{packs.PACK_SUFFIX}", 0, direct_io,
                                             reserve=False)
            base = self._next
            self._next = packs.page_up(base + len(data))
            self._end = max(self._end, base + len(data))
            out = self._file
            if self._next > out.reserved:
                try:
                    out.reserve(max(self._next, out.reserved + _RESERVE_BYTES))
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    out.reserve(self._next)  # room for this run at least, or ENOSPC
        if self._compression is not None:
            self._compression.timed_write(len(data), self._pace, lambda: out.write(data, base))
        else:
            self._pace(len(data))
            out.write(data, base)
        with self._lock:
            self._entries += [packs.Entry(name, base + offset, length, size) for name, offset, length in held]

    def publish(self) -> None:
        """Durable pack, its index, both renamed into the store (the index last), the store's directory synced;
        the staging directory goes."""
        with self._lock:
            out, entries, self._file = self._file, sorted(self._entries, key=lambda e: e[1]), None
        if out is not None:
            try:
                if out.reserved > self._end:
                    out.truncate(self._end)
                out.sync()
            finally:
                out.close()
            staged_pack = self._staging / f"{self._id}{packs.PACK_SUFFIX}"
            staged_index = self._staging / f"{self._id}{packs.INDEX_SUFFIX}"
            fsutil.write_file_durable(staged_index, packs.encode_index(entries))
            where = packs.packs_dir(self._store)
            fsutil.makedirs_durable(where, within=self._root)
            for staged, final in ((staged_pack, packs.pack_path(self._store, self._id)),
                                  (staged_index, packs.index_path(self._store, self._id))):
                fsutil.check_contained(self._root, final)
                os.rename(staged, final)
            layout.fsync_dir(where)
            packs.store_index(self._store).add(packs.pack_path(self._store, self._id), entries)
        self._staging.rmdir()

    def discard(self) -> None:
        with self._lock:
            out, self._file = self._file, None
        if out is not None:
            out.close()
        shutil.rmtree(self._staging, ignore_errors=True)


class PackCalls:
    """The pack calls of :class:`~ckptstage.daemon.tiers.interface.ChunkStorage` for a file-system tier, on the
    job's store that ``_store(job)`` names."""

    def _store(self, job: str) -> Path:
        raise NotImplementedError

    def list_packs(self, job: str) -> list[Pack]:
        return list_packs(self._store(job))

    def condemn_pack(self, job: str, pack_id: str, untouched_since: float) -> bool:
        return condemn_pack(self._store(job), pack_id, untouched_since)

    def condemned_packs(self, job: str) -> list[Pack]:
        return condemned_packs(self._store(job))

    def restore_pack(self, job: str, pack_id: str) -> None:
        restore_pack(self._store(job), pack_id)

    def delete_condemned_pack(self, job: str, pack_id: str) -> int:
        return delete_condemned_pack(self._store(job), pack_id)


def list_packs(store: Path) -> list[Pack]:
    """Every pack in ``store`` (a pack with no index has no names), with its file's modification time."""
    where = packs.packs_dir(store)
    try:
        files = os.listdir(where)
    except FileNotFoundError:
        return []
    out = []
    for pack_id in sorted({i for n in files if n.endswith(packs.PACK_SUFFIX) for i in [packs.pack_id_of(n)] if i}):
        try:
            mtime = os.stat(packs.pack_path(store, pack_id)).st_mtime
            entries = packs.read_index(packs.index_path(store, pack_id))
        except FileNotFoundError:
            if not os.path.exists(packs.pack_path(store, pack_id)):
                continue  # removed meanwhile
            entries = []  # a writer cut short between its two renames
        except packs.PackError:
            entries = []  # an index that cannot be trusted publishes nothing
        out.append(Pack.of(pack_id, entries, mtime))
    return out


def _condemned(store: Path) -> Path:
    return packs.packs_dir(store) / chunks.CONDEMNED_DIR


def condemn_pack(store: Path, pack_id: str, untouched_since: float) -> bool:
    """Moves a pack nobody relied on since ``untouched_since`` out of the store (its index first: readers stop
    finding it); False when it was touched since, or is gone."""
    pack, index = packs.pack_path(store, pack_id), packs.index_path(store, pack_id)
    try:
        if os.stat(pack).st_mtime >= untouched_since:
            return False
        _condemned(store).mkdir(exist_ok=True)
        if index.exists():
            os.rename(index, _condemned(store) / index.name)
        os.rename(pack, _condemned(store) / pack.name)
    except FileNotFoundError:
        return False
    packs.store_index(store).reset()
    return True


def condemned_packs(store: Path) -> list[Pack]:
    where = _condemned(store)
    try:
        files = os.listdir(where)
    except FileNotFoundError:
        return []
    out = []
    for name in files:
        pack_id = packs.pack_id_of(name)
        if pack_id is None or not name.endswith(packs.PACK_SUFFIX):
            continue
        try:
            entries = packs.read_index(where / f"{pack_id}{packs.INDEX_SUFFIX}")
        except (FileNotFoundError, packs.PackError):
            entries = []
        out.append(Pack.of(pack_id, entries, time.time()))
    return out


def restore_pack(store: Path, pack_id: str) -> None:
    """Puts a condemned pack back (its file, then its index). FileNotFoundError: it is gone."""
    where = _condemned(store)
    os.rename(where / f"{pack_id}{packs.PACK_SUFFIX}", packs.pack_path(store, pack_id))
    index = where / f"{pack_id}{packs.INDEX_SUFFIX}"
    if index.exists():
        os.rename(index, packs.index_path(store, pack_id))


def delete_condemned_pack(store: Path, pack_id: str) -> int:
    """Deletes a condemned pack (its index first); returns the bytes freed. FileNotFoundError: it is gone."""
    where = _condemned(store)
    pack = where / f"{pack_id}{packs.PACK_SUFFIX}"
    size = os.stat(pack).st_size
    (where / f"{pack_id}{packs.INDEX_SUFFIX}").unlink(missing_ok=True)
    pack.unlink()
    return size


def quarantine_pack(root: Path, store: Path, pack: Path, staging: Path,
                    compression: Compression | None = None) -> Path:
    """A pack one of whose chunks failed verification: every chunk that still hashes to its name is copied into
    a new pack (published first: no intact chunk leaves the store), then the pack and its index move to
    ``<store>/.corrupt/`` (kept for forensics, listed and expired like every quarantined copy), so that no save
    reuses the bad chunk and the next one with its bytes writes them again. ``compression``: the tier's (the new
    pack keeps chunks compressed as any of its batches would). Returns where the pack went."""
    pack_id = packs.pack_id_of(pack.name)
    if pack_id is None or pack.parent != packs.packs_dir(store):
        raise ValueError(f"{pack} is not a pack of {store}")
    index = packs.index_path(store, pack_id)
    try:
        entries = packs.read_index(index)
    except (FileNotFoundError, packs.PackError):
        entries = []  # nothing it holds can be trusted to be anywhere: it only goes aside
    batch = FsPackBatch(root, store, staging, compression)
    try:
        for e in entries:  # a chunk that fails its name (or is past the pack's end) is left behind
            def write(view: memoryview, name: str = e.name) -> None:
                batch.write(name, view, direct_io=True)

            try:
                with open_place(packs.Place(pack, e.offset, e.length, whole=False, size=e.size)) as f:
                    chunks.copy_checked(e.name, e.size or e.length, f.readinto, write)
            except FileNotFoundError:
                if not pack.exists():
                    raise
        batch.publish()
    finally:
        batch.discard()
    aside = store / chunks.CORRUPT_DIR
    aside.mkdir(exist_ok=True)
    tag = f"{pack_id}-{uuid.uuid4().hex[:6]}"
    if index.exists():
        os.rename(index, aside / f"{tag}{packs.INDEX_SUFFIX}")
    target = aside / f"{tag}{packs.PACK_SUFFIX}"
    os.rename(pack, target)
    packs.store_index(store).reset()
    return target
