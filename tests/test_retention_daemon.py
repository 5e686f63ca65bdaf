"""Retention through a real daemon: the issue's example, pins, keep-best, job overrides, gc, prefetch.

The rules themselves are table-tested in test_retention.py; these tests check
that the daemon applies them to both tiers, on disk and in what clients see,
after commits, drains and on its timer.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from ckptstage.client import Client
from ckptstage.client.errors import CheckpointNotFound
from ckptstage.protos import chunks, layout
from ckptstage.protos.v1 import ckptstage_pb2 as pb

import support
from hangfs import hang
from support import drain, free_port, read_data, wait_metric, wait_until

JOB = "retjob"


# --- helpers ---


def metric(port: int, name: str, **labels: str) -> float:
    """One sample scraped from the daemon's /metrics (0 when absent)."""
    return support.metric(support.scrape(port), name, **labels)


def on_disk(tier: Path | None, job: str = JOB) -> set[int]:
    """Steps of ``job`` with a committed part on the tier, as a scan of the directory sees them."""
    assert tier is not None
    for _ in range(50):
        try:
            return {ref.step for ref in layout.scan_tier(tier) if ref.job == job}
        except FileNotFoundError:  # the daemon deleted a step while we listed it: look again
            time.sleep(0.01)
    raise AssertionError(f"{tier} kept changing under the scan")


def listed(c: Client, tier: str) -> set[int]:
    return {i.step for i in c.list() if tier in i.tiers}


def tiers_hold(d: Any, c: Client, local: set[int], shared: set[int]) -> bool:
    """Both tiers hold exactly these steps, on disk and as the daemon lists them."""
    return (on_disk(d.local) == local and on_disk(d.shared) == shared
            and listed(c, "local") == local and listed(c, "shared") == shared)


def settle(d: Any, c: Client, local: set[int], shared: set[int], timeout: float = 10) -> None:
    """Waits for retention to reach the expected state; on timeout, says what the tiers hold."""
    deadline = time.monotonic() + timeout
    while not tiers_hold(d, c, local, shared):
        if time.monotonic() > deadline:
            pytest.fail(f"expected local {sorted(local)} shared {sorted(shared)}; on disk local "
                        f"{sorted(on_disk(d.local))} shared {sorted(on_disk(d.shared))}; listed local "
                        f"{sorted(listed(c, 'local'))} shared {sorted(listed(c, 'shared'))}")
        time.sleep(0.05)


def tiny(step: int) -> dict[str, Any]:
    return {"w": torch.full((16,), step, dtype=torch.int64), "step": step}


def save_steps(c: Client, steps: range | list[int], **kw: Any) -> list[Any]:
    handles = [c.save(s, tiny(s), **kw) for s in steps]
    for h in handles:
        h.wait("local", timeout=30)
    return handles


# --- tests ----------------------------------------------------------------------------


def test_issue_example_local_keeps_last_two_shared_keeps_last_three_and_every_tenth(daemon_factory: Any) -> None:
    port = free_port()
    d = daemon_factory(**{"local.keep_last": 2, "shared.keep_last": 3, "shared.keep_every": 10,
                          "metrics.listen": f"127.0.0.1:{port}"}).start()
    with Client(JOB, socket=d.socket) as c:
        handles = [c.save(s, tiny(s)) for s in range(1, 26)]
        for h in handles:
            # Every step reached the shared tier, even those its rules deleted since.
            h.wait("shared", timeout=60)
        drain(d)
        settle(d, c, local={24, 25}, shared={10, 20, 23, 24, 25})
        wait_metric(port, 23, "ckptstage_evictions_total", tier="local", rule="keep_last")
        wait_metric(port, 20, "ckptstage_evictions_total", tier="shared", rule="unkept")
        assert c.latest() == 25
        assert c.load(10)["step"] == 10  # a shared-only checkpoint restores
    log = d.log.read_text()
    assert "retention: deleted retjob step 11 rank 0 from shared (unkept" in log
    assert "retention: deleted retjob step 23 rank 0 from local (keep_last=2" in log
    # A restart (recovery, then a retention pass) changes nothing.
    d.stop()
    d.start()
    with Client(JOB, socket=d.socket) as c:
        settle(d, c, local={24, 25}, shared={10, 20, 23, 24, 25})


def test_wait_local_returns_without_waiting_for_the_steps_retention_deletes(daemon_factory: Any) -> None:
    """Deleting the steps retention no longer keeps follows each commit and can take a while (fsyncs on a busy
    disk); a trainer's wait("local") for the new step does not wait for it. Here it never ends: the step it
    deletes holds a hung mount, so every access below it blocks until the mount is released."""
    d = daemon_factory(**{"local.keep_last": 1, "shared.dir": "", "memory.enabled": False}).start()
    with Client(JOB, socket=d.socket) as c:
        c.save(1, tiny(1)).wait("local", timeout=30)
        stuck = layout.part_dir(d.local, JOB, 1, 0) / "stuck"
        stuck.mkdir()
        with hang(stuck):
            started = time.monotonic()
            c.save(2, tiny(2)).wait("local", timeout=15)
            assert time.monotonic() - started < 10
            assert c.latest() == 2
        c.save(3, tiny(3)).wait("local", timeout=30)  # the mount gone, the next pass deletes what is left
    wait_until(lambda: on_disk(d.local) == {3}, timeout=30, what="steps 1 and 2 deleted once the mount is gone")


def test_pinned_step_survives_both_tiers_until_unpinned(daemon_factory: Any) -> None:
    d = daemon_factory(**{"local.keep_last": 2, "shared.keep_last": 2, "retention.interval_s": 0.3}).start()
    with Client(JOB, socket=d.socket) as c:
        save_steps(c, [1])
        c.pin(1)
        with pytest.raises(CheckpointNotFound):
            c.pin(99)
        save_steps(c, range(2, 6))
        drain(d)
        settle(d, c, local={1, 4, 5}, shared={1, 4, 5})
        assert [i.step for i in c.list() if i.pinned] == [1]
    d.stop()  # pins survive a restart
    d.start()
    with Client(JOB, socket=d.socket) as c:
        time.sleep(0.7)  # two timer passes
        settle(d, c, local={1, 4, 5}, shared={1, 4, 5})
        c.unpin(1)
        settle(d, c, local={4, 5}, shared={4, 5})  # the next timed pass deletes it
        assert [i.step for i in c.list() if i.pinned] == []


def test_keep_best_by_metric_passed_at_save(daemon_factory: Any) -> None:
    d = daemon_factory(**{"local.keep_last": 1, "shared.keep_last": 1,
                          "shared.keep_best": {"metric": "val_loss", "mode": "min", "n": 2}}).start()
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 0.5, 5: 3.0, 6: 2.0}
    with Client(JOB, socket=d.socket) as c:
        for s, loss in losses.items():
            c.save(s, tiny(s), metrics={"val_loss": loss}).wait("shared", timeout=30)
        drain(d)
        settle(d, c, local={6}, shared={2, 4, 6})
        assert {i.step: i.metrics["val_loss"] for i in c.list()} == {2: 1.0, 4: 0.5, 6: 2.0}
        # A step without the metric does not rank; it goes once it is not the newest.
        c.save(7, tiny(7)).wait("shared", timeout=30)
        settle(d, c, local={7}, shared={2, 4, 7})


def test_job_overrides_only_add_to_the_operators_rules_within_the_cap(daemon_factory: Any) -> None:
    d = daemon_factory(**{"local.keep_last": 2, "shared.keep_last": 2, "retention.max_job_keep_last": 3}).start()
    wishes = {"local_keep_last": 5, "shared_keep_last": 1, "shared_keep_every": 4}
    with Client(JOB, socket=d.socket, retention=wishes) as c:
        save_steps(c, range(1, 10))
        drain(d)
        # local: keep_last max(2, min(5, cap 3)) = 3. shared: the operator's last 2, plus the job's
        # every 4th; the job's keep_last 1 is below the operator's 2 and deletes nothing more.
        settle(d, c, local={7, 8, 9}, shared={4, 8, 9})
    # Another job on the same daemon keeps the operator's rules.
    with Client("other", socket=d.socket) as c:
        save_steps(c, range(1, 5))
        drain(d)
        wait_until(lambda: on_disk(d.local, "other") == {3, 4} and on_disk(d.shared, "other") == {3, 4}, 10,
                   "the operator's rules for a job without overrides")
    # The job's rules outlive its session and a restart of the daemon, and a client that does not
    # say (a loader, a tool) leaves them as they are; an empty dict resets them to the operator's.
    d.stop()
    d.start()
    with Client(JOB, socket=d.socket) as c:
        assert c.load(9) is not None
    with d.connection() as conn:
        conn.call("CollectGarbage", pb.GcRequest(dry_run=False))
    assert on_disk(d.local) == {7, 8, 9} and on_disk(d.shared) == {4, 8, 9}
    with Client(JOB, socket=d.socket, retention={}):
        pass
    with d.connection() as conn:
        conn.call("CollectGarbage", pb.GcRequest(dry_run=False))
    assert on_disk(d.local) == {8, 9} and on_disk(d.shared) == {8, 9}


def test_job_overrides_reach_the_daemons_of_other_nodes(daemon_factory: Any) -> None:
    """Every daemon applies the shared rules to every job it finds on the shared tier, so a job's own
    rules must reach daemons that never had a session of it."""
    a = daemon_factory("node-a", **{"local.keep_last": 2, "shared.keep_last": 2})
    assert a.shared is not None
    b = daemon_factory("node-b", **{"shared.dir": str(a.shared), "shared.keep_last": 2})
    a.start()
    with Client(JOB, socket=a.socket, retention={"shared_keep_every": 4}) as c:
        save_steps(c, range(1, 10))
        drain(a)
        settle(a, c, local={8, 9}, shared={4, 8, 9})
    published = a.shared / JOB / "retention.json"
    wait_until(published.is_file, 10, "the job's rules on the shared tier")
    b.start()  # indexes the shared tier and runs a retention pass before it serves
    with b.connection() as conn:
        conn.call("CollectGarbage", pb.GcRequest(dry_run=False))
        listed_b = conn.call("ListCheckpoints", pb.ListRequest(job=JOB)).checkpoints
    assert [(i.step, list(i.ranks_shared)) for i in listed_b] == [(4, [0]), (8, [0]), (9, [0])]
    assert on_disk(a.shared) == {4, 8, 9}


def test_gc_dry_run_lists_deletions_with_reasons_and_deletes_nothing(daemon_factory: Any) -> None:
    port = free_port()
    d = daemon_factory(**{"local.keep_last": 2, "shared.keep_last": 2, "retention.interval_s": 3600,
                          "metrics.listen": f"127.0.0.1:{port}"}).start()
    with Client(JOB, socket=d.socket) as c:
        save_steps(c, [1])
        c.pin(1)
        save_steps(c, range(2, 5))
        drain(d)
        settle(d, c, local={1, 3, 4}, shared={1, 3, 4})
        c.unpin(1)  # nothing runs retention until asked: the timer is an hour away
        wait_metric(port, 1, "ckptstage_evictions_total", tier="local", rule="keep_last")  # step 2
        before = 1
        with d.connection() as conn:
            dry = conn.call("CollectGarbage", pb.GcRequest(dry_run=True))
            assert sorted((a.job, a.step, pb.Tier.Name(a.tier), a.reason) for a in dry.deleted) == [
                (JOB, 1, "LOCAL", "keep_last=2"), (JOB, 1, "SHARED", "unkept")]
            assert all(a.bytes > 0 for a in dry.deleted)
            assert tiers_hold(d, c, local={1, 3, 4}, shared={1, 3, 4})  # nothing deleted
            assert metric(port, "ckptstage_evictions_total", tier="local", rule="keep_last") == before
            done = conn.call("CollectGarbage", pb.GcRequest(dry_run=False))
            assert [(a.step, pb.Tier.Name(a.tier)) for a in done.deleted] == [(1, "LOCAL"), (1, "SHARED")]
            again = conn.call("CollectGarbage", pb.GcRequest(dry_run=True))
            assert list(again.deleted) == []
        assert tiers_hold(d, c, local={3, 4}, shared={3, 4})
        assert metric(port, "ckptstage_evictions_total", tier="local", rule="keep_last") == before + 1
        assert metric(port, "ckptstage_evictions_total", tier="shared", rule="unkept") == 2  # steps 2 and 1


def test_prefetch_stages_a_shared_only_checkpoint_back_onto_local(daemon_factory: Any) -> None:
    d = daemon_factory(**{"local.keep_last": 2}).start()
    with Client(JOB, socket=d.socket) as c:
        save_steps(c, range(1, 4))
        drain(d)
        settle(d, c, local={2, 3}, shared={1, 2, 3})
    d.stop()
    shutil.rmtree(layout.part_dir(d.local, JOB, 3, 0).parent)  # as if the node's SSD lost it
    d.start()
    with Client(JOB, socket=d.socket) as c, d.connection() as conn:
        assert [(i.step, i.tiers) for i in c.list()][-1] == (3, ("shared",))
        resp = conn.call("Prefetch", pb.PrefetchRequest(job=JOB, latest=True))
        assert (resp.step, resp.parts) == (3, 1)
        local, shared = (layout.part_dir(t, JOB, 3, 0) for t in (d.local, d.shared))
        chunks.verify_part(local)
        assert read_data(local) == read_data(shared)
        assert [(i.step, i.tiers) for i in c.list()][-1] == (3, ("local", "shared"))
        resp = conn.call("Prefetch", pb.PrefetchRequest(job=JOB, step=3))
        assert resp.parts == 0  # already local
        assert c.load()["step"] == 3
    # Nothing is copied back to the shared tier after a restart.
    d.stop()
    d.start()
    drain(d)
    assert d.log.read_text().count(f"drained {JOB} step 3 rank 0") == 1


def test_shared_rules_shorter_than_local_ones_do_not_pin_local_copies(daemon_factory: Any) -> None:
    """A local copy whose shared copy the shared rules deleted was drained all the same:
    local retention may delete it, and a restart does not copy it again."""
    d = daemon_factory(**{"local.keep_last": 3, "shared.keep_last": 1}).start()
    with Client(JOB, socket=d.socket) as c:
        save_steps(c, range(1, 5))
        drain(d)
        settle(d, c, local={2, 3, 4}, shared={4})
    d.stop()
    d.start()
    drain(d)
    with Client(JOB, socket=d.socket) as c:
        settle(d, c, local={2, 3, 4}, shared={4})
        save_steps(c, [5, 6])
        drain(d)
        settle(d, c, local={4, 5, 6}, shared={6})
    drained = re.findall(rf"drained {JOB} step (\d+) rank 0", d.log.read_text())
    assert sorted(int(s) for s in drained) == [1, 2, 3, 4, 5, 6]  # each exactly once


def test_a_free_space_floor_the_disk_cannot_reach_warns_once_and_shows_in_status(daemon_factory: Any) -> None:
    """A floor above what the disk can ever free evicts every deletable local step at each commit: the
    daemon says so once per episode, at WARNING, naming the key and the figures, and status shows it."""
    import json
    import subprocess
    import sys

    d = daemon_factory("floor", **{"local.keep_last": 10, "local.min_free_bytes": "1000TiB"}).start()
    with Client(JOB, socket=d.socket) as c:
        for step in (1, 2, 3, 4):
            c.save(step, {"w": torch.full((64,), float(step))}).wait("shared", timeout=30)
            c.wait_step(step, "shared", timeout=30)
    drain(d)
    wait_until(lambda: on_disk(d.local) == {4}, 30, "every step but the newest evicted from the local tier")
    warnings = [line for line in d.log.read_text().splitlines()
                if " WARNING " in line and "local.min_free_bytes = 1000 TiB" in line]
    assert len(warnings) == 1, warnings  # one per episode, not one per commit
    assert re.search(r"has \d+(\.\d+)? [KMGT]?i?B free after retention", warnings[0]), warnings[0]
    status = subprocess.run([sys.executable, "-m", "ckptstage.client.cli", "--socket", str(d.socket), "status",
                             "--json"], capture_output=True, text=True, timeout=60)
    [local] = [t for t in json.loads(status.stdout)["tiers"] if t["tier"] == "local"]
    assert len(local["warnings"]) == 1 and "local.min_free_bytes" in local["warnings"][0], local
    text = subprocess.run([sys.executable, "-m", "ckptstage.client.cli", "--socket", str(d.socket), "status"],
                          capture_output=True, text=True, timeout=60).stdout
    assert "  WARNING: local.min_free_bytes = 1000 TiB" in text, text
