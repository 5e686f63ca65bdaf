"""Reading a committed part back: one pass that reads, verifies and places every byte.

The data file is read straight into each tensor's own storage (freshly
allocated, or the caller's ``into=`` tensors), every byte hashed on the way
and each block's digest compared with the manifest (invariant 7); on any
mismatch nothing is returned.

The file is cut into *units* (8 MiB, whole digest blocks) that a few reader
threads take in file order. Each unit is read one of three ways:

* **cached** — most of its pages are in the page cache
  (:class:`pagemem.PageCache`): ordinary reads, since copying from memory
  beats any disk;
* **direct** — ``O_DIRECT``: large freshly allocated tensors get storage a
  few pages larger than the tensor, placed so that memory and file share
  their alignment within a page, and the disk writes into the tensor itself;
  everything else in the unit (small tensors, ``into=`` targets, the header)
  is read into the reader's page-aligned bounce buffer and copied out. No
  page-cache copy of the checkpoint is made;
* **buffered** — ordinary reads through the page cache, with kernel readahead.

Which of direct and buffered reads cold data faster is measured per device,
not assumed (:mod:`ckptstage.client.readmodes`); file systems that refuse
``O_DIRECT`` are read buffered. Fresh tensors' pages are mapped ahead of the
readers by :class:`pagemem.Prefaulter`.
docs/ARCHITECTURE.md ("Restore") gives the measurements behind the choices.

A part written incrementally has no data file of its own: its bytes are
chunk files in the job's chunk store (:mod:`ckptstage.protos.chunks`). Every
read goes through :class:`~ckptstage.client.extentfiles.ExtentFiles`, which cuts it where one file ends and
the next begins; a whole part is a single extent, so both are read, probed
and verified by the same code. Chunks begin on page boundaries, so the
aligned memory and page-aligned O_DIRECT reads above work unchanged.
"""

from __future__ import annotations

import mmap
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptstage.client import tree
from ckptstage.client.extentfiles import ExtentFiles, Pass, page_up
from ckptstage.client.fileplan import dtype_from_name
from ckptstage.client.pagemem import PAGE as _PAGE
from ckptstage.client.pagemem import Prefaulter
from ckptstage.client.readmodes import CACHED, DIRECT, HASH_BLOCK, POLICY, Device, Mode, Policy
from ckptstage.protos import chunks, layout

_UNIT = 8 << 20          # what one reader takes at a time (rounded to whole digest blocks)
_DIRECT_MIN = 1 << 20    # smaller fresh tensors go through the bounce buffer in direct mode
_MAX_IOV = 512           # buffers in one preadv (the kernel allows 1024)


_TRIAL_UNITS = 4        # units per slice of a comparison: one per direct reader
_TRIAL_ROUNDS = 2       # rounds (modes alternate, so a drift in the disk's speed hits both)


@dataclass
class _Span:
    """Bytes of the file at ``offset`` and where they go."""

    offset: int
    view: memoryview                 # exactly the tensor's (or the header's) bytes
    window: memoryview | None = None  # page-aligned memory that holds file offset ``base`` at index 0
    base: int = 0

    @property
    def end(self) -> int:
        return self.offset + len(self.view)

    def region(self) -> tuple[int, int]:
        """(address, length) of the memory the span's reads land in."""
        mem = self.window if self.window is not None else self.view
        return int(np.frombuffer(mem, np.uint8).ctypes.data), len(mem)

    def cut(self, start: int, n: int) -> _Span:
        return _Span(start, self.view[start - self.offset:start - self.offset + n], self.window, self.base)


@dataclass
class _Unit:
    lo: int
    hi: int
    spans: list[_Span]   # in file order, covering [lo, hi) exactly


@dataclass
class Stats:
    """What one :func:`read_part` did: bytes per mode, the comparison it ran (if any), the mode kept."""

    bytes: dict[str, int] = field(default_factory=dict)
    trial: dict[str, float] = field(default_factory=dict)  # mode kind -> bytes/s
    chosen: str = ""


last_stats = Stats()  # the most recent read_part's, for benchmarks and tests


def read_part(part: Path, into: Any = None, policy: Policy | None = None,
              committed: str = "") -> tuple[dict[str, Any], Any]:
    """Returns (manifest, state) of one part; raises :class:`layout.ManifestError` on any mismatch.
    ``committed``: the manifest's digest as the step's commit record names it (Locate says it)."""
    global last_stats
    manifest = layout.read_manifest(part, committed)
    entry = layout.manifest_files(manifest).get(layout.DATA_FILE)
    if entry is None:
        raise layout.ManifestError(f"{part}: manifest lists no {layout.DATA_FILE}")
    path = part / layout.DATA_FILE
    entries = [layout.TensorEntry.from_json(t) for t in manifest["tensors"]]
    data_start = int(manifest["data_start"])
    layout.validate_tensor_table(entries, data_start, entry.size)
    if len(entry.digests) != layout.chunk_count(entry.size, entry.chunk_bytes):
        raise layout.ChecksumMismatch(path, "the manifest's chunk list does not cover the file")
    targets = _targets(into, len(entries))
    files = ExtentFiles(path, chunks.extents(part, manifest))
    try:
        device, can_direct = files.first()
        key: Device = (device, "chunks") if files.chunked else device  # each kind of part measured apart
        placed = [_destination(e, targets[i] if targets else None, can_direct) for i, e in enumerate(entries)]
        spans = [_Span(0, memoryview(bytearray(data_start)))] + [s for _, s in placed if s is not None]
        if sum(len(s.view) for s in spans) != entry.size:
            raise layout.ManifestError(f"{path}: the tensors do not cover the file exactly")
        units = _units(sorted(spans, key=lambda s: s.offset), entry.chunk_bytes)
        for u in units:
            files.expect(u.lo, u.hi)
        stats = Stats()
        fresh = [s for i, (d, s) in enumerate(placed)
                 if s is not None and len(s.view) >= _DIRECT_MIN and (targets is None or d is not targets[i])]
        file = _File(path, files, entry, stats)
        with Prefaulter([s.region() for s in sorted(fresh, key=lambda s: s.offset)]):
            file.read(units, key, can_direct, policy or POLICY)
        last_stats = stats
    finally:
        files.close()
    out = [_finish(d, targets[i] if targets else None) for i, (d, _) in enumerate(placed)]
    state = tree.unflatten(manifest["tree"], out.__getitem__)
    return manifest, state


def _destination(t: layout.TensorEntry, target: torch.Tensor | None,
                 direct: bool) -> tuple[torch.Tensor, _Span | None]:
    """The CPU tensor the bytes are read into (the caller's own when it can take them directly)."""
    dtype = dtype_from_name(t.dtype)
    if target is not None:
        if target.dtype != dtype or tuple(target.shape) != t.shape:
            raise ValueError(f"into= tensor for {t.name!r} is {target.dtype} {tuple(target.shape)}, "
                             f"the checkpoint has {dtype} {t.shape}")
        if target.device.type == "cpu" and target.is_contiguous():
            return target, _span_of(t, target)
    elif direct and t.nbytes >= _DIRECT_MIN:
        # Storage whose memory is aligned like the file: page p of the window is page p of the file range.
        base = t.offset // _PAGE * _PAGE
        end = -(-(t.offset + t.nbytes) // _PAGE) * _PAGE
        raw = torch.empty(end - base + _PAGE, dtype=torch.uint8)
        pad = -raw.data_ptr() % _PAGE
        window = raw[pad:pad + end - base]
        dest = window[t.offset - base:t.offset - base + t.nbytes].view(dtype).view(t.shape)
        span = _Span(t.offset, bytes_of(dest), memoryview(window.numpy()), base)  # type: ignore[arg-type]
        return dest, span
    dest = torch.empty(t.shape, dtype=dtype)
    return dest, _span_of(t, dest)


def _span_of(t: layout.TensorEntry, dest: torch.Tensor) -> _Span | None:
    return _Span(t.offset, bytes_of(dest)) if t.nbytes else None


def _finish(dest: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    if target is None or target is dest:
        return dest
    target.copy_(dest)  # a CUDA or strided target
    return target


def bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place (what a read fills)."""
    return memoryview(t.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def _units(spans: list[_Span], chunk: int) -> list[_Unit]:
    """Cuts the file's spans into units of whole digest blocks, in file order.

    Spans without a window (read through a bounce buffer in direct mode) are
    also cut at every ``DIRECT.request`` boundary, so each piece fits one.
    """
    unit = max(chunk, _UNIT // chunk * chunk)
    units: list[_Unit] = []
    for span in spans:
        offset = span.offset
        while offset < span.end:
            i = offset // unit
            stop = min(span.end, (i + 1) * unit)
            if span.window is None:
                stop = min(stop, (offset // DIRECT.request + 1) * DIRECT.request)
            if not units or units[-1].lo != i * unit:
                units.append(_Unit(i * unit, i * unit, []))
            units[-1].spans.append(span.cut(offset, stop - offset))
            units[-1].hi = stop
            offset = stop
    return units


class _File:
    """One read_part's data file: its extents' descriptors, its digests, and the reader threads' bounce buffers."""

    def __init__(self, path: Path, files: ExtentFiles, entry: layout.FileEntry, stats: Stats) -> None:
        self.path = path
        self.files = files
        self.entry = entry
        self.stats = stats
        self._local = threading.local()
        self._failed = threading.Event()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ scheduling

    def read(self, units: list[_Unit], device: Device, can_direct: bool, policy: Policy) -> None:
        """Reads every unit: cached ones through the cache, cold ones the way ``policy`` says (or finds)."""
        modes = policy.choose(device, can_direct)
        with ThreadPoolExecutor(max_workers=max(m.readers for m in modes)) as pool:
            todo = iter(units)
            if len(modes) > 1:
                whole = len(modes) * _TRIAL_UNITS * _TRIAL_ROUNDS
                trial = _take(todo, whole)
                # A comparison needs every mode's slices; a small file (or cached data) says nothing.
                if len(trial) == whole and not self.files.cached(trial[0].lo, trial[0].hi):
                    rates = self._compare(pool, trial, modes)
                    self.stats.trial = {m.kind: r for m, r in rates.items()}
                    modes = [policy.record(device, rates)]
                else:  # decide another time
                    self._run(pool, trial, modes[0])
                    modes = modes[:1]
            self.stats.chosen = modes[0].kind
            self._run(pool, list(todo), modes[0])

    def _compare(self, pool: ThreadPoolExecutor, trial: list[_Unit], modes: list[Mode]) -> dict[Mode, float]:
        """Reads ``trial`` in slices of _TRIAL_UNITS units, the modes taking turns in an ABBA order (a
        drift in the disk's speed, or one mode's readahead spilling into the next slice, hits both);
        returns the median bytes/s of each mode over its slices."""
        spent: dict[Mode, list[float]] = {m: [] for m in modes}
        slices = [trial[k:k + _TRIAL_UNITS] for k in range(0, len(trial), _TRIAL_UNITS)]
        for k, piece in enumerate(slices):
            turn = k % (2 * len(modes))
            mode = modes[turn if turn < len(modes) else 2 * len(modes) - 1 - turn]
            t0 = time.perf_counter()
            self._run(pool, piece, mode)
            spent[mode].append(sum(u.hi - u.lo for u in piece) / max(time.perf_counter() - t0, 1e-9))
        return {m: statistics.median(r) if r else 0.0 for m, r in spent.items()}

    def _run(self, pool: ThreadPoolExecutor, units: Sequence[_Unit], cold: Mode) -> None:
        if not units:
            return
        it = iter(units)
        lock = threading.Lock()

        def worker() -> None:
            while not self._failed.is_set():
                with lock:
                    u = next(it, None)
                if u is None:
                    return
                try:
                    # Only direct reads ask: buffered ones take cached pages from the cache anyway.
                    cached = cold.kind == "direct" and self.files.cached(u.lo, u.hi)
                    self._unit(u, CACHED if cached else cold)
                except BaseException:
                    self._failed.set()  # the other readers stop at their next unit
                    raise

        # preadv and xxhash release the GIL: units are read (and verified) in parallel.
        for f in [pool.submit(worker) for _ in range(min(cold.readers, len(units)))]:
            f.result()

    # ------------------------------------------------------------------ one unit

    def _unit(self, u: _Unit, mode: Mode) -> None:
        verifier = layout.BlockVerifier(self.entry, self.path, u.lo, self.files.where)
        io = self.files.pass_over(u.lo, u.hi)
        if mode.kind == "direct":
            self._direct(io, u, verifier)
        else:
            self._buffered(io, CACHED.kind if mode is CACHED else "buffered", u, verifier, mode.request)
        verifier.finish(u.hi)
        io.close()
        with self._lock:
            self.stats.bytes[mode.kind] = self.stats.bytes.get(mode.kind, 0) + u.hi - u.lo

    def _buffered(self, io: Pass, kind: str, u: _Unit, verifier: layout.BlockVerifier, request: int) -> None:
        """preadv through the page cache into the spans' own bytes, ``request`` bytes per call."""
        pending = list(u.spans)
        while pending:
            batch: list[_Span] = []
            size = 0
            while pending and size < request and len(batch) < _MAX_IOV:
                s = pending[0]
                take = min(len(s.view), request - size)
                batch.append(s.cut(s.offset, take))
                pending[0] = s.cut(s.offset + take, len(s.view) - take)
                if not pending[0].view:
                    pending.pop(0)
                size += take
            io.pread_exact(kind, [s.view for s in batch], batch[0].offset)
            for s in batch:
                for at in range(0, len(s.view), HASH_BLOCK):
                    verifier.feed(s.view[at:at + HASH_BLOCK])

    def _direct(self, io: Pass, u: _Unit, verifier: layout.BlockVerifier) -> None:
        """O_DIRECT: into windows where a tensor has one, else through the reader's bounce buffer."""
        spans = u.spans
        i = 0
        while i < len(spans):
            s = spans[i]
            if s.window is not None:
                self._direct_window(io, s, verifier)
                i += 1
                continue
            j, lo = i, s.offset // _PAGE * _PAGE
            while j < len(spans) and spans[j].window is None and page_up(spans[j].end) - lo <= DIRECT.request:
                j += 1
            self._direct_bounce(io, spans[i:j], lo, verifier)
            i = j

    def _direct_window(self, io: Pass, s: _Span, verifier: layout.BlockVerifier) -> None:
        assert s.window is not None
        pos = s.offset
        while pos < s.end:
            # Whole pages from the page holding pos; unit boundaries are page-aligned, so pages
            # outside [offset, end) are the window's slack, never another tensor's bytes.
            lo = pos // _PAGE * _PAGE
            hi = min(lo + DIRECT.request, page_up(s.end))
            got = lo + io.pread("direct", [s.window[lo - s.base:hi - s.base]], lo)
            if got <= pos:
                raise self.files.eof(pos)
            got = min(got, s.end)
            verifier.feed(s.view[pos - s.offset:got - s.offset])
            pos = got

    def _direct_bounce(self, io: Pass, spans: list[_Span], lo: int, verifier: layout.BlockVerifier) -> None:
        """One O_DIRECT read of the pages holding ``spans`` (consecutive), then a copy into each.

        Hashed and copied block by block, so the copy reads what the hash just brought into the CPU cache.
        """
        start, end = spans[0].offset, spans[-1].end
        bounce = self._bounce()
        io.pread_exact("direct", [bounce[:page_up(end) - lo]], lo, need=end - lo)
        k = 0
        for at in range(start, end, HASH_BLOCK):
            stop = min(end, at + HASH_BLOCK)
            verifier.feed(bounce[at - lo:stop - lo])
            while k < len(spans) and spans[k].offset < stop:
                s = spans[k]
                a, b = max(at, s.offset), min(stop, s.end)
                dst, src = s.view[a - s.offset:b - s.offset], bounce[a - lo:b - lo]
                if b - a >= 64 << 10:  # numpy copies without the GIL
                    np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
                else:
                    dst[:] = src
                if s.end > stop:
                    break
                k += 1

    def _bounce(self) -> memoryview:
        """This reader thread's page-aligned buffer (an anonymous mapping: aligned, faulted in once)."""
        buf = getattr(self._local, "bounce", None)
        if buf is None:
            buf = self._local.bounce = memoryview(mmap.mmap(-1, DIRECT.request))
        return buf


def _take(it: Iterator[_Unit], n: int) -> list[_Unit]:
    out = []
    for _ in range(n):
        u = next(it, None)
        if u is None:
            break
        out.append(u)
    return out


def _targets(into: Any, n: int) -> list[torch.Tensor] | None:
    if into is None:
        return None
    _, tensors, _ = tree.flatten(into)
    if len(tensors) != n:
        raise ValueError(f"into= has {len(tensors)} tensors, the checkpoint has {n}")
    return tensors

