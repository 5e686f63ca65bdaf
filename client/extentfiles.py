"""The files behind a part's data file, read as one: positional reads across the extents of a whole part or
of its chunks (:func:`ckptstage.protos.chunks.extents`), their descriptors opened and closed as reads move on."""

from __future__ import annotations

import bisect
import errno
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ckptstage.client.pagemem import PAGE as _PAGE
from ckptstage.client.pagemem import PageCache
from ckptstage.client.readmodes import CACHED
from ckptstage.protos import chunks, layout

_PROBE_EXTENTS = 8       # a unit's chunk files asked whether it is cached, at most (the largest)


@dataclass
class _Handle:
    """The descriptors open on one extent's file, by kind of read."""

    # "buffered", "direct" (the buffered one where O_DIRECT is refused), "cached" (the probe's, no readahead)
    fds: dict[str, int] = field(default_factory=dict)
    cache: PageCache | None = None  # the probe, on fds["cached"]
    users: int = 0                  # reads using it right now (counted only where extents are closed for room)
    finished: bool = False          # no read is due any more: closed when the last user lets go
    checked: bool = False           # its file's size is the manifest's
    decoded: memoryview | None = None  # a compressed extent's bytes, decoded at its first read
    decoding: threading.Lock = field(default_factory=threading.Lock)

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

    A compressed extent (a chunk a shared tier keeps compressed,
    :attr:`chunks.Extent.coded`) is read whole at its first read and decoded;
    its reads are copies of the decoded bytes, which it keeps while it is open.

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

    def pread(self, kind: str, views: list[memoryview], offset: int, size: int = -1, io: Pass | None = None) -> int:
        """One preadv of ``views`` (``size`` bytes, if the caller knows) at ``offset``, up to the end of the
        extent holding it; bytes read. ``io``: the pass it is part of, which lets go of the extents before."""
        if not self.extents:
            return 0
        i = self.index(offset)
        if io is not None and io.next < i:
            io.past(i)
        e = self.extents[i]
        if e.coded:
            return _copy_out(self._decoded(i), views, offset - e.lo, size)
        room = page_up(e.hi) - offset
        if (size if size >= 0 else sum(len(v) for v in views)) > room:
            if room <= 0:
                return 0
            views = _head(views, room)
        if self._counted:
            h = self._acquire(i, kind)
            try:
                n = os.preadv(h.fds[kind], views, offset - e.base)
            finally:
                self._let_go(i)
        else:
            # Nothing closes an extent under a read here: no use count, and no lock once its file is open.
            found = self._open.get(i)
            fd = found.fds.get(kind) if found is not None else None
            if fd is None:
                fd = self._acquire(i, kind).fds[kind]
                self._let_go(i)
            n = os.preadv(fd, views, offset - e.base)
        # A chunk in a pack: what follows it in the file (padding to the page, another chunk) is not the part's.
        return n if e.whole else min(n, e.hi - offset)

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
        parts = [(min(hi, self.extents[i].hi) - max(lo, self.extents[i].lo), i) for i in self._range(lo, hi)
                 if not self.extents[i].coded]  # read into memory whatever the kind of read
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

    def _decoded(self, i: int) -> memoryview:
        """Compressed extent ``i``'s bytes: its frame read and decoded once while it is open (by whichever read
        comes first; the others wait for it)."""
        h = self._acquire(i, "buffered")
        try:
            with h.decoding:
                if h.decoded is None:
                    e = self.extents[i]
                    h.decoded = e.decode(os.pread(h.fds["buffered"], e.coded, e.lo - e.base))
                return h.decoded
        finally:
            self._let_go(i)

    # ------------------------------------------------------------------ descriptors

    def expect(self, lo: int, hi: int) -> None:
        """Bytes [lo, hi) will be read in one :meth:`pass_over`: their files stay open until it lets go."""
        for i in self._range(lo, hi):
            self._due[i] += 1

    def pass_over(self, lo: int, hi: int) -> Pass:
        """The reads of an expected range, in file order; :meth:`Pass.close` it when they are done."""
        return Pass(self, lo, hi)

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


class Pass:
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
        wrong = e.size_error(os.fstat(fd).st_size)
        if wrong:
            raise layout.ChecksumMismatch(e.path, wrong)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _copy_out(data: memoryview, views: list[memoryview], at: int, size: int) -> int:
    """Copies ``data`` from ``at`` into ``views`` (``size`` bytes of them, -1: all), up to its end; bytes copied."""
    total = size if size >= 0 else sum(len(v) for v in views)
    done = 0
    for v in views:
        n = min(len(v), total - done, len(data) - at - done)
        if n <= 0:
            break
        (v if v.format == "B" and v.ndim == 1 else v.cast("B"))[:n] = data[at + done:at + done + n]
        done += n
    return done


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


def page_up(n: int) -> int:
    return -(-n // _PAGE) * _PAGE
