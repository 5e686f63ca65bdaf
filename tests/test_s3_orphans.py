"""What a node that died for good left on the object store is cleaned by another node, and nothing live is.

A real daemon drains to a real SeaweedFS and is SIGKILLed in the middle of a multipart upload: its claim,
its writer's note and its upload stay. Another daemon's tier (:meth:`S3Tier.clean_abandoned`) cleans them
only once the store has seen them untouched for ``abandoned_s``, and never a writer that is alive (its claim
renewed) nor a published part.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed")
torch = pytest.importorskip("torch")

from ckptstage.client import Client  # noqa: E402
from ckptstage.daemon.launcher import DaemonProcess  # noqa: E402
from ckptstage.daemon.tiers.s3.tier import S3Tier  # noqa: E402
from ckptstage.protos import layout  # noqa: E402
from conftest import DEFAULTS  # noqa: E402
from s3server import BUCKET, S3Server, open_tier, s3_server  # noqa: E402
from support import wait_until  # noqa: E402

_ = s3_server  # the session's server, a fixture
MiB = 1 << 20
ABANDONED_S = 4.0  # the cleaner's threshold: the store's age of a claim or note (whole seconds)


def _keys(tier: S3Tier, under: str = "") -> list[str]:
    prefix = tier.dir_key(tier.root)
    return sorted(k[len(prefix):] for k in tier.objects.keys(prefix + under))


def _uploads(tier: S3Tier) -> list[str]:
    prefix = tier.dir_key(tier.root)
    return sorted(u["Key"][len(prefix):] for u in tier.objects.uploads(prefix))


def _state(n: int, seed: int) -> dict[str, Any]:
    return {"w": torch.rand(n, generator=torch.Generator().manual_seed(seed)), "seed": seed}


def test_a_killed_daemons_writing_is_cleaned_by_another_once_abandoned_and_a_live_writer_is_not(
        s3_server: S3Server, tmp_path: Path) -> None:
    prefix = f"orphans-{uuid.uuid4().hex[:8]}"
    d = DaemonProcess(tmp_path / "dead", {"shared.dir": "", "shared.url": f"s3://{BUCKET}/{prefix}",
                                          "shared.endpoint": s3_server.endpoint, "shared.multipart_bytes": "5MiB",
                                          "shared.max_bandwidth": "8MiB/s", "persist.incremental": False},
                      defaults=DEFAULTS, env={**s3_server.env(), "AWS_MAX_ATTEMPTS": "2"}).start()
    reader = open_tier(s3_server, "reader", prefix=prefix)
    try:
        with Client("dead", socket=d.socket) as client:
            client.save(1, _state(1000, 1)).wait("shared", timeout=30)  # published: must stay whole
            client.save(2, _state(6 * MiB, 2)).wait("local", timeout=30)  # 24 MiB: three seconds at the cap
        wait_until(lambda: _uploads(reader), 20, "a multipart upload under way", poll=0.05)
    finally:
        d.kill()
    killed = time.monotonic()
    part = "dead/step-000000000002/rank-00000/"
    [owner] = {k.split("/")[1] for k in _keys(reader, layout.TMP_DIR + "/")}
    assert _uploads(reader) == [part + layout.DATA_FILE] and part + ".claim" in _keys(reader, "dead/")

    # A live writer of a third node: its claim renewed every 0.1 s, a piece of its file up.
    live = S3Tier(reader.connection, "node-live", piece_bytes=5 * MiB, claim_stale_s=0.4)
    data = os.urandom(10 * MiB)
    writer = live.begin_part("live", 1, 0)
    try:
        sink = writer.create_file(layout.DATA_FILE, len(data), direct_io=False)
        sink.write(memoryview(data)[:5 * MiB], 0)
        # A removal another gone node began: the manifest went, a file stayed, its note says which part.
        gone = "gone/step-000000000001/rank-00000/"
        conn = reader.connection
        conn.client.put_object(Bucket=BUCKET, Key=f"{prefix}/{gone}{layout.DATA_FILE}", Body=b"left over")
        conn.client.put_object(Bucket=BUCKET, Key=f"{prefix}/{layout.TMP_DIR}/node-gone/removing/r1.json",
                               Body=json.dumps({"part": f"{prefix}/{gone}"}).encode())

        # A pass cleans nothing younger than its threshold: all of it was written moments ago.
        patient = S3Tier(reader.connection, "node-c", claim_stale_s=0.5, abandoned_s=60)
        assert patient.clean_abandoned() == 0
        assert len(_uploads(reader)) == 2 and part + ".claim" in _keys(reader, "dead/")
        time.sleep(ABANDONED_S + 1.5 - (time.monotonic() - killed))  # + 1 s: the store's times are whole seconds
        # Older than the threshold now: the dead ones go; the live writer's note is that old too, but its claim
        # was renewed meanwhile.
        cleaner = S3Tier(reader.connection, "node-c", claim_stale_s=0.5, abandoned_s=ABANDONED_S)
        assert cleaner.clean_abandoned() == 2  # the killed daemon's writing, the gone node's removal

        assert _uploads(reader) == ["live/step-000000000001/rank-00000/" + layout.DATA_FILE]  # the live one's
        assert _keys(reader, "dead/") == ["dead/step-000000000001/commit.json",
                                          "dead/step-000000000001/index.json",
                                          "dead/step-000000000001/rank-00000/data.safetensors",
                                          "dead/step-000000000001/rank-00000/manifest.json"]
        reader.verify_part(reader.part_location("dead", 1, 0))
        assert [k for k in _keys(reader) if k.startswith(f"{layout.TMP_DIR}/{owner}/")] == []
        assert _keys(reader, "gone/") == [] and _keys(reader, f"{layout.TMP_DIR}/node-gone/") == []
        assert cleaner.clean_abandoned() == 0

        # The live writer was never disturbed: it finishes and publishes.
        sink.write(memoryview(data)[5 * MiB:], 5 * MiB)
        sink.sync()
        where = writer.commit({"format": layout.FORMAT, "job": "live", "step": 1, "rank": 0, "world_size": 1,
                               "tensors": [], "tree": {}, "created": 1.0, "metrics": {}, "attempt": "run-1",
                               "files": {layout.DATA_FILE: layout.FileEntry(
                                   len(data), MiB, tuple(layout.block_digests(data, MiB))).to_json()}})
        reader.verify_part(where)
        assert _uploads(reader) == [] and [k for k in _keys(reader) if k.endswith(".claim")] == []
    finally:
        writer.abort()  # a no-op once committed; else its claim is no longer renewed
