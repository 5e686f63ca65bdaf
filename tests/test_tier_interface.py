"""The storage tier interface (daemon/tiers/interface.py) and its file-system implementation (daemon/tiers/fs.py).

The contract tests take a tier from the ``tier`` fixture and use only the
interface, so that a new kind of tier (an object store) runs the same ones by
adding itself to the fixture's parameters. The file-system tier is also held
to docs/FORMAT.md byte for byte: clients read its files directly.
"""

from __future__ import annotations

import errno
import inspect
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptstage.daemon.catalog import repack
from ckptstage.daemon.tiers import interface as tier_mod
from ckptstage.daemon.catalog.index import Catalog
from ckptstage.daemon.catalog.chunkstore import ChunkStore, referenced
from ckptstage.daemon.catalog.commits import Commits
from ckptstage.daemon.tiers.fs import FsTier
from ckptstage.daemon.tiers.interface import Tier, TierName
from ckptstage.protos import chunks, layout, packs
from s3server import object_bytes, open_tier, s3_server  # noqa: F401 - s3_server: the fixture
from support import RecordingTier

JOB = "tierjob"
OWNER = "node-a"
DATA = bytes(range(256)) * 40  # 10 KiB: three blocks of 4 KiB


def _manifest(step: int, rank: int, data: bytes, block: int = 4096, world_size: int = 1,
              chunk_list: list[list[Any]] | None = None) -> dict[str, Any]:
    manifest: dict[str, Any] = {
        "format": layout.FORMAT, "job": JOB, "step": step, "rank": rank, "world_size": world_size,
        "tensors": [], "tree": {}, "created": 1.0, "metrics": {}, "attempt": "run-1",
        "files": {layout.DATA_FILE: layout.FileEntry(len(data), block, tuple(layout.block_digests(data, block)))
                  .to_json()}}
    if chunk_list is not None:
        manifest["chunks"] = {layout.DATA_FILE: chunk_list}
    return manifest


def _publish(t: Tier, step: int, rank: int = 0, data: bytes = DATA, world_size: int = 1) -> tuple[Path, str]:
    """A part written through the interface only: a file at offsets, synced, then the manifest."""
    writer = t.begin_part(JOB, step, rank)
    try:
        sink = writer.create_file(layout.DATA_FILE, len(data), direct_io=False)
        try:
            half = len(data) // 2
            sink.write(memoryview(data)[half:], half)  # out of order, as the persister's pool writes
            sink.write(memoryview(data)[:half], 0)
            sink.sync()
        finally:
            sink.close()
        where = writer.commit(_manifest(step, rank, data, world_size=world_size))
    finally:
        writer.abort()
    return where, writer.manifest_digest


@pytest.fixture(params=["fs", "s3"])
def tier(request: Any, tmp_path: Path) -> Tier:
    """Each implementation of :class:`Tier`, empty, as the daemon ``node-a`` uses it (the object store:
    a fresh prefix of the session's SeaweedFS; skipped where it cannot start)."""
    if request.param == "s3":
        return open_tier(request.getfixturevalue("s3_server"), OWNER)
    return FsTier(tmp_path / "tier", OWNER)


def _put_chunks(t: Tier, items: dict[str, bytes]) -> None:
    """Chunks stored one each (name -> bytes), as stores written before packs hold them: a file or an object of
    their own (a batch writes a pack: see the pack tests, and tests/test_s3_packs.py)."""
    for name, data in items.items():
        location = chunks.chunk_path(chunks.store_dir(t.root, JOB), name)
        if isinstance(t, FsTier):
            location.parent.mkdir(parents=True, exist_ok=True)
            location.write_bytes(data)
        else:
            object_bytes(t, location, data)


def _stored(t: Tier, location: Path, data: bytes | None = None) -> bytes:
    """The bytes stored at a location (after writing ``data`` there behind the tier's back, if given):
    a file of the file-system tier, an object of the object store."""
    if isinstance(t, FsTier):
        if data is not None:
            location.write_bytes(data)
        return location.read_bytes()
    return object_bytes(t, location, data)


def _members(proto: type) -> dict[str, Any]:
    return {n: v for n, v in vars(proto).items() if not n.startswith("_") and callable(v)}


@pytest.mark.parametrize("proto", [tier_mod.PartIndex, tier_mod.PartStorage, tier_mod.ChunkStorage,
                                   tier_mod.Housekeeping])
def test_the_file_system_tier_implements_every_operation_with_its_parameters(proto: type, tmp_path: Path) -> None:
    fs = FsTier(tmp_path, OWNER)
    assert isinstance(fs, proto) and isinstance(fs, Tier)
    members = _members(proto)
    assert len(members) >= 5
    for name, declared in members.items():
        got = inspect.signature(getattr(FsTier, name))
        want = inspect.signature(declared)
        assert list(got.parameters) == list(want.parameters), name
        assert [p.default for p in got.parameters.values()] == [p.default for p in want.parameters.values()], name


def test_a_part_is_invisible_until_committed_and_then_has_the_documented_layout(tier: Tier) -> None:
    writer = tier.begin_part(JOB, 7, 0)
    sink = writer.create_file(layout.DATA_FILE, len(DATA), direct_io=False)
    sink.write(memoryview(DATA), 0)
    sink.sync()
    sink.close()
    assert list(tier.list_steps(JOB)) == [] and not tier.has_part(writer.final)
    manifest = _manifest(7, 0, DATA)
    where = writer.commit(manifest)
    assert where == writer.final == tier.part_location(JOB, 7, 0)
    [step] = list(tier.list_steps(JOB))
    assert (step.step, [p.rank for p in step.parts], step.record_ino) == (7, [0], None)
    assert step.path == tier.step_location(JOB, 7) == where.parent
    got, digest = tier.read_manifest(where)
    assert got == manifest and digest == writer.manifest_digest and tier.part_version(where) == writer.ino != 0
    assert tier.list_jobs() == [JOB]
    with tier.open_file(where, layout.DATA_FILE) as f:
        buf = bytearray(f.size)
        assert f.size == len(DATA) and f.readinto(memoryview(buf)) == len(DATA) and bytes(buf) == DATA
    tier.verify_part(where)


def test_the_file_system_tier_writes_docs_format_byte_for_byte(tmp_path: Path) -> None:
    fs = FsTier(tmp_path / "tier", OWNER)
    where, _ = _publish(fs, 120, rank=1, world_size=2)
    assert where == tmp_path / "tier" / JOB / "step-000000000120" / "rank-00001"
    assert sorted(os.listdir(where)) == [layout.DATA_FILE, layout.MANIFEST_FILE]
    assert (where / layout.DATA_FILE).read_bytes() == DATA
    assert (where / layout.MANIFEST_FILE).read_bytes() == layout.manifest_file_bytes(_manifest(120, 1, DATA, world_size=2))
    assert oct(os.stat(where / layout.MANIFEST_FILE).st_mode & 0o777) == oct(0o600)
    record = layout.CommitRecord(JOB, 120, "run-1", 1, 5.0, {0: layout.CommittedPart(len(DATA), "0" * 16)})
    assert fs.create_commit_record(where.parent, record)
    assert (where.parent / layout.COMMIT_FILE).read_bytes() == layout.commit_record_bytes(record)
    assert fs.readable_path(where) == where  # readers open these files themselves
    assert os.listdir(tmp_path / "tier" / layout.TMP_DIR / OWNER) == []  # no temporary left behind


def test_an_aborted_part_leaves_nothing_and_a_crashed_one_is_cleaned_on_start(tier: Tier) -> None:
    writer = tier.begin_part(JOB, 1, 0)
    writer.create_file(layout.DATA_FILE, 3, direct_io=False).close()
    writer.abort()
    assert list(tier.list_steps(JOB)) == [] and tier.clean_temporaries() == 0
    crashed = tier.begin_part(JOB, 2, 0)  # never committed nor aborted: the daemon died
    crashed.create_file(layout.DATA_FILE, 3, direct_io=False).close()
    assert tier.clean_temporaries() == 1
    assert tier.clean_temporaries() == 0 and list(tier.list_steps(JOB)) == []


def test_a_part_is_replaced_only_when_its_writer_allows_it(tier: Tier) -> None:
    where, first = _publish(tier, 3)
    asked: list[Path] = []
    writer = tier.begin_part(JOB, 3, 0, replace=lambda final: asked.append(final) is not None)
    with pytest.raises(FileExistsError):
        writer.commit(_manifest(3, 0, b""))
    writer.abort()
    assert asked == [where] and tier.read_manifest(where)[1] == first
    writer = tier.begin_part(JOB, 3, 0, replace=lambda final: True)
    writer.create_file(layout.DATA_FILE, 0, direct_io=False).close()
    writer.commit(_manifest(3, 0, b""))
    assert tier.read_manifest(where)[1] == writer.manifest_digest != first


def test_a_commit_record_is_created_exactly_once_among_racing_writers(tier: Tier) -> None:
    where, digest = _publish(tier, 5)
    step = where.parent
    assert not tier.has_commit_record(step) and tier.read_commit_record(step) is None
    records = [layout.CommitRecord(JOB, 5, f"run-{i}", 1, float(i), {0: layout.CommittedPart(len(DATA), digest)})
               for i in range(8)]
    won: list[int] = []
    barrier = threading.Barrier(len(records))

    def race(i: int) -> None:
        barrier.wait()
        if tier.create_commit_record(step, records[i]):
            won.append(i)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(len(records))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1
    assert tier.read_commit_record(step) == records[won[0]] and tier.record_version(step) != 0
    [listed] = list(tier.list_steps(JOB))
    assert listed.record_ino == tier.record_version(step)


def test_deleting_parts_then_the_record_removes_the_step(tier: Tier) -> None:
    where, digest = _publish(tier, 9)
    tier.create_commit_record(where.parent, layout.CommitRecord(JOB, 9, "run-1", 1, 1.0,
                                                                {0: layout.CommittedPart(len(DATA), digest)}))
    tier.remove_part(where)
    assert not tier.has_part(where)
    with pytest.raises(FileNotFoundError):
        tier.remove_part(where)
    [left] = list(tier.list_steps(JOB))
    assert left.parts == () and left.record_ino  # the record goes last
    tier.remove_commit_record(where.parent)
    assert list(tier.list_steps(JOB)) == [] and not tier.has_commit_record(where.parent)
    with pytest.raises(FileNotFoundError):
        tier.remove_commit_record(where.parent)


def test_a_step_index_reads_back_as_written_and_goes_with_the_record(tier: Tier) -> None:
    where, digest = _publish(tier, 10)
    step = where.parent
    assert tier.read_step_index(step) is None
    tier.write_step_index(step, b'{"first": 1}')
    tier.write_step_index(step, b'{"second": 2}')  # replaced whole
    assert tier.read_step_index(step) == b'{"second": 2}'
    tier.create_commit_record(step, layout.CommitRecord(JOB, 10, "run-1", 1, 1.0,
                                                        {0: layout.CommittedPart(len(DATA), digest)}))
    tier.remove_part(where)
    tier.remove_commit_record(step)
    assert tier.read_step_index(step) is None


def test_a_corrupt_byte_fails_verification_naming_the_block(tier: Tier) -> None:
    where, _ = _publish(tier, 4)
    path = where / layout.DATA_FILE
    data = bytearray(_stored(tier, path))
    data[5000] ^= 0x40  # block 1 of 4 KiB
    _stored(tier, path, bytes(data))
    with pytest.raises(layout.ChecksumMismatch, match=r"chunk 1 \(bytes 4096\.\.\)") as e:
        tier.verify_part(where)
    assert e.value.path == path


def test_new_chunks_are_visible_once_published_and_read_back_by_name(tier: Tier) -> None:
    """A store shows a batch's chunks when it is published (its pack's index), not before, and a discarded
    batch leaves none."""
    a, b = b"a" * 4096, b"b" * 100
    names = [chunks.digest(a), chunks.digest(b)]
    batch = tier.new_chunks(JOB)
    batch.write(names[0], memoryview(a), direct_io=False)
    batch.write(names[1], memoryview(b), direct_io=True)  # unaligned: falls back to buffered writes
    assert tier.missing_chunks(JOB, names) == names
    assert not tier.touch_chunk(JOB, names[0])
    batch.publish()
    batch.discard()  # a no-op once published
    assert tier.has_chunk_store(JOB) and tier.missing_chunks(JOB, names) == []
    assert sorted(tier.list_chunks(JOB)) == sorted(names)
    assert tier.chunk_size(JOB, names[1]) == 100 and tier.touch_chunk(JOB, names[1])
    with tier.open_chunk(JOB, names[0]) as f:
        assert f.size == 4096 and f.read(5000) == a
    c = chunks.digest(b"c")
    dropped = tier.new_chunks(JOB)
    dropped.write(c, memoryview(b"c"), direct_io=False)
    dropped.discard()
    assert tier.missing_chunks(JOB, [c]) == [c]
    with pytest.raises(FileNotFoundError):
        tier.open_chunk(JOB, c)
    assert tier.clean_temporaries() == 0  # batches leave no temporary behind
    assert tier.clean_abandoned() == 0  # nobody else wrote here


def test_an_incremental_part_publishes_its_chunks_before_its_manifest_and_holds_nothing_else(tmp_path: Path) -> None:
    fs = FsTier(tmp_path / "tier", OWNER)
    data = b"i" * 4096
    writer = fs.begin_part(JOB, 2, 0)
    batch = fs.new_chunks(JOB, writer)  # staged with the part: an abort takes it along
    batch.write(chunks.digest(data), memoryview(data), direct_io=False)
    batch.publish()
    assert fs.missing_chunks(JOB, [chunks.digest(data)]) == []
    where = writer.commit(_manifest(2, 0, data, chunk_list=[[chunks.digest(data), 4096]]))
    assert os.listdir(where) == [layout.MANIFEST_FILE]
    fs.verify_part(where)
    aborted = fs.begin_part(JOB, 3, 0)
    fs.new_chunks(JOB, aborted).write(chunks.digest(b"z"), memoryview(b"z"), direct_io=False)
    aborted.abort()
    assert fs.clean_temporaries() == 0 and fs.missing_chunks(JOB, [chunks.digest(b"z")]) == [chunks.digest(b"z")]


def test_condemned_chunks_go_only_when_untouched_and_come_back_on_request(tier: Tier) -> None:
    names = {n: chunks.digest(n.encode()) for n in ("old", "new", "back")}
    _put_chunks(tier, {name: text.encode() for text, name in names.items()})
    past, future = time.time() - 3600, time.time() + 3600
    assert not tier.condemn_chunk(JOB, names["new"], past)  # touched since: stays
    assert tier.condemn_chunk(JOB, names["old"], future) and tier.condemn_chunk(JOB, names["back"], future)
    assert not tier.condemn_chunk(JOB, names["old"], future)  # gone from the store already
    assert sorted(tier.condemned_chunks(JOB)) == sorted([names["old"], names["back"]])
    assert tier.list_chunks(JOB) == [names["new"]]
    tier.restore_chunk(JOB, names["back"])
    assert tier.delete_condemned_chunk(JOB, names["old"]) == 3
    with pytest.raises(FileNotFoundError):
        tier.delete_condemned_chunk(JOB, names["old"])
    assert tier.condemned_chunks(JOB) == [] and sorted(tier.list_chunks(JOB)) == sorted([names["new"], names["back"]])


def test_a_sweep_through_the_interface_keeps_exactly_the_chunks_a_manifest_names(tier: Tier) -> None:
    live, dead = b"L" * 4096, b"D" * 4096
    _put_chunks(tier, {chunks.digest(data): data for data in (live, dead)})
    writer = tier.begin_part(JOB, 1, 0)
    writer.commit(_manifest(1, 0, live, chunk_list=[[chunks.digest(live), len(live)]]))
    assert referenced(tier, JOB) == {chunks.digest(live)}
    assert tier.swept_at(JOB) is None
    swept = ChunkStore(tier, grace_s=-3600).sweep(JOB)  # everything is past its grace
    assert (swept.removed, swept.freed) == (1, 4096)
    assert tier.list_chunks(JOB) == [chunks.digest(live)]  # the note of the sweep is no chunk
    tier.verify_part(writer.final)  # an incremental part verifies through its chunks
    assert tier.swept_at(JOB) == pytest.approx(time.time(), abs=5)  # any node sharing the tier sees it


def test_manifests_of_replacements_being_assembled_count_for_the_mark(tmp_path: Path) -> None:
    fs = FsTier(tmp_path / "tier", OWNER)
    staged = tmp_path / "tier" / layout.TMP_DIR / "node-b" / "replace" / JOB / layout.step_dirname(3) / "rank-00000"
    staged.mkdir(parents=True)
    data = b"S" * 4096
    (staged / layout.MANIFEST_FILE).write_bytes(layout.manifest_file_bytes(
        _manifest(3, 0, data, chunk_list=[[chunks.digest(data), 4096]])))
    assert fs.list_manifests(JOB) == [staged]
    assert referenced(fs, JOB) == {chunks.digest(data)}
    before = fs.manifest_version(staged)
    (staged / layout.MANIFEST_FILE).write_bytes(layout.manifest_file_bytes(_manifest(3, 0, b"")))
    assert fs.manifest_version(staged) != before


def test_a_quarantined_part_leaves_every_listing_and_is_found_again(tier: Tier) -> None:
    where, _ = _publish(tier, 6)
    moved = tier.quarantine_part(where)
    assert not tier.has_part(where) and list(tier.list_steps(JOB)) == []
    [found] = tier.list_quarantined()
    assert (found.job, found.step, found.rank, found.location) == (JOB, 6, 0, moved)
    assert tier.quarantine_chunk(moved / layout.DATA_FILE) is None  # a part's own file is not a chunk


def test_a_corrupt_chunk_is_moved_out_of_its_store(tier: Tier) -> None:
    data = b"q" * 10
    _put_chunks(tier, {chunks.digest(data): data})
    moved = tier.quarantine_chunk(tier.chunk_location(JOB, chunks.digest(data)))
    assert moved is not None and _stored(tier, moved) == data
    assert tier.missing_chunks(JOB, [chunks.digest(data)]) == [chunks.digest(data)] and tier.list_chunks(JOB) == []


def test_quarantined_copies_are_listed_with_their_size_and_time_and_removed_alone(tier: Tier) -> None:
    before = time.time() - 5  # an object store's clock may lag ours a little
    part, _ = _publish(tier, 6)
    moved_part = tier.quarantine_part(part)
    data = b"c" * 1000
    _put_chunks(tier, {chunks.digest(data): data})
    moved_chunk = tier.quarantine_chunk(tier.chunk_location(JOB, chunks.digest(data)))
    assert moved_chunk is not None
    kept, _ = _publish(tier, 7)
    found = {q.location: q for q in tier.list_quarantined()}
    assert set(found) == {moved_part, moved_chunk}
    q_part, q_chunk = found[moved_part], found[moved_chunk]
    assert (q_part.step, q_part.rank, q_part.chunk) == (6, 0, "")
    assert q_part.nbytes >= len(DATA) and before <= q_part.since <= time.time() + 5
    assert (q_chunk.job, q_chunk.step, q_chunk.rank, q_chunk.chunk, q_chunk.nbytes) == \
        (JOB, None, None, chunks.digest(data), len(data))
    for refused in (kept, kept.parent, tier.chunk_location(JOB, chunks.digest(data))):
        with pytest.raises(ValueError):
            tier.delete_quarantined(refused)  # never a live part, a step, or the store's own chunk
    assert tier.delete_quarantined(moved_part) == q_part.nbytes
    assert tier.delete_quarantined(moved_chunk) == len(data)
    assert tier.list_quarantined() == [] and tier.has_part(kept)
    with pytest.raises(FileNotFoundError):
        tier.delete_quarantined(moved_part)


def test_job_documents_room_and_temporaries(tier: Tier) -> None:
    assert tier.read_job_json(JOB, "retention.json", {"none": 1}) == {"none": 1}
    tier.write_job_json(JOB, "retention.json", {"shared_keep_last": 3})
    assert tier.read_job_json(JOB, "retention.json", {}) == {"shared_keep_last": 3}
    assert tier.list_jobs() == [JOB] and list(tier.list_steps(JOB)) == []  # a document is no step
    usage = tier.usage()  # an object store sets no limit: it says so, with no figures
    assert (usage.free_bytes, usage.total_bytes) == (0, 0) if usage.unbounded else 0 < usage.free_bytes <= usage.total_bytes
    assert usage.unbounded == (type(tier).__name__ == "S3Tier")
    tier.prepare()
    staging = tier.root / layout.TMP_DIR / OWNER / "replace" / JOB
    assert not tier.discard_temporary(staging)


def test_the_file_system_tier_never_removes_a_temporary_through_a_link(tmp_path: Path) -> None:
    fs = FsTier(tmp_path / "tier", OWNER)
    fs.prepare()
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    (tmp_path / "tier" / layout.TMP_DIR).mkdir()
    (tmp_path / "tier" / layout.TMP_DIR / OWNER).symlink_to(outside, target_is_directory=True)
    with pytest.raises(OSError) as e:
        fs.discard_temporary(tmp_path / "tier" / layout.TMP_DIR / OWNER / "keep")
    assert e.value.errno == errno.ELOOP and (outside / "keep").is_dir()
    with pytest.raises(OSError) as e:
        fs.discard_temporary(tmp_path / "elsewhere")
    assert e.value.errno == errno.EXDEV
    with pytest.raises(ValueError):
        FsTier(tmp_path / "tier").begin_part(JOB, 1, 0)  # an indexing-only tier writes no temporaries


def test_the_catalogue_and_commits_use_whatever_tier_they_are_given(tmp_path: Path) -> None:
    """The seam a new kind of tier plugs into: the index and the commit records go through the interface."""
    fs = FsTier(tmp_path / "local", OWNER)
    _publish(fs, 11)
    tier = RecordingTier(fs)
    catalog = Catalog(tmp_path / "state" / "pins.json")
    assert catalog.load_tier(TierName.LOCAL, tier) == 1
    assert {"list_jobs", "list_steps", "read_manifest"} <= set(tier.calls)
    commits = Commits(catalog, tier, None)
    record = commits.seal_local(JOB, 11)
    assert record is not None and "create_commit_record" in tier.calls
    assert fs.read_commit_record(fs.step_location(JOB, 11)) == record
    ckpt = catalog.get(JOB, 11)
    assert ckpt is not None and ckpt.complete_on(TierName.LOCAL)


# --- packs: the file-system tier writes a batch of new chunks as one pack ------------------------------------


def test_a_batch_is_one_pack_published_by_its_index_and_read_by_range(tmp_path: Path) -> None:
    fs = FsTier(tmp_path / "tier", OWNER)
    items = {chunks.digest(d): d for d in (b"a" * 5000, b"b" * 4096, b"c" * 3)}
    batch = fs.new_chunks(JOB)
    for name, data in items.items():
        batch.write(name, memoryview(data), direct_io=True)
    assert fs.missing_chunks(JOB, list(items)) == list(items)  # nothing is in the store before publish
    batch.publish()
    [pack] = fs.list_packs(JOB)
    assert dict(pack.chunks) == {n: len(d) for n, d in items.items()} and fs.missing_chunks(JOB, list(items)) == []
    for name, data in items.items():
        with fs.open_chunk(JOB, name) as f:
            assert f.size == len(data) and f.read(1 << 20) == data  # its range only, nothing after it
    assert sorted(fs.list_chunks(JOB)) == sorted(items) and fs.clean_temporaries() == 0


def test_packs_are_condemned_put_back_and_deleted_whole_and_a_pack_with_no_index_is_none(tmp_path: Path) -> None:
    fs = FsTier(tmp_path / "tier", OWNER)
    for data in (b"1" * 10, b"2" * 10):
        batch = fs.new_chunks(JOB)
        batch.write(chunks.digest(data), memoryview(data), direct_io=False)
        batch.publish()
    first, second = sorted(fs.list_packs(JOB), key=lambda p: p.mtime)
    past, future = time.time() - 3600, time.time() + 3600
    assert not fs.condemn_pack(JOB, first.pack_id, past)  # written since: stays
    assert fs.condemn_pack(JOB, first.pack_id, future) and fs.condemn_pack(JOB, second.pack_id, future)
    assert fs.list_packs(JOB) == [] and fs.missing_chunks(JOB, [chunks.digest(b"1" * 10)]) != []
    assert {p.pack_id for p in fs.condemned_packs(JOB)} == {first.pack_id, second.pack_id}
    fs.restore_pack(JOB, first.pack_id)
    assert fs.delete_condemned_pack(JOB, second.pack_id) >= 10
    with pytest.raises(FileNotFoundError):
        fs.delete_condemned_pack(JOB, second.pack_id)
    assert [p.pack_id for p in fs.list_packs(JOB)] == [first.pack_id] and fs.condemned_packs(JOB) == []
    cut_short = packs.pack_path(chunks.store_dir(tmp_path / "tier", JOB), "cut-short")
    cut_short.write_bytes(b"x" * 100)  # its writer died before renaming the index in
    assert {p.pack_id: p.names for p in fs.list_packs(JOB)}["cut-short"] == frozenset()
    swept = ChunkStore(fs, grace_s=-3600).sweep(JOB, mark=lambda: {chunks.digest(b"1" * 10)})
    assert swept.restored == 0 and [p.pack_id for p in fs.list_packs(JOB)] == [first.pack_id]


@pytest.fixture(params=["fs", "s3"])
def ztier(request: Any, tmp_path: Path) -> Tier:
    """Each implementation of :class:`Tier` as a shared tier that keeps chunks compressed (``bg-zstd``)."""
    if request.param == "s3":
        return open_tier(request.getfixturevalue("s3_server"), OWNER, compression="bg-zstd")
    return FsTier(tmp_path / "tier", OWNER, compression="bg-zstd")


def _floats(n: int, seed: int) -> bytes:
    """``n`` float32 values of a normal distribution: model-state-like bytes that byte-grouped zstd shrinks."""
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32).tobytes()


def test_a_tier_that_compresses_serves_every_chunk_decoded_through_reads_repacks_and_quarantine(ztier: Tier) -> None:
    """A compressing tier keeps what shrinks as a codec frame (an index entry of four) and the rest as it is;
    every read of the interface (a chunk, a run, its size) gives the chunk's own bytes, a repack and a quarantine
    carry compressed chunks over intact, and a damaged frame is caught by the name check."""
    noise = np.random.default_rng(9).bytes(3 << 20)  # does not shrink: kept as it is
    kept = {chunks.digest(d): d for d in (_floats(64 << 10, 1), bytes(100_000), _floats(3000, 2))}
    items = {**kept, chunks.digest(noise): noise}
    batch = ztier.new_chunks(JOB)
    names = list(items)
    batch.write(names[0], memoryview(items[names[0]]), direct_io=True)
    joined = items[names[1]] + bytes(packs.page_up(100_000) - 100_000) + items[names[2]]
    batch.write_run([(names[1], 0, 100_000), (names[2], packs.page_up(100_000), 12000)], memoryview(joined),
                    direct_io=True)
    batch.write(names[3], memoryview(noise), direct_io=True)
    batch.publish()
    [pack] = ztier.list_packs(JOB)
    stored = dict(pack.chunks)
    assert stored[names[3]] == len(noise) and all(stored[n] < 0.95 * len(items[n]) for n in kept), stored
    assert ztier.compressed_sizes(JOB) == {n: stored[n] for n in kept}  # what ls and the metrics count
    for name, data in items.items():
        assert ztier.chunk_size(JOB, name) == len(data)
        with ztier.open_chunk(JOB, name) as f:
            assert f.size == len(data) and f.read(len(data) + 10) == data
    runs = ztier.chunk_runs(JOB, names, 16 << 20)
    assert sorted(r.names[0] for r in runs if r.coded) == sorted(kept) and all(len(r.chunks) == 1 for r in runs)
    for run in runs:
        with ztier.open_chunk_run(JOB, run) as f:
            got = f.read(f.size)
        assert all(chunks.digest(got[o:o + n]) == name for name, o, n in run.sized(len(got)))

    # A repack keeps the live compressed chunks (the noise is dead), each decoded and checked on the way.
    live = set(kept)
    assert repack.worth_repacking(pack, live)
    assert repack.repack(ztier, JOB, [pack], live) == sum(stored[n] for n in live)
    assert ztier.condemn_pack(JOB, pack.pack_id, time.time() + 3600)
    [moved] = ztier.list_packs(JOB)
    assert dict(moved.chunks).keys() == live and all(dict(moved.chunks)[n] < len(kept[n]) for n in live)
    for name in live:
        with ztier.open_chunk(JOB, name) as f:
            assert f.read(f.size) == kept[name]

    # A damaged frame: the chunk fails its name; the quarantine carries the others over, still compressed.
    bad = chunks.digest(_floats(64 << 10, 1))
    [run] = ztier.chunk_runs(JOB, [bad], 16 << 20)
    damaged = bytearray(_stored(ztier, run.path))
    damaged[run.offset + run.length // 2] ^= 0x01
    _stored(ztier, run.path, bytes(damaged))
    with ztier.open_chunk(JOB, bad) as f:
        assert chunks.digest(f.read(f.size)) != bad
    assert ztier.quarantine_chunk(ztier.chunk_location(JOB, bad)) is not None
    assert ztier.missing_chunks(JOB, list(live)) == [bad]
    for name in live - {bad}:
        with ztier.open_chunk(JOB, name) as f:
            assert f.read(f.size) == kept[name]
    [again] = ztier.list_packs(JOB)
    assert all(dict(again.chunks)[n] < len(kept[n]) for n in live - {bad})
