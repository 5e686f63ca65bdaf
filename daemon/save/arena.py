"""Shared-memory arenas and the global budget they are carved from.

An arena is a file in /dev/shm that the daemon creates, pre-faults and maps;
the client maps the same file, after which the daemon unlinks the name. From
then on the memory lives exactly as long as some process maps it: a SIGKILL
of either side leaves nothing in /dev/shm (invariant 5). Pre-faulting matters:
a first-touch copy into fresh tmpfs pages runs ~25x slower than into pages
already allocated, so allocation happens once, here, not in the trainer's
blocking window.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path

import psutil

from ckptstage.daemon.errors import ArenaFull, SharedMemoryFull
from ckptstage.daemon.logs import fields

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_NAME_RE = re.compile(r"ckptstage-(\d+)-[0-9a-f]+-\d+")


class Budget:
    """The daemon-wide cap on shared memory handed out (``[arena] max_bytes``).

    ``reclaim(n, owner)``, when set, is asked to give back at least ``n``
    bytes (by releasing them here) before a grant fails: the memory tier's
    copies make way for sessions that need the room (``owner``, the asking
    session's (job, rank), first gives up its own).
    """

    def __init__(self, total: int, reclaim: Callable[[int, tuple[str, int] | None], None] | None = None,
                 shm_dir: Path = SHM_DIR) -> None:
        self.total = total
        self.reclaim = reclaim
        self.shm_dir = shm_dir  # the file system the arenas are carved from (``[arena] dir``)
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    def grant(self, want: int, unit: int, owner: tuple[str, int] | None = None) -> int:
        """Reserves up to ``want`` bytes, rounded to ``unit``; at least one unit.

        Returns the bytes granted. Raises :class:`ArenaFull` when not even one
        unit is free: the caller then refuses the save with a message that
        says how much is needed.
        """
        want = max(unit, -(-want // unit) * unit)
        with self._lock:
            short = want - (self.total - self._used)
        if short > 0 and self.reclaim is not None:
            self.reclaim(short, owner)  # outside the lock: it calls release()
        with self._lock:
            free = self.total - self._used
            granted = min(want, free // unit * unit)
            if granted < unit:
                raise ArenaFull(want, free, self.total, unit)
            self._used += granted
            return granted

    def take(self, n: int) -> bool:
        """Reserves exactly ``n`` bytes if they are free now; never asks ``reclaim`` (what takes memory this
        way, a peer's replica, must not evict a session's arena or the memory tier's copies)."""
        with self._lock:
            if self.total - self._used < n:
                return False
            self._used += n
            return True

    def release(self, n: int) -> None:
        with self._lock:
            self._used -= n
            assert self._used >= 0, "arena budget released more than it granted"

    def fit_to_dir(self) -> int:
        """Caps the budget to what :attr:`shm_dir` has free (at start, once stale arenas are gone); returns it.

        A budget the file system cannot hold fails saves later, when an arena
        cannot be allocated: the operator hears of it now, with both figures.
        """
        space = shm_space(self.shm_dir)
        if space is None:
            return self.total
        free, size = space
        if self.total > free + self.used:
            log.warning("arena.max_bytes (%d bytes) does not fit in %s (%d bytes free of %d): the arena budget is "
                        "capped to %d bytes; lower arena.max_bytes, or enlarge the mount (docker run --shm-size, a "
                        "Kubernetes emptyDir with medium: Memory)", self.total, self.shm_dir, free, size,
                        free + self.used,
                        extra=fields(configured_bytes=self.total, free_bytes=free, fs_bytes=size,
                                     shm_dir=str(self.shm_dir)))
            with self._lock:
                self.total = free + self._used
        return self.total


def shm_space(shm_dir: Path) -> tuple[int, int] | None:
    """(bytes free, bytes in all) of the file system at ``shm_dir``; None when it cannot be asked."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


class Arena:
    """One session's shared-memory region, mapped in the daemon."""

    def __init__(self, name: str, size: int, generation: int, shm_dir: Path = SHM_DIR) -> None:
        self.path = shm_dir / name
        self.size = size
        self.generation = generation
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            # Allocates (and zeroes) every tmpfs page now, and fails cleanly
            # with ENOSPC here rather than SIGBUS later in a copy.
            os.posix_fallocate(fd, 0, size)
            self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _populate(),
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException as e:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.ENOMEM):
                raise self.no_room(size) from e
            raise
        # The descriptor stays open: the memory tier hands it to a reader once the name is gone.
        self.fd = fd
        self.view = memoryview(self.map)
        self._unlinked = False

    def no_room(self, size: int) -> SharedMemoryFull:
        """What a save hears when the file system holds no arena of ``size`` bytes (filled in by the session)."""
        free, total = shm_space(self.path.parent) or (0, 0)
        return SharedMemoryFull(size, free, total, 0, 0, str(self.path.parent))

    def unlink(self) -> None:
        """Removes the name once the client has mapped it (or gave up on it)."""
        if not self._unlinked:
            self.path.unlink(missing_ok=True)
            self._unlinked = True

    def close(self) -> None:
        self.unlink()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.view.release()
        try:
            self.map.close()
        except BufferError:  # a writer still holds a slice; the GC unmaps it later
            log.warning("arena %s still referenced at close", self.path.name,
                        extra=fields(tier="memory", bytes=self.size, arena=self.path.name))


def _populate() -> int:
    return getattr(mmap, "MAP_POPULATE", 0)


def arena_name(daemon_pid: int, session_id: str, generation: int) -> str:
    return f"ckptstage-{daemon_pid}-{session_id}-{generation}"


def sweep_stale(shm_dir: Path = SHM_DIR) -> int:
    """Removes arenas left by a daemon that died before unlinking them.

    Only files of this user whose creating daemon is no longer running are
    touched; returns how many were removed.
    """
    removed = 0
    try:
        entries = list(shm_dir.iterdir())
    except OSError:
        return 0
    for entry in entries:
        m = _NAME_RE.fullmatch(entry.name)
        if not m:
            continue
        try:
            st = entry.lstat()  # a link planted under an arena's name is removed, never followed
            pid = int(m.group(1))
            if st.st_uid != os.getuid() or psutil.pid_exists(pid) and pid != os.getpid():
                continue
            entry.unlink()
            removed += 1
        except OSError:
            continue
    return removed
