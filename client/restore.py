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
read goes through :class:`ExtentFiles`, which cuts it where one file ends and
the next begins; a whole part is a single extent, so both are read, probed
and verified by the same code. Chunks begin on page boundaries, so the
aligned memory and page-aligned O_DIRECT reads above work unchanged.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import mmap
import os
import statistics
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from ckptstage.client import tree
from ckptstage.client.fileplan import dtype_from_name
from ckptstage.client.pagemem import PAGE as _PAGE
from ckptstage.client.pagemem import PageCache, Prefaulter
from ckptstage.client.readmodes import CACHED, DIRECT, HASH_BLOCK, POLICY, Device, Mode, Policy
from ckptstage.protos import chunks, layout

_UNIT = 8 << 20          # what one reader takes at a time (rounded to whole digest blocks)
_DIRECT_MIN = 1 << 20    # smaller fresh tensors go through the bounce buffer in direct mode
_MAX_IOV = 512           # buffers in one preadv (the kernel allows 1024)
_KEEP_OPEN = 8           # extents whose descriptors stay open while no read is using them


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


def read_part(part: Path, into: Any = None, policy: Policy | None = None) -> tuple[dict[str, Any], Any]:
    """Returns (manifest, state) of one part; raises :class:`layout.ManifestError` on any mismatch."""
    global last_stats
    manifest = layout.read_manifest(part)
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


class _Verifier:
    """Hashes the bytes of one unit in file order and checks each digest block as it completes."""

    def __init__(self, file: _File, lo: int) -> None:
        self.file = file
        self.pos = lo
        self.hasher = xxhash.xxh3_64()

    def feed(self, data: memoryview) -> None:
        chunk = self.file.entry.chunk_bytes
        while data:
            take = min(len(data), chunk - self.pos % chunk)
            self.hasher.update(data[:take])
            data = data[take:]
            self.pos += take
            if self.pos % chunk == 0 or self.pos == self.file.entry.size:
                self._check((self.pos - 1) // chunk)

    def _check(self, i: int) -> None:
        digest = self.hasher.hexdigest()
        self.hasher = xxhash.xxh3_64()
        want = self.file.entry.digests[i]
        if digest != want:
            bs = self.file.entry.chunk_bytes
            where = self.file.files.where(i * bs, (i + 1) * bs)  # the chunk files holding the block, if any
            raise layout.ChecksumMismatch(self.file.path, f"chunk {i} (bytes {i * bs}..) {layout.CHECKSUM} "
                                                          f"{digest} != {want}{where}")


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
        verifier = _Verifier(self, u.lo)
        if mode.kind == "direct":
            self._direct(u, verifier)
        else:
            self._buffered(CACHED.kind if mode is CACHED else "buffered", u, verifier, mode.request)
        if verifier.pos != u.hi:
            raise layout.ChecksumMismatch(self.path, f"bytes {verifier.pos}..{u.hi} were not read")
        self.files.done(u.lo, u.hi)
        with self._lock:
            self.stats.bytes[mode.kind] = self.stats.bytes.get(mode.kind, 0) + u.hi - u.lo

    def _buffered(self, kind: str, u: _Unit, verifier: _Verifier, request: int) -> None:
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
            self.files.pread_exact(kind, [s.view for s in batch], batch[0].offset)
            for s in batch:
                for at in range(0, len(s.view), HASH_BLOCK):
                    verifier.feed(s.view[at:at + HASH_BLOCK])

    def _direct(self, u: _Unit, verifier: _Verifier) -> None:
        """O_DIRECT: into windows where a tensor has one, else through the reader's bounce buffer."""
        spans = u.spans
        i = 0
        while i < len(spans):
            s = spans[i]
            if s.window is not None:
                self._direct_window(s, verifier)
                i += 1
                continue
            j, lo = i, s.offset // _PAGE * _PAGE
            while j < len(spans) and spans[j].window is None and _page_up(spans[j].end) - lo <= DIRECT.request:
                j += 1
            self._direct_bounce(spans[i:j], lo, verifier)
            i = j

    def _direct_window(self, s: _Span, verifier: _Verifier) -> None:
        assert s.window is not None
        pos = s.offset
        while pos < s.end:
            # Whole pages from the page holding pos; unit boundaries are page-aligned, so pages
            # outside [offset, end) are the window's slack, never another tensor's bytes.
            lo = pos // _PAGE * _PAGE
            hi = min(lo + DIRECT.request, _page_up(s.end))
            got = lo + self.files.pread("direct", [s.window[lo - s.base:hi - s.base]], lo)
            if got <= pos:
                raise self.files.eof(pos)
            got = min(got, s.end)
            verifier.feed(s.view[pos - s.offset:got - s.offset])
            pos = got

    def _direct_bounce(self, spans: list[_Span], lo: int, verifier: _Verifier) -> None:
        """One O_DIRECT read of the pages holding ``spans`` (consecutive), then a copy into each.

        Hashed and copied block by block, so the copy reads what the hash just brought into the CPU cache.
        """
        start, end = spans[0].offset, spans[-1].end
        bounce = self._bounce()
        self.files.pread_exact("direct", [bounce[:_page_up(end) - lo]], lo, need=end - lo)
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


# ---------------------------------------------------------------------- the files behind a data file


@dataclass
class _Handle:
    """The descriptors open on one extent's file, by kind of read."""

    fds: dict[str, int] = field(default_factory=dict)  # "buffered", "direct" (the buffered one if refused)
    cache: PageCache | None = None                      # "cached": the page-cache probe's, no readahead
    users: int = 0                                      # reads and probes using it right now
    finished: bool = False                              # no read is due any more: close when the last lets go

    def fd(self, kind: str) -> int:
        if kind == CACHED.kind:
            assert self.cache is not None
            return self.cache.fd
        return self.fds[kind]

    def close(self) -> None:
        for fd in set(self.fds.values()):
            os.close(fd)
        if self.cache is not None:
            self.cache.close()


class ExtentFiles:
    """Positional reads of a part's data file, whether stored whole or as chunks (:func:`chunks.extents`).

    A read at an offset of the data file goes to the extent holding it, at
    ``offset - base`` of that extent's file, and stops where the extent ends
    (a short read: callers go on from there). Every extent but the last
    ends on a page, so page-aligned O_DIRECT reads stay page-aligned in every
    file, and past the last one they stop at its end of file as usual.

    An extent's file is opened at its first read, one descriptor per kind of
    read: ``buffered`` (sequential readahead), ``direct`` (O_DIRECT; the
    buffered descriptor where the file system refuses it) and ``cached``
    (:class:`PageCache`: the probe's, without readahead). Its descriptors
    are closed once every range announced with :meth:`expect` that touches
    it is :meth:`done` with; and whenever more than ``keep`` extents that no
    read is using are open, the least recently used are closed (opened again
    if read again). A whole part so keeps its one file open throughout, and
    a part of a thousand chunks holds a few dozen descriptors at most.

    A file that is not there is a :class:`layout.ManifestError` caused by the
    FileNotFoundError (:func:`layout.is_verification_failure`: the copy is
    bad), one of another size than the manifest's a :class:`layout.ChecksumMismatch`;
    other errors (EMFILE, EACCES: the process's own trouble) are raised as
    they are. Thread-safe.
    """

    def __init__(self, path: Path, extents: Sequence[chunks.Extent], keep: int = _KEEP_OPEN) -> None:
        self.path = path  # the data file the extents make up (the reads' errors name it, or its chunks)
        self.extents = list(extents)
        self._starts = [e.lo for e in self.extents]
        self._keep = keep
        self._due = [0] * len(self.extents)  # ranges expected and not done yet, per extent
        self._open: OrderedDict[int, _Handle] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    @property
    def chunked(self) -> bool:
        """Whether the data file is kept as chunks (not as the file itself)."""
        return any(e.path != self.path for e in self.extents)

    def index(self, offset: int) -> int:
        """The extent holding ``offset``."""
        return max(0, bisect.bisect_right(self._starts, offset) - 1)

    def _range(self, lo: int, hi: int) -> range:
        return range(self.index(lo), self.index(max(lo, hi - 1)) + 1) if self.extents else range(0)

    def where(self, lo: int, hi: int) -> str:
        """`` in <chunk files>`` when bytes [lo, hi) are kept in chunks (for error messages), else nothing."""
        paths = [str(self.extents[i].path) for i in self._range(lo, hi) if self.extents[i].path != self.path]
        return f" in {', '.join(paths)}" if paths else ""

    def first(self) -> tuple[int, bool]:
        """(device, whether it takes O_DIRECT) of the first extent's file, opened and its size checked."""
        if not self.extents:
            return os.stat(self.path.parent).st_dev, False
        h = self._acquire(0, "direct")
        try:
            return os.fstat(h.fds["direct"]).st_dev, h.fds["direct"] != h.fds.get("buffered")
        finally:
            self._let_go(0)

    # ------------------------------------------------------------------ reads

    def pread(self, kind: str, views: list[memoryview], offset: int) -> int:
        """One preadv of ``views`` at ``offset``, up to the end of the extent holding it; bytes read."""
        if not self.extents:
            return 0
        i = self.index(offset) if len(self._starts) > 1 else 0
        e = self.extents[i]
        room = _page_up(e.hi) - offset
        if room <= 0:
            return 0
        if sum(len(v) for v in views) > room:
            views = _head(views, room)
        h = self._acquire(i, kind)
        try:
            return os.preadv(h.fd(kind), views, offset - e.base)
        finally:
            self._let_go(i)

    def pread_exact(self, kind: str, views: list[memoryview], offset: int, need: int | None = None) -> None:
        """Reads until ``need`` bytes (all of ``views`` by default) are in; an end of file before is an error."""
        total = sum(len(v) for v in views) if need is None else need
        done = 0
        while done < total:
            n = self.pread(kind, _skip(views, done), offset + done)
            if n <= 0:
                raise self.eof(offset + done)
            done += n

    def eof(self, offset: int) -> layout.ChecksumMismatch:
        """The error for a file that ends before byte ``offset`` of the data file."""
        e = self.extents[self.index(offset)] if self.extents else chunks.Extent(0, 0, self.path, 0)
        return layout.ChecksumMismatch(e.path, f"unexpected end of file at byte {offset - e.base}")

    def cached(self, lo: int, hi: int) -> bool:
        """Whether at least half of bytes [lo, hi) are in the page cache (:meth:`PageCache.cached`)."""
        got = 0
        for i in self._range(lo, hi):
            e = self.extents[i]
            h = self._acquire(i, CACHED.kind)
            try:
                assert h.cache is not None
                got += h.cache.cached_bytes(max(lo, e.lo) - e.base, min(hi, e.hi) - e.base)
            finally:
                self._let_go(i)
        return got * 2 >= hi - lo

    # ------------------------------------------------------------------ descriptors

    def expect(self, lo: int, hi: int) -> None:
        """Bytes [lo, hi) will be read, and then :meth:`done` with: their files stay open until then."""
        for i in self._range(lo, hi):
            self._due[i] += 1

    def done(self, lo: int, hi: int) -> None:
        """Bytes [lo, hi) are read: the files that no other expected range needs are closed."""
        with self._lock:
            for i in self._range(lo, hi):
                self._due[i] -= 1
                h = self._open.get(i)
                if self._due[i] == 0 and h is not None:
                    h.finished = True
                    if not h.users:
                        self._open.pop(i).close()

    def close(self) -> None:
        with self._lock:
            while self._open:
                self._open.popitem()[1].close()

    def _acquire(self, i: int, kind: str) -> _Handle:
        """Extent ``i``'s descriptors with one of ``kind`` among them, marked in use until :meth:`_let_go`."""
        with self._lock:
            h = self._open.get(i)
            if h is None:
                h = self._open[i] = _Handle()
            elif len(self._open) > 1:
                self._open.move_to_end(i)
            h.users += 1
            if kind in h.fds or (kind == CACHED.kind and h.cache is not None):
                return h
            try:
                self._ensure(self.extents[i], h, kind)
            except BaseException:
                h.users -= 1
                if not h.users and not h.fds and h.cache is None:
                    del self._open[i]
                raise
            self._trim()
            return h

    def _let_go(self, i: int) -> None:
        with self._lock:
            h = self._open[i]
            h.users -= 1
            if not h.users and h.finished:
                self._open.pop(i).close()
            elif len(self._open) > self._keep:
                self._trim()

    def _trim(self) -> None:
        """Closes the least recently used extents no read is using, down to ``keep`` of them (under the lock)."""
        idle = [i for i, h in self._open.items() if not h.users]
        for i in idle[:max(0, len(idle) - self._keep)]:
            self._open.pop(i).close()

    @staticmethod
    def _ensure(e: chunks.Extent, h: _Handle, kind: str) -> None:
        if kind == CACHED.kind:
            if h.cache is None:
                fd = _open_extent(e, os.O_RDONLY)
                try:
                    h.cache = PageCache(e.path, fd=fd)
                except BaseException:
                    os.close(fd)
                    raise
        elif kind not in h.fds:
            if kind == "direct":
                try:
                    h.fds[kind] = _open_extent(e, os.O_RDONLY | os.O_DIRECT)
                except OSError as err:
                    if err.errno != errno.EINVAL:  # tmpfs (before Linux 6.6) and some others refuse O_DIRECT
                        raise
                    ExtentFiles._ensure(e, h, "buffered")
                    h.fds[kind] = h.fds["buffered"]
            else:
                fd = h.fds[kind] = _open_extent(e, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)


def _open_extent(e: chunks.Extent, flags: int) -> int:
    """A descriptor of the extent's file, whose size the manifest's must be."""
    try:
        fd = os.open(e.path, flags)
    except FileNotFoundError as err:
        raise layout.ManifestError(f"{e.path}: missing ({err.strerror})") from err
    try:
        size = os.fstat(fd).st_size
        if size != e.hi - e.base:
            raise layout.ChecksumMismatch(e.path, f"size {size} != {e.hi - e.base} in the manifest")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _head(views: list[memoryview], n: int) -> list[memoryview]:
    """The first ``n`` bytes of ``views``."""
    out = []
    for v in views:
        if n <= 0:
            break
        out.append(v[:n] if len(v) > n else v)
        n -= len(v)
    return out

def _skip(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` without their first ``n`` bytes."""
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out


def _page_up(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


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

