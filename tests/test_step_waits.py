"""Commits.wait_step sleeps on the records this daemon indexes: a local commit, or a replacement swapped in,
wakes it at once (it polled every 0.25 s); only waits that involve the shared tier, where other nodes write,
re-read it on a poll. Real catalogue, real commits, a real file-system tier."""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

from ckptstage.daemon.catalog import commits as commits_mod
from ckptstage.daemon.catalog.index import Catalog, Checkpoint, Part, TierName
from ckptstage.daemon.catalog.commits import Commits
from ckptstage.daemon.tiers.fs import FsTier
from ckptstage.protos import layout

JOB = "waitjob"
OWNER = "node-a"
DATA = b"w" * 5000


def _manifest(step: int, attempt: str = "run-1") -> dict[str, Any]:
    return {"format": layout.FORMAT, "job": JOB, "step": step, "rank": 0, "world_size": 1, "tensors": [],
            "tree": {}, "created": 1.0, "metrics": {}, "attempt": attempt,
            "files": {layout.DATA_FILE: layout.FileEntry(len(DATA), 4096, tuple(layout.block_digests(DATA, 4096)))
                      .to_json()}}


def _commit_part(tier: FsTier, catalog: Catalog, step: int, final: Path | None = None,
                 attempt: str = "run-1") -> Part:
    """Publishes rank 0's part of ``step`` and indexes it, as the persister and the node do."""
    writer = tier.begin_part(JOB, step, 0, replace=lambda _: True, final=final)
    try:
        sink = writer.create_file(layout.DATA_FILE, len(DATA), direct_io=False)
        sink.write(memoryview(DATA), 0)
        sink.sync()
        sink.close()
        where = writer.commit(_manifest(step, attempt))
    finally:
        writer.abort()
    part = Part.read(layout.PartRef(JOB, step, 0, where, tier.part_version(where)), TierName.LOCAL, tier)
    if final is None:
        catalog.add(part)
    return part


class _Waiter(threading.Thread):
    """One wait_step on a thread of its own: what it returned, and when."""

    def __init__(self, commits: Commits, step: int, tier: TierName | None, timeout: float = 10.0,
                 refresh: Any = None, stop: threading.Event | None = None) -> None:
        super().__init__(daemon=True)
        self.args_ = (commits, step, tier, timeout, refresh, stop)
        self.result: Checkpoint | None = None
        self.ended = 0.0

    def run(self) -> None:
        commits, step, tier, timeout, refresh, stop = self.args_
        self.result = commits.wait_step(JOB, step, tier, timeout, refresh, stop=stop)
        self.ended = time.monotonic()


def _setup(tmp_path: Path) -> tuple[FsTier, Catalog, Commits]:
    tier = FsTier(tmp_path / "local", OWNER)
    catalog = Catalog(tmp_path / "state" / "pins.json")
    return tier, catalog, Commits(catalog, tier, None)


def test_a_local_commit_wakes_a_local_step_wait_at_once_and_nothing_polls(tmp_path: Path) -> None:
    tier, catalog, commits = _setup(tmp_path)
    refreshed: list[int] = []
    delays = []
    for step in range(1, 6):
        waiter = _Waiter(commits, step, TierName.LOCAL, refresh=lambda j, s, w: refreshed.append(s))
        waiter.start()
        time.sleep(0.1)  # asleep in the wait by now
        assert waiter.is_alive()
        _commit_part(tier, catalog, step)
        assert commits.seal_local(JOB, step) is not None
        sealed = time.monotonic()
        waiter.join(10)
        assert waiter.result is not None and waiter.result.complete_on(TierName.LOCAL)
        delays.append(waiter.ended - sealed)
    # A poll every 0.25 s would make the median about 0.125 s.
    assert statistics.median(delays) < 0.05, delays
    assert refreshed == []  # only this daemon writes the local tier: nothing to re-read


def test_a_replacement_swapped_in_wakes_a_wait_for_the_step_on_that_tier(tmp_path: Path) -> None:
    tier, catalog, commits = _setup(tmp_path)
    # The step is complete on the shared tier only (its local copy went): a local wait waits.
    _commit_part(tier, catalog, 4)
    record = commits.seal_local(JOB, 4)
    assert record is not None
    catalog.drop_record(TierName.LOCAL, JOB, 4)
    catalog.remove(catalog.parts_of(JOB, 4, 0)[TierName.LOCAL])
    tier.remove_part(tier.part_location(JOB, 4, 0))
    tier.remove_commit_record(tier.step_location(JOB, 4))
    waiter = _Waiter(commits, 4, TierName.LOCAL)
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive()
    staged = _commit_part(tier, catalog, 4, final=tier.staged_location(JOB, 4, 0), attempt="run-2")
    replacement = commits.replacement_record(JOB, 4, "run-2", 1, {0: staged})
    assert commits.swap_in(TierName.LOCAL, replacement, {0: staged})
    swapped = time.monotonic()
    waiter.join(10)
    assert waiter.result is not None and waiter.result.records[TierName.LOCAL] == replacement
    assert waiter.ended - swapped < 0.2


def test_a_wait_involving_the_shared_tier_still_re_reads_it_on_a_poll(tmp_path: Path) -> None:
    _, _, commits = _setup(tmp_path)
    for tier in (TierName.SHARED, None):
        calls: list[float] = []
        waiter = _Waiter(commits, 9, tier, timeout=1.0, refresh=lambda j, s, w: calls.append(time.monotonic()))
        waiter.start()
        waiter.join(10)
        assert waiter.result is None  # nobody commits step 9
        gaps = [b - a for a, b in zip(calls, calls[1:])]
        assert 3 <= len(calls) <= 6 and min(gaps) >= commits_mod.POLL_S * 0.9, (tier, gaps)


def test_stopping_ends_a_step_wait_at_once(tmp_path: Path) -> None:
    _, _, commits = _setup(tmp_path)
    stop = threading.Event()
    waiter = _Waiter(commits, 3, TierName.LOCAL, timeout=30.0, stop=stop)
    waiter.start()
    time.sleep(0.1)
    stop.set()
    commits.wake()  # what Node.shutdown does after setting its stop event
    stopped = time.monotonic()
    waiter.join(10)
    assert not waiter.is_alive() and waiter.result is None and waiter.ended - stopped < 0.2
