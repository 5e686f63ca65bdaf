"""The kernel's memory as a restore sees it: what of a file is in the page cache, and mapping fresh
tensors' pages ahead of the readers that fill them (Linux system calls through ctypes, each with a
fallback where the kernel lacks it)."""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import threading
from pathlib import Path
from typing import Any

PAGE = 4096  # O_DIRECT alignment of file offsets, lengths and memory (safe for 512 and 4K devices)


class PageCache:
    """What of one file is in the page cache, and a descriptor to copy it from there.

    ``cachestat(2)`` (Linux 6.5+) counts the cached pages of a range and
    starts no I/O. Elsewhere a one-byte ``RWF_NOWAIT`` read of the range's
    first page answers instead. Both the probe and the reads of cached
    ranges use a descriptor of their own advised ``POSIX_FADV_RANDOM``: a
    read there starts no readahead, which would otherwise pull the next
    megabytes into the cache behind the O_DIRECT readers' backs (the disk
    reading the checkpoint twice, and every following range then looking
    cached).
    """

    def __init__(self, path: Path, use_cachestat: bool = True, fd: int | None = None) -> None:
        """``fd``: a descriptor of ``path`` already open, which this object then owns (and closes)."""
        self.fd = os.open(path, os.O_RDONLY) if fd is None else fd
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._cachestat = use_cachestat and _CACHESTAT is not None

    def cached(self, lo: int, hi: int) -> bool:
        """Whether at least half of the pages of [lo, hi) are cached (then a copy from memory wins)."""
        return self.cached_bytes(lo, hi) * 2 >= hi - lo

    def cached_bytes(self, lo: int, hi: int) -> int:
        """About how much of [lo, hi) is cached: its cached pages' bytes, or where only the first page
        can be asked about, all of it or nothing (so that the parts of a file kept in several add up)."""
        if self._cachestat:
            pages = _cachestat_pages(self.fd, lo, hi - lo)
            if pages is not None:
                return pages * PAGE
            self._cachestat = False
        try:
            return hi - lo if os.preadv(self.fd, [bytearray(1)], lo, os.RWF_NOWAIT) == 1 else 0
        except OSError:  # EAGAIN: not cached; EOPNOTSUPP: cannot tell, so read it as cold
            return 0

    def close(self) -> None:
        os.close(self.fd)


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted",
                                               "nr_recently_evicted")]


def _load_cachestat() -> Any:
    if not sys.platform.startswith("linux") or platform.machine() not in _CACHESTAT_NR:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = libc.syscall
    fn.restype = ctypes.c_long
    return fn


_CACHESTAT_NR = {"x86_64": 451, "aarch64": 451}  # one number on every architecture since 6.5
_CACHESTAT = _load_cachestat()


def _cachestat_pages(fd: int, offset: int, length: int) -> int | None:
    """Pages of [offset, offset+length) in the page cache; None where the kernel cannot say."""
    rng, out = _CachestatRange(offset, length), _Cachestat()
    if _CACHESTAT(_CACHESTAT_NR[platform.machine()], fd, ctypes.byref(rng), ctypes.byref(out), 0) != 0:
        return None  # ENOSYS before 6.5, EOPNOTSUPP on hugetlbfs, ...
    return int(out.nr_cache)


class Prefaulter:
    """Maps in the pages of freshly allocated tensors, in file order, on a thread of its own.

    A fresh tensor's pages are mapped at first touch; with O_DIRECT that
    happens inside the reader's ``preadv`` before the disk is even asked,
    so the readers take turns between faulting and waiting. On the
    development VM a first touch costs about as much as reading the bytes
    from disk (0.4-0.8 s per GiB), so this thread runs ahead of the readers
    with ``MADV_POPULATE_WRITE`` (Linux 5.14+; it writes nothing, so it is
    harmless when a reader is already past it) and the readers find mapped
    pages: 1 GiB cold went from 0.75 s to 0.55 s. Where the kernel refuses
    the advice, the readers fault as before.
    """

    def __init__(self, regions: list[tuple[int, int]]) -> None:
        self._regions = regions
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptstage-prefault", daemon=True)

    def __enter__(self) -> Prefaulter:
        if self._regions and _MADVISE is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join()  # before a failed read frees the tensors it is touching

    def _run(self) -> None:
        assert _MADVISE is not None
        for addr, n in self._regions:
            lo, hi = -(-addr // PAGE) * PAGE, (addr + n) // PAGE * PAGE
            for at in range(lo, hi, _PREFAULT_STEP):
                if self._stop.is_set():
                    return
                if _MADVISE(at, min(_PREFAULT_STEP, hi - at), _MADV_POPULATE_WRITE) != 0:
                    return  # EINVAL before 5.14: the readers fault the pages themselves


_MADV_POPULATE_WRITE = 23
_PREFAULT_STEP = 4 << 20


def _load_madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _load_madvise()
