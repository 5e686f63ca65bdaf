"""Moving bytes to and from objects: a file written at offsets as an upload, an object read by ranges.

:class:`UploadSink` is a :class:`ckptstage.daemon.tiers.interface.DataSink` over one
object: writes at any offset, from several threads, are gathered into pieces
of ``piece_bytes``; each piece goes up as one part of a multipart upload as
soon as it is whole, several at once, while the writer goes on (the drain
reads piece i+1 while piece i uploads). A file no larger than one piece is
one plain PUT at :meth:`UploadSink.sync`. The upload is completed by
``sync`` and aborted by ``close`` without it, so that an object is either
whole or absent: S3 never shows a multipart upload's object before it is
completed.

:class:`ObjectReader` is a :class:`ckptstage.daemon.tiers.interface.Reader` over one
object: a read fetches its range as several ranged GETs at once.

:class:`Transfers` opens both for a tier, on its threads.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any

from ckptstage.daemon.tiers.s3.client import Connection, errors
from ckptstage.daemon.tiers.s3.objects import abort

# S3's limits on a multipart upload: every part but the last at least 5 MiB, at most 10,000 parts.
MIN_PIECE_BYTES = 5 << 20
MAX_PIECES = 10_000
# The most a ranged GET asks for at once.
READ_PIECE_BYTES = 8 << 20
READ_AHEAD = 8  # ranged GETs in flight ahead of one reader (at most this many pieces held in memory)


def piece_size(size: int, piece_bytes: int) -> int:
    """The piece for a file of ``size`` bytes: ``piece_bytes``, or larger where 10,000 would not hold it."""
    return max(piece_bytes, MIN_PIECE_BYTES, -(-size // MAX_PIECES))


def begin_upload(conn: Connection, key: str) -> str:
    """Starts a multipart upload of ``key``; returns its id."""
    with errors("starting the upload of", conn, key):
        return str(conn.client.create_multipart_upload(Bucket=conn.bucket, Key=key)["UploadId"])


def upload_piece(conn: Connection, key: str, upload_id: str, number: int, body: bytes | bytearray
                 ) -> dict[str, Any]:
    """Uploads piece ``number`` (from 1) of an upload; returns what its completion must name it by."""
    with errors(f"uploading piece {number} of", conn, key):
        got = conn.client.upload_part(Bucket=conn.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body)
    part = {"PartNumber": number, "ETag": got["ETag"]}
    for name in ("ChecksumCRC32", "ChecksumCRC32C", "ChecksumCRC64NVME", "ChecksumSHA1", "ChecksumSHA256"):
        if got.get(name):
            part[name] = got[name]  # the completion must repeat each piece's checksum
    return part


def complete_upload(conn: Connection, key: str, upload_id: str, parts: list[dict[str, Any]]) -> None:
    """Makes an upload's object whole from its ``parts`` (in order): the object appears under ``key``."""
    with errors("completing the upload of", conn, key):
        conn.client.complete_multipart_upload(Bucket=conn.bucket, Key=key, UploadId=upload_id,
                                              MultipartUpload={"Parts": parts})


class UploadSink:
    """One object being written: pieces uploaded as they fill, the object whole at :meth:`sync`.

    ``pool`` runs the uploads; at most ``in_flight`` pieces of this object are
    held in memory waiting for theirs (a write waits for room: back-pressure
    instead of memory). ``before_complete`` is called before the object is
    made whole: it raises to keep it from appearing (the writer lost its
    claim on the key).
    """

    def __init__(self, conn: Connection, key: str, size: int, piece_bytes: int, pool: ThreadPoolExecutor,
                 in_flight: int, before_complete: Callable[[], None] | None = None) -> None:
        self._conn = conn
        self.key = key
        self.size = size
        self._piece = piece_size(size, piece_bytes)
        self._count = max(1, -(-size // self._piece))
        self._pool = pool
        self._room = threading.BoundedSemaphore(max(1, in_flight))
        self._lock = threading.Lock()
        self._buffers: dict[int, bytearray] = {}   # piece index -> its bytes, while it fills
        self._filled: dict[int, int] = {}          # piece index -> bytes written into it
        self._uploads: dict[int, Future[dict[str, Any]]] = {}
        self._upload_id: str | None = None
        self._before_complete = before_complete
        self._done = False
        self._closed = False

    # --- writing ---------------------------------------------------------------------

    def write(self, data: memoryview, offset: int) -> None:
        """Copies ``data`` into its pieces (the caller may reuse its buffer at once); a piece that is
        now whole starts uploading."""
        if offset < 0 or offset + len(data) > self.size:
            raise ValueError(f"{self.key}: write of {len(data)} bytes at {offset} outside its {self.size} bytes")
        data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        pos = 0
        while pos < len(data):
            index, within = divmod(offset + pos, self._piece)
            n = min(len(data) - pos, self._length(index) - within)
            whole = self._put(index, within, data[pos:pos + n])
            if whole is not None:
                self._start(index, whole)
            pos += n

    def _length(self, index: int) -> int:
        return min(self._piece, self.size - index * self._piece)

    def _put(self, index: int, within: int, data: memoryview) -> bytearray | None:
        """Copies into piece ``index``; returns its buffer when this made it whole."""
        with self._lock:
            buf = self._buffers.get(index)
            if buf is None:
                if index in self._uploads:
                    raise ValueError(f"{self.key}: piece {index} written again after it was uploaded")
                buf = self._buffers[index] = bytearray(self._length(index))
            buf[within:within + len(data)] = data
            self._filled[index] = self._filled.get(index, 0) + len(data)
            if self._filled[index] < len(buf) or self._count == 1:
                return None  # a file of one piece is one PUT, at sync
            del self._buffers[index]
            return buf

    def _start(self, index: int, buf: bytearray) -> None:
        with self._lock:
            failed = [f for f in self._uploads.values() if f.done() and f.exception() is not None]
        if failed:  # a piece that could not go up (after the SDK's retries) fails the file now, not at sync
            raise failed[0].exception()  # type: ignore[misc]
        self._room.acquire()  # released when this piece's upload is done
        try:
            upload_id = self._begin()
            future = self._pool.submit(self._upload_piece, upload_id, index, buf)
        except BaseException:
            self._room.release()
            raise
        future.add_done_callback(lambda _f: self._room.release())
        with self._lock:
            self._uploads[index] = future

    def _begin(self) -> str:
        with self._lock:
            if self._upload_id is None:
                self._upload_id = begin_upload(self._conn, self.key)
            return self._upload_id

    def _upload_piece(self, upload_id: str, index: int, buf: bytearray) -> dict[str, Any]:
        return upload_piece(self._conn, self.key, upload_id, index + 1, buf)

    # --- completion ------------------------------------------------------------------

    def sync(self) -> None:
        """Makes the object whole and visible under its key: the last pieces go up, the upload is
        completed (or the one PUT made). Bytes never written read as zeros, as in a sparse file."""
        if self._done:
            return
        with self._lock:
            rest = [(i, self._buffers.pop(i)) for i in sorted(self._buffers)]
            missing = [i for i in range(self._count) if i not in self._uploads and i not in dict(rest)]
        rest += [(i, bytearray(self._length(i))) for i in missing]
        if self._count == 1:
            [(_, body)] = rest
            if self._before_complete is not None:
                self._before_complete()
            with errors("writing", self._conn, self.key):
                self._conn.client.put_object(Bucket=self._conn.bucket, Key=self.key, Body=body)
            self._done = True
            return
        for index, buf in sorted(rest):
            self._start(index, buf)
        parts = [self._uploads[i].result() for i in range(self._count)]
        if self._before_complete is not None:
            self._before_complete()
        assert self._upload_id is not None, "a file of several pieces started its upload with its first"
        complete_upload(self._conn, self.key, self._upload_id, parts)
        self._done = True

    def close(self) -> None:
        """Releases the pieces; an upload not completed by :meth:`sync` is aborted (nothing is left)."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._buffers.clear()
            futures = list(self._uploads.values())
        for f in futures:
            f.exception()  # wait: an abort while a piece is still going up may leave that piece behind
        if not self._done and self._upload_id is not None:
            abort(self._conn, self.key, self._upload_id)


class ObjectReader:
    """An object read from its start (or where :meth:`seek` says), by ranged GETs on ``pool``; with ``window``
    (offset, length), only that range of it, as if it were the whole object (a chunk in a pack): shorter where
    the object ends first.

    Up to ``ahead`` GETs of :data:`READ_PIECE_BYTES` are kept in flight ahead
    of the reader, across reads: a read takes what has come and asks for the
    next ranges at once, so the pipe to the store never empties between two
    reads (on a store far away, waiting for all of one read's GETs before
    asking for the next read's cost a round trip per read). A seek elsewhere
    drops what was asked ahead. Every GET is pinned to the ETag seen at open:
    an object replaced meanwhile fails the read instead of mixing versions.
    """

    def __init__(self, conn: Connection, key: str, pool: ThreadPoolExecutor,
                 on_missing: Callable[[FileNotFoundError], BaseException] | None = None,
                 ahead: int = READ_AHEAD, window: tuple[int, int] | None = None) -> None:
        self._conn = conn
        self.key = key
        self._pool = pool
        self._ahead = max(1, ahead)
        try:
            with errors("reading", conn, key):
                head = conn.client.head_object(Bucket=conn.bucket, Key=key)
        except FileNotFoundError as e:
            raise (on_missing(e) if on_missing else e) from None
        self._base, length = window or (0, int(head["ContentLength"]))
        self.size: int = max(0, min(length, int(head["ContentLength"]) - self._base))
        self.metadata: dict[str, str] = dict(head.get("Metadata") or {})
        self._etag = str(head["ETag"])
        self._pos = 0
        self._asked: deque[tuple[int, int, Future[bytes]]] = deque()  # (start, end, GET), in order from _pos
        self._next = 0  # where the next range to ask for starts

    def readinto(self, buf: memoryview) -> int | None:
        view = memoryview(buf).cast("B")
        n = min(len(view), self.size - self._pos)
        if n <= 0:
            return 0
        done = 0
        while done < n:
            self._ask()
            lo, hi, got = self._asked[0]
            data = memoryview(got.result())
            take = min(hi - self._pos, n - done)
            view[done:done + take] = data[self._pos - lo:self._pos - lo + take]
            done += take
            self._pos += take
            if self._pos == hi:
                self._asked.popleft()
        self._ask()  # the next ranges come while the caller works on these
        return n

    def _ask(self) -> None:
        while len(self._asked) < self._ahead and self._next < self.size:
            lo, hi = self._next, min(self._next + READ_PIECE_BYTES, self.size)
            self._asked.append((lo, hi, self._pool.submit(self._get, lo, hi)))
            self._next = hi

    def _get(self, lo: int, hi: int) -> bytes:
        """Bytes [lo, hi) of the object; the object must not have changed."""
        with errors("reading", self._conn, self.key):
            got = self._conn.client.get_object(Bucket=self._conn.bucket, Key=self.key, IfMatch=self._etag,
                                               Range=f"bytes={self._base + lo}-{self._base + hi - 1}")
            data: bytes = got["Body"].read()
        if len(data) != hi - lo:
            raise OSError(f"reading {self._conn.where(self.key)}: {len(data)} bytes for a range of {hi - lo}")
        return data

    def seek(self, pos: int) -> None:
        """Where the next read starts."""
        pos = max(0, min(pos, self.size))
        if pos != self._pos:
            self._drop()
            self._pos = self._next = pos

    def _drop(self) -> None:
        for _, _, got in self._asked:
            got.cancel()  # one already running finishes unread
        self._asked.clear()

    def read(self, n: int) -> bytes:
        buf = bytearray(max(0, min(n, self.size - self._pos)))
        got = self.readinto(memoryview(buf)) or 0
        return bytes(buf[:got])

    def close(self) -> None:
        self._drop()

    def __enter__(self) -> ObjectReader:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class Transfers:
    """A tier's uploads and ranged reads over ``conn``: uploads in pieces of ``piece_bytes``, ``in_flight``
    of them per object at once, and ``threads`` for each kind of transfer (each kind its own pool)."""

    def __init__(self, conn: Connection, piece_bytes: int, in_flight: int, threads: int) -> None:
        self._conn = conn
        self._piece_bytes = piece_bytes
        self._in_flight = in_flight
        self._threads = threads
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._pools_lock = threading.Lock()

    def pool(self, name: str) -> ThreadPoolExecutor:
        """The tier's threads of one kind ("upload", "read"), started on first use."""
        with self._pools_lock:
            pool = self._pools.get(name)
            if pool is None:
                pool = self._pools[name] = ThreadPoolExecutor(self._threads, thread_name_prefix=f"s3-{name}")
            return pool

    def upload_sink(self, key: str, size: int, before_complete: Callable[[], None] | None = None) -> UploadSink:
        """An object of ``size`` bytes uploaded as it is written, in the tier's pieces, on its threads."""
        return UploadSink(self._conn, key, size, self._piece_bytes, self.pool("upload"), self._in_flight,
                          before_complete=before_complete)

    def reader(self, key: str, window: tuple[int, int] | None = None) -> ObjectReader:
        """The object at ``key`` (or the ``window`` of it: offset, length), read by ranges on the tier's
        threads."""
        return ObjectReader(self._conn, key, self.pool("read"), window=window)
