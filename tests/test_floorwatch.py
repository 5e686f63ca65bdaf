"""FloorWatch: one warning per episode of a local tier below its free-space floor after retention."""

from __future__ import annotations

import logging

import pytest

from ckptstage.daemon.retention.floorwatch import FloorWatch

GiB = 1 << 30


def test_one_warning_per_episode_and_the_status_warning_while_it_lasts(caplog: pytest.LogCaptureFixture) -> None:
    free = [40 * GiB]
    watch = FloorWatch(100 * GiB, "/ssd/ckptstage", lambda: free[0])
    caplog.set_level(logging.INFO, logger="ckptstage.daemon.retention.floorwatch")
    for _ in range(3):  # three commits, each evicting all it may
        watch.after_pass(evicted=2)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "local.min_free_bytes = 100 GiB but /ssd/ckptstage has 40 GiB free" in warnings[0].getMessage()
    assert watch.warning.startswith("local.min_free_bytes = 100 GiB")
    free[0] = 150 * GiB  # space came back: the episode ends
    watch.after_pass(evicted=0)
    assert watch.warning == ""
    assert any(r.levelno == logging.INFO and "holds again" in r.getMessage() for r in caplog.records)
    free[0] = 10 * GiB  # a new episode warns again
    watch.after_pass(evicted=1)
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


@pytest.mark.parametrize("floor, free", [(None, 1), (100, None)])
def test_nothing_to_watch_without_a_floor_or_a_reading(floor: int | None, free: int | None) -> None:
    watch = FloorWatch(floor, "/ssd", lambda: free)
    watch.after_pass(evicted=1)
    assert watch.warning == ""
