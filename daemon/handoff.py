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
from pathlib import Path

from ckptstage.daemon.memtier import MemoryTier
from ckptstage.daemon.metrics import Metrics
from ckptstage.protos.handoff import MAX_REQUEST_BYTES, bindable, parse_request

log = logging.getLogger(__name__)


class HandoffServer:
    def __init__(self, path: Path, memory: MemoryTier, metrics: Metrics) -> None:
        self.path = path
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
            with conn:
                try:
                    conn.settimeout(5.0)  # a reader that connects and says nothing does not stall the others
                    self._answer(conn)
                except (OSError, ValueError) as e:
                    log.info("memory handoff: %s", e)

    def _answer(self, conn: socket.socket) -> None:
        raw = _read_line(conn)
        try:
            job, step, rank = parse_request(raw)
        except ValueError as e:
            conn.sendall(json.dumps({"error": str(e)}).encode() + b"\n")
            return
        out = self._memory.hand_out(job, step, rank)
        if out is None:
            conn.sendall(json.dumps({"error": f"{job} step {step} rank {rank} is not in memory (any more)"})
                         .encode() + b"\n")
            return
        try:
            head = json.dumps({"offset": out.offset, "size": out.size, "arena_size": out.arena_size,
                               "manifest_bytes": len(out.manifest)}).encode() + b"\n"
            socket.send_fds(conn, [head], [out.fd])
            conn.sendall(out.manifest)
        finally:
            os.close(out.fd)
        self._metrics.memory_handouts.inc()


def _read_line(conn: socket.socket) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        piece = conn.recv(MAX_REQUEST_BYTES + 1 - len(buf))
        if not piece:
            raise ValueError("the reader hung up before its request ended")
        buf += piece
        if len(buf) > MAX_REQUEST_BYTES:
            raise ValueError(f"request over {MAX_REQUEST_BYTES} bytes")
    return buf
