"""A tier whose writes of part files and chunks are paced: to a byte rate (``[shared] max_bandwidth``), and
held back while a checkpoint is being loaded on this node (:mod:`~ckptstage.daemon.tiers.loadgate`).

Like restic's limiter backend, which overrides only Save and Load: the
wrapper overrides the two calls that hand out data-moving writers
(:meth:`Tier.begin_part`, :meth:`Tier.new_chunks`) and passes every other
call through. Reads are not paced: a prefetch from the shared tier back to
the local one was never a drain to it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from ckptstage.daemon.tiers.interface import ChunkBatch, DataSink, PartWriter, Tier

# A write takes its tokens this many bytes at a time (the digest block the drain reads and checks in): a
# whole 64 MiB piece's credit at once would fill the bucket to a piece and overshoot the cap.
_SLICE_BYTES = 1 << 20


class Pacer(Protocol):
    def acquire(self, nbytes: int) -> None:
        """Returns when ``nbytes`` may be written."""


class Pacers:
    """Several pacers, each taken in turn."""

    def __init__(self, pacers: list[Pacer]) -> None:
        self._pacers = pacers

    def acquire(self, nbytes: int) -> None:
        for pacer in self._pacers:
            pacer.acquire(nbytes)


class RateLimiter:
    """A token bucket shared by the drain workers (``[shared] max_bandwidth``).

    ``acquire(n)`` takes ``n`` tokens, going into debt when there are too few
    and sleeping the debt off, so concurrent workers share the rate. The
    bucket holds ``burst_s`` seconds of tokens, or one request if that is
    more: the time a worker spent reading and writing its last chunk must
    count towards the next one (with a 10 MiB bucket and 64 MiB chunks, every
    chunk paid its I/O time on top of n / rate, and a 200 MiB/s cap drained
    at 116-146 MiB/s).
    """

    def __init__(self, rate: int | None, burst_s: float = 0.05,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], object] = time.sleep) -> None:
        self.rate = rate
        self._burst = (rate or 0) * burst_s
        self._tokens = self._burst
        self._clock, self._sleep = clock, sleep
        self._last = clock()
        self._lock = threading.Lock()

    def acquire(self, n: int) -> None:
        if not self.rate:
            return
        with self._lock:
            now = self._clock()
            # The bucket holds at least one request: tokens earned while the
            # previous chunk was read and written count towards this one, else
            # every request would pay its I/O time on top of n / rate.
            self._tokens = min(max(self._burst, n), self._tokens + (now - self._last) * self.rate) - n
            self._last = now
            debt = -self._tokens
        if debt > 0:
            self._sleep(debt / self.rate)


def limited(tier: Tier, rate: int | None, sleep: Callable[[float], object] = time.sleep,
            gate: Pacer | None = None) -> Tier:
    """``tier`` with its data writes capped at ``rate`` bytes a second and held at ``gate`` (a
    :class:`~ckptstage.daemon.tiers.loadgate.LoadGate`); ``tier`` itself when there is neither.

    ``sleep`` is how a write waits for its tokens (the drain's stop event, so that stopping never waits out
    a debt)."""
    pacers: list[Pacer] = [p for p in (gate, RateLimiter(rate, sleep=sleep) if rate else None) if p is not None]
    if not pacers:
        return tier
    return LimitedTier(tier, pacers[0] if len(pacers) == 1 else Pacers(pacers))


class _Paced:
    """Wraps ``inner``: every call the subclass does not override passes through to it."""

    def __init__(self, inner: Any, limiter: Pacer) -> None:
        self._inner = inner
        self._limiter = limiter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class LimitedTier(_Paced):
    """A :class:`Tier` whose part files and new chunks are written at most at ``limiter``'s rate."""

    def __init__(self, tier: Tier, limiter: Pacer) -> None:
        super().__init__(tier, limiter)

    def begin_part(self, job: str, step: int, rank: int, replace: Callable[[Path], bool] | None = None,
                   final: Path | None = None) -> PartWriter:
        return _LimitedWriter(self._inner.begin_part(job, step, rank, replace=replace, final=final), self._limiter)

    def new_chunks(self, job: str, part: PartWriter | None = None) -> ChunkBatch:
        return _LimitedBatch(self._inner.new_chunks(job, part), self._limiter)


class _LimitedWriter(_Paced):
    """A :class:`PartWriter` (final, manifest_digest, ino, commit, abort: its own) whose files are paced."""

    def create_file(self, name: str, size: int, direct_io: bool, reserve: bool = True) -> DataSink:
        return _LimitedSink(self._inner.create_file(name, size, direct_io, reserve), self._limiter)


class _LimitedSink(_Paced):
    """A :class:`DataSink` that takes a write's tokens (a slice at a time) before writing it."""

    def write(self, data: memoryview, offset: int) -> None:
        _acquire(self._limiter, len(data))
        self._inner.write(data, offset)


class _LimitedBatch(_Paced):
    """A :class:`ChunkBatch` (publish, discard: its own) that takes each chunk's tokens before writing it; a
    batch that can pace itself (``pace_with``: the object store's, which knows what a compressed chunk sends)
    takes them for the bytes it sends instead."""

    def __init__(self, inner: Any, limiter: Pacer) -> None:
        super().__init__(inner, limiter)
        pace_with = getattr(inner, "pace_with", None)
        self._inner_paces = pace_with is not None
        if pace_with is not None:
            pace_with(lambda n: _acquire(limiter, n))

    def write(self, name: str, data: memoryview, direct_io: bool) -> None:
        if not self._inner_paces:
            _acquire(self._limiter, len(data))
        self._inner.write(name, data, direct_io)

    def write_run(self, held: Sequence[tuple[str, int, int]], data: memoryview, direct_io: bool) -> None:
        if not self._inner_paces:
            _acquire(self._limiter, len(data))
        self._inner.write_run(held, data, direct_io)


def _acquire(limiter: Pacer, nbytes: int) -> None:
    """Takes a write's tokens a slice at a time: a large write is paced, not let through in one burst."""
    for start in range(0, nbytes, _SLICE_BYTES):
        limiter.acquire(min(_SLICE_BYTES, nbytes - start))
