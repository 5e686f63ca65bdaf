"""Hands a memory-tier copy's descriptor to a reader, over a Unix socket beside the gRPC one.

gRPC cannot carry file descriptors, and the copy's shared memory has no
name any more (invariant 5: nothing is left in ``/dev/shm`` whoever dies),
so a reader cannot open it by path. It connects here instead and sends one
request line::

    {"job": "llama", "step": 120, "rank": 3}

and gets one answer line with the descriptor attached (``SCM_RIGHTS``)::

    {"offset": 0, "size": 33555520, "arena_size": 67108864, "manifest_bytes": 1934}

followed by the manifest's bytes; or ``{"error": "..."}`` and no
descriptor. Only a copy of the part the step's commit names at that moment
is handed out. The socket lives in the daemon's socket directory (0700) and is
itself 0600: only the daemon's user reaches it, as with the gRPC socket.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ckptstage.daemon.logs import fields
from ckptstage.daemon.save.memtier import MemoryTier
from ckptstage.daemon.metrics import Metrics
from ckptstage.protos.handoff import MAX_REQUEST_BYTES, bindable, parse_lifeline, parse_request

log = logging.getLogger(__name__)

REQUEST_S = 5.0  # the whole of one request, however the peer dribbles it


class HandoffServer:
    def __init__(self, path: Path, memory: MemoryTier, metrics: Metrics,
                 lifeline: Callable[[str, socket.socket], bool] = lambda sid, conn: False) -> None:
        """``lifeline(session_id, conn)`` takes a session's lifeline over (True) or refuses it."""
        self.path = path
        self._lifeline = lifeline
        self._memory = memory
        self._metrics = metrics
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def start(self) -> None:
        self.path.unlink(missing_ok=True)  # a dead daemon's (the daemon lock makes sure it is dead)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with bindable(self.path) as address:
                sock.bind(address)
            os.chmod(self.path, 0o600)
            sock.listen(64)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="memory-handoff", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
            except OSError:
                pass
            self._sock.close()
        if self._thread is not None:
            self._thread.join(5)
        self.path.unlink(missing_ok=True)

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                continue
            kept = False
            try:
                kept = self._answer(conn, time.monotonic() + REQUEST_S)
            except (OSError, ValueError) as e:
                log.info("memory handoff: %s", e, extra=fields(tier="memory", error=e))
            finally:
                if not kept:
                    conn.close()

    def _answer(self, conn: socket.socket, deadline: float) -> bool:
        """One request, answered within ``deadline`` whatever the peer does (one reader at a time is served:
        a slow or silent one must not hold up the others). True: the connection is a session's lifeline, kept."""
        raw = _read_line(conn, deadline)
        session_id = parse_lifeline(raw)
        if session_id is not None:
            return self._lifeline(session_id, conn)
        try:
            job, step, rank = parse_request(raw)
        except ValueError as e:
            conn.sendall(json.dumps({"error": str(e)}).encode() + b"\n")
            return False
        out = self._memory.hand_out(job, step, rank)
        if out is None:
            conn.sendall(json.dumps({"error": f"{job} step {step} rank {rank} is not in memory (any more)"})
                         .encode() + b"\n")
            return False
        try:
            head = json.dumps({"offset": out.offset, "size": out.size, "arena_size": out.arena_size,
                               "manifest_bytes": len(out.manifest)}).encode() + b"\n"
            _budget(conn, deadline)
            socket.send_fds(conn, [head], [out.fd])
            for i in range(0, len(out.manifest), 1 << 20):
                _budget(conn, deadline)
                conn.sendall(out.manifest[i:i + (1 << 20)])
        finally:
            os.close(out.fd)
        self._metrics.memory_handouts.inc()
        return False


def _budget(conn: socket.socket, deadline: float) -> None:
    """What is left of the request's time, as the socket's timeout; ValueError when none is."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise ValueError(f"the reader took over {REQUEST_S:g}s")
    conn.settimeout(left)


def _read_line(conn: socket.socket, deadline: float) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        _budget(conn, deadline)
        piece = conn.recv(MAX_REQUEST_BYTES + 1 - len(buf))
        if not piece:
            raise ValueError("the reader hung up before its request ended")
        buf += piece
        if len(buf) > MAX_REQUEST_BYTES:
            raise ValueError(f"request over {MAX_REQUEST_BYTES} bytes")
    return buf
