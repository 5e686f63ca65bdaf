"""Client timeouts mean what they say, and a client outlives its daemon's restarts.

Against a daemon frozen with SIGSTOP (it accepts connections but never
answers), every call given a timeout returns or raises TimeoutError within
that timeout plus a second. After a daemon outage of any length, a client
that lived through it saves again within a second of the daemon serving.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
import pytest
import torch
from ckptstage.client import Client, DaemonTimeout, DaemonUnavailable
from ckptstage.protos.v1 import ckptstage_pb2 as pb
from support import wait_until

TIMEOUT = 2.0


def state_of(step: int) -> dict[str, Any]:
    return {"w": torch.full((256, 256), float(step)), "step": step}


def assert_times_out(call: Callable[[], Any], timeout: float = TIMEOUT) -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        call()
    elapsed = time.monotonic() - t0
    assert elapsed <= timeout + 1.0, f"raised after {elapsed:.2f}s, the timeout was {timeout}s"


def test_every_timeout_holds_against_a_stopped_daemon(daemon: Any) -> None:
    with Client("frozen", socket=daemon.socket) as c:
        committed = c.save(1, state_of(1))
        committed.wait("local", timeout=30)
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            assert_times_out(lambda: committed.wait("shared", timeout=TIMEOUT))
            pending = c.save(2, state_of(2))
            assert_times_out(lambda: pending.wait_snapshot(timeout=TIMEOUT))
            assert_times_out(lambda: pending.wait("local", timeout=TIMEOUT))
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        # Thawed, the daemon answers what was asked meanwhile: nothing was lost.
        pending.wait("local", timeout=30)
        assert torch.equal(c.load(2)["w"], state_of(2)["w"])


def test_a_stopped_daemon_raises_a_typed_timeout(daemon: Any) -> None:
    with Client("typed", socket=daemon.socket) as c:
        c.save(1, state_of(1)).wait("local", timeout=30)
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            # The signal is delivered asynchronously: a call made before every thread has stopped may be answered.
            stopped = psutil.Process(daemon.proc.pid)
            wait_until(lambda: stopped.status() == psutil.STATUS_STOPPED, 10, "the daemon to stop")
            with pytest.raises(DaemonTimeout):  # a CkptStageError and a TimeoutError
                c._conn.call("Status", pb.StatusRequest(), timeout=0.5)
        finally:
            daemon.proc.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("outage_s", [0.5, 8.0])
def test_a_client_saves_within_a_second_of_its_daemon_coming_back(daemon: Any, outage_s: float) -> None:
    with Client("outlive", socket=daemon.socket) as c:
        c.save(1, state_of(1)).wait("local", timeout=30)
        daemon.kill()
        time.sleep(outage_s)  # long enough for gRPC's reconnect backoff to grow, unless it is capped
        daemon.start()  # returns once the daemon answers Status
        t0 = time.monotonic()
        c.save(2, state_of(2)).wait("local", timeout=10)
        elapsed = time.monotonic() - t0
        assert elapsed < 1.0, f"the first save after the restart took {elapsed:.2f}s"
        assert c.latest() == 2 and torch.equal(c.load(1)["w"], state_of(1)["w"])


@pytest.mark.parametrize("connect_timeout", [2.0, 5.0])
def test_connect_timeout_holds_against_a_stopped_daemon(daemon: Any, connect_timeout: float) -> None:
    # A stopped daemon accepts the connection but never answers: the constructor gives up after its own
    # connect_timeout, not after gRPC's 20 s connection-attempt timeout plus connect_timeout.
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable) as info:
            Client("frozen-open", socket=daemon.socket, connect_timeout=connect_timeout)
        elapsed = time.monotonic() - t0
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert connect_timeout - 0.1 <= elapsed <= connect_timeout + 1.0, \
        f"raised after {elapsed:.2f}s, connect_timeout was {connect_timeout}s"
    assert str(daemon.socket) in str(info.value) and "hung, stopped" in str(info.value)
    with Client("frozen-open", socket=daemon.socket, connect_timeout=10) as c:  # thawed, it serves again
        c.save(1, state_of(1)).wait("local", timeout=30)


def test_a_wait_without_a_timeout_outlasts_a_daemon_too_busy_to_answer(daemon: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """No timeout means no timeout: a daemon that answers a WaitSave later than the call's own deadline (frozen
    here for several of them) is asked again, and the wait returns once it answers."""
    from ckptstage.client import saver

    monkeypatch.setattr(saver, "WAIT_SLICE_S", 0.5)  # each WaitSave: 0.5 s, its call's deadline 1 s
    with Client("busy", socket=daemon.socket) as c:
        handle = c.save(1, state_of(1))
        handle.wait_snapshot(timeout=30)
        outcome: list[BaseException | None] = []
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            waiter = threading.Thread(target=lambda: outcome.append(_raised(lambda: handle.wait("local"))))
            waiter.start()
            time.sleep(3.5)  # three of the waiter's calls past their deadline
            assert waiter.is_alive() and outcome == [], outcome
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        waiter.join(30)
        assert outcome == [None]


def _raised(call: Callable[[], Any]) -> BaseException | None:
    try:
        call()
    except BaseException as e:  # noqa: BLE001 - the test asserts on it
        return e
    return None
