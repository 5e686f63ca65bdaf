"""The shared tier on an S3-compatible object store (daemon/tiers/s3/tier.py), against a real SeaweedFS.

The tier contract itself runs on the object store from tests/test_tier_interface.py (its ``tier``
fixture) and, here, tests/test_tier_replacing.py's; these are what only an object store has:
publication that a listing never shows early, multipart uploads and their orphans, the errors of a
store that refuses us, the configuration, and a real daemon draining to it and restoring from it.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed")

from ckptstage.daemon.catalog.index import Catalog  # noqa: E402
from ckptstage.daemon.config import ConfigError, load_config  # noqa: E402
from ckptstage.daemon.tiers.s3.client import Location, open_connection  # noqa: E402
from ckptstage.daemon.tiers.s3.tier import S3Tier  # noqa: E402
from ckptstage.daemon.tiers.interface import Tier, TierName, Usage  # noqa: E402
from ckptstage.daemon.tiers.kinds import open_tiers  # noqa: E402
from ckptstage.protos import chunks, layout  # noqa: E402
from s3server import (ACCESS_KEY, BUCKET, REGION, SECRET_KEY, S3Server, object_bytes, open_tier,  # noqa: E402
                      s3_server)
# The Replacing contract, run here on the object store (its own module's fixture names the file-system tier).
from test_tier_replacing import (test_a_discarded_replacement_leaves_the_step_alone,  # noqa: E402, F401
                                 test_a_replacement_of_a_step_gone_meanwhile_becomes_the_step,
                                 test_a_staged_replacement_is_invisible_until_swapped_in_whole)

JOB = "s3job"
OWNER = "node-a"
MiB = 1 << 20
_ = s3_server  # the session's server, a fixture


@pytest.fixture
def tier(s3_server: S3Server) -> Tier:
    """An empty prefix of the server's bucket, as the daemon ``node-a`` uses it."""
    return open_tier(s3_server, OWNER)  # type: ignore[no-any-return]


def _manifest(step: int, data: bytes, block: int = 1 << 20) -> dict[str, Any]:
    return {"format": layout.FORMAT, "job": JOB, "step": step, "rank": 0, "world_size": 1, "tensors": [],
            "tree": {}, "created": 1.0, "metrics": {}, "attempt": "run-1",
            "files": {layout.DATA_FILE: layout.FileEntry(len(data), block, tuple(layout.block_digests(data, block)))
                      .to_json()}}


def _keys(tier: S3Tier, under: str = "") -> list[str]:
    conn = tier.connection
    prefix = tier.key(tier.root / under) if under else tier.key(tier.root) + "/"
    pages = conn.client.get_paginator("list_objects_v2").paginate(Bucket=conn.bucket, Prefix=prefix)
    return sorted(o["Key"][len(tier.key(tier.root)) + 1:] for p in pages for o in p.get("Contents", []))


def _uploads(tier: S3Tier) -> list[str]:
    conn = tier.connection
    got = conn.client.list_multipart_uploads(Bucket=conn.bucket, Prefix=tier.key(tier.root) + "/")
    return [u["Key"] for u in got.get("Uploads", [])]


# --- publication -------------------------------------------------------------------------------------


def test_a_step_exists_only_through_its_commit_record_written_last(tier: S3Tier, tmp_path: Path) -> None:
    data = os.urandom(3000)
    catalog = Catalog(tmp_path / "pins.json")
    # Objects a crash left at a part's keys, without a manifest: no part.
    conn = tier.connection
    conn.client.put_object(Bucket=conn.bucket, Key=tier.key(tier.part_location(JOB, 2, 0) / layout.DATA_FILE),
                           Body=data)
    assert list(tier.list_steps(JOB)) == [] and not tier.has_part(tier.part_location(JOB, 2, 0))
    # A part with its manifest and no commit record: listed as a part, never as a committed step.
    writer = tier.begin_part(JOB, 2, 0)
    sink = writer.create_file(layout.DATA_FILE, len(data), direct_io=False)
    sink.write(memoryview(data), 0)
    sink.sync()
    sink.close()
    where = writer.commit(_manifest(2, data))
    [step] = list(tier.list_steps(JOB))
    assert [p.rank for p in step.parts] == [0] and step.record_ino is None
    assert catalog.load_tier(TierName.SHARED, tier) == 1
    ckpt = catalog.get(JOB, 2)
    assert ckpt is not None and not ckpt.complete_on(TierName.SHARED)
    # The record, last, makes it: written once (a conditional PUT), the layout FORMAT.md names.
    record = layout.CommitRecord(JOB, 2, "run-1", 1, 5.0, {0: layout.CommittedPart(len(data), writer.manifest_digest)})
    assert tier.create_commit_record(where.parent, record) and not tier.create_commit_record(where.parent, record)
    catalog.sync_job(TierName.SHARED, tier, JOB)
    ckpt = catalog.get(JOB, 2)
    assert ckpt is not None and ckpt.complete_on(TierName.SHARED)
    assert _keys(tier) == [f"{JOB}/step-000000000002/commit.json", f"{JOB}/step-000000000002/rank-00000/data.safetensors",
                           f"{JOB}/step-000000000002/rank-00000/manifest.json"]
    assert object_bytes(tier, where.parent / layout.COMMIT_FILE) == layout.commit_record_bytes(record)
    assert tier.readable_path(where) is None  # clients cannot open objects: the daemon fetches them first


def test_a_large_file_goes_up_in_pieces_written_out_of_order_and_a_flipped_byte_is_found(
        s3_server: S3Server) -> None:
    tier = S3Tier(open_tier(s3_server, OWNER).connection, OWNER, piece_bytes=5 * MiB, in_flight=2)
    data = os.urandom(12 * MiB + 123)  # three pieces, the last short
    writer = tier.begin_part(JOB, 1, 0)
    sink = writer.create_file(layout.DATA_FILE, len(data), direct_io=True)
    cuts = list(range(0, len(data), MiB)) + [len(data)]
    spans = list(zip(cuts, cuts[1:]))[::-1]  # backwards, from four threads: as the persister's pool writes
    threads = [threading.Thread(target=lambda lo, hi: sink.write(memoryview(data)[lo:hi], lo), args=span)
               for span in spans]
    for t in threads[:4]:
        t.start()
    for t in threads[4:]:
        t.start()
    for t in threads:
        t.join()
    # Uploading straight to its key, under the part's claim, and not published.
    part = f"{JOB}/step-000000000001/rank-00000/"
    assert _uploads(tier) == [tier.key(writer.final / layout.DATA_FILE)] and list(tier.list_steps(JOB)) == []
    assert _keys(tier, JOB) == [part + ".claim"]
    sink.sync()
    sink.close()
    assert _keys(tier, JOB) == [part + ".claim", part + layout.DATA_FILE] and list(tier.list_steps(JOB)) == []
    where = writer.commit(_manifest(1, data))
    conn = tier.connection
    etag = conn.client.head_object(Bucket=conn.bucket, Key=tier.key(where / layout.DATA_FILE))["ETag"]
    assert etag.strip('"').endswith("-3")  # a multipart object of three pieces
    with tier.open_file(where, layout.DATA_FILE) as f:
        buf = bytearray(f.size)
        assert f.readinto(memoryview(buf)) == len(data) and bytes(buf) == data and f.read(1) == b""
    tier.verify_part(where)
    assert _keys(tier, layout.TMP_DIR) == [] and _uploads(tier) == []  # nothing staged is left behind
    spoiled = bytearray(data)
    spoiled[7 * MiB + 5] ^= 1
    object_bytes(tier, where / layout.DATA_FILE, bytes(spoiled))
    with pytest.raises(layout.ChecksumMismatch, match=r"chunk 7 \(bytes 7340032\.\.\)") as e:
        tier.verify_part(where)
    assert e.value.path == where / layout.DATA_FILE


_KILLED_WRITER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {tests!r})
    from ckptstage.daemon.tiers.s3.client import Location, open_connection
    from ckptstage.daemon.tiers.s3.tier import S3Tier
    from ckptstage.protos import layout
    conn = open_connection(Location({bucket!r}, {prefix!r}), {endpoint!r}, {region!r},
                           access_key_id={key!r}, secret_access_key={secret!r})
    tier = S3Tier(conn, {owner!r}, piece_bytes=5 << 20)
    writer = tier.begin_part("s3job", 9, 0)
    sink = writer.create_file(layout.DATA_FILE, 15 << 20, direct_io=False)
    sink.write(memoryview(os.urandom(10 << 20)), 0)  # two pieces up, the third never comes
    print("uploading", flush=True)
    time.sleep(60)
""")


def test_a_writer_killed_mid_upload_leaves_nothing_visible_and_its_orphans_go_at_the_next_start(
        s3_server: S3Server, tier: S3Tier) -> None:
    other = S3Tier(tier.connection, "node-b", piece_bytes=5 * MiB)  # another node's upload, in flight
    theirs = other.begin_part(JOB, 9, 1).create_file(layout.DATA_FILE, 10 * MiB, direct_io=False)
    theirs.write(memoryview(bytes(5 * MiB)), 0)
    script = _KILLED_WRITER.format(tests=str(Path(__file__).parent), bucket=BUCKET, prefix=tier.key(tier.root),
                                   endpoint=s3_server.endpoint, region=REGION, key=ACCESS_KEY, secret=SECRET_KEY,
                                   owner=OWNER)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "uploading"
        deadline = time.monotonic() + 20
        while len(_uploads(tier)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert len(_uploads(tier)) == 2  # ours (killed) and node-b's
    assert list(tier.list_steps(JOB)) == []  # nothing visible
    ours, node_b = f"{JOB}/step-000000000009/rank-00000/", f"{JOB}/step-000000000009/rank-00001/"
    assert _keys(tier, JOB) == [ours + ".claim", node_b + ".claim"]  # each writer's claim on its part
    restarted = S3Tier(tier.connection, OWNER)
    restarted.prepare()
    assert restarted.clean_temporaries() == 1  # the killed writer's entry: its note, its claim, its upload
    # Only this owner's orphans are aborted: node-b's upload and claim stay.
    assert _uploads(tier) == [tier.key(tier.root / node_b / layout.DATA_FILE)]
    assert [k for k in _keys(tier) if not k.startswith(f"{layout.TMP_DIR}/node-b/")] == [node_b + ".claim"]
    theirs.close()  # node-b aborts its own
    assert _uploads(tier) == []


_CLAIM_HOLDER = textwrap.dedent("""
    import sys, time
    from ckptstage.daemon.tiers.s3.client import Location, open_connection
    from ckptstage.daemon.tiers.s3.tier import S3Tier
    from ckptstage.protos import layout
    conn = open_connection(Location({bucket!r}, {prefix!r}), {endpoint!r}, {region!r},
                           access_key_id={key!r}, secret_access_key={secret!r})
    tier = S3Tier(conn, "node-a", piece_bytes=5 << 20, claim_stale_s={stale!r})
    sink = tier.begin_part("s3job", 5, 0).create_file(layout.DATA_FILE, 10 << 20, direct_io=False)
    sink.write(memoryview(bytes(5 << 20)), 0)  # one piece up, its claim renewed until killed
    print("writing", flush=True)
    time.sleep(60)
""")


def test_two_daemons_never_write_one_part_at_once_and_an_abandoned_claim_is_taken_over(
        s3_server: S3Server, tier: S3Tier) -> None:
    stale = 1.0
    script = _CLAIM_HOLDER.format(bucket=BUCKET, prefix=tier.key(tier.root), endpoint=s3_server.endpoint,
                                  region=REGION, key=ACCESS_KEY, secret=SECRET_KEY, stale=stale)
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    other = S3Tier(tier.connection, "node-b", claim_stale_s=stale)
    data = os.urandom(3000)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "writing"
        began = time.monotonic()
        while time.monotonic() - began < 2.5 * stale:  # renewed every stale/4: never abandoned while it lives
            with pytest.raises(OSError, match="is being written by node-a") as busy:
                other.begin_part(JOB, 5, 0).create_file(layout.DATA_FILE, len(data), direct_io=False)
            assert busy.value.errno == errno.EBUSY
            time.sleep(0.2)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert len(_uploads(tier)) == 1  # the killed holder's, at the part's key
    deadline = time.monotonic() + 10 * stale
    while True:  # as a drain retries: seen unchanged for claim_stale_s, the claim is abandoned
        writer = other.begin_part(JOB, 5, 0)
        try:
            sink = writer.create_file(layout.DATA_FILE, len(data), direct_io=False)
            break
        except OSError as e:
            assert e.errno == errno.EBUSY and time.monotonic() < deadline
            time.sleep(0.2)
    assert _uploads(tier) == []  # the abandoned writer's upload went with its claim
    sink.write(memoryview(data), 0)
    sink.sync()
    where = writer.commit(_manifest(5, data))
    with tier.open_file(where, layout.DATA_FILE) as f:
        assert f.read(len(data) + 1) == data
    assert _keys(tier, JOB) == [f"{JOB}/step-000000000005/rank-00000/{n}" for n in (layout.DATA_FILE,
                                                                                    layout.MANIFEST_FILE)]


def test_a_writer_whose_claim_was_broken_completes_nothing_and_leaves_the_new_holders_objects(
        tier: S3Tier) -> None:
    mine = S3Tier(tier.connection, OWNER, claim_stale_s=0.4)  # renewed every 0.1 s
    writer = mine.begin_part(JOB, 6, 0)
    sink = writer.create_file(layout.DATA_FILE, 3000, direct_io=False)
    sink.write(memoryview(b"a" * 3000), 0)
    # Another daemon found the claim abandoned (this one was cut off the store) and took the part.
    conn = tier.connection
    part = writer.final
    conn.client.put_object(Bucket=conn.bucket, Key=tier.key(part / ".claim"), Body=b'{"owner": "node-b"}')
    conn.client.put_object(Bucket=conn.bucket, Key=tier.key(part / layout.DATA_FILE), Body=b"theirs")
    time.sleep(0.3)  # a renewal finds the claim changed
    with pytest.raises(OSError, match="lost its claim"):
        sink.sync()
    with pytest.raises(OSError, match="lost its claim"):
        writer.commit(_manifest(6, b"a" * 3000))
    writer.abort()
    assert object_bytes(tier, part / layout.DATA_FILE) == b"theirs"
    assert object_bytes(tier, part / ".claim") == b'{"owner": "node-b"}'
    assert list(tier.list_steps(JOB)) == [] and _keys(tier, layout.TMP_DIR) == []


def test_a_removal_cut_short_is_finished_at_the_next_start(tier: S3Tier) -> None:
    data = b"r" * 5000
    writer = tier.begin_part(JOB, 4, 0)
    sink = writer.create_file(layout.DATA_FILE, len(data), direct_io=False)
    sink.write(memoryview(data), 0)
    sink.sync()
    where = writer.commit(_manifest(4, data))
    # What remove_part leaves when killed after the manifest went: its note and the data object.
    conn = tier.connection
    note = tier.key(layout.tmp_root(tier.root, OWNER) / "removing" / "x.json")
    conn.client.put_object(Bucket=conn.bucket, Key=note, Body=b'{"part": "%s/"}' % tier.key(where).encode())
    conn.client.delete_object(Bucket=conn.bucket, Key=tier.key(where / layout.MANIFEST_FILE))
    assert list(tier.list_steps(JOB)) == [] and _keys(tier, JOB) != []
    assert tier.clean_temporaries() == 1
    assert _keys(tier) == []


def test_the_tier_is_named_by_its_url_and_sets_no_limit_of_its_own(tier: S3Tier) -> None:
    url = f"s3://{BUCKET}/{tier.key(tier.root)}"
    assert tier.location == url and str(tier.root).startswith("/s3:")
    assert tier.usage() == Usage(free_bytes=0, total_bytes=0, unbounded=True)
    with pytest.raises(FileNotFoundError) as gone:
        tier.remove_part(tier.part_location(JOB, 3, 0))
    assert f"{url}/{JOB}/step-000000000003/rank-00000" in str(gone.value) and "/s3:" not in str(gone.value)


def test_new_chunks_go_up_as_one_pack_a_touch_tags_its_index_and_a_sweep_moves_it_whole(tier: S3Tier) -> None:
    conn = tier.connection
    sent: list[str] = []
    conn.client.meta.events.register("before-call.s3", lambda model, **_: sent.append(model.name))
    data = [os.urandom(3000 + i) for i in range(3)]
    names = [chunks.digest(memoryview(d)) for d in data]
    batch = tier.new_chunks(JOB)
    for name, d in zip(names, data):
        batch.write(name, memoryview(d), direct_io=False)
    assert sorted(tier.missing_chunks(JOB, names)) == sorted(names)  # nothing is in the store before publish
    batch.publish()
    batch.discard()
    # Three chunks, two PUTs: the pack (smaller than a piece: no multipart upload), then its index.
    assert [c for c in sent if c.startswith(("Put", "Create", "Upload", "Copy"))] == ["PutObject", "PutObject"]
    assert tier.missing_chunks(JOB, names) == [] and _keys(tier, layout.TMP_DIR) == []
    [pack] = tier.list_packs(JOB)
    assert pack.names == set(names)
    for name, d in zip(names, data):
        assert tier.chunk_size(JOB, name) == len(d)
        with tier.open_chunk(JOB, name) as f:
            assert f.read(1 << 20) == d
    key = tier.key(tier.chunk_location(JOB, names[0]))
    before = conn.client.head_object(Bucket=conn.bucket, Key=key)
    time.sleep(2.1)  # the store's times are whole seconds
    cutoff = time.time()  # untouched since the write, by its modification time
    sent.clear()
    assert tier.touch_chunks(JOB, names) == set(names) and sent == ["PutObjectTagging"]  # the pack's index, once
    after = conn.client.head_object(Bucket=conn.bucket, Key=key)
    assert (after["LastModified"], after["ETag"]) == (before["LastModified"], before["ETag"])  # no byte moved
    # A sweep reads the touch from the index's tag: relied on since the cutoff, the pack stays.
    assert not tier.condemn_pack(JOB, pack.pack_id, cutoff)
    assert tier.condemn_pack(JOB, pack.pack_id, time.time() + 1)  # once nobody touched it for the grace
    assert tier.list_packs(JOB) == [] and sorted(tier.missing_chunks(JOB, names)) == sorted(names)
    assert not tier.touch_chunk(JOB, names[0])  # condemned: not in the store
    assert [p.names for p in tier.condemned_packs(JOB)] == [set(names)]
    tier.restore_pack(JOB, pack.pack_id)  # named again before it went
    assert tier.missing_chunks(JOB, names) == []
    assert tier.condemn_pack(JOB, pack.pack_id, time.time() + 1)
    assert tier.delete_condemned_pack(JOB, pack.pack_id) == after["ContentLength"]
    assert tier.condemned_packs(JOB) == [] and tier.list_packs(JOB) == []
    assert [k for k in _keys(tier, JOB) if "/packs/" in k] == []
    with pytest.raises(FileNotFoundError):
        tier.restore_pack(JOB, pack.pack_id)


def test_a_chunk_kept_as_an_object_of_its_own_is_still_read_touched_and_swept(tier: S3Tier) -> None:
    """A store written before packs: each chunk an object at its name's key."""
    data = os.urandom(5000)
    name = chunks.digest(memoryview(data))
    tier.objects.put(tier.key(tier.chunk_location(JOB, name)), data)
    assert tier.missing_chunks(JOB, [name]) == [] and tier.chunk_size(JOB, name) == len(data)
    assert tier.list_chunks(JOB) == [name] and tier.list_packs(JOB) == []
    with tier.open_chunk(JOB, name) as f:
        assert f.read(1 << 20) == data
    time.sleep(2.1)
    cutoff = time.time()
    assert tier.touch_chunk(JOB, name) and not tier.condemn_chunk(JOB, name, cutoff)
    assert tier.condemn_chunk(JOB, name, time.time() + 1) and tier.condemned_chunks(JOB) == [name]
    assert tier.missing_chunks(JOB, [name]) == [name] and not tier.touch_chunk(JOB, name)


# --- errors that name the bucket and the endpoint ------------------------------------------------------


def _tier_with(s3_server: S3Server, bucket: str = BUCKET, secret: str = SECRET_KEY,
               endpoint: str | None = None) -> S3Tier:
    conn = open_connection(Location(bucket, "p"), endpoint or s3_server.endpoint, REGION,
                           access_key_id=ACCESS_KEY, secret_access_key=secret)
    return S3Tier(conn, OWNER)


def test_refused_credentials_a_missing_bucket_or_a_silent_endpoint_are_errors_naming_them(
        s3_server: S3Server) -> None:
    with pytest.raises(PermissionError) as denied:
        _tier_with(s3_server, secret="wrong").check()
    assert BUCKET in str(denied.value) and s3_server.endpoint in str(denied.value)
    assert "credentials from explicit" in str(denied.value)  # where they came from, never the key itself
    assert "wrong" not in str(denied.value)
    with pytest.raises(FileNotFoundError) as missing:
        _tier_with(s3_server, bucket="no-such-bucket").prepare()
    assert "no-such-bucket" in str(missing.value) and s3_server.endpoint in str(missing.value)
    from s3server import free_ports

    closed = f"http://127.0.0.1:{free_ports(1)[0]}"
    began = time.monotonic()
    with pytest.raises(OSError) as silent:
        _tier_with(s3_server, endpoint=closed).check()
    assert closed in str(silent.value) and BUCKET in str(silent.value)
    assert time.monotonic() - began < 20  # retried with backoff, then given up


# --- configuration -------------------------------------------------------------------------------------


def test_the_config_names_an_object_store_by_url_and_keeps_secrets_out_of_the_file(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path)}
    cfg = load_config(None, {"shared.url": "s3://ckpt-bucket/team/run3/", "shared.endpoint": "http://h:8333",
                             "shared.region": "eu-west-1"}, env=env)
    assert (cfg.shared.url, cfg.shared.dir, cfg.shared.enabled) == ("s3://ckpt-bucket/team/run3", None, True)
    assert load_config(None, {"shared.url": "s3://ckpt-bucket"}, env=env).shared.url == "s3://ckpt-bucket"
    refused = {
        ("shared.url", "s3://bkt/p", "shared.dir", "/x"): ("shared.url", "both name the shared tier"),
        ("shared.url", "https://bkt/p"): ("shared.url", "got 'https://bkt/p'"),
        ("shared.url", "s3://Bad_Bucket/p"): ("shared.url", "not a valid bucket name"),
        ("shared.url", "s3://bucket/a//b"): ("shared.url", "empty, dot-led"),
        ("shared.url", "s3://bucket/a/../b"): ("shared.url", "empty, dot-led"),
        ("shared.url", "s3://bucket", "shared.endpoint", "ftp://h"): ("shared.endpoint", "http:// or https://"),
        ("shared.url", "s3://bucket", "shared.endpoint", "http://h:99999"): ("shared.endpoint", "99999"),
        ("shared.endpoint", "http://h:8333"): ("shared.endpoint", "shared.url is not set"),
        ("shared.url", "s3://bucket", "shared.region", "eu west"): ("shared.region", "'eu west'"),
        ("shared.url", "s3://bucket", "shared.access_key_id", "AKIA1", "shared.secret_access_key", "s3cr3t"):
            ("shared.access_key_id", "allow_inline_credentials"),
        ("shared.url", "s3://bucket", "shared.allow_inline_credentials", True, "shared.secret_access_key", "s3cr3t"):
            ("shared.access_key_id", "must be set with shared.secret_access_key"),
    }
    for flat, (key, words) in refused.items():
        settings = dict(zip(flat[::2], flat[1::2]))
        with pytest.raises(ConfigError) as e:
            load_config(None, settings, env=env)
        assert e.value.key == key and words in str(e.value), (settings, str(e.value))
        assert "s3cr3t" not in str(e.value)
    inline = load_config(None, {"shared.url": "s3://bucket", "shared.allow_inline_credentials": True,
                                "shared.access_key_id": "AKIA1", "shared.secret_access_key": "s3cr3t"}, env=env)
    assert (inline.shared.access_key_id, inline.shared.secret_access_key) == ("AKIA1", "s3cr3t")
    assert load_config(None, {"shared.url": "s3://b1x/p"}, env=env).to_toml().count("url = ") == 1


def test_open_tiers_opens_the_object_store_a_url_names(s3_server: S3Server, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    cfg = load_config(None, {"local.dir": str(tmp_path / "local"), "shared.dir": "", "shared.url": f"s3://{BUCKET}/o",
                             "shared.endpoint": s3_server.endpoint, "shared.region": REGION,
                             "shared.allow_inline_credentials": True, "shared.access_key_id": ACCESS_KEY,
                             "shared.secret_access_key": SECRET_KEY}, env={"HOME": str(tmp_path)})
    shared = open_tiers(cfg, OWNER)[TierName.SHARED]
    assert isinstance(shared, S3Tier) and shared.url == f"s3://{BUCKET}/o" and shared.owner == OWNER
    shared.prepare()
    assert "credentials written in the config file" in caplog.text and SECRET_KEY not in caplog.text


# --- a real daemon ------------------------------------------------------------------------------------


def _daemon(s3_server: S3Server, root: Path, prefix: str, secret: str = SECRET_KEY) -> Any:
    from conftest import DEFAULTS

    from ckptstage.daemon.launcher import DaemonProcess

    settings = {"shared.dir": "", "shared.url": f"s3://{BUCKET}/{prefix}", "shared.endpoint": s3_server.endpoint}
    env = {**s3_server.env(), "AWS_SECRET_ACCESS_KEY": secret}  # credentials from the environment
    return DaemonProcess(root, settings, defaults=DEFAULTS, env=env, log_level="DEBUG")


def test_a_daemon_drains_to_the_object_store_and_another_node_restores_from_it(
        s3_server: S3Server, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from ckptstage.client import Client

    state = {"w": torch.arange(300_000, dtype=torch.float32), "step": 3}
    a, b = _daemon(s3_server, tmp_path / "a", "e2e"), _daemon(s3_server, tmp_path / "b", "e2e")
    try:
        a.start()
        with Client("e2e", socket=a.socket) as client:
            client.save(3, state).wait("shared", timeout=60)
        reader = open_tier(s3_server, "reader", prefix="e2e")
        assert [s.step for s in reader.list_steps("e2e") if s.record_ino] == [3]
        b.start()  # another node: nothing local; the step is on the object store only
        with Client("e2e", socket=b.socket) as client:
            deadline = time.monotonic() + 30
            while not client.list() and time.monotonic() < deadline:
                time.sleep(0.1)
            [info] = client.list()
            assert (info.step, tuple(info.tiers)) == (3, ("shared",))
            # A client cannot read objects: its load has the daemon fetch the part to the local tier first.
            got = client.load()
            assert got["step"] == 3 and torch.equal(got["w"], state["w"])
            [info] = client.list()
            assert sorted(info.tiers) == ["local", "shared"]
            out = subprocess.run([sys.executable, "-m", "ckptstage.client.cli", "--socket", str(b.socket),
                                  "prefetch", "e2e"], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr  # nothing left to fetch
    finally:
        a.stop()
        b.stop()


def test_a_daemon_refused_by_the_store_saves_locally_and_says_why(s3_server: S3Server, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from ckptstage.client import Client

    d = _daemon(s3_server, tmp_path / "n", "refused", secret="wrong-secret")
    try:
        d.start()
        with Client("refused", socket=d.socket) as client:
            client.save(1, {"w": torch.ones(10)}).wait("local", timeout=30)
            assert [i.step for i in client.list()] == [1]
        log = (tmp_path / "n" / "daemon.log").read_text()
        assert f"access to the bucket '{BUCKET}' at {s3_server.endpoint} refused" in log
        assert "wrong-secret" not in log
    finally:
        d.stop()


def test_an_object_is_read_whole_through_odd_reads_and_seeks_with_gets_kept_in_flight_ahead(
        s3_server: S3Server) -> None:
    """ObjectReader keeps READ_AHEAD ranged GETs in flight across reads; reads of any size and seeks
    anywhere give the object's bytes."""
    from concurrent.futures import ThreadPoolExecutor

    from ckptstage.daemon.tiers.s3.io import READ_AHEAD, READ_PIECE_BYTES, ObjectReader

    from support import wait_until
    from test_s3_faults import FaultProxy

    data = os.urandom(5 * READ_PIECE_BYTES + 12345)
    key = f"reader-{os.getpid()}/object"
    writer = open_tier(s3_server, "writer").connection
    writer.client.put_object(Bucket=BUCKET, Key=key, Body=data)
    proxy = FaultProxy(s3_server.endpoint)
    conn = open_connection(Location(BUCKET, "x"), proxy.endpoint, REGION, access_key_id=ACCESS_KEY,
                           secret_access_key=SECRET_KEY)
    try:
        with ThreadPoolExecutor(8) as pool:
            reader = ObjectReader(conn, key, pool, ahead=3)
            assert reader.read(1) == data[:1]
            # One byte read, three ranges asked: the first and the two behind it, before anyone reads them.
            wait_until(lambda: sum(s.startswith("GET") for s in proxy.seen) == 3, 10, "three GETs ahead")
            got = bytearray(data[:1])
            for size in (7, READ_PIECE_BYTES - 3, 2 * READ_PIECE_BYTES + 1, 1 << 20):
                got += reader.read(size)
            reader.seek(len(data) - 100)  # far ahead: what was asked ahead is dropped
            tail = reader.read(1000)
            reader.seek(10)  # and back
            assert reader.read(20) == data[10:30]
            reader.close()
            assert bytes(got) == data[:len(got)] and tail == data[-100:]
            whole = ObjectReader(conn, key, pool, ahead=READ_AHEAD)
            assert whole.read(len(data) + 1) == data and whole.read(1) == b""
    finally:
        proxy.close()
