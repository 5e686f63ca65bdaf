"""A restore never waits behind the drain: while a load is in flight on a node, drains (and replicas to peers)
hold back, and go on once it ends, once its reader is gone, or once they have waited ``yield_to_loads_s``.

The gate itself with real threads and short times; then real daemons with a real shared directory, the lease
taken through the wire as ``Client.load`` and the DCP Reader take it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import pytest
import torch
from ckptstage.client import Client
from ckptstage.client.loadlease import LoadLease
from ckptstage.daemon.tiers.loadgate import LoadGate
from ckptstage.protos import layout
from ckptstage.protos.v1 import ckptstage_pb2 as pb
from support import free_port, metric, scrape, wait_until

JOB = "gated"


def acquire_in_thread(gate: LoadGate) -> threading.Event:
    done = threading.Event()
    threading.Thread(target=lambda: (gate.acquire(1 << 20), done.set()), daemon=True).start()
    return done


def test_nothing_waits_without_a_load() -> None:
    gate = LoadGate(60)
    t0 = time.monotonic()
    gate.acquire(1 << 20)
    assert time.monotonic() - t0 < 0.05 and gate.waited_s() == 0.0 and gate.loads() == 0


def test_a_writer_waits_while_a_load_holds_its_lease_and_goes_on_when_it_ends() -> None:
    gate = LoadGate(60)
    gate.hold("a", ttl_s=30)
    gate.hold("b", ttl_s=30)
    done = acquire_in_thread(gate)
    assert not done.wait(0.3)
    gate.release("a")
    assert not done.wait(0.2), "one load still reads"
    gate.release("b")
    assert done.wait(2)
    assert gate.loads() == 0 and gate.began() == 2 and gate.waited_s() >= 0.4


def test_a_lease_its_reader_stopped_renewing_expires() -> None:
    gate = LoadGate(60)
    gate.hold("dead reader", ttl_s=0.4)
    t0 = time.monotonic()
    gate.acquire(1)
    assert 0.3 <= time.monotonic() - t0 < 2 and gate.loads() == 0


def test_loads_one_after_another_hold_writers_back_at_most_max_pause(caplog: pytest.LogCaptureFixture) -> None:
    gate = LoadGate(0.5)
    gate.hold("first", ttl_s=30)
    t0 = time.monotonic()
    gate.acquire(1)
    assert 0.4 <= time.monotonic() - t0 < 2
    gate.hold("second", ttl_s=30)  # the same stretch of loads: no new pause
    t1 = time.monotonic()
    gate.acquire(1)
    assert time.monotonic() - t1 < 0.1
    assert sum("loads have been in flight" in r.getMessage() for r in caplog.records) == 1
    gate.release("first")
    gate.release("second")
    gate.hold("later", ttl_s=30)  # a new stretch: writers wait again
    assert not acquire_in_thread(gate).wait(0.2)
    gate.release("later")


def test_zero_never_waits_and_open_for_good_lets_waiting_writers_go() -> None:
    never = LoadGate(0)
    never.hold("x", ttl_s=30)
    t0 = time.monotonic()
    never.acquire(1)
    assert time.monotonic() - t0 < 0.05
    gate = LoadGate(60)
    gate.hold("x", ttl_s=30)
    done = acquire_in_thread(gate)
    assert not done.wait(0.2)
    gate.open_for_good()  # the daemon stops: its last drain goes first
    assert done.wait(2)


# --- real daemons -------------------------------------------------------------------


def on_shared(d: Any, step: int) -> bool:
    return layout.commit_path(d.shared, JOB, step).exists()


def loading(conn: Any, lease: str, ttl_s: float = 30.0, done: bool = False) -> None:
    conn.call("Loading", pb.LoadingRequest(lease=lease, ttl_s=ttl_s, done=done))


def test_the_drain_waits_for_a_load_on_its_node_and_goes_on_after(daemon_factory: Any) -> None:
    port = free_port()
    d = daemon_factory(**{"metrics.listen": f"127.0.0.1:{port}"}).start()
    with d.connection() as conn, Client(JOB, socket=d.socket) as c:
        loading(conn, "restart")
        c.save(1, {"w": torch.ones(1 << 18)}).wait("local", timeout=30)
        time.sleep(1.5)
        assert not on_shared(d, 1), "the drain went on during the load"
        text = scrape(port)
        assert metric(text, "ckptstage_loads_in_flight") == 1
        assert metric(text, "ckptstage_yielded_to_loads_seconds_total") > 0.5
        loading(conn, "restart", done=True)
        c.wait_step(1, "shared", timeout=30)
    assert metric(scrape(port), "ckptstage_loads_in_flight") == 0


def test_a_load_whose_reader_died_holds_the_drain_no_longer_than_its_lease(daemon_factory: Any) -> None:
    d = daemon_factory().start()
    with d.connection() as conn, Client(JOB, socket=d.socket) as c:
        loading(conn, "killed reader", ttl_s=2.0)  # never renewed, never ended
        c.save(1, {"w": torch.ones(1 << 18)}).wait("local", timeout=30)
        assert not on_shared(d, 1)
        c.wait_step(1, "shared", timeout=30)


def test_loads_without_end_hold_the_drain_back_only_yield_to_loads_s(daemon_factory: Any) -> None:
    d = daemon_factory(**{"persist.yield_to_loads_s": 1}).start()
    with d.connection() as conn, LoadLease(conn), Client(JOB, socket=d.socket) as c:  # renewed all along
        c.save(1, {"w": torch.ones(1 << 18)}).wait("local", timeout=30)
        c.wait_step(1, "shared", timeout=30)
    assert "loads have been in flight for 1 s: background copies go on beside them" in d.log.read_text()


def test_client_load_announces_its_load_and_ends_it(daemon_factory: Any) -> None:
    port = free_port()
    d = daemon_factory(**{"metrics.listen": f"127.0.0.1:{port}"}).start()
    with Client(JOB, socket=d.socket) as c:
        c.save(1, {"w": torch.arange(1000.0)}).wait("local", timeout=30)
        before = metric(scrape(port), "ckptstage_loads_total")
        assert torch.equal(c.load(1)["w"], torch.arange(1000.0))
    text = scrape(port)
    assert metric(text, "ckptstage_loads_total") == before + 1
    assert metric(text, "ckptstage_loads_in_flight") == 0
    wait_until(lambda: on_shared(d, 1), 30, "the drain once the load ended")


def test_a_bad_lease_is_refused_naming_what_is_wrong(daemon: Any) -> None:
    with daemon.connection() as conn:
        for lease, ttl_s, named in [("", 5.0, "lease"), ("x" * 129, 5.0, "lease"), ("ok", 0.0, "ttl_s"),
                                    ("ok", 601.0, "ttl_s")]:
            with pytest.raises(grpc.RpcError) as e:
                conn.stub.Loading(pb.LoadingRequest(lease=lease, ttl_s=ttl_s), timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and named in (e.value.details() or ""), \
                (lease, ttl_s, e.value.details())
