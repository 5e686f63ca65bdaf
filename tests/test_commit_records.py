"""One commit per step: commit records, attempts and their failures, against a real daemon.

A step is complete when every rank's part of one attempt is committed; the
per-step commit record, written last on each tier, is what makes it exist
there (docs/FORMAT.md). Faults are real: SIGKILL of the daemon, a flipped
byte in a record on disk.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from ckptstage.client import Client
from ckptstage.client.errors import AlreadyCommitted, CheckpointNotFound, InvalidRequest
from ckptstage.client.rpc import Connection
from ckptstage.protos import layout
from ckptstage.protos.v1 import ckptstage_pb2 as pb
from support import drain, wait_until

JOB = "commitjob"


def state_of(step: int, rank: int, attempt: str = "") -> dict[str, Any]:
    salt = sum(map(ord, attempt))
    return {"w": torch.full((256,), float(step * 100 + rank * 10 + salt)), "step": step, "rank": rank}


def client(d: Any, rank: int, world: int, attempt: str) -> Client:
    return Client(JOB, socket=d.socket, rank=rank, world_size=world, attempt=attempt)


def infos(conn: Connection, job: str = JOB) -> dict[int, pb.CheckpointInfo]:
    return {c.step: c for c in conn.call("ListCheckpoints", pb.ListRequest(job=job)).checkpoints}


def record_on(tier: Path, step: int) -> layout.CommitRecord | None:
    return layout.read_commit_record(layout.step_dir(tier, JOB, step))


def test_the_last_part_of_an_attempt_writes_the_local_record_and_the_drain_the_shared_one(daemon_factory: Any) -> None:
    d = daemon_factory().start()
    with client(d, 0, 2, "run-1") as c0, client(d, 1, 2, "run-1") as c1, d.connection() as conn:
        c0.save(5, state_of(5, 0)).wait("local", timeout=30)
        assert not layout.commit_path(d.local, JOB, 5).exists()  # one rank of two: not a step yet
        info = infos(conn)[5]
        assert (info.complete, info.committed_local, info.attempt, list(info.ranks_missing)) == \
            (False, False, "run-1", [1])
        with pytest.raises(CheckpointNotFound, match="ranks \\[1\\] of attempt 'run-1'"):
            conn.call("Locate", pb.LocateRequest(job=JOB, step=5, all_ranks=True))
        c1.save(5, state_of(5, 1)).wait("local", timeout=30)
        # Written before the last rank's wait("local") returned.
        record = record_on(d.local, 5)
        assert record is not None and (record.attempt, record.world_size) == ("run-1", 2)
        for rank in (0, 1):
            manifest = layout.part_dir(d.local, JOB, 5, rank) / layout.MANIFEST_FILE
            assert record.parts[rank].manifest_digest == layout.chunk_digest(manifest.read_bytes())
        info = infos(conn)[5]
        assert (info.complete, info.committed_local, list(info.ranks_missing)) == (True, True, [])
        done = conn.call("WaitStep", pb.WaitStepRequest(job=JOB, step=5, tier=pb.SHARED, timeout_s=20), timeout=30)
        assert (done.done, done.attempt, done.world_size) == (True, "run-1", 2)
        assert record_on(d.shared, 5) is not None and record_on(d.shared, 5).attempt == "run-1"  # type: ignore[union-attr]
        assert infos(conn)[5].committed_shared
        located = conn.call("Locate", pb.LocateRequest(job=JOB, latest=True, rank=7, all_ranks=True))
        assert (located.step, located.attempt, list(located.locations)) == (5, "run-1", [])  # rank 7: none
        assert [(p.rank, [loc.tier for loc in p.locations]) for p in located.parts] == \
            [(0, [pb.LOCAL, pb.SHARED]), (1, [pb.LOCAL, pb.SHARED])]
        assert torch.equal(c1.load(5)["w"], state_of(5, 1)["w"])
    log = d.log.read_text()
    assert log.count(f"committed {JOB} step 5 on the shared tier") == 1
    assert log.count(f"committed {JOB} step 5 on the local tier") == 1


def test_attempts_never_mix_and_the_next_attempt_replaces_an_incomplete_step(daemon_factory: Any) -> None:
    d = daemon_factory(**{"local.keep_last": 5}).start()
    with client(d, 0, 2, "A") as a0, client(d, 1, 2, "A") as a1:
        for c in (a0, a1):
            c.save(1, state_of(1, c.rank, "A")).wait("local", timeout=30)
        # Attempt A dies during step 2: only rank 0's part is committed.
        a0.save(2, state_of(2, 0, "A")).wait("shared", timeout=30)
    with client(d, 1, 2, "B") as b1, d.connection() as conn:
        b1.save(2, state_of(2, 1, "B")).wait("local", timeout=30)
        # Rank 0 of A and rank 1 of B: every rank is there, but not of one attempt.
        assert not layout.commit_path(d.local, JOB, 2).exists()
        assert b1.latest() == 1
        assert not infos(conn)[2].complete
        with client(d, 0, 2, "B") as b0:
            b0.save(2, state_of(2, 0, "B")).wait("shared", timeout=30)  # replaces A's part on both tiers
            b1.wait_step(2, "shared", timeout=30)
            assert b0.latest() == 2
            for tier in (d.local, d.shared):
                record = record_on(tier, 2)
                assert record is not None and record.attempt == "B"
                for rank in (0, 1):
                    manifest = layout.read_manifest(layout.part_dir(tier, JOB, 2, rank))
                    assert manifest["attempt"] == "B"
            assert torch.equal(b0.load(2)["w"], state_of(2, 0, "B")["w"])
            # A committed step is never replaced, by another attempt or by the same one.
            with pytest.raises(AlreadyCommitted, match="step 2 of job 'commitjob' is committed"):
                b0.save(2, state_of(2, 0, "B")).wait("local", timeout=30)
        with client(d, 0, 2, "C") as c0:
            with pytest.raises(AlreadyCommitted, match="attempt 'B'"):
                c0.save(2, state_of(2, 0, "C")).wait("local", timeout=30)
    assert torch.equal(Client(JOB, socket=d.socket, rank=0, world_size=2, attempt="D").load(2)["w"],
                       state_of(2, 0, "B")["w"])


def test_an_invalid_attempt_is_refused_naming_it(daemon_factory: Any) -> None:
    d = daemon_factory().start()
    with d.connection() as conn:
        for bad in ("has space", "x" * 129, "slash/y"):
            with pytest.raises(InvalidRequest, match="attempt"):
                conn.call("OpenSession", pb.OpenSessionRequest(job=JOB, world_size=1, attempt=bad))
    with client(d, 0, 1, "ok:1.2_3-4") as c:
        c.save(1, state_of(1, 0)).wait("local", timeout=30)
        assert c.latest() == 1


def test_a_daemon_killed_before_the_record_writes_it_on_restart(daemon_factory: Any) -> None:
    """SIGKILL after every part of a step is committed but before its record: restart writes it.

    The window is microseconds wide, so the test makes the state the kill
    leaves: both parts committed, the daemon SIGKILLed, the record not there.
    """
    d = daemon_factory(**{"shared.dir": ""}).start()
    with client(d, 0, 2, "k") as c0, client(d, 1, 2, "k") as c1:
        for c in (c0, c1):
            c.save(3, state_of(3, c.rank, "k")).wait("local", timeout=30)
    assert d.kill(signal.SIGKILL) == -signal.SIGKILL
    layout.commit_path(d.local, JOB, 3).unlink()
    d.start()
    record = record_on(d.local, 3)
    assert record is not None and (record.attempt, sorted(record.parts)) == ("k", [0, 1])
    assert "wrote the missing local commit record of commitjob step 3" in d.log.read_text()
    with client(d, 1, 2, "k2") as c:
        assert c.latest() == 3
        assert torch.equal(c.load(3)["w"], state_of(3, 1, "k")["w"])


def flip_byte(path: Path, at: int = 10) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))


def test_a_corrupt_commit_record_is_not_trusted(daemon_factory: Any) -> None:
    d = daemon_factory().start()
    with client(d, 0, 1, "z") as c:
        for step in (1, 2):
            c.save(step, state_of(step, 0)).wait("shared", timeout=30)
    drain(d)
    d.stop()
    flip_byte(layout.commit_path(d.local, JOB, 2))
    d.start()
    with d.connection() as conn:
        info = infos(conn)[2]
        assert (info.complete, info.committed_local, info.committed_shared) == (True, False, True)
        located = conn.call("Locate", pb.LocateRequest(job=JOB, latest=True))
        assert located.step == 2  # from the shared copy, whose record verifies
    assert f"not trusting the commit record {layout.commit_path(d.local, JOB, 2)}" in d.log.read_text()
    d.stop()
    flip_byte(layout.commit_path(d.shared, JOB, 2), at=30)
    d.start()
    with d.connection() as conn:
        assert not infos(conn)[2].complete
        assert conn.call("Locate", pb.LocateRequest(job=JOB, latest=True)).step == 1
    # Neither record was written over: they stay for a person to look at.
    for tier in (d.local, d.shared):
        with pytest.raises(layout.ChecksumMismatch):
            record_on(tier, 2)


def test_wait_step_times_out_for_an_incomplete_step_within_its_timeout(daemon_factory: Any) -> None:
    d = daemon_factory().start()
    with client(d, 0, 2, "w") as c, d.connection() as conn:
        c.save(4, state_of(4, 0)).wait("local", timeout=30)
        t0 = time.monotonic()
        resp = conn.call("WaitStep", pb.WaitStepRequest(job=JOB, step=4, timeout_s=1.0), timeout=5)
        assert not resp.done and 0.9 < time.monotonic() - t0 < 3.0
        # No timeout given: answers before the RPC's own deadline.
        resp = conn.call("WaitStep", pb.WaitStepRequest(job=JOB, step=4, tier=pb.SHARED), timeout=1.5)
        assert not resp.done
        wait_until(lambda: "drained commitjob step 4 rank 0" in d.log.read_text(), 10, "the drain")
        assert not record_on(d.shared, 4)


def test_sigterm_ends_a_wait_step_in_flight_and_the_daemon_exits_promptly(daemon: Any) -> None:
    """A WaitStep that would wait 25 s must not hold the daemon's exit (its thread ends with the daemon)."""
    import threading

    outcome: list[BaseException | pb.WaitStepResponse] = []

    def wait() -> None:
        try:
            with daemon.connection() as conn:
                outcome.append(conn.call("WaitStep", pb.WaitStepRequest(job=JOB, step=7, timeout_s=25), timeout=30))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.5)  # the call is in the daemon's wait loop
    t0 = time.monotonic()
    assert daemon.kill(signal.SIGTERM) == 0
    assert time.monotonic() - t0 < 10, "the daemon took longer than 10 s to exit with a WaitStep in flight"
    waiter.join(10)
    assert outcome and not (isinstance(outcome[0], pb.WaitStepResponse) and outcome[0].done)
