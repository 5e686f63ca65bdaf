"""Retention passes after commits are coalesced: one running and one waiting per key, never a queue of them."""

from __future__ import annotations

import threading
import time

from ckptstage.daemon.retention.coalesce import PassGate


def test_a_burst_of_requests_runs_the_running_pass_and_one_more():
    gate = PassGate()
    started, release = threading.Event(), threading.Event()
    runs: list[str] = []

    def first() -> None:
        runs.append("first")
        started.set()
        release.wait(10)

    results: dict[str, bool] = {}
    t1 = threading.Thread(target=lambda: results.__setitem__("first", gate.run("job", first)))
    t1.start()
    assert started.wait(10)
    # A request while a pass runs waits for it, then runs: the running pass may have planned before its commit.
    t2 = threading.Thread(target=lambda: results.__setitem__("second", gate.run("job", lambda: runs.append("second"))))
    t2.start()
    deadline = time.monotonic() + 10
    while "job" not in gate._waiting and time.monotonic() < deadline:
        time.sleep(0.001)
    # Every further request finds a pass waiting to start, which will see its commit: it returns at once.
    t0 = time.monotonic()
    assert [gate.run("job", lambda: runs.append("late")) for _ in range(50)] == [False] * 50
    assert time.monotonic() - t0 < 1.0
    # Another key is not held up by this one.
    assert gate.run("other", lambda: runs.append("other"))
    release.set()
    t1.join(10)
    t2.join(10)
    assert results == {"first": True, "second": True}
    assert runs == ["first", "other", "second"]


def test_a_pass_that_raises_lets_the_next_one_run():
    gate = PassGate()

    def boom() -> None:
        raise OSError("disk gone")

    try:
        gate.run("job", boom)
    except OSError:
        pass
    ran = []
    assert gate.run("job", lambda: ran.append(1))
    assert ran == [1]
