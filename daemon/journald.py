"""journald's native protocol: one log entry, its fields exactly as given, as one datagram.

The daemon writes its own entries rather than through libsystemd's
``sd_journal_send`` (what cysystemd calls): that macro adds the call site of
the C wrapper (``CODE_FILE=cysystemd/_journal.pyx``) beside the daemon's own,
so every entry carried ``CODE_FILE``, ``CODE_LINE`` and ``CODE_FUNC`` twice.

The protocol (systemd's "Native Journal Protocol"): fields separated by a
newline; ``NAME=value`` where the value holds no newline, else ``NAME``, a
newline, the value's length as 64-bit little-endian, the value, then the
newline. An entry too big for one datagram travels as a sealed memfd passed
with ``SCM_RIGHTS``, as libsystemd does.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct
from collections.abc import Mapping

SOCKET = "/run/systemd/journal/socket"
# journald accepts a sealed memfd only when every seal that stops a change is set.
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL


def encode(entry: Mapping[str, str | int | float]) -> bytes:
    """The datagram of one entry; names must be journal field names (upper case, digits, ``_``)."""
    out = bytearray()
    for name, value in entry.items():
        data = str(value).encode("utf-8", errors="replace")
        key = name.encode("ascii")
        if b"\n" in data:
            out += key + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += key + b"=" + data + b"\n"
    return bytes(out)


class JournalSocket:
    """Sends entries to journald's socket at ``path``; one unconnected datagram socket, reused."""

    def __init__(self, path: str = SOCKET) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    def send(self, entry: Mapping[str, str | int | float]) -> None:
        """Writes one entry; raises OSError when journald cannot be reached."""
        data = encode(entry)
        try:
            self._sock.sendto(data, self.path)
        except OSError as e:
            if e.errno not in (errno.EMSGSIZE, errno.ENOBUFS):
                raise
            self._send_large(data)

    def _send_large(self, data: bytes) -> None:
        fd = os.memfd_create("ckptstaged-journal", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            self._sock.sendmsg([], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))], 0, self.path)
        finally:
            os.close(fd)

    def close(self) -> None:
        self._sock.close()
