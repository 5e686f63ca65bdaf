"""How a restore reads cold data: the modes, and the policy that picks one per device by measuring.

Which of ``O_DIRECT`` and buffered reads is faster depends on the disk and
the file system (a local NVMe or virtual disk favours direct; some network
and FUSE file systems are slow with it), so :class:`Adaptive` compares them
on the checkpoint being read and keeps the winner per device (and apart
for parts stored as chunks, :data:`Device`); every few restores it compares
again. docs/ARCHITECTURE.md ("Restore") gives the measurements behind the
defaults.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Protocol

HASH_BLOCK = 256 << 10  # bytes hashed right after they are copied, while they are still in the CPU cache

# What a choice is kept for: a device number (``st_dev``) for parts stored whole, ``(st_dev, "chunks")``
# for parts stored as chunks (read file by file: the kernel's readahead, and so buffered reads, fare
# differently there), so that neither kind of part decides for the other.
Device = Hashable


@dataclass(frozen=True)
class Mode:
    """One way to read cold data: ``kind`` is "direct" or "buffered"; ``request`` bytes per read."""

    kind: str
    readers: int
    request: int


# Measured on the development VM (bench/bench_restore.py, docs/BENCHMARKS.md "Restore at disk speed"):
# O_DIRECT held ~1.9 GB/s from 2 to 8 readers and 1 to 16 MiB requests; buffered reads peaked with
# 2 readers (4 or 8 readers interleave the kernel's readahead streams and fall to ~1 GB/s).
DIRECT = Mode("direct", readers=4, request=4 << 20)
BUFFERED = Mode("buffered", readers=2, request=1 << 20)
CACHED = Mode("cached", readers=2, request=HASH_BLOCK)


class Policy(Protocol):
    """Chooses how cold units are read; told what each choice achieved (a seam for tests)."""

    def choose(self, device: Device, can_direct: bool) -> list[Mode]:
        """One mode to read every cold unit with, or several to compare on the first units."""

    def record(self, device: Device, results: dict[Mode, float]) -> Mode:
        """Bytes per second each compared mode achieved; returns the one to read the rest with."""


@dataclass
class Fixed:
    """Always the same mode (tests, and benchmarks that compare modes)."""

    mode: Mode

    def choose(self, device: Device, can_direct: bool) -> list[Mode]:
        return [self.mode if can_direct or self.mode.kind != "direct" else BUFFERED]

    def record(self, device: Device, results: dict[Mode, float]) -> Mode:
        return self.mode


@dataclass
class Adaptive:
    """Per device: the faster of direct and buffered reads, measured on the checkpoint being read.

    A device never measured (or measured ``retrial_every`` restores ago) gets
    both modes, compared on the file's first units; the winner is kept.
    A device that refuses O_DIRECT always reads buffered.
    """

    candidates: tuple[Mode, ...] = (DIRECT, BUFFERED)
    retrial_every: int = 16
    margin: float = 0.10
    _best: dict[Device, Mode] = field(default_factory=dict)
    _uses: dict[Device, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def choose(self, device: Device, can_direct: bool) -> list[Mode]:
        if not can_direct:
            return [BUFFERED]
        with self._lock:
            uses = self._uses.get(device, 0)
            self._uses[device] = uses + 1
            best = self._best.get(device)
        if best is None or uses % self.retrial_every == 0:
            return list(self.candidates)
        return [best]

    def record(self, device: Device, results: dict[Mode, float]) -> Mode:
        # The first candidate (direct) keeps its place unless another is clearly faster: it leaves no
        # page-cache copy of the checkpoint taking the trainer's memory, and the comparison is slanted
        # its way by at most the readahead that spills out of a buffered slice into the next one.
        first = self.candidates[0]
        best = max(results, key=results.__getitem__)
        if first in results and results[best] < results[first] * (1 + self.margin):
            best = first
        with self._lock:
            self._best[device] = best
        return best

    def best(self, device: Device) -> Mode | None:
        return self._best.get(device)


POLICY: Policy = Adaptive()
