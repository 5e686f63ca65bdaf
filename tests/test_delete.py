"""Deleting a step on request: ``Client.delete`` and ``ckptstage rm``, against a real daemon and real tiers."""

from __future__ import annotations

import json

import pytest
import torch
from support import drain, two_ranks, wait_until
from test_cli import ckptstage

from ckptstage.client import CheckpointNotFound, Client, StepPinned
from ckptstage.protos import layout


def _state(seed: int, n: int = 1000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(7, generator=g)}


def test_delete_removes_the_step_from_both_tiers_and_leaves_the_others(daemon):
    with Client("del-both", socket=daemon.socket) as c:
        for step in (1, 2, 3):
            c.save(step, _state(step)).wait("shared", timeout=30)
        c.delete(2)
        assert [i.step for i in c.list()] == [1, 3]
        assert not layout.step_dir(daemon.local, "del-both", 2).exists()
        assert not layout.step_dir(daemon.shared, "del-both", 2).exists()
        with pytest.raises(CheckpointNotFound, match="step 2"):
            c.load(2)
        assert torch.equal(c.load(3)["w"], _state(3)["w"])
        with pytest.raises(CheckpointNotFound, match="step 2 of job 'del-both'"):
            c.delete(2)  # gone: a second delete says so


def test_a_pinned_step_refuses_deletion_naming_the_pin(daemon):
    with Client("del-pin", socket=daemon.socket) as c:
        c.save(4, _state(4)).wait("local", timeout=30)
        c.pin(4)
        with pytest.raises(StepPinned, match=r"step 4 of job 'del-pin' is pinned.*ckptstage unpin del-pin 4"):
            c.delete(4)
        assert torch.equal(c.load(4)["w"], _state(4)["w"])  # nothing lost
        c.unpin(4)
        c.delete(4)
        assert c.list() == []


def test_delete_while_the_drain_copies_the_step_leaves_nothing_on_the_shared_tier(daemon_factory):
    # 8 MiB at 4 MiB/s: the deletion arrives while the part is being copied to the shared tier.
    d = daemon_factory("del-drain", **{"shared.max_bandwidth": "4MiB/s"}).start()
    with Client("del-drain", socket=d.socket) as c:
        c.save(1, {"w": torch.randn(2 << 20)}).wait("local", timeout=30)
        c.delete(1)
        assert c.list() == []
    drain(d)
    assert not layout.step_dir(d.shared, "del-drain", 1).exists()
    assert not layout.step_dir(d.local, "del-drain", 1).exists()


def test_a_step_only_the_shared_tier_holds_is_deleted_there(daemon_factory, tmp_path):
    # Two daemons stand for two nodes on one shared tier; node B never saw the job's saves.
    a = daemon_factory("del-a", **{"shared.dir": str(tmp_path / "shared")}).start()
    b = daemon_factory("del-b", **{"shared.dir": str(tmp_path / "shared")}).start()
    with Client("del-x", socket=a.socket) as c:
        c.save(8, _state(8)).wait("shared", timeout=30)
    with Client("del-x", socket=b.socket) as c:
        c.delete(8)
    assert not layout.step_dir(tmp_path / "shared", "del-x", 8).exists()
    assert layout.step_dir(a.local, "del-x", 8).exists()  # node A's local copy is A's to delete
    with Client("del-x", socket=a.socket) as c:
        c.delete(8)
        assert c.list() == []


def test_rm_command(daemon):
    with Client("del-cli", socket=daemon.socket) as c:
        for step in (1, 2, 3):
            c.save(step, _state(step)).wait("local", timeout=30)
        c.pin(3)
    out = ckptstage("rm", "del-cli", "1", socket=daemon.socket)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("del-cli step 1: deleted from "), out.stdout
    # One step pinned, one missing, one fine: the good one goes, the others are reported, exit 1.
    out = ckptstage("rm", "del-cli", "3", "9", "2", "--json", socket=daemon.socket)
    assert out.returncode == 1
    assert "step 3 of job 'del-cli' is pinned" in out.stderr and "no step 9 of job 'del-cli'" in out.stderr
    report = json.loads(out.stdout)
    assert [d["step"] for d in report["deleted"]] == [2] and report["failed"] == 2
    wait_until(lambda: [i.step for i in Client("del-cli", socket=daemon.socket).list()] == [3], 5, "only step 3")


def test_deleting_a_step_still_queued_for_the_shared_tier_is_no_failed_drain(daemon_factory):
    # The drain is slow: steps wait in its queue. Deleting one there takes it out of the queue; nothing
    # failed (Drain says so), and the other steps still reach the shared tier.
    d = daemon_factory("del-queued", **{"shared.max_bandwidth": "2MiB/s", "shared.max_concurrent": 1}).start()
    with Client("delq", socket=d.socket) as c:
        for step in (1, 2, 3):
            c.save(step, _state(step, n=256 << 10)).wait("local", timeout=30)
        c.delete(2)
        assert [i.step for i in c.list()] == [1, 3]
    drain(d, timeout=60)  # fails if any drain failed
    assert sorted(p.name for p in (d.shared / "delq").glob("step-*")) == [
        "step-000000000001", "step-000000000003"]


def test_deleting_a_step_drops_a_replacement_of_it_still_waiting_for_ranks(daemon):
    # Rank 0 saved step 2 again (overwrite) and waits for rank 1's replacement; the step is deleted
    # meanwhile. The half-assembled replacement goes with it: nothing of it comes back later.
    c0, c1 = two_ranks(daemon, "del-staged")
    try:
        for c in (c0, c1):
            c.save(2, _state(1)).wait("local", timeout=30)
        c0.save(2, _state(2), overwrite=True).wait_snapshot()
        staged = list((daemon.local / ".tmp").rglob("step-000000000002"))
        wait_until(lambda: list((daemon.local / ".tmp").rglob("manifest.json")), 20, "the staged replacement")
        c0.delete(2)
        assert not list((daemon.local / ".tmp").rglob("step-000000000002")), staged
        assert [i.step for i in c0.list()] == []
        for c in (c0, c1):  # the step saved anew is the new state, whole
            c.save(2, _state(3)).wait("local", timeout=30)
        assert torch.equal(c1.load(2)["w"], _state(3)["w"]) and torch.equal(c0.load(2)["w"], _state(3)["w"])
    finally:
        c0.close()
        c1.close()
