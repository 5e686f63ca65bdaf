"""Chunk packs on the object store (daemon/tiers/s3/packbatch.py, packs.py), against a real SeaweedFS.

A batch's chunks go up as a few pack objects (multipart where a pack passes a piece), never an object per
chunk; what a batch abandons leaves nothing; the sweep's calls move a pack whole, repack a mostly dead one and
remove what a dead writer left; a corrupt pack goes aside with its intact chunks kept; a pack cut short is
found on read; a real daemon drains a part with many chunks as two objects, and its own retention removes the
packs only deleted steps named.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed")

from ckptstage.client import Client  # noqa: E402
from ckptstage.daemon.catalog.chunkstore import ChunkStore  # noqa: E402
from ckptstage.daemon.launcher import DaemonProcess  # noqa: E402
from ckptstage.daemon.tiers.s3 import packbatch  # noqa: E402
from ckptstage.daemon.tiers.s3 import packs as s3packs  # noqa: E402
from ckptstage.daemon.tiers.s3.client import Location, open_connection  # noqa: E402
from ckptstage.daemon.tiers.s3.io import MIN_PIECE_BYTES  # noqa: E402
from ckptstage.daemon.tiers.s3.tier import S3Tier  # noqa: E402
from ckptstage.protos import chunks, layout, packs  # noqa: E402
from conftest import DEFAULTS  # noqa: E402
from s3server import ACCESS_KEY, BUCKET, REGION, SECRET_KEY, S3Server, s3_server  # noqa: E402
from support import wait_until  # noqa: E402

JOB = "packs"
_ = s3_server  # the session's server, a fixture


def _tier(server: S3Server, prefix: str, piece_bytes: int = MIN_PIECE_BYTES) -> S3Tier:
    conn = open_connection(Location(BUCKET, prefix), server.endpoint, REGION,
                           access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY)
    return S3Tier(conn, "node-a", piece_bytes=piece_bytes)


def _calls(tier: S3Tier) -> list[str]:
    sent: list[str] = []
    tier.connection.client.meta.events.register("before-call.s3", lambda model, **_: sent.append(model.name))
    return sent


def _keys(tier: S3Tier, under: str) -> list[str]:
    conn = tier.connection
    prefix = tier.key(tier.root / under) + "/"
    pages = conn.client.get_paginator("list_objects_v2").paginate(Bucket=conn.bucket, Prefix=prefix)
    return sorted(o["Key"][len(prefix):] for p in pages for o in p.get("Contents", []))


def _chunks(n: int, size: int) -> dict[str, bytes]:
    data = [os.urandom(size + i) for i in range(n)]
    return {chunks.digest(memoryview(d)): d for d in data}


def test_chunks_from_several_threads_go_up_as_pieces_of_few_packs_and_each_reads_back(
        s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packbatch, "PACK_BYTES", 12 << 20)  # a pack rolls over past 12 MiB (two pieces and more)
    tier = _tier(s3_server, f"multi-{os.urandom(4).hex()}")
    sent = _calls(tier)
    made = _chunks(24, 1 << 20)  # 24 MiB and a little
    batch = tier.new_chunks(JOB)
    items = list(made.items())
    threads = [threading.Thread(target=lambda part=items[k::4]: [batch.write(n, memoryview(d), False) for n, d in part])
               for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(tier.missing_chunks(JOB, made)) == set(made)  # nothing is in the store before publish
    batch.publish()
    stored = tier.list_packs(JOB)
    assert len(stored) == 2 and set().union(*(p.names for p in stored)) == set(made)  # 24 chunks, two packs
    assert sent.count("CreateMultipartUpload") == 2 and sent.count("CompleteMultipartUpload") == 2
    assert sent.count("UploadPart") >= 5 and sent.count("PutObject") == 2  # the pieces; the two indexes
    assert tier.missing_chunks(JOB, made) == []
    for name, data in made.items():
        with tier.open_chunk(JOB, name) as f:
            assert f.read(len(data) + 1) == data
    runs = tier.chunk_runs(JOB, made, 8 << 20)  # neighbours of a pack in one ranged read
    assert len(runs) < len(made) and sorted(n for r in runs for n in r.names) == sorted(made)
    for run in runs:
        with tier.open_chunk_run(JOB, run) as f:
            view = memoryview(f.read(run.length))
            assert all(chunks.digest(view[o:o + n]) == name for name, o, n in run.chunks)


def test_a_batch_discarded_half_way_leaves_no_object_and_no_upload(s3_server: S3Server) -> None:
    tier = _tier(s3_server, f"discard-{os.urandom(4).hex()}")
    batch = tier.new_chunks(JOB)
    for name, data in _chunks(7, 1 << 20).items():  # a piece of 5 MiB went up: an upload is under way
        batch.write(name, memoryview(data), False)
    conn = tier.connection
    assert conn.client.list_multipart_uploads(Bucket=conn.bucket, Prefix=tier.key(tier.root)).get("Uploads")
    batch.discard()
    assert not conn.client.list_multipart_uploads(Bucket=conn.bucket, Prefix=tier.key(tier.root)).get("Uploads")
    assert _keys(tier, JOB) == [] and tier.list_packs(JOB) == []


def test_what_a_dead_writer_left_is_removed_once_stale_and_never_before(
        s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = _tier(s3_server, f"dead-{os.urandom(4).hex()}")
    conn = tier.connection
    store = chunks.store_dir(tier.root, JOB)
    orphan = tier.key(packs.pack_path(store, "orphan"))  # completed, its index never written
    conn.client.put_object(Bucket=conn.bucket, Key=orphan, Body=b"x" * 5000)
    started = conn.client.create_multipart_upload(Bucket=conn.bucket, Key=tier.key(packs.pack_path(store, "cut")))
    sweeps = ChunkStore(tier, grace_s=0)
    time.sleep(1.1)
    sweeps.sweep(JOB, mark=set)
    assert "chunks/packs/orphan.pack" in _keys(tier, JOB)  # young: kept
    assert conn.client.list_multipart_uploads(Bucket=conn.bucket, Prefix=tier.key(tier.root)).get("Uploads")
    monkeypatch.setattr(s3packs, "ABANDONED_S", 0.5)
    sweeps.sweep(JOB, mark=set)
    assert [k for k in _keys(tier, JOB) if k.startswith("chunks/packs/")] == []
    uploads = conn.client.list_multipart_uploads(Bucket=conn.bucket, Prefix=tier.key(tier.root)).get("Uploads", [])
    assert started["UploadId"] not in [u["UploadId"] for u in uploads]


def test_a_pack_condemned_by_another_node_is_missing_to_a_node_that_read_its_index_before(
        s3_server: S3Server) -> None:
    """A writer checks its part's chunks once the part is published (a sweep elsewhere may have taken one):
    a pack whose index was condemned is gone to it, though its bytes are still there."""
    prefix = f"elsewhere-{os.urandom(4).hex()}"
    sweeper, writer = _tier(s3_server, prefix), _tier(s3_server, prefix)
    made = _chunks(2, 10_000)
    batch = sweeper.new_chunks(JOB)
    for name, data in made.items():
        batch.write(name, memoryview(data), False)
    batch.publish()
    assert writer.missing_chunks(JOB, made) == []  # the writer has read the pack's index
    [pack] = sweeper.list_packs(JOB)
    assert sweeper.condemn_pack(JOB, pack.pack_id, time.time() + 2)
    assert sorted(writer.missing_chunks(JOB, made)) == sorted(made)
    assert writer.touch_chunks(JOB, made) == set()


def test_a_sweep_repacks_a_mostly_dead_pack_and_removes_it_keeping_every_named_chunk(s3_server: S3Server) -> None:
    tier = _tier(s3_server, f"repack-{os.urandom(4).hex()}")
    live, dead = _chunks(1, 100_000), _chunks(2, 1 << 20)
    batch = tier.new_chunks(JOB)
    for name, data in {**live, **dead}.items():
        batch.write(name, memoryview(data), False)
    batch.publish()
    [old] = tier.list_packs(JOB)
    time.sleep(1.1)
    swept = ChunkStore(tier, grace_s=0).sweep(JOB, mark=lambda: set(live))
    assert swept.removed == 3 and old.pack_id not in {p.pack_id for p in tier.list_packs(JOB)}
    [new] = tier.list_packs(JOB)
    assert new.names == set(live) and sorted(tier.missing_chunks(JOB, [*live, *dead])) == sorted(dead)
    with tier.open_chunk(JOB, next(iter(live))) as f:
        assert f.read(1 << 20) == next(iter(live.values()))
    assert [k for k in _keys(tier, JOB) if k.startswith("chunks/packs/")] == sorted(
        f"chunks/packs/{new.pack_id}{suffix}" for suffix in (packs.INDEX_SUFFIX, packs.PACK_SUFFIX))


def test_a_corrupt_pack_goes_aside_its_intact_chunks_repacked_and_it_is_listed_and_expired(
        s3_server: S3Server) -> None:
    tier = _tier(s3_server, f"corrupt-{os.urandom(4).hex()}")
    made = _chunks(3, 50_000)
    batch = tier.new_chunks(JOB)
    for name, data in made.items():
        batch.write(name, memoryview(data), False)
    batch.publish()
    [pack] = tier.list_packs(JOB)
    bad = next(iter(made))
    location = tier.chunk_location(JOB, bad)
    conn = tier.connection
    body = bytearray(conn.client.get_object(Bucket=conn.bucket, Key=tier.key(location))["Body"].read())
    [run] = tier.chunk_runs(JOB, [bad], 1 << 20)
    body[run.offset + 7] ^= 0x01
    conn.client.put_object(Bucket=conn.bucket, Key=tier.key(location), Body=bytes(body))
    moved = tier.quarantine_chunk(location)
    assert moved is not None and moved.parent.name == chunks.CORRUPT_DIR and packs.is_pack_file(moved.name)
    assert tier.missing_chunks(JOB, made) == [bad]  # the others are in a new pack
    assert pack.pack_id not in {p.pack_id for p in tier.list_packs(JOB)}
    for name in made.keys() - {bad}:
        with tier.open_chunk(JOB, name) as f:
            assert f.read(1 << 20) == made[name]
    [copy] = [q for q in tier.list_quarantined() if q.location == moved]
    assert copy.nbytes == len(body) and copy.chunk == moved.name
    assert tier.delete_quarantined(moved) == len(body)
    assert [k for k in _keys(tier, JOB) if "/.corrupt/" in f"/{k}"] == []


def test_a_pack_cut_short_fails_the_check_naming_it_and_its_chunk(s3_server: S3Server) -> None:
    tier = _tier(s3_server, f"short-{os.urandom(4).hex()}")
    data = os.urandom(3 << 20)
    name = chunks.digest(memoryview(data))
    batch = tier.new_chunks(JOB)
    batch.write(name, memoryview(data), False)
    batch.publish()
    location = tier.chunk_location(JOB, name)
    conn = tier.connection
    conn.client.put_object(Bucket=conn.bucket, Key=tier.key(location), Body=data[:1 << 20])  # its index points past
    part = tier.part_location(JOB, 1, 0)
    block = 1 << 20
    manifest = {"format": layout.FORMAT, "job": JOB, "step": 1, "rank": 0, "world_size": 1, "tensors": [], "tree": {},
                "created": 1.0, "metrics": {}, "attempt": "run-1",
                "files": {layout.DATA_FILE: layout.FileEntry(len(data), block, tuple(layout.block_digests(data, block)))
                          .to_json()},
                "chunks": {layout.DATA_FILE: [[name, len(data)]]}}
    writer = tier.begin_part(JOB, 1, 0)
    writer.commit(manifest)
    with pytest.raises(layout.ChecksumMismatch) as caught:
        tier.verify_part(part)
    assert str(location.name) in str(caught.value) and "size" in str(caught.value)


def test_a_daemon_drains_a_part_of_many_chunks_as_one_pack_and_its_index(s3_server: S3Server, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    prefix = f"drain-{os.urandom(4).hex()}"
    daemon = DaemonProcess(tmp_path / "n", {"shared.dir": "", "shared.url": f"s3://{BUCKET}/{prefix}",
                                            "shared.endpoint": s3_server.endpoint, "persist.incremental": True},
                           defaults=DEFAULTS, env=s3_server.env()).start()
    state: dict[str, Any] = {f"w{i}": torch.randn(40_000) for i in range(40)}  # a chunk each (160 KB)
    try:
        with Client(JOB, socket=daemon.socket) as c:
            c.save(1, state).wait("shared", timeout=60)
            state["w0"] = state["w0"] + 1
            c.save(2, state).wait("shared", timeout=60)
            got = c.load(step=1)
    finally:
        daemon.stop()
    assert all(torch.equal(got[k], v) for k, v in state.items() if k != "w0")
    client = s3_server.client()
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/{JOB}/chunks/").get("Contents", [])
    keys = [o["Key"].split("/chunks/", 1)[1] for o in listed]
    assert len([k for k in keys if k.endswith(packs.PACK_SUFFIX)]) == 2  # one pack per part: step 2's holds w0's
    assert all(k.startswith("packs/") or k == chunks.SWEPT_FILE for k in keys), keys  # no object per chunk


def test_retention_on_the_object_store_removes_the_packs_only_deleted_steps_named(
        s3_server: S3Server, tmp_path: Path) -> None:
    """A daemon's own retention, end to end: keep_last 1 on the object store; each step's own tensor goes with
    its step, in its pack (removed whole); the base every step names stays in the first step's pack (with the
    first step's own tensor: a third of it, not worth a repack)."""
    torch = pytest.importorskip("torch")
    prefix = f"retained-{os.urandom(4).hex()}"
    daemon = DaemonProcess(tmp_path / "n", {"shared.dir": "", "shared.url": f"s3://{BUCKET}/{prefix}",
                                            "shared.endpoint": s3_server.endpoint, "persist.incremental": True,
                                            "persist.chunk_grace_s": 0.01, "shared.keep_last": 1,
                                            # the store's times are whole seconds: a pack written in the
                                            # last second or two is never condemned; the timer's passes
                                            # sweep once they are older
                                            "local.keep_last": 1, "retention.interval_s": 0.5},
                           defaults=DEFAULTS, env=s3_server.env()).start()
    base = torch.randn(1 << 20)  # 4 MiB, in every step
    tier = _tier(s3_server, prefix)
    try:
        with Client(JOB, socket=daemon.socket) as c:
            for step in range(1, 5):
                c.save(step, {"base": base, "own": torch.full((1 << 19,), float(step))}).wait("shared", timeout=60)
                if step == 1:
                    [first] = tier.list_packs(JOB)
            part = tier.part_location(JOB, 4, 0)
            named = chunks.referenced(tier.read_manifest(part)[0])

            def settled() -> bool:
                stored = tier.list_packs(JOB)
                return len(stored) == 2 and not tier.condemned_packs(JOB) and \
                    named <= set().union(*(p.names for p in stored))

            wait_until(settled, 30, "the packs of steps 2 and 3 removed")
            assert first.pack_id in {p.pack_id for p in tier.list_packs(JOB)}  # the base's pack stays
            tier.verify_part(part)
            assert torch.equal(c.load(step=4)["own"], torch.full((1 << 19,), 4.0))
    finally:
        daemon.stop()
