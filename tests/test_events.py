"""Events instead of upward callbacks (daemon/events.py): the bus's guarantees, and the persister's events
at its seam (a real arena file, a real file-system tier, a real writer pool): what it publishes, in which
order, and that a commit is handled before its waiters wake."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ckptstage.daemon.save import persister as persister_mod
from ckptstage.daemon.save.arena import Arena
from ckptstage.daemon.events import Bus
from ckptstage.daemon.tiers.fs import FsTier
from ckptstage.daemon.save.manifest_check import parse_manifest
from ckptstage.daemon.save.persister import Persister, Save
from ckptstage.protos import layout

JOB = "eventjob"
CHUNK = 4096


@dataclass(frozen=True)
class Ping:
    n: int


@dataclass(frozen=True)
class LoudPing(Ping):
    pass


def test_handlers_run_on_the_publishers_thread_in_subscription_order_for_their_class_only() -> None:
    bus = Bus()
    seen: list[tuple[str, int, str]] = []
    bus.subscribe(Ping, lambda e: seen.append(("first", e.n, threading.current_thread().name)))
    bus.subscribe(Ping, lambda e: seen.append(("second", e.n, threading.current_thread().name)))
    bus.subscribe(LoudPing, lambda e: seen.append(("loud", e.n, threading.current_thread().name)))
    bus.publish("an event nobody subscribed to")
    publisher = threading.Thread(target=lambda: (bus.publish(Ping(1)), bus.publish(LoudPing(2))), name="pub")
    publisher.start()
    publisher.join()
    assert seen == [("first", 1, "pub"), ("second", 1, "pub"), ("loud", 2, "pub")]


def test_a_handlers_exception_reaches_the_publisher() -> None:
    bus = Bus()

    def broken(e: Ping) -> None:
        raise RuntimeError(f"handler failed on {e.n}")

    bus.subscribe(Ping, broken)
    with pytest.raises(RuntimeError, match="handler failed on 7"):
        bus.publish(Ping(7))


def _save(tmp_path: Path, tier: FsTier, step: int, nbytes: int = 3 * CHUNK) -> Save:
    manifest = layout.encode_manifest({
        "format": layout.FORMAT, "job": JOB, "step": step, "rank": 0, "world_size": 1, "data_start": 0,
        "tensors": [{"name": "t", "dtype": "uint8", "shape": [nbytes], "offset": 0, "nbytes": nbytes}],
        "tree": {"d": [[{"s": "t"}, {"T": 0}]]}, "attempt": ""})
    spec = parse_manifest(manifest, JOB, step, 0, 1, nbytes, {})
    arena = Arena(f"arena-{step}", nbytes, 1, shm_dir=tmp_path)
    arena.view[:] = bytes(i % 251 for i in range(nbytes))
    return Save(f"save-{step}", "session", spec, arena, 0, CHUNK, tier.begin_part(JOB, step, 0))


def _recording_bus(events: list[tuple[str, Any]]) -> Bus:
    bus = Bus()
    bus.subscribe(persister_mod.Progressed, lambda e: events.append(("progressed", e.save.frontier)))
    # What the node's handler relies on: the part is published, and nobody waiting has woken yet.
    bus.subscribe(persister_mod.Committed,
                  lambda e: events.append(("committed", (e.save.committed_path, e.save.local_done.is_set()))))
    bus.subscribe(persister_mod.Failed, lambda e: events.append(("failed", e.save.error)))
    return bus


def test_a_save_publishes_its_progress_then_its_commit_before_its_waiters_wake(tmp_path: Path) -> None:
    tier = FsTier(tmp_path / "local", "node-a")
    events: list[tuple[str, Any]] = []
    persister = Persister(2, _recording_bus(events))
    save = _save(tmp_path, tier, 1)
    try:
        persister.progress(save, 2 * CHUNK)
        persister.progress(save, 3 * CHUNK, finished=True)
        assert save.local_done.wait(10)
    finally:
        persister.shutdown(wait=True)
        save.arena.close()
    kinds = [k for k, _ in events]
    assert kinds == ["progressed"] * 3 + ["committed"]
    assert sorted(v for k, v in events if k == "progressed")[-1] == 3  # the last one saw every chunk written
    assert events[-1][1] == (tier.part_location(JOB, 1, 0), False)
    assert save.error is None and tier.read_manifest(tier.part_location(JOB, 1, 0))[0]["step"] == 1


def test_a_failed_save_publishes_one_failure_and_never_wakes_its_waiters(tmp_path: Path) -> None:
    tier = FsTier(tmp_path / "local", "node-a")
    events: list[tuple[str, Any]] = []
    persister = Persister(1, _recording_bus(events))
    save = _save(tmp_path, tier, 2)
    try:
        persister.fail(save, "the client went away")
        persister.fail(save, "and again")  # settled: no second event
    finally:
        persister.shutdown(wait=True)
        save.arena.close()
    assert events == [("failed", "the client went away")]
    assert not save.local_done.is_set() and list(tier.list_steps(JOB)) == []


def test_a_commit_handler_that_breaks_still_lets_the_waiters_wake(tmp_path: Path) -> None:
    tier = FsTier(tmp_path / "local", "node-a")
    bus = Bus()

    def broken(e: persister_mod.Committed) -> None:
        raise RuntimeError("the node's booking failed")

    bus.subscribe(persister_mod.Committed, broken)
    persister = Persister(1, bus)
    save = _save(tmp_path, tier, 3, nbytes=CHUNK)
    try:
        persister.progress(save, CHUNK, finished=True)
        assert save.local_done.wait(10)  # a waiter is never left hanging by a handler's failure
    finally:
        persister.shutdown(wait=True)
        save.arena.close()
