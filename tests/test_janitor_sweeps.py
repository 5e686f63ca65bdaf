"""When retention sweeps the chunk stores: after a pass that deleted parts, at start and on request, and on
the timer at most once per grace period; never after a commit's or a drain's pass that deleted nothing.

A sweep reads the whole job's listing (every part's manifest, every pack's
index) on a tier that may be a shared file system seen by thousands of
ranks. Every rank's commit and every part's drain asks for a retention pass;
sweeping after each of them cost the shared tier tens of thousands of
metadata calls per step at 64 ranks (bench_scale). The janitor, in process,
with a real chunk store on a real directory, counted at the store.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ckptstage.daemon.catalog.chunkstore import ChunkStore, Swept
from ckptstage.daemon.catalog.index import Catalog
from ckptstage.daemon.config import load_config
from ckptstage.daemon.metrics import Metrics
from ckptstage.daemon.retention.janitor import Janitor
from ckptstage.daemon.retention.job_rules import JobRules
from ckptstage.daemon.tiers.fs import FsTier
from ckptstage.daemon.tiers.interface import TierName
from ckptstage.protos import chunks
from support import booked_part

JOB = "sweeps"
LOCAL = TierName.LOCAL


class CountedStore(ChunkStore):
    """The real chunk store, counting the sweeps asked of it per store key."""

    def __init__(self, tier: FsTier) -> None:
        super().__init__(tier, grace_s=600.0)
        self.swept: list[str] = []

    def sweep(self, job: str, mark=None) -> Swept:  # type: ignore[no-untyped-def]
        self.swept.append(job)
        return super().sweep(job, mark)


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Janitor, Catalog, FsTier, CountedStore]:
    local = tmp_path / "local"
    config = load_config(None, {"local.dir": str(local), "local.keep_last": 2}, env={"HOME": str(tmp_path)})
    storage = FsTier(local, "n")
    store = CountedStore(storage)
    catalog = Catalog(tmp_path / "state" / "pins.json")
    janitor = Janitor(config, catalog, Metrics(), None, JobRules(tmp_path / "rules.json", storage),
                      lambda job, step, rank: False, {LOCAL: store}, tiers={LOCAL: storage})
    for step in (1, 2):
        booked_part(catalog, storage, LOCAL, JOB, step)
    chunks.store_dir(local, JOB).mkdir(parents=True)  # the job's chunk store (empty)
    return janitor, catalog, storage, store


@pytest.mark.parametrize("trigger", ["commit", "drain"])
def test_a_pass_after_a_commit_or_a_drain_that_deletes_nothing_sweeps_nothing(setup, trigger: str) -> None:
    janitor, _, _, store = setup
    for _ in range(5):
        assert janitor.apply(JOB, trigger=trigger, shared=False) == []
    assert store.swept == []


@pytest.mark.parametrize("trigger", ["commit", "drain", "timer", "gc"])
def test_a_pass_that_deletes_a_step_sweeps_the_jobs_store_and_the_users(setup, trigger: str) -> None:
    janitor, catalog, storage, store = setup
    booked_part(catalog, storage, LOCAL, JOB, 3)
    assert [a.step for a in janitor.apply(JOB, trigger=trigger, shared=False)] == [1]
    assert store.swept == [JOB, chunks.USER_STORE]


def test_start_and_gc_sweep_and_the_timer_at_most_once_per_grace_period(setup) -> None:
    janitor, _, _, store = setup
    janitor.apply(JOB, trigger="start", shared=False)
    assert store.swept == [JOB, chunks.USER_STORE]
    janitor.apply(JOB, trigger="timer", shared=False)  # within the grace of the sweep at start
    assert len(store.swept) == 2
    janitor.apply(JOB, trigger="gc", shared=False)  # on request
    assert len(store.swept) == 4
    store.grace_s = 0.0
    janitor.apply(JOB, trigger="timer", shared=False)
    assert len(store.swept) == 6


def test_a_deletion_another_node_carried_out_leaves_the_sweep_to_that_node(tmp_path: Path, setup) -> None:
    """Two daemons on one tier plan the same deletion: the one that removes the step sweeps, the other finds
    it gone and does not (a shared tier's store swept N times per deleted step is N full listings)."""
    janitor, catalog, storage, store = setup
    booked_part(catalog, storage, LOCAL, JOB, 3)
    seen_there, there = Catalog(tmp_path / "other.json"), FsTier(storage.root, "m")
    for step in (1, 2, 3):  # the other node's index of the same tier
        booked_part(seen_there, there, LOCAL, JOB, step, write=False)
    config = load_config(None, {"local.dir": str(storage.root), "local.keep_last": 2}, env={"HOME": str(tmp_path)})
    other_store = CountedStore(there)
    other = Janitor(config, seen_there, Metrics(), None, JobRules(tmp_path / "rules2.json", there),
                    lambda job, step, rank: False, {LOCAL: other_store}, tiers={LOCAL: there})
    assert [a.step for a in janitor.apply(JOB, trigger="drain", shared=False)] == [1]
    assert store.swept == [JOB, chunks.USER_STORE]
    assert [a.step for a in other.apply(JOB, trigger="drain", shared=False)] == [1]  # planned, found gone
    assert other_store.swept == []


def test_a_sweep_on_one_node_spaces_out_the_sweeps_of_the_others(tmp_path: Path, setup) -> None:
    """Nodes take turns deleting a shared tier's steps: each one's first deletion would sweep (it never swept),
    N sweeps per quarter of the grace; the store's note of its last sweep makes it one."""
    janitor, catalog, storage, store = setup
    there = FsTier(storage.root, "m")
    seen_there = Catalog(tmp_path / "other.json")
    config = load_config(None, {"local.dir": str(storage.root), "local.keep_last": 2}, env={"HOME": str(tmp_path)})
    other_store = CountedStore(there)
    other = Janitor(config, seen_there, Metrics(), None, JobRules(tmp_path / "rules2.json", there),
                    lambda job, step, rank: False, {LOCAL: other_store}, tiers={LOCAL: there})
    booked_part(catalog, storage, LOCAL, JOB, 3)
    assert [a.step for a in janitor.apply(JOB, trigger="drain", shared=False)] == [1]
    assert store.swept == [JOB, chunks.USER_STORE]
    assert there.swept_at(JOB) == pytest.approx(time.time(), abs=5)
    booked_part(catalog, storage, LOCAL, JOB, 4)
    for step in (2, 3, 4):
        booked_part(seen_there, there, LOCAL, JOB, step, write=False)
    assert [a.step for a in other.apply(JOB, trigger="drain", shared=False)] == [2]  # this node removed step 2
    assert other_store.swept == [chunks.USER_STORE]  # the job's store was swept a moment ago; the user's has none


def test_deleting_passes_sweep_a_store_at_most_once_per_quarter_of_the_grace(setup) -> None:
    """A chunk whose last reference went waits out the grace anyway: a sweep per deleting pass (a step a
    minute) would read the whole listing every step for little."""
    janitor, catalog, storage, store = setup
    booked_part(catalog, storage, LOCAL, JOB, 3)
    assert [a.step for a in janitor.apply(JOB, trigger="drain", shared=False)] == [1]
    assert len(store.swept) == 2
    booked_part(catalog, storage, LOCAL, JOB, 4)
    assert [a.step for a in janitor.apply(JOB, trigger="drain", shared=False)] == [2]
    assert len(store.swept) == 2  # within a quarter of the 600 s grace
    store.grace_s = 0.0
    booked_part(catalog, storage, LOCAL, JOB, 5)
    assert [a.step for a in janitor.apply(JOB, trigger="drain", shared=False)] == [3]
    assert len(store.swept) == 4
