"""The daemon always answers: idle ranks cost no thread, and a session nobody attaches is reaped."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from ckptstage.client import Client
from ckptstage.client.errors import SessionLost
from ckptstage.client.rpc import Connection
from ckptstage.protos.v1 import ckptstage_pb2 as pb
from support import wait_until

RANKS = 256
RANKS_PER_CHANNEL = 32  # as ranks spread over processes, each with its own channel


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads: line")


def open_session(conn: Connection, job: str, rank: int, world: int) -> str:
    resp = conn.call("OpenSession", pb.OpenSessionRequest(job=job, rank=rank, world_size=world, pid=os.getpid(),
                                                          hostname="test"))
    return str(resp.session_id)


def status_latencies(d: Any, n: int = 10) -> list[float]:
    out = []
    with d.connection() as conn:
        for _ in range(n):
            t0 = time.monotonic()
            conn.status(timeout=5)
            out.append(time.monotonic() - t0)
    return out


def test_256_attached_idle_ranks_hold_no_thread_and_status_and_new_clients_answer(daemon_factory: Any) -> None:
    d = daemon_factory().start()
    assert d.proc is not None
    threads_before = threads_of(d.proc.pid)
    conns = [d.connection() for _ in range(RANKS // RANKS_PER_CHANNEL)]
    streams = []
    try:
        for rank in range(RANKS):
            conn = conns[rank // RANKS_PER_CHANNEL]
            stream = conn.stub.Attach(pb.AttachRequest(session_id=open_session(conn, "idle", rank, RANKS)))
            assert next(stream).kind == pb.SessionEvent.READY
            streams.append(stream)
        with d.connection() as conn:
            assert len(conn.status().sessions) == RANKS
        latencies = status_latencies(d)
        assert statistics.median(latencies) < 0.1 and max(latencies) < 0.5, latencies
        # Attached streams wait on the event loop, not on threads (the old server held one each).
        assert threads_of(d.proc.pid) - threads_before < 40
        # A trainer that starts now connects, saves and loads at once.
        with Client("fresh", socket=d.socket) as c:
            c.save(1, {"w": torch.arange(1000.0)}).wait("local", timeout=10)
            assert torch.equal(c.load(1)["w"], torch.arange(1000.0))
    finally:
        for stream in streams:
            stream.cancel()
        for conn in conns:
            conn.close()
    # Their streams gone, the daemon frees every idle rank's session.
    wait_until(lambda: not d.connection().status().sessions, 30, "the idle ranks' sessions to be reaped")


def test_a_session_that_never_attaches_is_reaped_with_its_arena(daemon_factory: Any) -> None:
    # What a trainer killed between OpenSession and Attach leaves: a session nobody will ever close.
    d = daemon_factory(**{"arena.attach_timeout_s": 1}).start()
    with d.connection() as conn:
        session_id = open_session(conn, "orphan", 0, 1)
        arena = conn.call("EnsureArena", pb.EnsureArenaRequest(session_id=session_id, want_bytes=8 << 20))
        assert Path(arena.path).exists()
        status = conn.status()
        assert [s.job for s in status.sessions] == ["orphan"] and status.arena_used_bytes == 8 << 20

        def reaped() -> bool:
            s = conn.status()
            return not s.sessions and s.arena_used_bytes == 0

        wait_until(reaped, 10, "the unattached session to be reaped")
        assert not Path(arena.path).exists()  # its /dev/shm file is gone with it
        with pytest.raises(SessionLost):
            conn.call("EnsureArena", pb.EnsureArenaRequest(session_id=session_id, want_bytes=1 << 20))
    # An attached client is never reaped, however long it idles.
    with Client("alive", socket=d.socket) as c:
        time.sleep(2.5)
        c.save(1, {"w": torch.ones(10)}).wait("local", timeout=10)
