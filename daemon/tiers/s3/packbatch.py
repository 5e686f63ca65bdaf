"""New chunks of a job's store on the object store, written as packs: a few large objects per part, not an
object per chunk.

A part of a few hundred chunks, times thousands of ranks, would be hundreds
of thousands of PUTs per step as an object each, and as many requests again
for every later step that touches them. :class:`S3PackBatch` appends each
chunk (compressed where the tier's :class:`Compression` says so) at the next
page of the open pack's buffer; a buffer that reaches the tier's piece size
goes up as one piece of the pack's multipart upload, from the thread that
filled it (several threads fill and send at once). A pack rolls over at
:data:`PACK_BYTES`, so that a sweep can drop or repack one in a bounded
copy. :meth:`S3PackBatch.publish` sends what is left, completes each pack,
then writes its index (docs/FORMAT.md, "Packs"): the index publishes the
pack, exactly as on a file system. A pack no bigger than one piece is one
PUT.

Until its upload is completed a pack is invisible (S3 shows no object of an
upload in progress), and :meth:`S3PackBatch.discard` aborts it; one left by
a daemon that died is aborted by a later sweep (:mod:`ckptstage.daemon.tiers.s3.packs`).
A crash between a pack's completion and its index leaves a pack no index
publishes, which no reader sees and a sweep removes once stale. A pack's id
begins with its daemon's tag (:func:`owner_tag`), so that a daemon that
restarts aborts the uploads it left at once (:meth:`S3Packs.abort_own_uploads`).
"""

from __future__ import annotations

import threading
import uuid

import xxhash
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptstage.daemon.tiers.s3.client import Connection
from ckptstage.daemon.tiers.compression import Compression
from ckptstage.daemon.tiers.s3.io import begin_upload, complete_upload, upload_piece
from ckptstage.daemon.tiers.s3.keys import Keys
from ckptstage.daemon.tiers.s3.objects import Objects, abort
from ckptstage.protos import chunks, packs

PACK_BYTES = 1 << 30  # a pack rolls over once this much is in it (or one piece, where pieces are larger)


def owner_tag(owner: str) -> str:
    """What the ids of the packs daemon ``owner`` writes begin with (then ``-``): 8 hex digits."""
    return xxhash.xxh3_64_hexdigest(owner.encode())[:8]


@dataclass
class _Pack:
    """A pack being filled: its bytes sent (``sent``) and those waiting in ``buf`` for their piece."""

    pack_id: str
    sent: int = 0
    buf: bytearray = field(default_factory=bytearray)
    entries: list[packs.Entry] = field(default_factory=list)
    pieces: dict[int, dict[str, Any]] = field(default_factory=dict)  # number -> what completes it
    numbered: int = 0                                                # pieces handed out so far
    upload_id: str | None = None
    done: bool = False
    begin: threading.Lock = field(default_factory=threading.Lock)

    @property
    def filled(self) -> int:
        return self.sent + len(self.buf)


class S3PackBatch:
    """New chunks of the store ``job`` on ``keys``' tier, packed (see the module docstring). ``piece_bytes``:
    the tier's upload piece; ``published(pack, entries)`` is told of each pack once its index is written."""

    def __init__(self, keys: Keys, objects: Objects, job: str, compression: Compression, piece_bytes: int,
                 published: Callable[[Path, list[packs.Entry]], None]) -> None:
        self._keys = keys
        self._objects = objects
        self._conn: Connection = objects.connection
        self._store = keys.store(chunks.check_store_key(job))
        self._compression = compression
        self._piece = piece_bytes
        self._most = max(PACK_BYTES, piece_bytes)
        self._published = published
        self._pace: Callable[[int], None] = lambda n: None
        self._lock = threading.Lock()
        self._open = self._new()
        self._full: list[_Pack] = []  # packs rolled over, to complete at publish

    def pace_with(self, pace: Callable[[int], None]) -> None:
        """``pace(n)`` before each upload of ``n`` bytes (a rate limit counting what is sent, not what the
        chunks hold)."""
        self._pace = pace

    def write(self, name: str, data: memoryview, direct_io: bool) -> None:
        """Appends one chunk to the open pack (compressed where the tier says so); sends a piece it filled."""
        if not chunks.is_chunk_name(name):
            raise ValueError(f"{name!r} is not a chunk name")
        frame = self._compression.encode(data)
        body = memoryview(frame) if frame is not None else data.cast("B") if data.format != "B" else data
        with self._lock:
            pack = self._open
            at = packs.page_up(pack.filled)
            pack.buf += bytes(at - pack.filled)
            pack.buf += body
            pack.entries.append(packs.Entry(name, at, len(body), 0 if frame is None else len(data)))
            piece = self._take_piece(pack) if len(pack.buf) >= self._piece else None
            if pack.filled >= self._most:
                self._full.append(pack)
                self._open = self._new()
        if piece is not None:
            self._send(pack, *piece)

    def write_run(self, held: Sequence[tuple[str, int, int]], data: memoryview, direct_io: bool) -> None:
        """Each chunk of the run appended in turn (each may be compressed on its own)."""
        for name, offset, length in held:
            self.write(name, data[offset:offset + length], direct_io)

    def publish(self) -> None:
        """Sends what is left of each pack, completes it, then writes its index; the store's readers know
        of each pack once this returns."""
        with self._lock:
            todo = [p for p in (*self._full, self._open) if p.entries and not p.done]
        for pack in todo:
            self._finish(pack)

    def discard(self) -> None:
        """Aborts each upload not completed (its pieces are deleted); packs published stay."""
        with self._lock:
            todo = [p for p in (*self._full, self._open) if p.upload_id is not None and not p.done]
            for pack in todo:
                pack.buf = bytearray()
        for pack in todo:
            abort(self._conn, self._key(pack, packs.PACK_SUFFIX), pack.upload_id)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ inside

    def _new(self) -> _Pack:
        return _Pack(f"{owner_tag(self._keys.owner)}-{uuid.uuid4().hex[:16]}")

    def _key(self, pack: _Pack, suffix: str) -> str:
        return self._keys.key(packs.packs_dir(self._store) / f"{pack.pack_id}{suffix}")

    @staticmethod
    def _take_piece(pack: _Pack) -> tuple[int, bytearray]:
        """The pack's buffer as its next piece (under the batch's lock)."""
        pack.numbered += 1
        body, pack.buf = pack.buf, bytearray()
        pack.sent += len(body)
        return pack.numbered, body

    def _send(self, pack: _Pack, number: int, body: bytearray) -> None:
        key = self._key(pack, packs.PACK_SUFFIX)
        with pack.begin:
            if pack.upload_id is None:
                pack.upload_id = begin_upload(self._conn, key)
        upload_id = pack.upload_id
        got = self._compression.timed_write(len(body), self._pace,
                                            lambda: upload_piece(self._conn, key, upload_id, number, body))
        with self._lock:
            pack.pieces[number] = got

    def _finish(self, pack: _Pack) -> None:
        key = self._key(pack, packs.PACK_SUFFIX)
        with self._lock:
            last = self._take_piece(pack) if pack.buf else None
        if pack.upload_id is None and last is not None:  # the whole pack is one piece: one PUT
            body = bytes(last[1])
            self._compression.timed_write(len(body), self._pace, lambda: self._objects.put(key, body))
        else:
            if last is not None:
                self._send(pack, *last)
            with self._lock:
                parts = [pack.pieces[n] for n in range(1, pack.numbered + 1)]
            complete_upload(self._conn, key, pack.upload_id, parts)  # type: ignore[arg-type]
        pack.done = True
        entries = sorted(pack.entries, key=lambda e: e.offset)
        self._objects.put(self._key(pack, packs.INDEX_SUFFIX), packs.encode_index(entries))
        self._published(self._keys.location(key), entries)
