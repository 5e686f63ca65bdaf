"""The daemon launcher (``ckptstage.daemon.launcher``) that the tests, the benchmarks and the demo start
``ckptstaged`` with: readiness by ``READY=1`` on its own ``NOTIFY_SOCKET``, start-up failures as exceptions,
stop, kill and restart."""

from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path

import pytest
import torch

from ckptstage.client import Client
from ckptstage.client.rpc import Connection
from ckptstage.daemon.config import ConfigError
from ckptstage.daemon.launcher import DaemonExited, DaemonNotReady, DaemonProcess, sends_ready
from ckptstage.protos.v1 import ckptstage_pb2 as pb

SMALL = {"arena.max_bytes": "64MiB", "persist.chunk_bytes": "1MiB", "arena.min_session_bytes": "1MiB"}

needs_ready = pytest.mark.skipif(not sends_ready(), reason="the installed daemon does not send READY=1")


def reaped(pid: int) -> bool:
    """Gone for good: no process, not even a zombie, and not our child any more."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return not Path(f"/proc/{pid}").exists()
    return False


@needs_ready
def test_start_returns_once_ready_and_the_daemon_answers_at_once(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "n", SMALL)
    try:
        d.start()
        with Connection(d.socket) as conn:  # no waiting for a daemon still starting: it answers now or fails
            assert conn.call("Status", pb.StatusRequest(), timeout=2, wait_for_ready=False).pid == d.pid
        assert "READY=1" in d.notifications
        assert not any(line.startswith("STOPPING") for line in d.notifications)
    finally:
        d.stop()
    assert "STOPPING=1" in d.notifications  # kept once the process is gone
    assert not (d.root / "notify.sock").exists()


FAKE = textwrap.dedent('''
    """A stand-in for ckptstaged that sends READY=1 late, or from a child process: READY=1"""
    import os, socket, sys, time

    def send(line):
        addr = os.environ["NOTIFY_SOCKET"]
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(line.encode(), "\\0" + addr[1:] if addr.startswith("@") else addr)

    mode = sys.argv[sys.argv.index("--mode") + 1]
    if mode == "late":
        time.sleep(1.0)
        send("READY=1")
    elif os.fork() == 0:
        send("READY=1")
        os._exit(0)
    time.sleep(120)
''')


@pytest.mark.parametrize("mode", ["late", "child"])
def test_only_ready_from_the_daemon_process_itself_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          mode: str) -> None:
    # As systemd's NotifyAccess=main: READY=1 from another process (here a child) is not the daemon's.
    (tmp_path / f"fake_ckptstaged_{mode}.py").write_text(FAKE)
    monkeypatch.syspath_prepend(str(tmp_path))
    d = DaemonProcess(tmp_path / "n", SMALL, module=f"fake_ckptstaged_{mode}", args=["--mode", mode],
                      env={"PYTHONPATH": str(tmp_path)})
    began = time.monotonic()
    try:
        if mode == "late":
            d.start(timeout=30)
            assert time.monotonic() - began >= 1.0 and d.running
        else:
            with pytest.raises(DaemonNotReady, match="not ready after 2s"):
                d.start(timeout=2)
            assert not d.running and reaped(d.pid)  # one that never became ready is stopped
    finally:
        d.stop()


def test_a_daemon_that_never_sends_ready_is_ready_once_it_answers(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # A daemon module whose source has no sd_notify (an older ckptstaged, a patched copy in an A/B
    # benchmark): the launcher gives it no NOTIFY_SOCKET and waits for a Status call to answer instead.
    (tmp_path / "plain_ckptstaged.py").write_text("import sys\nfrom ckptstage.daemon.main import main\n"
                                                  "sys.exit(main())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not sends_ready("plain_ckptstaged")
    with DaemonProcess(tmp_path / "n", SMALL, module="plain_ckptstaged", env={"PYTHONPATH": str(tmp_path)}) as d:
        with Connection(d.socket) as conn:
            assert conn.call("Status", pb.StatusRequest(), timeout=2, wait_for_ready=False).pid == d.pid
        assert d.notifications == [] and not (d.root / "notify.sock").exists()


def test_a_startup_error_raises_with_the_key_and_exit_status_78(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "n", {**SMALL, "metrics.listen": "192.0.2.1:9464"})  # TEST-NET-1: not ours
    with pytest.raises(DaemonExited) as info:
        d.start()
    assert info.value.returncode == 78
    assert "status 78" in str(info.value) and "metrics.listen" in str(info.value)
    assert info.value.output.splitlines() == [line for line in d.log.read_text().splitlines() if line.strip()]
    assert "metrics.listen = '192.0.2.1:9464': cannot listen there" in info.value.output
    assert not d.running and reaped(d.pid)


def test_a_given_config_file_is_run_as_it_is(tmp_path: Path) -> None:
    # A config file the launcher did not write: its values name the socket and tiers, and the daemon's own
    # start-up check refuses a socket path that is a directory (exit 78, one line naming the key).
    sock = tmp_path / "dir.sock"
    sock.mkdir()
    path = tmp_path / "given.toml"
    path.write_text(f'socket = "{sock}"\n[local]\ndir = "{tmp_path / "l"}"\n[arena]\nmax_bytes = "64MiB"\n')
    d = DaemonProcess(tmp_path / "n", config=path)
    assert (d.socket, d.local, d.shared, d.config_path) == (sock, tmp_path / "l", None, path)
    with pytest.raises(DaemonExited, match="exited with status 78") as info:
        d.start()
    assert info.value.returncode == 78 and "socket" in info.value.output and "not a socket" in info.value.output
    with pytest.raises(ValueError, match="does not rewrite it"):
        d.write_config(**{"shared.keep_last": 2})
    path.write_text(path.read_text() + "[retention]\ninterval_s = 0.000001\n")
    with pytest.raises(ConfigError, match="retention.interval_s"):  # checked by the daemon's own loader
        DaemonProcess(tmp_path / "n", config=path)


def test_stop_sends_sigterm_and_waits_for_the_exit(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "n", SMALL).start()
    pid = d.pid
    assert d.stop() == 0  # SIGTERM: a clean shutdown, waited for
    assert reaped(pid) and not d.running
    assert not d.socket.exists()  # the daemon removed its socket on the way out
    assert "stopped" in d.log.read_text()
    assert d.stop() == 0  # again: nothing to do


def test_stop_kills_a_daemon_that_does_not_exit_in_time(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "n", SMALL).start()
    os.kill(d.pid, signal.SIGSTOP)  # a stopped process cannot act on SIGTERM
    began = time.monotonic()
    assert d.stop(timeout=1) == -signal.SIGKILL
    assert 1 <= time.monotonic() - began < 10
    assert reaped(d.pid)


def test_kill_leaves_no_zombie(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "n", SMALL).start()
    assert d.kill() == -signal.SIGKILL
    assert reaped(d.pid) and not d.running
    assert d.socket.exists()  # a crash leaves its socket behind: the next start clears it
    assert not (d.root / "notify.sock").exists()
    d.start()
    assert d.kill(signal.SIGTERM) == 0


def test_restart_keeps_the_dirs(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path / "n", SMALL) as d:
        dirs, first = (d.socket, d.local, d.shared, d.config_path), d.pid
        with Client("job", socket=d.socket) as c:
            c.save(3, {"w": torch.arange(8.0)}).wait("shared", timeout=30)
        d.restart()
        assert d.pid != first and reaped(first)
        assert (d.socket, d.local, d.shared, d.config_path) == dirs
        with Client("job", socket=d.socket) as c:
            assert c.latest() == 3
            assert torch.equal(c.load()["w"], torch.arange(8.0))
    assert not d.running and reaped(d.pid)


def test_a_root_too_deep_for_a_socket_path_notifies_on_an_abstract_socket(tmp_path: Path) -> None:
    root = tmp_path / ("r" * 60) / ("o" * 60)
    d = DaemonProcess(root, {**SMALL, "socket": str(tmp_path / "d.sock")})
    with d:
        assert len(os.fsencode(root / "notify.sock")) > 107 and not (root / "notify.sock").exists()
        with Connection(d.socket) as conn:
            assert conn.status(timeout=2).pid == d.pid
        if sends_ready():
            assert "READY=1" in d.notifications
