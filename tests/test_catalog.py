"""The catalogue's drained records and its re-reading of a tier other daemons write to."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

from ckptstage.daemon.catalog.index import Catalog, Part, TierName
from ckptstage.daemon.catalog.commits import Commits
from ckptstage.daemon.tiers.fs import FsTier
from ckptstage.protos.layout import scan_tier
from ckptstage.protos import layout
from support import commit_part as commit


def local_part(tier: Path, job: str, step: int, rank: int = 0, created: float = 1.0) -> Part:
    path = commit(tier, job, step, rank, world_size=1, created=created)
    return Part.read(layout.PartRef(job, step, rank, path), TierName.LOCAL, FsTier(tier, "test-node"))


def test_drained_records_survive_a_restart_and_go_with_the_local_part(tmp_path: Path) -> None:
    state, local = tmp_path / "state", tmp_path / "local"
    local_tier = FsTier(local, "test-node")
    cat = Catalog(state / "pins.json")
    parts = [local_part(local, "j", s) for s in (1, 2, 3)]
    for p in parts:
        cat.add(p)
    cat.mark_drained("j", 1, 0, parts[0].digest)
    cat.mark_drained("j", 2, 0, parts[1].digest)
    cat.remove(parts[0])  # deleted from local: its record goes too
    again = Catalog(state / "pins.json")
    again.load_tier(TierName.LOCAL, local_tier)
    assert [again.was_drained("j", s, 0) for s in (1, 2, 3)] == [False, True, False]
    # After a restart, records of parts that are no longer on the local tier are pruned.
    cat.mark_drained("j", 3, 0, parts[2].digest)
    shutil.rmtree(parts[2].path)
    fresh = Catalog(state / "pins.json")
    fresh.load_tier(TierName.LOCAL, local_tier)
    assert fresh.prune_drained() == 1
    assert [fresh.was_drained("j", s, 0) for s in (2, 3)] == [True, False]
    reloaded = Catalog(state / "pins.json")
    reloaded.load_tier(TierName.LOCAL, local_tier)
    assert [reloaded.was_drained("j", s, 0) for s in (2, 3)] == [True, False]


def test_a_drained_record_names_the_part_not_the_name(tmp_path: Path) -> None:
    """A part replaced under the same (job, step, rank) (a save with overwrite) is not drained because its
    predecessor was, also across a restart that comes between the replacement and the record's update."""
    state, local = tmp_path / "state", tmp_path / "local"
    local_tier = FsTier(local, "test-node")
    cat = Catalog(state / "pins.json")
    old = local_part(local, "j", 5)
    cat.add(old)
    cat.mark_drained("j", 5, 0, old.digest)
    shutil.rmtree(old.path)
    new = local_part(local, "j", 5, created=2.0)  # written again: another manifest under the same name
    assert new.digest != old.digest
    restarted = Catalog(state / "pins.json")  # the record of the old part is still in the file
    restarted.load_tier(TierName.LOCAL, local_tier)
    assert not restarted.was_drained("j", 5, 0)
    assert restarted.prune_drained() == 1
    # A record written by an older daemon names no digest: it still counts for the part that is there.
    (state / "drained.json").write_text('[["j", 5, 0]]')
    legacy = Catalog(state / "pins.json")
    legacy.load_tier(TierName.LOCAL, local_tier)
    assert legacy.was_drained("j", 5, 0)


def test_concurrent_drained_records_all_reach_the_file(tmp_path: Path) -> None:
    cat = Catalog(tmp_path / "pins.json")

    def mark(rank: int) -> None:
        for step in range(40):
            cat.mark_drained("j", step, rank, "")

    threads = [threading.Thread(target=mark, args=(r,)) for r in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reloaded = Catalog(tmp_path / "pins.json")
    missing = [(s, r) for s in range(40) for r in range(6) if not reloaded.was_drained("j", s, r)]
    assert missing == []


def test_sync_job_sees_other_nodes_parts_appear_and_vanish(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    fs = FsTier(shared, "test-node")
    cat = Catalog(tmp_path / "state" / "pins.json")
    mine = commit(shared, "j", 1, 0)
    cat.load_tier(TierName.SHARED, fs)
    ckpt = cat.get("j", 1)
    assert ckpt is not None and not ckpt.complete
    theirs = commit(shared, "j", 1, 1)  # the other node's rank
    commit(shared, "j", 2, 1)
    commit(shared, "other", 1, 0)  # another job: not this sync's business
    assert cat.sync_job(TierName.SHARED, fs, "j", step=1) == (1, 0)
    ckpt = cat.get("j", 1)
    # Both ranks are indexed, but a step exists only once its commit record is there.
    assert ckpt is not None and ckpt.ranks_on(TierName.SHARED) == [0, 1] and not ckpt.complete
    assert cat.get("j", 2) is None
    Commits(cat, FsTier(tmp_path / "local", "test-node"), fs).seal_shared("j", 1)
    ckpt = cat.get("j", 1)
    assert ckpt is not None and ckpt.complete_on(TierName.SHARED)
    assert layout.read_commit_record(shared / "j" / layout.step_dirname(1)) == ckpt.records[TierName.SHARED]
    assert cat.sync_job(TierName.SHARED, fs, "j") == (1, 0)
    assert cat.sync_job(TierName.SHARED, fs, "j") == (0, 0)  # known parts are not read again
    shutil.rmtree(theirs)  # the other node's retention deleted its part
    shutil.rmtree(shared / "j" / layout.step_dirname(2))
    assert cat.sync_job(TierName.SHARED, fs, "j") == (0, 2)
    assert [c.step for c in cat.checkpoints("j")] == [1]
    assert cat.get("other", 1) is None
    assert {r.path for r in scan_tier(shared, "j")} == {mine}
    assert list(scan_tier(shared, "nosuchjob")) == []
    assert list(scan_tier(shared, "j", step=7)) == []
