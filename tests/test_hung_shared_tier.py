"""A shared file system that hangs (a dead NFS/Lustre server) never delays the node's local work.

The hang is real: a FUSE mount whose server never answers (tests/hangfs.py),
mounted over the shared tier while the daemon runs, or before it starts.
Every daemon thread that touches the shared tier blocks in the kernel; the
local commit path, ``Status``, the metrics scrape, listing and loading must
not be among them. Released, the hang fails with ENOTCONN and the drain
catches up.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.request import urlopen

import torch
from ckptstage.client import Client
from ckptstage.protos import layout
from ckptstage.protos.v1 import ckptstage_pb2 as pb
from hangfs import hang
from support import drain, free_port, wait_until

JOB = "hung"


def state_of(step: int) -> dict[str, Any]:
    return {"w": torch.full((64, 256), float(step)), "step": step}


def shared_status(d: Any) -> pb.TierStatus:
    with d.connection() as conn:
        return next(t for t in conn.status(timeout=1).tiers if t.tier == pb.SHARED)


def timed(fn: Any) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def assert_local_work_goes_on(d: Any, client: Client, steps: range, port: int) -> None:
    for step in steps:
        h = client.save(step, state_of(step))
        # Committed locally as fast as ever: nothing on the commit path waits for the shared tier.
        assert timed(lambda: h.wait("local", timeout=10)) < 3.0, f"step {step}"
    # Status and the metrics endpoint answer from memory and the tier probes' last readings.
    assert timed(lambda: shared_status(d)) < 1.0
    wait_until(lambda: not shared_status(d).reachable, 10, "Status to show the shared tier unreachable")
    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert b"ckptstage_tier_used_bytes" in resp.read()
    assert client.latest() == steps[-1]
    loaded = client.load(steps[-1])
    assert torch.equal(loaded["w"], state_of(steps[-1])["w"])
    # A trainer that starts now connects, saves and commits too.
    with Client(JOB + "-new", socket=d.socket) as fresh:
        assert timed(lambda: fresh.save(1, state_of(1)).wait("local", timeout=10)) < 3.0


def test_a_shared_tier_that_hangs_mid_run_never_delays_local_commits(daemon_factory: Any) -> None:
    port = free_port()
    d = daemon_factory(**{"retention.interval_s": 1, "shared.keep_last": 10,
                          "metrics.listen": f"127.0.0.1:{port}"}).start()
    with Client(JOB, socket=d.socket) as client:
        client.save(1, state_of(1)).wait("shared", timeout=30)
        with hang(d.shared):
            # Give the drain workers and the shared-tier timer time to block inside the hung mount.
            client.save(2, state_of(2)).wait("local", timeout=10)
            time.sleep(1.5)
            assert_local_work_goes_on(d, client, range(3, 7), port)
        # Released: the blocked calls fail (ENOTCONN), the drain backs off and then catches up.
        drain(d, timeout=60)
        for step in range(1, 7):
            assert (layout.part_dir(d.shared, JOB, step, 0) / layout.MANIFEST_FILE).is_file()
        assert [i.tiers for i in client.list()][-1] == ("local", "shared")


def test_the_daemon_starts_and_serves_while_the_shared_tier_hangs(daemon_factory: Any) -> None:
    port = free_port()
    d = daemon_factory(**{"retention.interval_s": 1, "metrics.listen": f"127.0.0.1:{port}"})
    d.shared.mkdir(parents=True)
    with hang(d.shared):
        # Start-up indexes only the local tier; the shared one is indexed in the background.
        assert timed(lambda: d.start()) < 10.0
        with Client(JOB, socket=d.socket) as client:
            assert_local_work_goes_on(d, client, range(1, 4), port)
    drain(d, timeout=60)
    assert {ref.step for ref in layout.scan_tier(d.shared, JOB)} == {1, 2, 3}
