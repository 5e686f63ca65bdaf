"""ckptstaged as a systemd service: the notification protocol against a real daemon, and the unit file.

The test binds the datagram socket systemd would (``$NOTIFY_SOCKET``, an abstract
address) and starts the real daemon with it in its environment, as systemd
does; the fixtures only write the daemon's config.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import free_port, scrape

from ckptstage.client import Client
from ckptstage.client.rpc import Connection
from ckptstage.daemon.node import node_name
from ckptstage.daemon.notify import watchdog_interval_s
from ckptstage.daemon.server import LOOP_THREAD
from ckptstage.protos import layout

UNIT = Path(__file__).resolve().parent.parent / "deploy" / "systemd" / "ckptstaged@.service"
MAX_EXPOSURE = 2.5


class NotifySocket:
    """The service manager's end of ``$NOTIFY_SOCKET``: every datagram the daemon sends, in order."""

    def __init__(self) -> None:
        self.name = f"ckptstage-test-{uuid.uuid4().hex[:12]}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.name)
        self.seen: list[tuple[float, str]] = []

    @property
    def address(self) -> str:
        return "@" + self.name  # sd_notify's spelling of an abstract address

    def receive(self, seconds: float) -> list[str]:
        """The messages that arrive within ``seconds``."""
        got: list[str] = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                break
            for line in data.decode().splitlines():
                self.seen.append((time.monotonic(), line))
                got.append(line)
        return got

    def wait_for(self, wanted: str, timeout: float) -> list[str]:
        """Receives until a message starting with ``wanted`` arrives; returns everything up to it."""
        got: list[str] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                line = self.sock.recv(4096).decode()
            except TimeoutError:
                break
            self.seen.append((time.monotonic(), line))
            got.append(line)
            if line.startswith(wanted):
                return got
        pytest.fail(f"no {wanted!r} within {timeout}s; received {got}")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify_socket() -> Iterator[NotifySocket]:
    listener = NotifySocket()
    yield listener
    listener.close()


@pytest.fixture
def run_daemon() -> Iterator[Any]:
    """Starts ``ckptstaged`` on a config written by ``daemon_factory``, with the environment a service
    manager gives it; the processes are killed at the end."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(d: Any, env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
        full = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        with open(d.root / "daemon.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "ckptstage.daemon.main", "--config", str(d.config_path),
                                     "--log-level", "DEBUG", *args], stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env={**full, "PYTHONUNBUFFERED": "1", **env})
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ready_only_once_recovered_and_serving_then_stopping_on_sigterm(
        daemon_factory: Any, run_daemon: Any, notify_socket: NotifySocket) -> None:
    d = daemon_factory("sd")
    leftover = layout.tmp_root(d.local, node_name(d.local)) / "crashed-save"
    leftover.mkdir(parents=True)
    (leftover / "data").write_bytes(b"x" * 4096)
    proc = run_daemon(d, {"NOTIFY_SOCKET": notify_socket.address})

    before = notify_socket.wait_for("READY=1", timeout=30)
    # At READY=1 the daemon must already have done what a client relies on.
    assert not leftover.exists(), "READY=1 before the local tier's temporaries were removed"
    with Connection(d.socket) as conn:
        conn.status(timeout=2)
    assert any(m.startswith("STATUS=serving: 0 sessions") for m in before), before

    proc.send_signal(signal.SIGTERM)
    after = notify_socket.wait_for("STOPPING=1", timeout=10)
    assert "READY=1" not in after
    assert proc.wait(timeout=60) == 0
    assert [m for m in notify_socket.receive(0.2) if m.startswith("STATUS=")] == [
        "STATUS=stopping: finishing in-flight saves (up to 30s)"]
