"""ckptstaged as a systemd service: the notification protocol against a real daemon, and the unit file.

The test binds the datagram socket systemd would (``$NOTIFY_SOCKET``, an abstract
address) and starts the real daemon with it in its environment, as systemd
does; the fixtures only write the daemon's config.
"""

from __future__ import annotations

import ctypes
import re
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import free_port, scrape, unit_directives, wait_until

from ckptstage.client import Client
from ckptstage.client.rpc import Connection
from ckptstage.daemon.node.node import node_name
from ckptstage.daemon.serve.notify import watchdog_interval_s
from ckptstage.daemon.serve.server import LOOP_THREAD
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

    def wait_status(self, pattern: str, timeout: float) -> None:
        """Receives until a STATUS= message that is exactly ``pattern`` (a regex) arrives."""
        wait_until(lambda: any(re.fullmatch(f"STATUS={pattern}", m.strip()) for m in self.receive(0.3)), timeout,
                   f"STATUS={pattern}")

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

    def wait_for(self, wanted: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> list[str]:
        """Receives until a message starting with ``wanted`` arrives; returns everything up to it.
        Fails at once if ``proc`` exits first."""
        got: list[str] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(min(0.2, max(0.01, deadline - time.monotonic())))
            try:
                line = self.sock.recv(4096).decode()
            except TimeoutError:
                if proc is not None and proc.poll() is not None:
                    pytest.fail(f"the daemon exited with {proc.returncode} before {wanted!r}; received {got}")
                continue
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
    d = daemon_factory("sd", **{"shared.drain_on_stop_s": 20})
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
        "STATUS=stopping: finishing in-flight saves (up to 30s), then draining each job's newest step (up to 20s)"]


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
    assert any(m.startswith("STATUS=serving: 0 sessions, drain queue 0 parts (0 B)") for m in before)
    notify_socket.wait_status(r"serving: 0 sessions, drain queue 0 parts \(0 B\)", timeout=10)  # the tier probed
    with Client("job", socket=d.socket, rank=0, world_size=2), Client("job", socket=d.socket, rank=1, world_size=2):
        notify_socket.wait_status(r"serving: 2 sessions, drain queue 0 parts \(0 B\)", timeout=5)
    notify_socket.wait_status(r"serving: 0 sessions, drain queue 0 parts \(0 B\)", timeout=5)


def test_status_line_says_when_drains_fail(daemon_factory: Any, run_daemon: Any,
                                           notify_socket: NotifySocket) -> None:
    torch = pytest.importorskip("torch")
    d = daemon_factory("st")
    d.shared.mkdir(parents=True)
    blocker = d.shared / "job"
    blocker.write_text("not a directory")  # every copy of the job's parts fails with an OSError
    # The unit's watchdog (WatchdogSec=30): a ping every 15 s. The line follows the state within
    # seconds all the same, not at the next ping.
    run_daemon(d, {"NOTIFY_SOCKET": notify_socket.address, "WATCHDOG_USEC": "30000000"})
    notify_socket.wait_for("READY=1", timeout=30)

    with Client("job", socket=d.socket) as client:
        client.save(1, {"w": torch.zeros(4)}).wait("local", timeout=30)
        notify_socket.wait_status(r"serving: 1 session, drain queue 1 part \(.*\), shared tier degraded", 5)
        blocker.unlink()
        client.wait_step(1, "shared", timeout=30)
        notify_socket.wait_status(r"serving: 1 session, drain queue 0 parts \(0 B\)", 5)  # healthy again


# --- the unit file ------------------------------------------------------------------------------------------


def _unit_copy(tmp_path: Path) -> Path:
    """The shipped unit with ExecStart naming the ckptstaged of this environment.

    ``systemd-analyze verify`` checks that ExecStart is an executable; the unit names the path the README
    installs it at (/usr/local/bin/ckptstaged), absent here. Only that path changes: every other line is
    verified as shipped.
    """
    exe = Path(sys.executable).parent / "ckptstaged"
    if not exe.exists():
        pytest.skip(f"no ckptstaged entry point beside {sys.executable}")
    text = UNIT.read_text()
    assert text.count("ExecStart=/usr/local/bin/ckptstaged ") == 1
    copy = tmp_path / UNIT.name
    copy.write_text(text.replace("ExecStart=/usr/local/bin/ckptstaged ", f"ExecStart={exe} "))
    return copy


def _analyze(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    return subprocess.run(["systemd-analyze", *args], capture_output=True, text=True, cwd=cwd, timeout=60)


def test_unit_verifies_clean(tmp_path: Path) -> None:
    unit = _unit_copy(tmp_path)
    out = _analyze("verify", "--man=no", unit.name, cwd=tmp_path)
    # verify exits 0 on an unknown key or a misplaced directive too, and only prints it: output must be empty.
    assert (out.returncode, out.stdout + out.stderr) == (0, "")


def test_unit_exposure_is_at_most_2_5(tmp_path: Path) -> None:
    unit = _unit_copy(tmp_path)
    out = _analyze("security", "--offline=yes", f"--threshold={int(MAX_EXPOSURE * 10)}", unit.name, cwd=tmp_path)
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d)", out.stdout)
    assert match, out.stdout + out.stderr
    assert float(match.group(1)) <= MAX_EXPOSURE and out.returncode == 0, out.stdout


def test_unit_directives_the_daemon_relies_on() -> None:
    service = unit_directives(UNIT.read_text(), "[Service]")
    assert service["Type"] == ["notify"] and service["NotifyAccess"] == ["main"]
    # The daemon pings every WatchdogSec/2; RestartPreventExitStatus is main.EXIT_CONFIG.
    assert int(service["WatchdogSec"][0]) >= 10
    from ckptstage.daemon.main import EXIT_CONFIG
    assert service["RestartPreventExitStatus"] == [str(EXIT_CONFIG)]
    # The shutdown bound (persist.shutdown_timeout_s, 30 s by default) must fit before systemd's SIGKILL.
    from ckptstage.daemon.config import PersistConfig, SharedConfig
    assert int(service["TimeoutStopSec"][0]) > PersistConfig().shutdown_timeout_s + SharedConfig().drain_on_stop_s
    assert service["UMask"] == ["0077"] and service["CapabilityBoundingSet"] == [""]
    assert "LimitMEMLOCK" in service and service["RemoveIPC"] == ["no"]
    # The arenas in /dev/shm are shared with the trainers and the default tier is in the home directory:
    # nothing may hide either.
    assert service.get("ProtectHome", ["read-only"]) == ["read-only"]
    assert "PrivateIPC" not in service and "TemporaryFileSystem" not in service


# --- the daemon inside the unit's restrictions ---------------------------------------------------------------

NOBODY = 65534
_PR_SET_MDWE, _PR_MDWE_REFUSE_EXEC_GAIN = 65, 1
# Runs the daemon with MemoryDenyWriteExecute's rule in force (the prctl systemd >= 254 uses): from then on no
# mapping may become writable and executable. (Set here, after the interpreter's start, rather than before an
# exec: the unprivileged user may not exec this environment's interpreter by path.)
_MDWE_RUN = ("import ctypes, runpy, sys\n"
             "if ctypes.CDLL(None).prctl(65, 1, 0, 0, 0) != 0: sys.exit('PR_SET_MDWE refused')\n"
             "sys.argv[0] = 'ckptstaged'\n"
             "runpy.run_module('ckptstage.daemon.main', run_name='__main__', alter_sys=True)")


def _syscall_group(name: str) -> set[str]:
    """The system calls of a ``SystemCallFilter=`` group, nested groups expanded."""
    out = subprocess.run(["systemd-analyze", "syscall-filter", name], capture_output=True, text=True, check=True)
    calls: set[str] = set()
    for line in out.stdout.splitlines()[1:]:
        line = line.strip()
        if line.startswith("@"):
            calls |= _syscall_group(line)
        elif line and not line.startswith("#"):
            calls.add(line)
    return calls


def _mdwe_supported() -> bool:
    probe = subprocess.run([sys.executable, "-c", _MDWE_RUN, "--version"], capture_output=True, timeout=30)
    return probe.returncode == 0


def test_the_daemon_works_inside_the_units_restrictions(notify_socket: NotifySocket) -> None:
    """What can be reproduced without systemd, as the unit sets it up: a user without capabilities or new
    privileges (User=, CapabilityBoundingSet=, NoNewPrivileges=), LimitMEMLOCK=0, MemoryDenyWriteExecute=
    (where the kernel has PR_SET_MDWE); every system call the daemon makes through a save, a drain, an
    overwrite, a load, a metrics scrape and a SIGTERM is in SystemCallFilter=, every socket in
    RestrictAddressFamilies=. (The mount-namespace directives need systemd: deploy/systemd/README.md.)"""
    from conftest import DaemonProc

    tools = {t: shutil.which(t) for t in ("strace", "setpriv", "prlimit", "systemd-analyze")}
    if os.geteuid() != 0 or not all(tools.values()):
        pytest.skip(f"needs root and {', '.join(tools)}")
    sandbox = [tools["prlimit"], "--memlock=0:0", tools["setpriv"], f"--reuid={NOBODY}", f"--regid={NOBODY}",
               "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", sys.executable]
    if subprocess.run([*sandbox, "-c", "import ckptstage.daemon.main"], capture_output=True).returncode:
        pytest.skip("user nobody cannot import ckptstage from here (a private home directory?)")
    mdwe = _mdwe_supported()
    base = Path(tempfile.mkdtemp(prefix="ckptstage-sandbox-", dir="/tmp"))  # pytest's tmp_path is root's alone
    try:
        port = free_port()
        d = DaemonProc(base / "node", **{"metrics.listen": f"127.0.0.1:{port}"})
        os.chmod(base, 0o755)
        for path in [base, *base.rglob("*")]:
            os.chown(path, NOBODY, NOBODY)
        trace = base / "strace.log"
        daemon_cmd = [*(["-c", _MDWE_RUN] if mdwe else ["-m", "ckptstage.daemon.main"]),
                      "--config", str(d.config_path)]
        env = {**os.environ, "NOTIFY_SOCKET": notify_socket.address}
        with open(base / "daemon.log", "wb") as log:
            proc = subprocess.Popen([tools["strace"], "-f", "-qq", "-o", str(trace), *sandbox, *daemon_cmd],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            notify_socket.wait_for("READY=1", timeout=60, proc=proc)
            import numpy as np

            from ckptstage.client import Client

            state = {"w": np.arange(100_000, dtype=np.float32)}
            with Client("sandboxed", socket=d.socket) as c:
                c.save(1, state).wait("shared", timeout=60)
                state["w"][:10] = -1
                c.save(1, state, overwrite=True).wait("shared", timeout=60)  # renameat2 through ctypes
                assert np.array_equal(c.load(1)["w"], state["w"])
            assert "ckptstage_sessions" in scrape(port)
            # SIGTERM to the daemon, strace's child (prlimit and setpriv exec it in place); strace exits with it.
            [daemon_pid] = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            os.kill(int(daemon_pid), signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, (base / "daemon.log").read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert (d.shared / "sandboxed").is_dir()

        lines = trace.read_text().splitlines()
        start = max(i for i, line in enumerate(lines) if "execve(" in line and '"--config"' in line
                    and line.rstrip().endswith("= 0"))
        daemon_lines = lines[start + 1:]
        used = {m.group(1) for line in daemon_lines if (m := re.match(r"\d+\s+([a-z0-9_]+)\(", line))}
        allowed = _syscall_group("@system-service") - _syscall_group("@privileged")
        assert used and used <= allowed, f"outside SystemCallFilter=: {sorted(used - allowed)}"
        families = {m.group(1) for line in daemon_lines if (m := re.search(r"\bsocket\((AF_[A-Z0-9]+)", line))}
        assert families <= {"AF_UNIX", "AF_INET", "AF_INET6"}, families
        # MemoryDenyWriteExecute= refuses a mapping both writable and executable, and making one executable later.
        exec_gain = [line for line in daemon_lines if re.search(r"\b(mmap|mprotect|pkey_mprotect)\(", line)
                     and "PROT_EXEC" in line and ("PROT_WRITE" in line or "mprotect(" in line)]
        assert not exec_gain, exec_gain[:3]
    finally:
        shutil.rmtree(base, ignore_errors=True)
