"""Real daemons on an object-store shared tier (a real SeaweedFS): retention there, and two nodes sharing it.

Retention on the object store keeps what it keeps on a file system (keep_last, pins, never the only
copy), and removes every object of what it deletes, also when the store fails half way through a
deletion. Two daemons with their own local tiers share one bucket prefix: one drains, the other lists
the job, prefetches it and loads it, and both apply the job's rules there.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed")
torch = pytest.importorskip("torch")

from ckptstage.client import Client  # noqa: E402
from ckptstage.client.rpc import Connection  # noqa: E402
from ckptstage.daemon.launcher import DaemonProcess  # noqa: E402
from ckptstage.protos import layout  # noqa: E402
from ckptstage.protos.v1 import ckptstage_pb2 as pb  # noqa: E402
from conftest import DEFAULTS  # noqa: E402
from s3server import BUCKET, S3Server, open_tier, s3_server  # noqa: E402
from support import free_port, metric, scrape, wait_until  # noqa: E402
from test_cli import ckptstage  # noqa: E402
from test_s3_faults import WRITES, FaultProxy  # noqa: E402

_ = s3_server  # the session's server, a fixture
RULES = {"retention.interval_s": 0.3}  # timed retention passes often: the tests wait for their effect


def _daemon(server: S3Server, root: Path, prefix: str, endpoint: str | None = None, **settings: Any) -> DaemonProcess:
    """A daemon whose shared tier is ``s3://BUCKET/prefix`` (at ``endpoint``: the server's, or a proxy's),
    credentials from the environment, two attempts per request, metrics served."""
    env = {**server.env(), "AWS_MAX_ATTEMPTS": "2"}
    return DaemonProcess(root, {"shared.dir": "", "shared.url": f"s3://{BUCKET}/{prefix}",
                                "shared.endpoint": endpoint or server.endpoint,
                                "metrics.listen": f"127.0.0.1:{free_port()}", **RULES, **settings},
                         defaults=DEFAULTS, env=env, log_level="DEBUG").start()


def _port(d: DaemonProcess) -> int:
    return int(urlparse(str(d.metrics_url)).port or 0)


def _state(seed: int) -> dict[str, Any]:
    return {"w": torch.rand(2000, generator=torch.Generator().manual_seed(seed)), "seed": seed}


def _keys(server: S3Server, prefix: str) -> list[str]:
    conn = open_tier(server, "reader", prefix=prefix).connection
    return sorted(o["Key"][len(prefix) + 1:] for page in conn.client.get_paginator("list_objects_v2").paginate(
        Bucket=conn.bucket, Prefix=prefix + "/") for o in page.get("Contents", []))


def _steps_held(server: S3Server, prefix: str, job: str) -> list[int]:
    """The steps of which the store holds any object (committed or not, whole or not)."""
    return sorted({s for k in _keys(server, prefix) if k.startswith(f"{job}/step-")
                   if (s := layout.parse_step_dirname(k.split("/")[1])) is not None})


def _committed(server: S3Server, prefix: str, job: str) -> list[int]:
    """The steps committed on the store, each whole (every part named verifies)."""
    tier = open_tier(server, "reader", prefix=prefix)
    steps = []
    for s in tier.list_steps(job):
        record = tier.read_commit_record(s.path)
        if record is not None and sorted(p.rank for p in s.parts) == sorted(record.parts):
            for p in s.parts:
                tier.verify_part(p.path)
            steps.append(s.step)
    return steps


def _on(client: Client, tier: str) -> list[int]:
    return [i.step for i in client.list() if tier in i.tiers]


def test_retention_on_the_object_store_keeps_the_last_and_the_pinned_and_removes_every_object_of_the_rest(
        s3_server: S3Server, tmp_path: Path) -> None:
    d = _daemon(s3_server, tmp_path / "n", "keep", **{"shared.keep_last": 2, "local.keep_last": 1})
    try:
        with Client("keep", socket=d.socket) as client:
            client.save(1, _state(1)).wait("shared", timeout=30)
            client.pin(1)
            for step in (2, 3, 4, 5):
                client.save(step, _state(step)).wait("shared", timeout=30)
            # Nothing of the deleted steps is left: no data, manifest, record or claim.
            wait_until(lambda: _steps_held(s3_server, "keep", "keep") == [1, 4, 5], 20, "steps 1, 4, 5 held")
            assert _committed(s3_server, "keep", "keep") == [1, 4, 5]
            assert _on(client, "shared") == [1, 4, 5]
            client.unpin(1)
            wait_until(lambda: _steps_held(s3_server, "keep", "keep") == [4, 5], 20, "step 1 deleted once unpinned")
            wait_until(lambda: _on(client, "local") == [5], 20, "step 1 deleted from local once unpinned")
            assert _on(client, "shared") == [4, 5]
        text = scrape(_port(d))
        assert metric(text, "ckptstage_evictions_total", tier="shared", rule="unkept") == 3  # steps 2, 3, then 1
    finally:
        d.stop()
    assert [k for k in _keys(s3_server, "keep") if "/.tmp/" in f"/{k}" or k.endswith(".claim")] == []


def test_an_undrained_checkpoint_is_never_deleted_and_a_deletion_cut_short_is_finished(
        s3_server: S3Server, tmp_path: Path) -> None:
    proxy = FaultProxy(s3_server.endpoint)
    # Whole parts (a data object beside the manifest), whatever the suite's default: an incremental part's
    # chunks stay in the job's store when it goes, so only a whole part's deletion can stop half way.
    d = _daemon(s3_server, tmp_path / "n", "only", endpoint=proxy.endpoint,
                **{"shared.keep_last": 1, "local.keep_last": 1, "persist.incremental": False})
    port = _port(d)
    try:
        with Client("only", socket=d.socket) as client:
            proxy.fail(503, "SlowDown", match=WRITES)  # nothing reaches the store
            handles = [client.save(step, _state(step)) for step in (1, 2, 3)]
            for h in handles:
                h.wait("local", timeout=30)
            passes = metric(scrape(port), "ckptstage_retention_passes_total", trigger="timer")
            wait_until(lambda: metric(scrape(port), "ckptstage_retention_passes_total", trigger="timer") >= passes + 2,
                       10, "two retention passes")
            assert _on(client, "local") == [1, 2, 3]  # each is the only copy: local keep_last=1 deletes none
            proxy.heal()
            for h in handles:
                h.wait("shared", timeout=30)
            wait_until(lambda: _on(client, "local") == [3], 20, "local retention once drained")
            wait_until(lambda: _steps_held(s3_server, "only", "only") == [3], 20, "shared retention")
            # The store fails deleting many objects at once: a deletion of step 3 stops half way.
            proxy.fail(500, "InternalError", match=r"^POST [^ ]*[?&]delete")
            client.save(4, _state(4)).wait("shared", timeout=30)
            reader = open_tier(s3_server, "reader", prefix="only")
            # Its manifest went first: the part is gone at once, the step never complete again.
            wait_until(lambda: any(s.endswith("-> 500") for s in proxy.seen), 20, "a deletion failing")
            [step3] = [s for s in reader.list_steps("only") if s.step == 3]
            assert step3.parts == () and step3.record_ino
            assert _committed(s3_server, "only", "only") == [4] and _on(client, "shared") == [4]
            assert f"only/{layout.step_dirname(3)}/rank-00000/{layout.DATA_FILE}" in _keys(s3_server, "only")
            proxy.heal()
            wait_until(lambda: _steps_held(s3_server, "only", "only") == [4], 20, "the deletion finished")
    finally:
        d.stop()
        proxy.close()
    assert [k for k in _keys(s3_server, "only") if "/.tmp/" in f"/{k}" or k.endswith(".claim")] == []


def test_two_nodes_share_one_prefix_one_drains_the_other_restores_and_both_apply_the_rules(
        s3_server: S3Server, tmp_path: Path) -> None:
    # The operators differ: A keeps 10 steps on the store, B 2. The job asks for 3 (a job may keep more,
    # never less), published on the store: B deletes down to 3, A (keeping more) nothing.
    a = _daemon(s3_server, tmp_path / "a", "by-two", **{"shared.keep_last": 10, "local.keep_last": 1})
    b = _daemon(s3_server, tmp_path / "b", "by-two", **{"shared.keep_last": 2, "local.keep_last": 1})
    try:
        with Client("two", socket=a.socket, retention={"shared_keep_last": 3}) as writer, \
                Client("two", socket=b.socket) as reader:
            for step in (1, 2, 3):
                writer.save(step, _state(step)).wait("shared", timeout=30)
            # B never saw the job: it lists what the store holds, and restores it through a prefetch.
            wait_until(lambda: _on(reader, "shared") == [1, 2, 3], 20, "B listing the store")
            assert _on(reader, "local") == []
            with Connection(b.socket) as conn:
                got = conn.call("Prefetch", pb.PrefetchRequest(job="two", latest=True), timeout=60)
            assert (got.step, got.parts) == (3, 1)
            loaded = reader.load()
            assert loaded["seed"] == 3 and torch.equal(loaded["w"], _state(3)["w"])
            for step in (4, 5):
                writer.save(step, _state(step)).wait("shared", timeout=30)
            wait_until(lambda: _steps_held(s3_server, "by-two", "two") == [3, 4, 5], 20, "B's retention on the store")
            wait_until(lambda: _on(reader, "shared") == [3, 4, 5], 20, "B's index following the store")
            wait_until(lambda: _on(writer, "shared") == [3, 4, 5], 20, "A's index following the store")
            assert _committed(s3_server, "by-two", "two") == [3, 4, 5]
            assert _on(writer, "local") == [5] and _on(reader, "local") == [3]  # each node's own local rules
    finally:
        a.stop()
        b.stop()
    deleted = {node: re.findall(r"retention: deleted two step (\d+) rank 0 from shared",
                                (tmp_path / node / "daemon.log").read_text()) for node in ("a", "b")}
    assert deleted == {"a": [], "b": ["1", "2"]}
    assert [k for k in _keys(s3_server, "by-two") if "/.tmp/" in f"/{k}" or k.endswith(".claim")] == []


def test_status_names_the_store_by_its_url_and_reports_no_free_space_figure(s3_server: S3Server,
                                                                           tmp_path: Path) -> None:
    """An object store has no free space to run out of: status says so, and no free/size series exists for it
    (a 0 there would fire the free-space alert); the tier's place is its URL, in status and in the start log."""
    d = _daemon(s3_server, tmp_path / "n", "shown")
    url = f"s3://{BUCKET}/shown"
    try:
        with Client("shown", socket=d.socket) as client:
            client.save(1, _state(1)).wait("shared", timeout=30)
        with Connection(d.socket) as conn:
            wait_until(lambda: [t for t in conn.status().tiers if t.tier == pb.SHARED][0].reachable, 20,
                       "the store probed")
            [shared] = [t for t in conn.status().tiers if t.tier == pb.SHARED]
            [local] = [t for t in conn.status().tiers if t.tier == pb.LOCAL]
        assert (shared.dir, shared.unbounded, shared.free_bytes, shared.state) == (url, True, 0, "ok")
        assert shared.checkpoints == 1 and shared.used_bytes > 0
        assert not local.unbounded and local.free_bytes > 0
        text = ckptstage("status", socket=d.socket).stdout
        assert re.search(rf"shared: {re.escape(url)} — 1 part\(s\), .* used, no size limit", text), text
        scraped = scrape(_port(d))
        assert 'ckptstage_tier_free_bytes{tier="local"}' in scraped
        assert 'tier="shared"' not in "".join(line for line in scraped.splitlines()
                                             if line.startswith(("ckptstage_tier_free_bytes", "ckptstage_tier_size")))
    finally:
        d.stop()
    assert f"shared {url}, arena budget" in (tmp_path / "n" / "daemon.log").read_text()


def test_the_drain_to_the_store_holds_the_bandwidth_cap(s3_server: S3Server, tmp_path: Path) -> None:
    """``[shared] max_bandwidth`` governs the object store's uploads as it does a file system's copies."""
    d = _daemon(s3_server, tmp_path / "n", "capped",
                **{"shared.max_bandwidth": "16MiB/s", "persist.incremental": False})
    rate, nbytes = 16 << 20, 32 << 20
    try:
        with Client("capped", socket=d.socket) as client:
            client.save(1, {"w": torch.arange(nbytes // 8, dtype=torch.int64)}).wait("shared", timeout=60)
        text = scrape(_port(d))
    finally:
        d.stop()
    took = metric(text, "ckptstage_drain_duration_seconds_sum")
    assert metric(text, "ckptstage_drain_duration_seconds_count") == 1
    # Held: never beaten by more than the limiter's burst (the upper bound is the file-system test's concern).
    assert took >= 0.9 * nbytes / rate, f"{nbytes} bytes reached the store in {took:.2f}s, the cap says {nbytes / rate:.2f}s"


def test_a_profile_that_does_not_exist_stops_the_start_naming_it(s3_server: S3Server, tmp_path: Path) -> None:
    """A missing profile is the operator's to fix, not a fault to retry: exit 78 (systemd does not restart),
    one line naming the key and the files searched, no traceback."""
    import subprocess
    import sys

    from ckptstage.daemon.main import EXIT_CONFIG

    d = DaemonProcess(tmp_path / "n", {"shared.dir": "", "shared.url": f"s3://{BUCKET}/p", "shared.profile": "nosuch",
                                       "shared.endpoint": s3_server.endpoint}, defaults=DEFAULTS)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "AWS_CONFIG_FILE": str(tmp_path / "none"),
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}
    out = subprocess.run([sys.executable, "-m", "ckptstage.daemon.main", "--config", str(d.config_path)],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == EXIT_CONFIG, out.stderr
    assert "Traceback" not in out.stderr
    assert re.search(r"shared\.profile.*no profile 'nosuch' in the AWS config or credentials file", out.stderr)


def test_the_installed_sdk_sends_every_conditional_request_the_tier_needs(s3_server: S3Server) -> None:
    from ckptstage.daemon.tiers.s3.client import check_sdk

    check_sdk(open_tier(s3_server, "probe").connection.client)  # the pinned boto3 floor is met here
