"""Sealing a step on the shared tier at a cost linear in the job: one listing per node, the W manifests read on
one node (the seal claim), every other node indexing the step from its record alone.

Real files on a real directory; the only seam is a count of the manifests a tier opens (``CountingTier``).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from ckptstage.daemon.catalog.commits import Commits
from ckptstage.daemon.catalog.index import Catalog, Part, TierName
from ckptstage.daemon.drain.queue import DrainQueue
from ckptstage.daemon.config import SharedConfig
from ckptstage.daemon.tiers.fs import FsTier
from ckptstage.protos import layout
from support import commit_part

JOB, STEP, WORLD = "sealjob", 3, 6


class CountingTier(FsTier):
    """An FsTier that counts the manifests it reads."""

    def __init__(self, root: Path, owner: str) -> None:
        super().__init__(root, owner)
        self.manifests_read = 0

    def read_manifest(self, part: Path) -> Any:
        self.manifests_read += 1
        return super().read_manifest(part)


def node(tmp: Path, name: str, shared: Path) -> tuple[Catalog, Commits, CountingTier]:
    catalog = Catalog(tmp / name / "pins.json")
    tier = CountingTier(shared, name)
    return catalog, Commits(catalog, FsTier(tmp / name / "local", name), tier), tier


def publish(shared: Path, ranks: range, attempt: str = "run") -> None:
    for rank in ranks:
        commit_part(shared, JOB, STEP, rank, world_size=WORLD, created=100.0 + rank, attempt=attempt,
                    metrics={"loss": 0.5} if rank == 0 else {})


def step_dir(shared: Path) -> Path:
    return layout.step_dir(shared, JOB, STEP)


def test_a_node_that_finds_a_rank_missing_reads_nothing_and_the_last_one_seals(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    _, first, tier_a = node(tmp_path, "a", shared)
    _, last, tier_b = node(tmp_path, "b", shared)
    publish(shared, range(0, 3))
    assert first.seal_shared(JOB, STEP, WORLD) is None
    assert tier_a.manifests_read == 0  # one listing said rank 3 is not there yet
    publish(shared, range(3, WORLD))
    record = last.seal_shared(JOB, STEP, WORLD)
    assert record is not None and sorted(record.parts) == list(range(WORLD))
    assert tier_b.manifests_read == WORLD  # each part's manifest, once
    assert not (step_dir(shared) / layout.SEAL_CLAIM_FILE).exists()  # given back once sealed
    assert layout.read_commit_record(step_dir(shared)) == record


def test_a_claimed_step_is_left_to_its_holder_and_recovery_seals_it_anyway(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    publish(shared, range(WORLD))
    (step_dir(shared) / layout.SEAL_CLAIM_FILE).write_text("node-that-died")
    catalog, commits, tier = node(tmp_path, "b", shared)
    assert commits.seal_shared(JOB, STEP, WORLD) is None
    assert tier.manifests_read == 0 and not layout.commit_path(shared, JOB, STEP).exists()
    # A daemon starting seals what it finds whole, claim or not (the holder may never come back).
    catalog.load_tier(TierName.SHARED, tier)
    assert commits.seal_all(TierName.SHARED) == 1
    assert layout.commit_path(shared, JOB, STEP).exists()
    ckpt = catalog.get(JOB, STEP)
    assert ckpt is not None and ckpt.complete_on(TierName.SHARED)


def test_a_claim_that_cannot_seal_is_given_back(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    publish(shared, range(0, 3), attempt="old")
    publish(shared, range(3, WORLD), attempt="new")  # two attempts never add up to a step
    _, commits, _ = node(tmp_path, "a", shared)
    assert commits.seal_shared(JOB, STEP, WORLD) is None
    assert not (step_dir(shared) / layout.SEAL_CLAIM_FILE).exists()
    assert not layout.commit_path(shared, JOB, STEP).exists()


def test_of_nodes_finding_every_part_at_once_one_reads_the_manifests(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    publish(shared, range(WORLD))
    nodes = [node(tmp_path, f"n{i}", shared) for i in range(6)]
    start = threading.Barrier(len(nodes))
    records: list[Any] = []

    def seal(commits: Commits) -> None:
        start.wait()
        records.append(commits.seal_shared(JOB, STEP, WORLD))

    threads = [threading.Thread(target=seal, args=(commits,)) for _, commits, _ in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reads = sorted(tier.manifests_read for _, _, tier in nodes)
    # The holder reads W; a node that lost the claim reads none (it may find the record made meanwhile,
    # which costs it the record only). Without the claim every node would read all W.
    assert reads[-1] == WORLD and sum(reads) == WORLD, reads
    assert layout.commit_path(shared, JOB, STEP).exists()
    assert sum(r is not None for r in records) >= 1


def test_another_node_indexes_a_sealed_step_from_its_record_without_opening_a_manifest(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    publish(shared, range(WORLD))
    _, sealer, _ = node(tmp_path, "a", shared)
    assert sealer.seal_shared(JOB, STEP, WORLD) is not None
    catalog, _, tier = node(tmp_path, "b", shared)
    catalog.sync_job(TierName.SHARED, tier, JOB, uncommitted=False)
    ckpt = catalog.get(JOB, STEP)
    assert ckpt is not None and ckpt.complete_on(TierName.SHARED)
    assert tier.manifests_read == 0
    assert ckpt.metrics == {"loss": 0.5} and ckpt.created == 100.0  # what the manifests said, from the record
    parts = [ckpt.parts[r][TierName.SHARED] for r in range(WORLD)]
    assert [p.nbytes for p in parts] == [0] * WORLD and {p.attempt for p in parts} == {"run"}


def test_a_record_written_before_records_named_when_parts_were_saved_still_indexes(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    publish(shared, range(WORLD))
    tier = CountingTier(shared, "a")
    digests = {r: tier.read_manifest(layout.part_dir(shared, JOB, STEP, r))[1] for r in range(WORLD)}
    old = layout.CommitRecord(JOB, STEP, "run", WORLD, 200.0, {r: layout.CommittedPart(0, d) for r, d in digests.items()})
    assert '"created"' not in layout.commit_record_bytes(old).decode().split('"parts"')[1]
    assert tier.create_commit_record(step_dir(shared), old)
    catalog = Catalog(tmp_path / "b" / "pins.json")
    tier.manifests_read = 0
    catalog.sync_job(TierName.SHARED, tier, JOB, uncommitted=False)
    ckpt = catalog.get(JOB, STEP)
    assert ckpt is not None and ckpt.complete_on(TierName.SHARED) and tier.manifests_read == WORLD


def test_a_watcher_reads_no_part_of_a_step_still_draining_and_one_record_once_it_is_sealed(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    publish(shared, range(0, 3))
    catalog, _, tier = node(tmp_path, "watcher", shared)
    assert catalog.sync_record(TierName.SHARED, tier, JOB, STEP) == (0, 0)
    catalog.sync_job(TierName.SHARED, tier, JOB, uncommitted=False)
    assert tier.manifests_read == 0 and catalog.get(JOB, STEP) is None
    publish(shared, range(3, WORLD))
    _, sealer, _ = node(tmp_path, "sealer", shared)
    assert sealer.seal_shared(JOB, STEP, WORLD) is not None
    assert catalog.sync_record(TierName.SHARED, tier, JOB, STEP) == (WORLD, 0)
    assert tier.manifests_read == 0
    assert catalog.sync_record(TierName.SHARED, tier, JOB, STEP) == (0, 0)  # nothing changed: one stat
    # Asked for everything (a listing of the job, a deletion), the parts of a step not sealed are read.
    commit_part(shared, JOB, STEP + 1, 0, world_size=WORLD, attempt="run")
    catalog.sync_job(TierName.SHARED, tier, JOB)
    ckpt = catalog.get(JOB, STEP + 1)
    assert ckpt is not None and ckpt.ranks_on(TierName.SHARED) == [0] and tier.manifests_read == 1


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_of_two_workers_finishing_a_steps_last_parts_exactly_one_looks_at_the_step(tmp_path: Path,
                                                                                 order: str) -> None:
    catalog = Catalog(tmp_path / "pins.json")
    queue = DrainQueue(SharedConfig(dir=tmp_path / "shared"), catalog)
    local = FsTier(tmp_path / "local", "n")
    for rank in (0, 1):
        path = commit_part(tmp_path / "local", JOB, STEP, rank, world_size=2, attempt="run")
        part = Part.read(layout.PartRef(JOB, STEP, rank, path), TierName.LOCAL, local)
        catalog.add(part)
        queue.enqueue(part)
    queue.indexed()
    claimed = [queue.claim(), queue.claim()]
    assert all(c is not None for c in claimed)
    first, second = (claimed if order == "ab" else claimed[::-1])
    assert first is not None and second is not None
    assert queue.copied(first[0]) is False  # the other part of the step is still in copy here
    assert queue.copied(second[0]) is True
