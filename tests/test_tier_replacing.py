"""Replacing a committed step as tier operations (daemon/tiers/interface.py ``Replacing``), on every implementation.

The contract: a replacement's parts are published out of sight, the whole
step is swapped in with its new commit record, and the old step is gone;
the catalogue learns of it through overwrite.Swapper, which reaches the tier
only through the interface.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

from ckptstage.daemon.catalog import overwrite
from ckptstage.daemon.tiers import fsreplace
from ckptstage.daemon.tiers import interface as tier_mod
from ckptstage.daemon.catalog.index import Catalog, TierName
from ckptstage.daemon.catalog.commits import Commits, complete_attempt
from ckptstage.daemon.tiers.fs import FsTier
from ckptstage.daemon.tiers.interface import Tier
from ckptstage.protos import layout
from support import RecordingTier

JOB = "swapjob"
OWNER = "node-a"


def _manifest(step: int, rank: int, data: bytes, attempt: str, world_size: int) -> dict[str, Any]:
    return {"format": layout.FORMAT, "job": JOB, "step": step, "rank": rank, "world_size": world_size,
            "tensors": [], "tree": {}, "created": 1.0, "metrics": {}, "attempt": attempt,
            "files": {layout.DATA_FILE: layout.FileEntry(len(data), 4096, tuple(layout.block_digests(data, 4096)))
                      .to_json()}}


def _publish(t: Tier, step: int, rank: int, data: bytes, attempt: str = "run-1", world_size: int = 2,
             staged: bool = False) -> Path:
    final = t.staged_location(JOB, step, rank) if staged else None
    writer = t.begin_part(JOB, step, rank, replace=(lambda _: True) if staged else None, final=final)
    try:
        sink = writer.create_file(layout.DATA_FILE, len(data), direct_io=False)
        try:
            sink.write(memoryview(data), 0)
            sink.sync()
        finally:
            sink.close()
        return writer.commit(_manifest(step, rank, data, attempt, world_size))
    finally:
        writer.abort()


def _record(t: Tier, step: int, attempt: str, staged: bool) -> layout.CommitRecord:
    refs = t.list_staged(JOB, step) if staged else [r for s in t.list_steps(JOB, step) for r in s.parts]
    parts = {r.rank: layout.CommittedPart(100, t.read_manifest(r.path)[1]) for r in refs}
    return layout.CommitRecord(JOB, step, attempt, len(parts), 2.0, parts)


def _data_of(t: Tier, part: Path) -> bytes:
    with t.open_file(part, layout.DATA_FILE) as f:
        return f.read(f.size)


@pytest.fixture(params=["fs", "fs-no-exchange"])
def tier(request: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Tier:
    """Each implementation of :class:`Tier`; the file-system tier also where the file system has no atomic
    exchange (NFS): two renames."""
    if request.param == "fs-no-exchange":
        monkeypatch.setattr(fsreplace, "_rename_exchange", lambda a, b: False)
    return FsTier(tmp_path / "tier", OWNER)


def test_the_file_system_tier_implements_replacing_with_its_parameters(tmp_path: Path) -> None:
    fs = FsTier(tmp_path, OWNER)
    assert isinstance(fs, tier_mod.Replacing) and isinstance(fs, Tier)
    members = {n: v for n, v in vars(tier_mod.Replacing).items() if not n.startswith("_") and callable(v)}
    assert set(members) == {"staged_location", "list_staged", "swap_in", "discard_staged", "recover_staged"}
    for name, declared in members.items():
        got, want = inspect.signature(getattr(FsTier, name)), inspect.signature(declared)
        assert list(got.parameters) == list(want.parameters), name


def test_a_staged_replacement_is_invisible_until_swapped_in_whole(tier: Tier) -> None:
    old = [_publish(tier, 5, r, b"old-%d" % r * 100) for r in (0, 1)]
    tier.create_commit_record(tier.step_location(JOB, 5), _record(tier, 5, "run-1", staged=False))
    _publish(tier, 5, 0, b"new-0" * 100, attempt="run-2", staged=True)
    # One rank staged: the step is still the old one; the staged part is listed only as staged.
    assert [r.rank for r in tier.list_staged(JOB, 5)] == [0]
    assert [(s.step, [p.path for p in s.parts]) for s in tier.list_steps(JOB)] == [(5, old)]
    assert _data_of(tier, old[0]) == b"old-0" * 100
    assert tier.staged_location(JOB, 5, 0) in tier.list_manifests(JOB)  # its chunks count for a sweep
    _publish(tier, 5, 1, b"new-1" * 100, attempt="run-2", staged=True)
    record = _record(tier, 5, "run-2", staged=True)
    assert tier.swap_in(record)
    assert tier.read_commit_record(tier.step_location(JOB, 5)) == record
    [step] = list(tier.list_steps(JOB))
    assert [p.rank for p in step.parts] == [0, 1]
    assert [_data_of(tier, tier.part_location(JOB, 5, r)) for r in (0, 1)] == [b"new-0" * 100, b"new-1" * 100]
    assert tier.list_staged(JOB, 5) == [] and tier.staged_location(JOB, 5, 0) not in tier.list_manifests(JOB)
    assert not tier.swap_in(record)  # swapped in already
    if isinstance(tier, FsTier):  # the old step is gone, not left in the temporaries
        assert not [p for p in tier.root.rglob("*") if p.is_file() and b"old-" in p.read_bytes()]


def test_a_replacement_of_a_step_gone_meanwhile_becomes_the_step(tier: Tier) -> None:
    _publish(tier, 8, 0, b"x" * 5000, world_size=1, staged=True)
    record = _record(tier, 8, "run-1", staged=True)
    assert tier.swap_in(record)
    assert tier.read_commit_record(tier.step_location(JOB, 8)) == record
    assert _data_of(tier, tier.part_location(JOB, 8, 0)) == b"x" * 5000


def test_a_discarded_replacement_leaves_the_step_alone(tier: Tier) -> None:
    old = _publish(tier, 3, 0, b"old" * 100, world_size=1)
    assert not tier.discard_staged(JOB, 3)
    _publish(tier, 3, 0, b"new" * 100, world_size=1, staged=True)
    assert tier.discard_staged(JOB, 3)
    assert tier.list_staged(JOB, 3) == [] and not tier.swap_in(_record(tier, 3, "run-1", staged=False))
    assert _data_of(tier, old) == b"old" * 100


def test_recovery_rolls_a_sealed_replacement_forward_only_where_no_step_is_in_place(tmp_path: Path) -> None:
    # What a crash leaves, on the file-system tier: a staged step with its record written, and either the
    # old step still in place (crash before the swap) or none (crash between the two renames).
    for old_in_place, expect in ((True, b"old" * 10), (False, b"new" * 10)):
        fs = FsTier(tmp_path / f"tier-{old_in_place}", OWNER)
        if old_in_place:
            _publish(fs, 4, 0, b"old" * 10, world_size=1)
        _publish(fs, 4, 0, b"new" * 10, world_size=1, staged=True)
        staged_step = fs.staged_location(JOB, 4, 0).parent
        (staged_step / layout.COMMIT_FILE).write_bytes(layout.commit_record_bytes(_record(fs, 4, "run-1", True)))
        assert fs.recover_staged() == (0 if old_in_place else 1)
        fs.clean_temporaries()
        assert _data_of(fs, fs.part_location(JOB, 4, 0)) == expect
        assert fs.list_staged(JOB, 4) == []


def test_the_swapper_replaces_a_step_through_the_interface_and_the_catalogue_follows(tmp_path: Path) -> None:
    fs = FsTier(tmp_path / "local", OWNER)
    for r in (0, 1):
        _publish(fs, 6, r, b"old" * 100)
    catalog = Catalog(tmp_path / "state" / "pins.json")
    catalog.load_tier(TierName.LOCAL, fs)
    commits = Commits(catalog, fs, None)
    assert commits.seal_local(JOB, 6) is not None
    for r in (0, 1):
        _publish(fs, 6, r, b"new" * 100, attempt="run-2", staged=True)
    tier = RecordingTier(fs)
    staged = overwrite.staged_parts(tier, TierName.LOCAL, JOB, 6)  # type: ignore[arg-type]
    found = complete_attempt(staged)
    assert found is not None and found[0] == "run-2"
    record = commits.replacement_record(JOB, 6, "run-2", found[1], found[2])
    moved = overwrite.Swapper(catalog, {TierName.LOCAL: tier}).swap_in(  # type: ignore[dict-item]
        TierName.LOCAL, record, found[2])
    assert {"list_staged", "read_manifest", "swap_in", "part_location", "part_version", "record_version"} <= \
        set(tier.calls)
    ckpt = catalog.get(JOB, 6)
    assert ckpt is not None and ckpt.complete_on(TierName.LOCAL) and ckpt.records[TierName.LOCAL] == record
    assert [p.path for p in moved] == [fs.part_location(JOB, 6, r) for r in (0, 1)]
    assert all(p.ino == fs.part_version(p.path) != 0 for p in moved)
    assert record.replaces and _data_of(fs, fs.part_location(JOB, 6, 1)) == b"new" * 100
