"""The chunk stores of incremental parts on the object store: one per job, each chunk an object named by its bytes.

New chunks go straight to their keys (:class:`S3ChunkBatch` says why that
is safe). A chunk reused is touched with a tag naming the time
(:data:`TOUCHED_TAG`), which a sweep reads besides the modification time
before it condemns the chunk: no bytes move, and a versioned bucket keeps no
extra version of the chunk for each save that reuses it. A store that
refuses tags has its chunks copied onto themselves instead, as S3 sets no
modification time otherwise. A sweep's rules (leases, the grace period) are
:class:`ckptstage.daemon.catalog.chunkstore.ChunkStore`'s: this module only
stores, lists and moves chunks.
"""

from __future__ import annotations

import errno
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from ckptstage.daemon.logs import fields
from ckptstage.daemon.tiers.interface import PartWriter
from ckptstage.daemon.tiers.s3.client import is_refused
from ckptstage.daemon.tiers.s3.io import ObjectReader, Transfers
from ckptstage.daemon.tiers.s3.compression import SIZE_META, Compression, DecodedReader, open_object
from ckptstage.daemon.tiers.s3.keys import Keys
from ckptstage.daemon.tiers.s3.objects import Objects
from ckptstage.protos import chunks

log = logging.getLogger(__name__)

_MANY = 256                  # more chunk names than this: list the store instead of asking for each
TOUCHED_TAG = "ckptstage-touched"  # a chunk's tag: when a writer last relied on it (unix time, touch_chunk)


class S3Chunks:
    """The chunk stores of the jobs under ``keys``' prefix, on one bucket's ``objects``; chunks are read
    through ``transfers``."""

    def __init__(self, keys: Keys, objects: Objects, transfers: Transfers, compression: Compression) -> None:
        self._keys = keys
        self._objects = objects
        self._transfers = transfers
        self.compression = compression
        self._refused: set[str] = set()  # what the store declined to do ("tagging", "reading tags")

    def has_chunk_store(self, job: str) -> bool:
        return self._objects.any_under(self._keys.dir_key(self._keys.store(job)))

    def swept_at(self, job: str) -> float | None:
        head = self._objects.head(self._swept_key(job))
        return None if head is None else head["LastModified"].timestamp()

    def note_swept(self, job: str) -> None:
        self._objects.put(self._swept_key(job), b"")

    def _swept_key(self, job: str) -> str:
        return self._keys.key(self._keys.store(job) / chunks.SWEPT_FILE)

    def touch_chunk(self, job: str, name: str) -> bool:
        """Marks the chunk as relied on now: its tag :data:`TOUCHED_TAG` says when, which a sweep reads
        besides its modification time (:meth:`condemn_chunk`). A tag moves no bytes, and makes no new
        version of the chunk in a versioned bucket. Where the store refuses tags, the chunk is copied onto
        itself instead: its modification time becomes now."""
        key = self._keys.chunk_key(job, name)
        now = f"{math.ceil(time.time() * 1000) / 1000:.3f}"  # to the millisecond, never before the touch
        try:
            if "tagging" not in self._refused:
                try:
                    self._objects.tag(key, {TOUCHED_TAG: now})
                    return True
                except OSError as e:
                    if not is_refused(e):
                        raise
                    self._refuse("tagging", e, "chunks reused are touched by copying them onto themselves")
            head = self._objects.head(key)
            if head is None:
                return False
            self._objects.rewrite(key, {**(head.get("Metadata") or {}), "touched": now})  # a decoded size stays
        except FileNotFoundError:
            return False
        return True

    def _refuse(self, what: str, e: OSError, instead: str) -> None:
        """Notes (once, with a warning) that the store refuses ``what``: the tier does ``instead`` from now on."""
        if what not in self._refused:
            log.warning("%s refuses %s (%s): %s", self._keys.url, what, e, instead,
                        extra=fields(tier="shared", path=self._keys.url, error=e))
        self._refused.add(what)

    def _touched(self, key: str) -> float:
        """When a writer last touched the object by its tag (unix time; 0: never, or the store keeps no
        tags); FileNotFoundError when it is gone."""
        if "reading tags" in self._refused:
            return 0.0
        try:
            tags = self._objects.tags(key)
        except OSError as e:
            if not is_refused(e):
                raise
            self._refuse("reading tags", e, "a sweep knows when a chunk was used last by its modification time only")
            return 0.0
        try:
            return float(tags.get(TOUCHED_TAG, 0))
        except ValueError:
            return 0.0

    def chunk_size(self, job: str, name: str) -> int:
        key = self._keys.chunk_key(job, name)
        head = self._objects.head(key)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no chunk {self._objects.where(key)}")
        return int((head.get("Metadata") or {}).get(SIZE_META, head["ContentLength"]))

    def open_chunk(self, job: str, name: str) -> ObjectReader | DecodedReader:
        """The chunk's bytes: read by ranges, or when it is kept compressed, whole and decoded."""
        return open_object(self._transfers, self._keys.chunk_key(job, name))

    def missing_chunks(self, job: str, names: Iterable[str]) -> list[str]:
        names = list(names)
        if len(names) > _MANY:
            held = set(self.list_chunks(job))
            return [n for n in names if n not in held]
        keys = [self._keys.chunk_key(job, n) for n in names]
        there = list(self._transfers.pool("read").map(self._objects.head, keys))
        return [n for n, head in zip(names, there) if head is None]

    def new_chunks(self, job: str, part: PartWriter | None = None) -> S3ChunkBatch:
        """A batch whose chunks go straight into the store (nothing is staged: see :class:`S3ChunkBatch`)."""
        return S3ChunkBatch(self._keys, self._objects, chunks.check_store_key(job), self.compression)

    def list_chunks(self, job: str) -> list[str]:
        out = []
        for obj in self._objects.listing(self._keys.dir_key(self._keys.store(job))):
            fan, _, name = obj.get("Key", "").rpartition("/")
            if chunks.is_chunk_name(name) and fan.endswith(f"/{name[:2]}"):  # not .condemned nor .corrupt
                out.append(name)
        return out

    def condemn_chunk(self, job: str, name: str, untouched_since: float) -> bool:
        key = self._keys.chunk_key(job, name)
        head = self._objects.head(key)
        # S3 keeps modification times to the second: the second it names may run up to 1 s later.
        if head is None or head["LastModified"].timestamp() + 1 > untouched_since:
            return False
        try:
            if self._touched(key) > untouched_since:
                return False
            self._objects.copy(key, self._keys.condemned(job, name), int(head["ContentLength"]))
            self._objects.delete(key, str(head["ETag"]))
        except FileNotFoundError:
            return False  # another node's sweep took it first
        return True

    def condemned_chunks(self, job: str) -> list[str]:
        prefix = self._keys.dir_key(self._keys.store(job) / chunks.CONDEMNED_DIR)
        return [name for obj in self._objects.listing(prefix)
                if chunks.is_chunk_name(name := obj.get("Key", "")[len(prefix):])]

    def restore_chunk(self, job: str, name: str) -> None:
        condemned = self._keys.condemned(job, name)
        head = self._objects.head(condemned)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no condemned chunk {self._objects.where(condemned)}")
        self._objects.copy(condemned, self._keys.chunk_key(job, name), int(head["ContentLength"]))
        self._objects.delete(condemned)

    def delete_condemned_chunk(self, job: str, name: str) -> int:
        condemned = self._keys.condemned(job, name)
        head = self._objects.head(condemned)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no condemned chunk {self._objects.where(condemned)}")
        self._objects.delete(condemned, str(head["ETag"]))
        return int(head["ContentLength"])

    def quarantine_chunk(self, location: Path) -> Path | None:
        target = chunks.corrupt_location(location)
        if target is None:
            return None
        key = self._keys.key(location)
        head = self._objects.head(key)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no chunk {self._objects.where(key)}")
        self._objects.copy(key, self._keys.key(target), int(head["ContentLength"]))
        self._objects.delete(key, str(head["ETag"]))
        return target


class S3ChunkBatch:
    """New chunks of a job's store, each uploaded straight to its key in the store by :meth:`write`.

    Staging them first and copying them in at :meth:`publish` would cost a
    second copy of every byte and twice the requests, and protect nothing: a
    chunk's name is the hash of its bytes, so a chunk never changes (one
    written where the same name already is has the same bytes), and a PUT is
    whole or absent. A chunk in the store before a manifest names it is
    harmless: no part relies on it yet, a writer that finds it reuses the
    right bytes, and a sweep leaves it for the grace period as it was written
    just now (this daemon's sweeps never take a chunk its writers lease). So
    every chunk is in the store once its :meth:`write` returned, and
    :meth:`discard` leaves what was written for a later save to reuse or a
    sweep to remove: another writer may rely on it already.
    """

    def __init__(self, keys: Keys, objects: Objects, job: str, compression: Compression) -> None:
        self._keys = keys
        self._objects = objects
        self._job = job
        self._compression = compression
        self._pace: Callable[[int], None] = lambda n: None

    def pace_with(self, pace: Callable[[int], None]) -> None:
        """``pace(n)`` before each upload of ``n`` bytes (a rate limit counting what is sent, not what the
        chunks hold)."""
        self._pace = pace

    def write(self, name: str, data: memoryview, direct_io: bool) -> None:
        """Uploads one chunk, compressed where the tier's :class:`Compression` says so."""
        if not chunks.is_chunk_name(name):
            raise ValueError(f"{name!r} is not a chunk name")
        frame = self._compression.encode(data)
        body = bytes(data) if frame is None else frame
        t0 = time.perf_counter()
        self._pace(len(body))  # a cap on the tier is part of what an upload costs: "auto" weighs it too
        self._objects.put(self._keys.chunk_key(self._job, name), body,
                          metadata=None if frame is None else {SIZE_META: str(len(data))})
        self._compression.sent(len(body), time.perf_counter() - t0)

    def write_run(self, held: Sequence[tuple[str, int, int]], data: memoryview, direct_io: bool) -> None:
        """An object per chunk."""
        for name, offset, length in held:
            self.write(name, data[offset:offset + length], direct_io)

    def publish(self) -> None:
        """Nothing left to do: each chunk went into the store whole as it was written."""

    def discard(self) -> None:
        """Nothing to undo: chunks written stay for a later save or a sweep (see the class)."""
