"""A file system that hangs: a FUSE mount whose server never answers.

Every access below the mount point blocks in the kernel, as on a network
file system whose server stopped (a hung NFS or Lustre mount), until
:meth:`HangingMount.release` closes the FUSE device: then every waiting call
fails with ENOTCONN and the mount is detached. Needs root and /dev/fuse;
:func:`hang` skips the test otherwise.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

_MNT_DETACH = 2


class HangingMount:
    def __init__(self, target: Path) -> None:
        self.target = target
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = os.open("/dev/fuse", os.O_RDWR)
        # Mounted, the kernel sends FUSE_INIT to the device; nobody ever reads it, so every
        # request to this file system waits for an answer that does not come.
        opts = f"fd={self._fd},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()},allow_other"
        if self._libc.mount(b"ckptstage-hang", os.fsencode(target), b"fuse", 0, opts.encode()) != 0:
            err = ctypes.get_errno()
            os.close(self._fd)
            raise OSError(err, f"mount fuse on {target}: {os.strerror(err)}")
        self._id = next((i for i, point in _mounts() if point == str(target)), None)

    def release(self) -> None:
        """Aborts the connection (waiting calls fail with ENOTCONN) and detaches the mount, wherever it is now
        (a directory above it may have been renamed meanwhile: a deletion moves a step aside first)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            where = next((point for i, point in _mounts() if i == self._id), str(self.target))
            self._libc.umount2(os.fsencode(where), _MNT_DETACH)


def _mounts() -> list[tuple[int, str]]:
    """(mount id, mount point) of this process's mounts, as the kernel names them now (its escapes undone)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # octal escapes: \040 for a space
            out.append((int(fields[0]), point))
    return out


@contextmanager
def hang(target: Path) -> Iterator[HangingMount]:
    """Mounts a hanging file system over ``target`` (an existing directory) for the block's duration."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("a hanging FUSE mount needs root and /dev/fuse")
    try:
        mount = HangingMount(target)
    except OSError as e:
        pytest.skip(f"cannot mount FUSE here: {e}")
    try:
        yield mount
    finally:
        mount.release()
