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
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptstage.client import tree
from ckptstage.client.fileplan import dtype_from_name
from ckptstage.client.pagemem import PAGE as _PAGE
from ckptstage.client.pagemem import PageCache, Prefaulter
from ckptstage.client.readmodes import CACHED, DIRECT, HASH_BLOCK, POLICY, Device, Mode, Policy
from ckptstage.protos import chunks, layout

_UNIT = 8 << 20          # what one reader takes at a time (rounded to whole digest blocks)
_DIRECT_MIN = 1 << 20    # smaller fresh tensors go through the bounce buffer in direct mode
_MAX_IOV = 512           # buffers in one preadv (the kernel allows 1024)
_PROBE_EXTENTS = 8       # a unit's chunk files asked whether it is cached, at most (the largest)


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

    def _buffered(self, io: _Pass, kind: str, u: _Unit, verifier: layout.BlockVerifier, request: int) -> None:
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

    def _direct(self, io: _Pass, u: _Unit, verifier: layout.BlockVerifier) -> None:
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
            while j < len(spans) and spans[j].window is None and _page_up(spans[j].end) - lo <= DIRECT.request:
                j += 1
            self._direct_bounce(io, spans[i:j], lo, verifier)
            i = j

    def _direct_window(self, io: _Pass, s: _Span, verifier: layout.BlockVerifier) -> None:
        assert s.window is not None
        pos = s.offset
        while pos < s.end:
            # Whole pages from the page holding pos; unit boundaries are page-aligned, so pages
            # outside [offset, end) are the window's slack, never another tensor's bytes.
            lo = pos // _PAGE * _PAGE
            hi = min(lo + DIRECT.request, _page_up(s.end))
            got = lo + io.pread("direct", [s.window[lo - s.base:hi - s.base]], lo)
            if got <= pos:
                raise self.files.eof(pos)
            got = min(got, s.end)
            verifier.feed(s.view[pos - s.offset:got - s.offset])
            pos = got

    def _direct_bounce(self, io: _Pass, spans: list[_Span], lo: int, verifier: layout.BlockVerifier) -> None:
        """One O_DIRECT read of the pages holding ``spans`` (consecutive), then a copy into each.

        Hashed and copied block by block, so the copy reads what the hash just brought into the CPU cache.
        """
        start, end = spans[0].offset, spans[-1].end
        bounce = self._bounce()
        io.pread_exact("direct", [bounce[:_page_up(end) - lo]], lo, need=end - lo)
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

    # "buffered", "direct" (the buffered one where O_DIRECT is refused), "cached" (the probe's, no readahead)
    fds: dict[str, int] = field(default_factory=dict)
    cache: PageCache | None = None  # the probe, on fds["cached"]
    users: int = 0                  # reads using it right now (counted only where extents are closed for room)
    finished: bool = False          # no read is due any more: closed when the last user lets go
    checked: bool = False           # its file's size is the manifest's

    def close(self) -> None:
        for fd in set(self.fds.values()):
            os.close(fd)


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
    (:class:`PageCache`, the probe's: no readahead). When they are closed:

    * ``keep=None`` (a restore, which knows its reads in advance): once no
      read is due. Every range to be read is announced with :meth:`expect`;
      a :meth:`pass_over` it lets go of each extent as its reads move past,
      and an extent that every announced range has let go of is closed. What
      is open is the readers' current extents and the few that a probe
      (:meth:`cached`) of the range a reader takes next opened, and reads
      take no lock once a file is open (none is closed under a read).
    * ``keep=N`` (reads in no known order): the least recently used extents
      that no read is using are closed whenever more than ``N`` are open.

    A whole part keeps its one file open while it is read either way; a part
    of a thousand chunks holds a few dozen descriptors at most.

    A file that is not there is a :class:`layout.ManifestError` caused by the
    FileNotFoundError (:func:`layout.is_verification_failure`: the copy is
    bad), one of another size than the manifest's a :class:`layout.ChecksumMismatch`;
    other errors (EMFILE, EACCES: the process's own trouble) are raised as
    they are. Thread-safe.
    """

    def __init__(self, path: Path, extents: Sequence[chunks.Extent], keep: int | None = None) -> None:
        self.path = path  # the data file the extents make up (the reads' errors name it, or its chunks)
        self.extents = list(extents)
        self._starts = [e.lo for e in self.extents]
        self._keep = keep
        # No use counts where no extent is ever closed for room: all are kept, or closed only when due.
        self._counted = keep is not None and len(self.extents) > keep
        self._due = [0] * len(self.extents)  # announced ranges that have not let go of each extent yet
        self._open: OrderedDict[int, _Handle] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    @property
    def chunked(self) -> bool:
        """Whether the data file is kept as chunks (not as the file itself)."""
        return any(e.path != self.path for e in self.extents)

    def index(self, offset: int) -> int:
        """The extent holding ``offset``."""
        if len(self._starts) == 1:
            return 0
        return max(0, bisect.bisect_right(self._starts, offset) - 1)

    def _range(self, lo: int, hi: int) -> range:
        return range(self.index(lo), self.index(max(lo, hi - 1)) + 1) if self.extents else range(0)

    def where(self, lo: int, hi: int) -> str:
        """`` (chunk files: <paths>)`` when bytes [lo, hi) are kept in chunks (for error messages), else nothing
        (a :data:`layout.Locate`)."""
        paths = [str(self.extents[i].path) for i in self._range(lo, hi) if self.extents[i].path != self.path]
        return f" (chunk files: {', '.join(paths)})" if paths else ""

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

    def pread(self, kind: str, views: list[memoryview], offset: int, size: int = -1, io: _Pass | None = None) -> int:
        """One preadv of ``views`` (``size`` bytes, if the caller knows) at ``offset``, up to the end of the
        extent holding it; bytes read. ``io``: the pass it is part of, which lets go of the extents before."""
        if not self.extents:
            return 0
        i = self.index(offset)
        if io is not None and io.next < i:
            io.past(i)
        e = self.extents[i]
        room = _page_up(e.hi) - offset
        if (size if size >= 0 else sum(len(v) for v in views)) > room:
            if room <= 0:
                return 0
            views = _head(views, room)
        if self._counted:
            h = self._acquire(i, kind)
            try:
                return os.preadv(h.fds[kind], views, offset - e.base)
            finally:
                self._let_go(i)
        # Nothing closes an extent under a read here: no use count, and no lock once its file is open.
        found = self._open.get(i)
        fd = found.fds.get(kind) if found is not None else None
        if fd is None:
            fd = self._acquire(i, kind).fds[kind]
            self._let_go(i)
        return os.preadv(fd, views, offset - e.base)

    def pread_exact(self, kind: str, views: list[memoryview], offset: int, need: int | None = None) -> None:
        """Reads until ``need`` bytes (all of ``views`` by default) are in; an end of file before is an error."""
        _read_exact(self.pread, self.eof, kind, views, offset, need)

    def eof(self, offset: int) -> layout.ChecksumMismatch:
        """The error for a file that ends before byte ``offset`` of the data file."""
        e = self.extents[self.index(offset)] if self.extents else chunks.Extent(0, 0, self.path, 0)
        return layout.ChecksumMismatch(e.path, f"unexpected end of file at byte {offset - e.base}")

    def cached(self, lo: int, hi: int) -> bool:
        """Whether at least half of bytes [lo, hi) are in the page cache (:meth:`PageCache.cached`).

        Asked of the range's :data:`_PROBE_EXTENTS` largest extents at most
        (all of a whole file's range), through their ``cached`` descriptors,
        which cached reads of the range then use.
        """
        parts = [(min(hi, self.extents[i].hi) - max(lo, self.extents[i].lo), i) for i in self._range(lo, hi)]
        if len(parts) > _PROBE_EXTENTS:
            parts = sorted(parts, reverse=True)[:_PROBE_EXTENTS]
        got = 0
        for _, i in parts:
            e = self.extents[i]
            h = self._acquire(i, CACHED.kind)
            try:
                assert h.cache is not None
                got += h.cache.cached_bytes(max(lo, e.lo) - e.base, min(hi, e.hi) - e.base)
            finally:
                self._let_go(i)
        return got * 2 >= sum(n for n, _ in parts)

    # ------------------------------------------------------------------ descriptors

    def expect(self, lo: int, hi: int) -> None:
        """Bytes [lo, hi) will be read in one :meth:`pass_over`: their files stay open until it lets go."""
        for i in self._range(lo, hi):
            self._due[i] += 1

    def pass_over(self, lo: int, hi: int) -> _Pass:
        """The reads of an expected range, in file order; :meth:`_Pass.close` it when they are done."""
        return _Pass(self, lo, hi)

    def _release(self, i: int) -> None:
        """One announced range is past extent ``i``: closed once none is due."""
        with self._lock:
            self._due[i] -= 1
            h = self._open.get(i)
            if self._due[i] or h is None:
                return
            h.finished = True
            if h.users:
                return  # a probe: it closes them as it lets go
            del self._open[i]
        h.close()

    def close(self) -> None:
        with self._lock:
            handles = list(self._open.values())
            self._open.clear()
        for h in handles:
            h.close()

    # Descriptors are opened and closed outside the lock: readers on other extents never wait for a system call.

    def _acquire(self, i: int, kind: str | None) -> _Handle:
        """Extent ``i``'s descriptors (with one for ``kind`` among them), in use until :meth:`_let_go`."""
        with self._lock:
            h = self._open.get(i)
            if h is None:
                h = self._open[i] = _Handle()
            elif len(self._open) > 1:
                self._open.move_to_end(i)
            h.users += 1
            if kind is None or kind in h.fds:
                return h
            check = not h.checked
        try:
            fd, cache, refused = _open_kind(self.extents[i], kind, check)
        except BaseException:
            self._let_go(i)
            raise
        spare: list[_Handle] = []
        with self._lock:
            h.checked = True
            if kind in h.fds:  # another reader opened it meanwhile
                spare.append(_Handle({kind: fd}))
            elif refused and "buffered" in h.fds:  # O_DIRECT refused: the buffered descriptor reads for it
                spare.append(_Handle({kind: fd}))
                h.fds[kind] = h.fds["buffered"]
            else:
                h.fds[kind] = fd
                if refused:
                    h.fds["buffered"] = fd
                if cache is not None:
                    h.cache = cache
            spare += self._trim()
        for x in spare:
            x.close()
        return h

    def _let_go(self, i: int) -> None:
        with self._lock:
            h = self._open[i]
            h.users -= 1
            if not h.users and (h.finished or not h.fds):
                del self._open[i]
                spare = [h]
            else:
                spare = self._trim()
        for x in spare:
            x.close()

    def _trim(self) -> list[_Handle]:
        """Takes out the least recently used extents no read is using, down to ``keep`` of them (under the
        lock); the caller closes them."""
        if self._keep is None or len(self._open) <= self._keep:
            return []
        idle = [i for i, h in self._open.items() if not h.users]
        return [self._open.pop(i) for i in idle[:max(0, len(idle) - self._keep)]]


class _Pass:
    """The reads of one expected range of an :class:`ExtentFiles`, in file order: each extent is let go
    of as soon as a read begins past it, and the rest at :meth:`close`."""

    def __init__(self, files: ExtentFiles, lo: int, hi: int) -> None:
        self.files = files
        self.next, self._last = (files.index(lo), files.index(max(lo, hi - 1))) if files.extents else (0, -1)

    def past(self, i: int) -> None:
        """The reads have moved on to extent ``i``: lets go of those before it."""
        while self.next < i:
            self.files._release(self.next)
            self.next += 1

    def pread(self, kind: str, views: list[memoryview], offset: int, size: int = -1) -> int:
        return self.files.pread(kind, views, offset, size, self)

    def pread_exact(self, kind: str, views: list[memoryview], offset: int, need: int | None = None) -> None:
        _read_exact(self.pread, self.files.eof, kind, views, offset, need)

    def close(self) -> None:
        self.past(self._last + 1)


def _read_exact(pread: Callable[[str, list[memoryview], int, int], int],
                eof: Callable[[int], layout.ChecksumMismatch], kind: str, views: list[memoryview], offset: int,
                need: int | None) -> None:
    """``pread`` until ``need`` bytes (all of ``views`` by default) are in; an end of file before is ``eof``."""
    size = sum(len(v) for v in views)
    total = size if need is None else need
    done = 0
    while done < total:
        n = pread(kind, _skip(views, done) if done else views, offset + done, size - done)
        if n <= 0:
            raise eof(offset + done)
        done += n


def _open_kind(e: chunks.Extent, kind: str, check: bool) -> tuple[int, PageCache | None, bool]:
    """A new descriptor of extent ``e``'s file for reads of ``kind``: (it, its probe for "cached", whether
    O_DIRECT was refused and it is a buffered one instead)."""
    refused = False
    if kind == "direct":
        try:
            return _open_extent(e, os.O_RDONLY | os.O_DIRECT, check), None, False
        except OSError as err:
            if err.errno != errno.EINVAL:  # tmpfs (before Linux 6.6) and some others refuse O_DIRECT
                raise
        refused = True
    fd = _open_extent(e, os.O_RDONLY, check)
    try:
        if kind == CACHED.kind:
            return fd, PageCache(e.path, fd=fd), False  # POSIX_FADV_RANDOM: its reads start no readahead
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    except BaseException:
        os.close(fd)
        raise
    return fd, None, refused


def _open_extent(e: chunks.Extent, flags: int, check: bool = True) -> int:
    """A descriptor of the extent's file; ``check``: its size must be the manifest's (once per extent is enough)."""
    try:
        fd = os.open(e.path, flags)
    except FileNotFoundError as err:
        raise layout.ManifestError(f"{e.path}: missing ({err.strerror})") from err
    if not check:
        return fd
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

