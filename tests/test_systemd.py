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


@pytest.mark.parametrize(("env", "pid", "expected"), [
    ({}, 10, None),
    ({"WATCHDOG_USEC": "400000"}, 10, 0.2),
    ({"WATCHDOG_USEC": "400000", "WATCHDOG_PID": "10"}, 10, 0.2),
    ({"WATCHDOG_USEC": "400000", "WATCHDOG_PID": "11"}, 10, None),  # a wrapper's watchdog, not ours
    ({"WATCHDOG_USEC": "0"}, 10, None),
    ({"WATCHDOG_USEC": "-5"}, 10, None),
    ({"WATCHDOG_USEC": "soon"}, 10, None),
    ({"WATCHDOG_USEC": "30000000"}, 10, 15.0),
])
def test_watchdog_interval_is_half_of_what_systemd_asks_of_this_process(env: dict[str, str], pid: int,
                                                                          expected: float | None) -> None:
    assert watchdog_interval_s(env, pid) == expected


class _Ptrace:
    """Stops one thread of another process (a debugger's interrupt), leaving its other threads running."""

    SEIZE, INTERRUPT, DETACH = 0x4206, 0x4207, 17
    WALL = 0x40000000

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        self.libc.ptrace.restype = ctypes.c_long

    def _call(self, request: int, tid: int) -> None:
        if self.libc.ptrace(request, tid, None, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def stop(self, tid: int) -> None:
        self._call(self.SEIZE, tid)
        self._call(self.INTERRUPT, tid)
        os.waitpid(tid, self.WALL)  # returns once the thread is stopped

    def resume(self, tid: int) -> None:
        self._call(self.DETACH, tid)


def _loop_thread(pid: int) -> int:
    """The RPC loop's thread: the first of the threads named after it (threads it starts inherit the name)."""
    tids = sorted(int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()
                  if (t / "comm").read_text().strip() == LOOP_THREAD)
    assert tids, f"no thread {LOOP_THREAD!r} in process {pid}"
    return tids[0]


def _stop_while_idle(ptrace: _Ptrace, pid: int, tid: int) -> None:
    """Stops the thread where it waits for events (in epoll, the GIL released), not inside Python code:
    stopped holding the GIL it would freeze every thread, not only itself."""
    for _ in range(50):
        ptrace.stop(tid)
        task = Path(f"/proc/{pid}/task/{tid}")
        if "epoll" in (task / "wchan").read_text() or (task / "syscall").read_text().split()[0] in ("232", "281"):
            return
        ptrace.resume(tid)
        time.sleep(0.01)
    raise AssertionError("the rpc loop was never found waiting for events")


def test_watchdog_pings_come_from_the_rpc_loop_and_stop_while_it_hangs(
        daemon_factory: Any, run_daemon: Any, notify_socket: NotifySocket) -> None:
    port = free_port()
    d = daemon_factory("wd", **{"metrics.listen": f"127.0.0.1:{port}"})
    proc = run_daemon(d, {"NOTIFY_SOCKET": notify_socket.address, "WATCHDOG_USEC": "400000"})
    notify_socket.wait_for("READY=1", timeout=30)
    pings = notify_socket.receive(1.2).count("WATCHDOG=1")
    assert pings >= 4, f"{pings} pings in 1.2s at a 0.2s interval"

    loop = _loop_thread(proc.pid)
    ptrace = _Ptrace()
    try:
        _stop_while_idle(ptrace, proc.pid, loop)
        how = "the rpc loop's thread stopped"
    except OSError:  # no ptrace here (e.g. a container without CAP_SYS_PTRACE): freeze the whole process
        os.kill(proc.pid, signal.SIGSTOP)
        how = "the process stopped"
    try:
        notify_socket.receive(0.3)  # a ping already on its way
        assert notify_socket.receive(1.0).count("WATCHDOG=1") == 0, f"pings went on while {how}"
        if how.startswith("the rpc loop"):
            # Only the loop hangs: the rest of the daemon runs (its metrics endpoint answers), the RPCs do not.
            assert "ckptstage_sessions" in scrape(port)
            with pytest.raises(Exception):  # noqa: B017 - a deadline exceeded, whatever its wrapper
                with Connection(d.socket) as conn:
                    conn.status(timeout=0.5)
    finally:
        if how.startswith("the rpc loop"):
            ptrace.resume(loop)
        else:
            os.kill(proc.pid, signal.SIGCONT)
    notify_socket.wait_for("WATCHDOG=1", timeout=2)
    assert notify_socket.receive(1.0).count("WATCHDOG=1") >= 3


def test_status_line_counts_sessions(daemon_factory: Any, run_daemon: Any, notify_socket: NotifySocket) -> None:
    d = daemon_factory("st")
    run_daemon(d, {"NOTIFY_SOCKET": notify_socket.address, "WATCHDOG_USEC": "200000"})
    before = notify_socket.wait_for("READY=1", timeout=30)
    assert "STATUS=serving: 0 sessions, drain queue 0 parts (0 B)" in before
    with Client("job", socket=d.socket, rank=0, world_size=2), Client("job", socket=d.socket, rank=1, world_size=2):
        notify_socket.wait_for("STATUS=serving: 2 sessions, drain queue 0 parts (0 B)", timeout=5)
    notify_socket.wait_for("STATUS=serving: 0 sessions", timeout=5)
