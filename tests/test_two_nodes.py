"""Several nodes, one shared tier: one commit per step, and every node sees the same thing.

Real daemons, each with its own local tier, all on the SAME shared
directory, as on a cluster: two nodes run two ranks each of a four-rank job,
their drains race to write the step's shared commit record, and a third
node that never saw the job answers for it from the shared tier within 2 s.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from ckptstage.client import Client
from ckptstage.protos import layout
from ckptstage.protos.v1 import ckptstage_pb2 as pb
from support import wait_until

JOB = "twonodes"
WORLD = 4
STALENESS_S = 2.0


def state_of(step: int, rank: int) -> dict[str, Any]:
    return {"w": torch.full((1024,), float(step * 10 + rank)), "step": step}


def save_everywhere(clients: list[Client], step: int) -> None:
    """Every rank saves ``step`` at once (a barrier, as a training step ends) and waits for the shared tier."""
    barrier = threading.Barrier(len(clients))
    errors: list[BaseException] = []

    def run(c: Client) -> None:
        try:
            barrier.wait(timeout=10)
            c.save(step, state_of(step, c.rank)).wait("shared", timeout=60)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not errors, errors


def latest(d: Any) -> pb.LocateResponse:
    with d.connection() as conn:
        return conn.call("Locate", pb.LocateRequest(job=JOB, latest=True, all_ranks=True))


def test_two_nodes_commit_each_step_once_and_every_node_agrees(daemon_factory: Any) -> None:
    a = daemon_factory("node-a", **{"local.keep_last": 5, "shared.keep_last": 5})
    assert a.shared is not None
    b = daemon_factory("node-b", **{"shared.dir": str(a.shared), "local.keep_last": 5, "shared.keep_last": 5})
    a.start()
    b.start()
    clients = [Client(JOB, socket=(a if r < 2 else b).socket, rank=r, world_size=WORLD, attempt="run-7")
               for r in range(WORLD)]
    try:
        for step in (10, 20):
            save_everywhere(clients, step)
            # Neither node holds every rank: no local record; exactly one shared record, written by one node.
            for d in (a, b):
                assert not layout.commit_path(d.local, JOB, step).exists()
            record = layout.read_commit_record(layout.step_dir(a.shared, JOB, step))
            assert record is not None and (record.attempt, sorted(record.parts)) == ("run-7", [0, 1, 2, 3])
            logs = a.log.read_text() + b.log.read_text()
            assert logs.count(f"committed {JOB} step {step} on the shared tier") == 1
        assert not [p for p in (a.shared / layout.TMP_DIR).rglob("commit.json*")]  # no temporaries left
        # Both nodes agree on the newest step and on where every rank's part lies.
        for d in (a, b):
            resp = wait_until(lambda d=d: (r := latest(d)).step == 20 and r, STALENESS_S, "latest on both nodes")
            assert (resp.attempt, resp.world_size, len(resp.parts)) == ("run-7", WORLD, WORLD)
            local_ranks = {0, 1} if d is a else {2, 3}
            for part in resp.parts:
                tiers = [loc.tier for loc in part.locations]
                assert tiers == ([pb.LOCAL, pb.SHARED] if part.rank in local_ranks else [pb.SHARED])

        # A third node that never saw the job answers from the shared tier within 2 s of starting.
        c = daemon_factory("node-c", **{"shared.dir": str(a.shared)}).start()
        t0 = time.monotonic()
        resp = wait_until(lambda: (r := latest(c)).step == 20 and r, STALENESS_S, "the new node to see step 20")
        assert time.monotonic() - t0 < STALENESS_S
        committed = layout.read_commit_record(layout.step_dir(a.shared, JOB, 20))
        assert committed is not None
        assert [list(p.locations) for p in resp.parts] == [
            [pb.PartLocation(tier=pb.SHARED, dir=str(layout.part_dir(a.shared, JOB, 20, r)),
                             manifest_digest=committed.parts[r].manifest_digest)] for r in range(WORLD)]
        with c.connection() as conn:
            listed = {i.step: i for i in conn.call("ListCheckpoints", pb.ListRequest(job=JOB)).checkpoints}
            assert [(s, i.committed_shared, i.committed_local, i.attempt) for s, i in sorted(listed.items())] == \
                [(10, True, False, "run-7"), (20, True, False, "run-7")]
            # A step wait that starts before the step exists sees it once other nodes commit it.
            waiter = conn.start("WaitStep", pb.WaitStepRequest(job=JOB, step=30, tier=pb.SHARED, timeout_s=25),
                                timeout=30)
            save_everywhere(clients, 30)
            committed = time.monotonic()
            done = waiter()
            assert (done.done, done.attempt, done.world_size) == (True, "run-7", WORLD)
            wait_until(lambda: latest(c).step == 30, STALENESS_S, "the new node to see step 30")
            assert time.monotonic() - committed < STALENESS_S
            # Prefetch stages every rank onto the new node; the step then exists on its local tier too.
            fetched = conn.call("Prefetch", pb.PrefetchRequest(job=JOB, latest=True), timeout=60)
            assert (fetched.step, fetched.parts) == (30, WORLD)
            here = layout.read_commit_record(layout.step_dir(c.local, JOB, 30))
            there = layout.read_commit_record(layout.step_dir(a.shared, JOB, 30))
            assert here is not None and there is not None
            assert (here.attempt, here.world_size, here.parts) == (there.attempt, there.world_size, there.parts)
        with Client(JOB, socket=c.socket, rank=3, world_size=WORLD, attempt="run-8") as reader:
            assert reader.latest() == 30
            assert torch.equal(reader.load(30)["w"], state_of(30, 3)["w"])
    finally:
        for cl in clients:
            cl.close()


def test_a_rank_that_never_saves_leaves_the_step_incomplete_on_every_node(daemon_factory: Any) -> None:
    a = daemon_factory("node-a")
    assert a.shared is not None
    b = daemon_factory("node-b", **{"shared.dir": str(a.shared)})
    a.start()
    b.start()
    clients = [Client(JOB, socket=(a if r < 2 else b).socket, rank=r, world_size=WORLD, attempt="one")
               for r in range(WORLD)]
    try:
        save_everywhere(clients, 1)
        save_everywhere(clients[:3], 2)  # rank 3 dies before it saves step 2
        time.sleep(STALENESS_S)
        for d in (a, b):
            assert latest(d).step == 1
            with d.connection() as conn:
                info = {i.step: i for i in conn.call("ListCheckpoints", pb.ListRequest(job=JOB)).checkpoints}[2]
                assert (info.complete, list(info.ranks_missing), info.attempt) == (False, [3], "one")
        for tier in (a.local, b.local, a.shared):
            assert not layout.commit_path(tier, JOB, 2).exists()
    finally:
        for cl in clients:
            cl.close()
    # The restarted run (a new attempt) saves step 2 again: its parts replace the stale ones.
    again = [Client(JOB, socket=(a if r < 2 else b).socket, rank=r, world_size=WORLD, attempt="two")
             for r in range(WORLD)]
    try:
        save_everywhere(again, 2)
        for d in (a, b):
            resp = wait_until(lambda d=d: (r := latest(d)).step == 2 and r, STALENESS_S, "step 2 complete")
            assert resp.attempt == "two"
        for r in range(WORLD):
            assert layout.read_manifest(layout.part_dir(a.shared, JOB, 2, r))["attempt"] == "two"
        assert torch.equal(again[0].load(2)["w"], state_of(2, 0)["w"])
    finally:
        for cl in again:
            cl.close()


def test_a_crashed_attempts_late_drain_never_replaces_its_successors_part(daemon_factory: Any, tmp_path: Any) -> None:
    """Attempt 'old' committed rank 0 of step 5 on node A, which could not drain it then; attempt 'new'
    saved and drained the same part from node B. When A's drain resumes, it must not overwrite B's part."""
    shared = tmp_path / "shared-tier"
    a = daemon_factory("node-a", **{"shared.dir": ""}).start()  # no shared tier yet: nothing drains
    with Client(JOB, socket=a.socket, rank=0, world_size=2, attempt="old") as c:
        c.save(5, state_of(5, 0)).wait("local", timeout=30)
    time.sleep(0.05)  # 'new' is strictly later
    b = daemon_factory("node-b", **{"shared.dir": str(shared)}).start()
    with Client(JOB, socket=b.socket, rank=0, world_size=2, attempt="new") as c:
        c.save(5, {"w": torch.full((1024,), -1.0), "step": 5}).wait("shared", timeout=30)
    part = layout.part_dir(shared, JOB, 5, 0)
    assert layout.manifest_attempt(layout.read_manifest(part)) == "new"
    a.stop()
    a.write_config(**{"shared.dir": str(shared)})
    a.start()
    wait_until(lambda: "not draining" in a.log.read_text(), 20, "node A to give up draining the older part")
    assert layout.manifest_attempt(layout.read_manifest(part)) == "new"


def test_nodes_never_disagree_on_latest_while_a_drain_is_in_flight(daemon_factory: Any) -> None:
    """Node B drains slowly (a bandwidth cap): while its parts of step 20 are on their way, both nodes answer
    step 10, and a node answers 20 only once the shared commit record exists; then both agree within 2 s."""
    a = daemon_factory("node-a")
    assert a.shared is not None
    b = daemon_factory("node-b", **{"shared.dir": str(a.shared), "shared.max_bandwidth": "2MiB/s"})
    a.start()
    b.start()
    clients = [Client(JOB, socket=(a if r < 2 else b).socket, rank=r, world_size=WORLD, attempt="run-9")
               for r in range(WORLD)]
    big = {"w": torch.zeros(1 << 20)}  # 4 MiB per rank: node B needs about 4 s to drain its two parts
    try:
        save_everywhere(clients, 10)
        handles = [c.save(20, dict(big, step=20)) for c in clients]
        for h in handles:
            h.wait("local", timeout=30)
        record = layout.step_dir(a.shared, JOB, 20) / layout.COMMIT_FILE
        seen: dict[str, set[int]] = {"a": set(), "b": set()}
        while not record.exists():
            for name, d in (("a", a), ("b", b)):
                step = latest(d).step
                seen[name].add(step)
                assert step == 10 or record.exists(), f"node {name} reported step {step} before its record existed"
            time.sleep(0.05)
        # The drain was really in flight meanwhile (a node may see 20 in the loop's last round: the record
        # can appear between the loop's check and that node's answer, which the assertion above allows).
        assert 10 in seen["a"] and 10 in seen["b"], seen
        recorded = time.monotonic()
        for d in (a, b):
            wait_until(lambda d=d: latest(d).step == 20, STALENESS_S, "both nodes to see step 20")
        assert time.monotonic() - recorded < STALENESS_S + 0.5
        for h in handles:
            h.wait("shared", timeout=30)
    finally:
        for cl in clients:
            cl.close()


def test_a_step_asked_for_by_number_is_answered_complete_on_every_node_at_once(daemon_factory: Any) -> None:
    """A job's ranks on two nodes load, by number, the step they have just saved (DCP's save then load): the
    node that did not seal it answers it complete at once, re-reading that step from the shared tier, though
    its periodic re-read of the job is minutes off."""
    slow = {"shared.stale_after_s": 300, "shared.watch_interval_s": 300}
    a = daemon_factory("node-a", **slow)
    assert a.shared is not None
    b = daemon_factory("node-b", **{"shared.dir": str(a.shared), **slow})
    a.start()
    b.start()
    clients = [Client(JOB, socket=(a if r < 2 else b).socket, rank=r, world_size=WORLD, attempt="run")
               for r in range(WORLD)]
    try:
        assert clients[2].latest() is None  # node b has read the job from the shared tier just now
        for c in clients[2:]:  # node b's parts reach the shared tier first: node a completes the step, seals it
            c.save(5, state_of(5, c.rank)).wait("local", timeout=30)
        wait_until(lambda: all((layout.part_dir(a.shared, JOB, 5, r) / layout.MANIFEST_FILE).exists() for r in (2, 3)),
                   30, "node b's parts on the shared tier")
        for c in clients[:2]:
            c.save(5, state_of(5, c.rank)).wait("shared", timeout=30)
        assert "committed twonodes step 5 on the shared tier" in a.log.read_text()
        with b.connection() as conn:
            resp = conn.call("Locate", pb.LocateRequest(job=JOB, step=5, all_ranks=True))
        assert (resp.step, resp.world_size, len(resp.parts)) == (5, WORLD, WORLD)
        assert all(p.locations for p in resp.parts)
    finally:
        for cl in clients:
            cl.close()
