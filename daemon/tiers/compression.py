"""Whether a shared tier keeps a chunk compressed (``[shared] compression``), and the reader of a decoded one.

"none" never compresses, "zstd" and "bg-zstd" always try (:mod:`ckptstage.protos.codec`;
"bg-zstd" over byte planes, what model states gain most from), keeping a
chunk as it is when it does not shrink by 5%. "auto" (the default) compresses
when it makes the write finish sooner, judged per chunk from what the tier
has measured on this node:

* each write's bytes per second (one stream: a chunk is written by one
  thread; a cap on the tier, ``[shared] max_bandwidth``, is part of what a
  write costs), and the share of that time spent waiting for the cap,
* the codec's bytes per second on this node's data, and the share it saved.

A chunk compressed in a stream and then written takes ``n / C + r n / B``,
written as it is ``n / B`` (``C`` the codec's speed, ``r`` the stored share,
``B`` the stream's bandwidth): compressing pays when ``C (1 - r) > B``, even
when nothing overlaps the compression. So a tier that takes a stream at
2 GB/s never sees compressed chunks, and one that takes it at 100 MB/s (an
object store) gets them for fp32 and bf16 states (bg-zstd saves 17-32% at
about 0.8 GB/s per core; docs/BENCHMARKS.md).

Behind a cap that binds (most of a write's time is spent waiting for it),
the writers share a fixed rate: while one stream compresses, the others
take the whole of it, so what the cap lets through is what decides, and
every byte saved is time saved as long as the codec keeps up with a
stream's share: compressing pays when ``C > B``. (A drain that does not
wait for its cap is bound by something else, often the node's own CPU,
which compressing would only load more.)

Until it has measured them, and every :data:`PROBE_EVERY` chunks after,
"auto" compresses one chunk to keep its figures current.

The local tier never compresses: it is the restore's fast path, read in
place at the disk's speed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar

from ckptstage.protos import codec

MODES = ("auto", "none", "zstd", "bg-zstd")
PROBE_EVERY = 64              # "auto": one chunk in this many is compressed to keep the figures current
CAP_BINDS = 0.5               # "auto": a cap binds when writes spend more than this share of their time waiting
_WEIGHT = 0.2                 # of a new measurement in the running figures

T = TypeVar("T")


@dataclass(frozen=True)
class Figures:
    """What a tier's :class:`Compression` did and measured since the daemon started (its metrics)."""

    mode: str
    compressed: int                  # new chunks kept compressed
    raw: int                         # ... kept as they are
    logical_bytes: int               # their bytes, as saved
    stored_bytes: int                # ... as written
    stream_bytes_per_s: float | None  # "auto"'s figures (None: not measured yet)
    codec_bytes_per_s: float | None
    stored_share: float | None


class Compression:
    """One tier's choice per chunk, and what it measured."""

    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"compression must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode = mode
        self._lock = threading.Lock()
        self._stream = _Rate()                 # one write's bytes per second
        self._waited = _Rate()                 # the seconds of those writes spent waiting for the cap, per second
        self._codec = _Rate()                  # uncompressed bytes per second through the codec
        self._stored: float | None = None      # the share of its bytes a compressed chunk kept
        self._count = 0
        self._kept = [0, 0]                    # chunks written raw, compressed
        self._bytes = [0, 0]                   # their bytes: logical, stored

    def encode(self, data: memoryview) -> bytes | None:
        """The frame to write for ``data`` (None: write it as it is)."""
        frame = None
        if self._wanted():
            t0 = time.perf_counter()
            frame = codec.encode(data, grouped=self.mode != "zstd")
            took = time.perf_counter() - t0
            with self._lock:
                self._codec.add(len(data), took)
                self._stored = _blend(self._stored, 1.0 if frame is None else len(frame) / max(1, len(data)))
        with self._lock:
            self._kept[frame is not None] += 1
            self._bytes[0] += len(data)
            self._bytes[1] += len(data) if frame is None else len(frame)
        return frame

    def timed_write(self, nbytes: int, pace: Callable[[int], None], write: Callable[[], T]) -> T:
        """``write()`` of ``nbytes`` once ``pace(nbytes)`` let it (the tier's rate limit), timed: what "auto"
        weighs."""
        t0 = time.perf_counter()
        pace(nbytes)
        t1 = time.perf_counter()
        out = write()
        self.sent(nbytes, time.perf_counter() - t0, waited=t1 - t0)
        return out

    def sent(self, nbytes: int, seconds: float, waited: float = 0.0) -> None:
        """A write of ``nbytes`` to the tier took ``seconds``, ``waited`` of them for the tier's rate limit."""
        if nbytes >= 64 << 10:  # smaller ones measure the round trip, not the stream
            with self._lock:
                self._stream.add(nbytes, seconds)
                self._waited.add(waited, seconds)

    def pays(self) -> bool | None:
        """Whether compressing makes a write finish sooner, from the figures so far (None: not measured)."""
        with self._lock:
            stream, codec_bps, waited = self._stream.value, self._codec.value, self._waited.value
            if stream is None or codec_bps is None or self._stored is None:
                return None
            capped = waited is not None and waited > CAP_BINDS and self._stored < 1 - codec.MIN_GAIN
            return codec_bps * (1.0 - self._stored) > stream or (capped and codec_bps > stream)

    def figures(self) -> Figures:
        with self._lock:
            return Figures(self.mode, self._kept[1], self._kept[0], self._bytes[0], self._bytes[1],
                           self._stream.value, self._codec.value, self._stored)

    def _wanted(self) -> bool:
        if self.mode == "none":
            return False
        if self.mode != "auto":
            return True
        with self._lock:
            self._count += 1
            probe = self._count % PROBE_EVERY == 1
        return bool(self.pays()) or probe


class _Rate:
    """An amount per second (bytes; or seconds spent waiting: a share) over the recent measurements: the
    amounts and the seconds each summed with older ones fading (by :data:`_WEIGHT` a measurement), then
    divided. Weighted by time, not by measurement, so a write that went through at memory speed (a rate
    limit's burst, the page cache) does not outweigh the many that waited for the tier."""

    def __init__(self) -> None:
        self._bytes = 0.0
        self._seconds = 0.0

    def add(self, nbytes: float, seconds: float) -> None:
        self._bytes = (1 - _WEIGHT) * self._bytes + nbytes
        self._seconds = (1 - _WEIGHT) * self._seconds + max(seconds, 1e-9)

    @property
    def value(self) -> float | None:
        return self._bytes / self._seconds if self._seconds else None


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - _WEIGHT) * old + _WEIGHT * new


class DecodedReader:
    """A compressed chunk's decoded bytes, read from memory (a chunk is at most a unit of the daemon's
    persist, 64 MiB). A frame that does not decode is served as it is: the reader's check of the bytes
    against the chunk's name then fails and names the chunk, as it does for a damaged chunk stored raw."""

    def __init__(self, frame: bytes | bytearray) -> None:
        try:
            self._data = memoryview(codec.decode(frame))
        except codec.CodecError:
            self._data = memoryview(frame)
        self.size = len(self._data)
        self._pos = 0

    def readinto(self, buf: memoryview) -> int | None:
        view = memoryview(buf).cast("B")
        n = min(len(view), self.size - self._pos)
        view[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        return n

    def read(self, n: int) -> bytes:
        out = bytes(self._data[self._pos:self._pos + max(0, n)])
        self._pos += len(out)
        return out

    def seek(self, pos: int) -> None:
        self._pos = max(0, min(pos, self.size))

    def close(self) -> None:
        pass

    def __enter__(self) -> DecodedReader:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
