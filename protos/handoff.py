"""The memory tier's descriptor handoff: the wire format both sides share (see daemon/serve/handoff.py)."""

from __future__ import annotations

import array
import contextlib
import json
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptstage.protos import layout

MAX_REQUEST_BYTES = 4096
SUFFIX = ".mem"


def socket_path(rpc_socket: str | Path) -> Path:
    """The handoff socket of the daemon serving gRPC on ``rpc_socket``: beside it."""
    return Path(f"{rpc_socket}{SUFFIX}")


@contextlib.contextmanager
def bindable(path: Path) -> Iterator[str]:
    """``path`` as an address ``bind``/``connect`` take: through ``/proc/self/fd`` when it is longer than
    the 107 bytes of ``sun_path`` (a socket beside a long gRPC socket path)."""
    if len(os.fsencode(path)) <= 107:
        yield str(path)
        return
    dirfd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{dirfd}/{path.name}"
    finally:
        os.close(dirfd)


def lifeline(path: Path, session_id: str, timeout: float = 5.0) -> socket.socket:
    """Opens the session's lifeline: a connection the daemon holds for the session's life and that closes
    only when this process closes it (after its last write into the arena) or dies. It is how the daemon
    knows that no writer is left before it keeps the arena as a memory copy. The caller keeps the socket
    open (it is close-on-exec: a program this process execs does not hold it) and closes it when done."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        with bindable(path) as address:
            sock.connect(address)
        sock.sendall(json.dumps({"session": session_id}).encode() + b"\n")
    except BaseException:
        sock.close()
        raise
    return sock


def parse_lifeline(raw: bytes) -> str | None:
    """The session id of a lifeline's opening line, or None when the line is a copy request."""
    try:
        req: Any = json.loads(raw)
    except ValueError:
        return None
    sid = req.get("session") if isinstance(req, dict) else None
    return sid if isinstance(sid, str) and 0 < len(sid) <= 64 else None


def encode_request(job: str, step: int, rank: int) -> bytes:
    return json.dumps({"job": job, "step": step, "rank": rank}).encode() + b"\n"


def parse_request(raw: bytes) -> tuple[str, int, int]:
    """(job, step, rank) of a request line; ValueError naming what is wrong."""
    try:
        req: Any = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"request is not JSON: {e}") from None
    if not isinstance(req, dict):
        raise ValueError("request is not a JSON object")
    job, step, rank = req.get("job"), req.get("step"), req.get("rank")
    if not isinstance(job, str):
        raise ValueError("request needs a string 'job'")
    if type(step) is not int or type(rank) is not int or step < 0 or rank < 0:
        raise ValueError("request needs non-negative integer 'step' and 'rank'")
    layout.check_job(job)
    return job, step, rank


@dataclass
class Received:
    """A copy handed over: the caller owns ``fd`` (close it once mapped)."""

    fd: int
    offset: int
    size: int
    arena_size: int
    manifest: bytes


class NotInMemory(Exception):
    """The daemon no longer holds the copy (or never did): read the part from disk."""


def fetch(path: Path, job: str, step: int, rank: int, timeout: float = 10.0) -> Received:
    """Asks the daemon at ``path`` for the memory copy of a part; raises NotInMemory or OSError."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        with bindable(path) as address:
            sock.connect(address)
        sock.sendall(encode_request(job, step, rank))
        msg, fds = _recv_fd(sock)
        try:
            head_raw, _, rest = msg.partition(b"\n")
            try:
                head = json.loads(head_raw)
                if "error" in head:
                    raise NotInMemory(str(head["error"]))
                if len(fds) != 1:
                    raise NotInMemory("the daemon's answer carried no descriptor")
                manifest = _read_exact(sock, rest, int(head["manifest_bytes"]))
                got = Received(fds[0], int(head["offset"]), int(head["size"]), int(head["arena_size"]), manifest)
            except (ValueError, KeyError, TypeError) as e:  # it hung up, or answered something else
                raise NotInMemory(f"no usable answer from the daemon ({e or 'it hung up'})") from None
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
    _check_fits(got)
    return got


def _recv_fd(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One message and the descriptors it carries, close-on-exec from the start: a child another thread starts
    meanwhile must not inherit (and pin) the arena. (``socket.recv_fds`` drops its flags before Python 3.12.)"""
    msg, ancdata, _, _ = sock.recvmsg(MAX_REQUEST_BYTES, socket.CMSG_LEN(4), socket.MSG_CMSG_CLOEXEC)
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return msg, list(fds)


def _read_exact(sock: socket.socket, have: bytes, n: int) -> bytes:
    if not 0 <= n <= layout.MAX_MANIFEST_BYTES + 64:
        raise NotInMemory(f"a manifest of {n} bytes is out of bounds")
    parts = [have]
    got = len(have)
    while got < n:
        piece = sock.recv(min(1 << 20, n - got))
        if not piece:
            raise NotInMemory("the daemon hung up while sending the manifest")
        parts.append(piece)
        got += len(piece)
    return b"".join(parts)[:n]


def _check_fits(got: Received) -> None:
    size = os.fstat(got.fd).st_size
    if not (0 <= got.offset and 0 <= got.size and got.offset + got.size <= got.arena_size == size):
        os.close(got.fd)
        raise NotInMemory(f"image [{got.offset}, +{got.size}) does not fit the {size}-byte arena handed over")
