"""The copy engine: training state -> the daemon's shared-memory arena.

The data file's image streams through the arena as a ring: file offset ``f``
of a save lands at arena offset ``(stream_base + f) % arena_size``. Bytes are
copied in file order, in pieces of at most one chunk, straight from each
tensor into an arena view of the tensor's dtype (``Tensor.copy_`` handles
strides, devices and threads). After every chunk the daemon is told how far
the copy got, so it persists while the client copies; when the ring is full
the client waits for the daemon to release space (back-pressure).

The copy does not wait for the daemon: the client knows where its previous
save ended in the stream, so it copies to the next chunk-aligned position
and tells the daemon afterwards (``BeginSave`` carries that position and the
manifest the daemon validates). It needs the daemon's answer earlier only to
report progress or to wait for space, i.e. when the state is larger than
what the ring has free.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ckptstage.client.fileplan import FilePlan
from ckptstage.client.rpc import Connection
from ckptstage.protos.v1 import ckptstage_pb2 as pb


class ArenaMap:
    """The client's mapping of its session's arena."""

    def __init__(self, info: pb.ArenaInfo) -> None:
        self.size = info.size_bytes
        self.generation = info.generation
        fd = os.open(info.path, os.O_RDWR)
        try:
            # MAP_POPULATE: fault the (already allocated) pages in now, not in the first save.
            self._map = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self.u8 = torch.frombuffer(self._map, dtype=torch.uint8)
        self._registered = False

    def register_cuda(self) -> None:
        """Pins the arena for CUDA so device-to-host copies run at DMA speed (no-op without CUDA)."""
        if self._registered or not torch.cuda.is_available():
            return
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(self.u8.data_ptr(), self.size, 0)
        self._registered = int(err) == 0

    def close(self) -> None:
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.u8.data_ptr())
            self._registered = False
        del self.u8
        try:
            self._map.close()
        except BufferError:
            pass  # a tensor view is still alive somewhere; the mapping goes with it


def ready_events(tensors: list[torch.Tensor]) -> dict[torch.device, Any]:
    """Marks, on each device's current stream, the point the snapshot must see.

    Called on the trainer's thread inside ``save()``: the side streams that
    copy wait for these events, so they read the values as of ``save()`` even
    though the trainer's stream has kernels still queued.
    """
    events: dict[torch.device, Any] = {}
    for t in tensors:
        if t.is_cuda and t.device not in events:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(t.device))
            events[t.device] = ev
    return events


class _SideStreams:
    """One CUDA side stream per device, so device-to-host copies overlap the trainer's kernels."""

    def __init__(self, ready: dict[torch.device, Any]) -> None:
        self._ready = ready
        self._streams: dict[torch.device, Any] = {}

    def context(self, t: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
        if not t.is_cuda:
            return contextlib.nullcontext()
        stream = self._streams.get(t.device)
        if stream is None:
            stream = torch.cuda.Stream(device=t.device)
            if t.device in self._ready:
                stream.wait_event(self._ready[t.device])
            self._streams[t.device] = stream
        return torch.cuda.stream(stream)

    def synchronize(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()


class CopyThreads:
    """How many intra-op threads the snapshot thread copies with.

    In the background (the trainer computing) one: a copy's parallel region
    beside the trainer's own stalls the trainer's OpenMP barriers whenever a
    core is short, and one thread copies at ~75% of two here. Once the
    trainer waits for the snapshot (``wait_snapshot()``, the ``protect()``
    hook), its cores are idle: the copy then uses the trainer's thread count
    for the pieces that remain.

    With torch's OpenMP backend the count is per thread (an OpenMP ICV), so
    this never changes the trainer's own. :meth:`confirm_private` checks that
    from the trainer's side and turns switching off where it is not so.
    """

    def __init__(self, full: int) -> None:
        self.full = max(1, full)
        self.enabled = self.full > 1
        self._set_in_worker = threading.Event()

    def start_background(self) -> None:
        """On the snapshot thread, once: copy with one thread from now on."""
        if self.enabled:
            torch.set_num_threads(1)
        self._set_in_worker.set()

    def confirm_private(self) -> None:
        """On the trainer's thread, after the snapshot thread started: was only that thread changed?"""
        self._set_in_worker.wait()
        if self.enabled and torch.get_num_threads() != self.full:
            torch.set_num_threads(self.full)  # a process-wide setting: restore it, never switch again
            self.enabled = False

    def set(self, n: int) -> None:
        if self.enabled:
            torch.set_num_threads(n)


@dataclass
class _Piece:
    file_off: int
    nbytes: int
    src: torch.Tensor  # flat, of the destination dtype (or the tensor itself, with its shape)


class Streamer:
    """Copies one save's file image into the arena, with back-pressure.

    ``begin`` returns the daemon's answer to this save's ``BeginSave``,
    blocking until it arrives; the streamer calls it only when it must talk
    to the daemon (streaming, or waiting for ring space).
    """

    def __init__(self, conn: Connection, arena: ArenaMap, stream_base: int, chunk_bytes: int, released: int,
                 begin: Callable[[], pb.BeginSaveResponse], ready: dict[torch.device, Any] | None = None,
                 threads: CopyThreads | None = None, urgent: threading.Event | None = None) -> None:
        self.conn = conn
        self.arena = arena
        self.base = stream_base
        self.chunk = chunk_bytes
        self.copied = 0
        self.reported = 0
        self.released = released  # what the client last heard: never more than the daemon's own
        self.stream = True
        self.cuda = _SideStreams(ready or {})
        self._begin = begin
        self._threads = threads
        self._urgent = urgent
        self._boosted = False

    def run(self, plan: FilePlan, tensors: list[torch.Tensor]) -> None:
        """Copies every byte of the file image into the ring; returns once all of it is in the arena."""
        # Snapshot first: when the whole file fits in the ring, tell the
        # daemon nothing until the copy is done, so its hashing and writing do
        # not compete with the trainer's copy for cores and memory bandwidth
        # (the trainer's blocked time is what matters). A larger state has to
        # stream: then every chunk is reported as soon as it is copied.
        if self._must_stream(plan.data_bytes):
            self._answer()  # what the client knows is stale: ask how much is really free
            self.stream = self._must_stream(plan.data_bytes)
        else:
            self.stream = False
        self._write_bytes(0, plan.header)
        order = sorted(range(len(tensors)), key=lambda i: plan.entries[i].offset)
        try:
            for i in order:
                entry, t = plan.entries[i], tensors[i]
                with self.cuda.context(t):
                    for piece in self._pieces(entry.offset, entry.nbytes, t):
                        self._boost_if_waited_for()
                        self._copy_piece(piece)
            self.cuda.synchronize()
        finally:
            if self._boosted and self._threads is not None:
                self._threads.set(1)

    def _boost_if_waited_for(self) -> None:
        if not self._boosted and self._threads is not None and self._urgent is not None and self._urgent.is_set():
            self._threads.set(self._threads.full)
            self._boosted = True

    def _must_stream(self, data_bytes: int) -> bool:
        return self.base + data_bytes - self.released > self.arena.size

    def _answer(self) -> pb.BeginSaveResponse:
        resp = self._begin()  # checked against self.base by the caller's begin (Client._began)
        self.released = max(self.released, resp.released)
        return resp

    def _pieces(self, offset: int, nbytes: int, t: torch.Tensor) -> Iterator[_Piece]:
        """Splits a tensor at chunk boundaries and at the ring's end (element-aligned both)."""
        if nbytes == 0:
            return
        spans = list(self._spans(offset, nbytes))
        if len(spans) == 1:
            yield _Piece(offset, nbytes, t)  # strided copy straight from the source
            return
        flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
        size = t.element_size()
        for start, n in spans:
            e0 = (start - offset) // size
            yield _Piece(start, n, flat[e0:e0 + n // size])

    def _spans(self, offset: int, nbytes: int) -> Iterator[tuple[int, int]]:
        end = offset + nbytes
        pos = offset
        while pos < end:
            next_chunk = (pos // self.chunk + 1) * self.chunk
            ring_end = self.arena.size - (self.base + pos) % self.arena.size
            n = min(end, next_chunk, pos + ring_end) - pos
            yield pos, n
            pos += n

    def _copy_piece(self, piece: _Piece) -> None:
        self._make_room(piece.file_off + piece.nbytes)
        a = (self.base + piece.file_off) % self.arena.size
        dst = self.arena.u8[a:a + piece.nbytes].view(piece.src.dtype)
        if piece.src.dim() != 1 or piece.src.numel() != dst.numel():
            dst = dst.view(piece.src.shape)
        dst.copy_(piece.src, non_blocking=piece.src.is_cuda)
        self._advance(piece.file_off + piece.nbytes)

    def _write_bytes(self, file_off: int, data: bytes) -> None:
        for start, n in self._spans(file_off, len(data)):
            self._make_room(start + n)
            a = (self.base + start) % self.arena.size
            self.arena.u8[a:a + n].copy_(torch.frombuffer(bytearray(data[start - file_off:start - file_off + n]),
                                                          dtype=torch.uint8))
            self._advance(start + n)

    def _make_room(self, file_end: int) -> None:
        """Blocks until the ring has space for bytes up to ``file_end``."""
        need = self.base + file_end - self.arena.size
        while need > self.released:
            self._progress(wait_released=need)

    def _advance(self, file_end: int) -> None:
        self.copied = file_end
        if self.stream and self.copied - self.reported >= self.chunk:
            self._progress(wait_released=0)

    def _progress(self, wait_released: int) -> None:
        save_id = self._answer().save_id
        if wait_released and self.released >= wait_released:
            return  # BeginSave's answer already frees enough
        self.cuda.synchronize()  # bytes reported to the daemon must really be in the arena
        resp = self.conn.call("Progress", pb.ProgressRequest(
            save_id=save_id, copied_upto=self.copied, wait_released=wait_released), timeout=60)
        self.reported = self.copied
        self.released = max(self.released, resp.released)
