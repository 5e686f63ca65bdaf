"""Failures are visible: drain health in ``Status``, ``ListJobs``, ``SetPin``'s answer, against a real daemon.

The fault is real: the shared tier's directory of the job is a regular file,
so every copy of the job's parts fails with an OS error the way a permission
error would (root ignores chmod, so a mode change would not fail anything).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from ckptstage.client import Client
from ckptstage.client.errors import CheckpointNotFound, SaveFailed
from ckptstage.daemon.drain.health import TierHealth
from ckptstage.daemon.node.status import tier_state
from ckptstage.protos import layout
from ckptstage.protos.v1 import ckptstage_pb2 as pb
from support import data_size, drain, flip_data_byte, wait_until

JOB = "healthjob"


def state_of(step: int, n: int = 4096) -> dict[str, Any]:
    return {"w": torch.arange(step * n, (step + 1) * n, dtype=torch.int32), "step": step}


def status(d: Any) -> pb.StatusResponse:
    with d.connection() as conn:
        return conn.status()


def shared_tier(st: pb.StatusResponse) -> pb.TierStatus:
    return next(t for t in st.tiers if t.tier == pb.SHARED)


def job_of(jobs: Any, name: str) -> pb.JobStatus:
    found = [j for j in jobs if j.job == name]
    assert len(found) == 1, f"{name} listed {len(found)} times in {[j.job for j in jobs]}"
    return found[0]


def bytes_on_disk(tier: Path, job: str) -> int:
    return sum(layout.part_bytes(layout.read_manifest(ref.path)) for ref in layout.scan_tier(tier, job))


def test_failing_drain_degrades_the_shared_tier_until_a_drain_succeeds(daemon_factory: Any) -> None:
    d = daemon_factory("n")
    assert d.shared is not None
    d.shared.mkdir(parents=True)
    blocker = d.shared / JOB
    blocker.write_text("not a directory")  # every copy of the job's parts fails with an OSError
    d.start()
    healthy = status(d)
    assert shared_tier(healthy).state == "ok" and shared_tier(healthy).last_error == ""

    before = time.time()
    with Client(JOB, socket=d.socket) as client:
        h = client.save(1, state_of(1))
        h.wait("local", timeout=30)

        def failing() -> pb.StatusResponse | None:
            st = status(d)
            job = job_of(st.jobs, JOB)
            return st if shared_tier(st).state == "degraded" and job.drain.consecutive_failures >= 2 else None

        st = wait_until(failing, 30, "the shared tier degraded, the job's drain failing twice")
        tier, job = shared_tier(st), job_of(st.jobs, JOB)
        assert tier.reachable  # the file system answers: only the drains show the fault
        assert JOB in tier.last_error and before <= tier.last_error_time <= time.time()
        assert job.drain.state == "retrying"
        assert JOB in job.drain.last_error and before <= job.drain.last_error_time <= time.time()
        assert job.drain.queued_parts == 1 and job.drain.queued_bytes == bytes_on_disk(d.local, JOB)
        local = next(t for t in st.tiers if t.tier == pb.LOCAL)
        assert local.state == "ok" and local.last_error == ""

        blocker.unlink()  # the fault goes: the next retry succeeds
        h.wait("shared", timeout=30)
        drain(d)
    st = status(d)
    tier, job = shared_tier(st), job_of(st.jobs, JOB)
    assert (tier.state, tier.last_error, tier.last_error_time) == ("ok", "", 0.0)
    assert (job.drain.state, job.drain.last_error, job.drain.last_error_time, job.drain.consecutive_failures,
            job.drain.queued_parts) == ("idle", "", 0.0, 0, 0)


def test_list_jobs_counts_steps_bytes_and_sessions(daemon_factory: Any) -> None:
    d = daemon_factory("n", **{"local.keep_last": 10, "shared.keep_last": 10}).start()
    assert d.shared is not None
    before = time.time()
    with Client("jobb", socket=d.socket) as b:
        b.save(5, state_of(5, 2048)).wait("local", timeout=30)
    reader = Client("jobc", socket=d.socket)  # a session of a job with no checkpoint yet
    with Client("joba", socket=d.socket) as a:
        for step in (1, 2, 3):
            a.save(step, state_of(step)).wait("local", timeout=30)
        drain(d)
        with d.connection() as conn:
            jobs = conn.call("ListJobs", pb.ListJobsRequest()).jobs
        assert [j.job for j in jobs] == ["joba", "jobb", "jobc"]
        ja, jb, jc = jobs
        assert (ja.checkpoints, ja.latest_step, ja.has_latest, ja.sessions) == (3, 3, True, 1)
        assert (jb.checkpoints, jb.latest_step, jb.has_latest, jb.sessions) == (1, 5, True, 0)
        assert (jc.checkpoints, jc.has_latest, jc.sessions, jc.local_bytes) == (0, False, 1, 0)
        for j in (ja, jb):
            assert j.local_bytes == bytes_on_disk(d.local, j.job) > 0
            assert j.shared_bytes == bytes_on_disk(d.shared, j.job) == j.local_bytes
            assert before <= j.last_commit_time <= time.time()
            assert j.drain.state == "idle" and j.drain.queued_parts == 0
        assert jb.local_bytes < ja.local_bytes
        assert jc.last_commit_time == 0.0
        in_status = status(d).jobs
        assert [(j.job, j.checkpoints, j.latest_step, j.local_bytes) for j in in_status] == \
            [(j.job, j.checkpoints, j.latest_step, j.local_bytes) for j in jobs]
    reader.close()
    wait_until(lambda: all(j.sessions == 0 for j in status(d).jobs), 10, "every session closed")


def test_set_pin_says_whether_it_changed_anything(daemon_factory: Any) -> None:
    d = daemon_factory("n", **{"shared.dir": ""}).start()
    with Client(JOB, socket=d.socket) as client:
        client.save(1, state_of(1)).wait("local", timeout=30)
    with d.connection() as conn:
        def pin(pinned: bool, step: int = 1) -> tuple[bool, bool]:
            r = conn.call("SetPin", pb.PinRequest(job=JOB, step=step, pinned=pinned))
            return r.changed, r.pinned

        assert pin(True) == (True, True)
        assert pin(True) == (False, True)
        assert pin(False) == (True, False)
        assert pin(False) == (False, False)
        with pytest.raises(CheckpointNotFound):
            pin(True, step=2)
        st = conn.status()
    tier = shared_tier(st)
    assert (tier.enabled, tier.state) == (False, "disabled")
    assert job_of(st.jobs, JOB).drain.state == "disabled"


def test_an_old_client_reads_set_pin_as_empty(daemon: Any) -> None:
    """PinResponse is wire-compatible with Empty: a client built before it still works."""
    with Client(JOB, socket=daemon.socket) as client:
        client.save(1, state_of(1)).wait("local", timeout=30)
    channel = grpc.insecure_channel(f"unix:{daemon.socket}")
    try:
        call = channel.unary_unary("/ckptstage.v1.Checkpointer/SetPin",
                                   request_serializer=pb.PinRequest.SerializeToString,
                                   response_deserializer=pb.Empty.FromString)
        assert isinstance(call(pb.PinRequest(job=JOB, step=1, pinned=True), timeout=10), pb.Empty)
    finally:
        channel.close()
    with Client(JOB, socket=daemon.socket) as client:
        assert [c.pinned for c in client.list()] == [True]


def test_a_drain_that_cannot_succeed_is_failed_not_retrying(daemon_factory: Any) -> None:
    # The local copy is corrupt (a flipped byte): draining it would spread the corruption, and no retry
    # fixes it. The drain is held back by the job's directory being a file until the byte is flipped.
    d = daemon_factory("n")
    assert d.shared is not None
    d.shared.mkdir(parents=True)
    blocker = d.shared / JOB
    blocker.write_text("not a directory")
    d.start()
    before = time.time()
    with Client(JOB, socket=d.socket) as client:
        h = client.save(1, state_of(1))
        h.wait("local", timeout=30)
        part = layout.part_dir(d.local, JOB, 1, 0)
        wait_until(lambda: job_of(status(d).jobs, JOB).drain.state == "retrying", 30, "the drain retrying")
        flip_data_byte(part, data_size(part) // 2)
        blocker.unlink()
        with pytest.raises(SaveFailed):
            h.wait("shared", timeout=30)
    job = job_of(status(d).jobs, JOB)
    assert job.drain.state == "failed" and job.drain.queued_parts == 0
    assert job.drain.consecutive_failures >= 2  # the retries while the tier refused, then the corrupt copy
    assert "corrupt" in job.drain.last_error and before <= job.drain.last_error_time <= time.time()
    assert shared_tier(status(d)).state == "degraded"


@pytest.mark.parametrize("enabled, reachable, health, expected", [
    (False, None, None, ("disabled", "", 0.0)),
    (True, None, None, ("ok", "", 0.0)),
    (True, True, TierHealth(False), ("ok", "", 0.0)),
    (True, True, TierHealth(True, "denied", 5.0), ("degraded", "denied", 5.0)),
    (True, False, TierHealth(False), ("unreachable", "", 0.0)),
    (True, False, TierHealth(True, "gone", 7.0), ("unreachable", "gone", 7.0)),
    (True, None, TierHealth(True, "denied", 5.0), ("degraded", "denied", 5.0)),
])
def test_tier_state(enabled: bool, reachable: bool | None, health: TierHealth | None,
                    expected: tuple[str, str, float]) -> None:
    assert tier_state(enabled, reachable, health) == expected
