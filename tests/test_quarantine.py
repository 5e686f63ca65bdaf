"""A copy is hidden only on the daemon's own evidence.

A report from a reader makes the daemon re-read the copy; only a mismatch of
its own quarantines it. A reader's own trouble (here: a real EMFILE) never
hides a good copy, and a report with no evidence behind it hides nothing.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from ckptstage.client import Client
from ckptstage.client.cli import main as cli
from ckptstage.protos import layout
from ckptstage.protos.v1 import ckptstage_pb2 as pb
from support import drain, flip_data_byte, free_port, metric, scrape, wait_until

JOB = "quar"


def state_of(step: int) -> dict[str, Any]:
    return {"w": torch.arange(50_000, dtype=torch.float32) + step, "step": step}


def saved(d: Any, steps: range) -> None:
    with Client(JOB, socket=d.socket) as c:
        for step in steps:
            c.save(step, state_of(step)).wait("local", timeout=30)
    drain(d)


def verdicts(port: int, verdict: str) -> float:
    text = scrape(port)
    return sum(metric(text, "ckptstage_corrupt_reports_total", tier=t, verdict=verdict) for t in ("local", "shared"))


def copies(d: Any, step: int) -> list[bool]:
    return [(layout.part_dir(tier, JOB, step, 0) / layout.MANIFEST_FILE).is_file() for tier in (d.local, d.shared)]


def test_a_report_without_evidence_hides_nothing(daemon_factory: Any) -> None:
    port = free_port()
    d = daemon_factory(**{"metrics.listen": f"127.0.0.1:{port}"}).start()
    saved(d, range(1, 3))
    with d.connection() as conn:
        for tier in (pb.LOCAL, pb.SHARED):
            conn.call("ReportCorrupt", pb.ReportCorruptRequest(job=JOB, step=2, rank=0, tier=tier,
                                                               detail="trust me, it is corrupt"))
    wait_until(lambda: verdicts(port, "intact") == 2, 20, "the daemon to re-verify both copies")
    assert copies(d, 2) == [True, True] and verdicts(port, "corrupt") == 0
    with Client(JOB, socket=d.socket) as c:
        assert c.latest() == 2 and torch.equal(c.load(2)["w"], state_of(2)["w"])


# A trainer whose process cannot open another file: its load fails with EMFILE on every copy.
OUT_OF_FDS = r"""
import os, resource, sys
from ckptstage.client import Client
c = Client(sys.argv[2], socket=sys.argv[1])
c.latest()
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
try:
    c.load(2)
except OSError as e:
    print("ERRNO", e.errno, type(e).__name__)
"""


def test_a_trainer_out_of_file_descriptors_never_quarantines_good_copies(daemon_factory: Any) -> None:
    port = free_port()
    d = daemon_factory(**{"metrics.listen": f"127.0.0.1:{port}"}).start()
    saved(d, range(1, 3))
    out = subprocess.run([sys.executable, "-c", OUT_OF_FDS, str(d.socket), JOB], capture_output=True, text=True,
                         timeout=120)
    assert "ERRNO 24" in out.stdout, out.stdout + out.stderr  # EMFILE, raised as itself, not CorruptCheckpoint
    assert verdicts(port, "intact") + verdicts(port, "corrupt") == 0  # never even reported
    assert copies(d, 2) == [True, True]
    with Client(JOB, socket=d.socket) as c:
        assert c.latest() == 2 and torch.equal(c.load(2)["w"], state_of(2)["w"])


def test_a_real_flipped_byte_is_quarantined_counted_and_listed(daemon_factory: Any, capsys: Any) -> None:
    port = free_port()
    # The memory tier off: with it, the load would read the intact copy kept in memory, not the disk.
    d = daemon_factory(**{"metrics.listen": f"127.0.0.1:{port}", "memory.enabled": False}).start()
    saved(d, range(1, 3))
    flip_data_byte(layout.part_dir(d.local, JOB, 2, 0), 4096 + 777)
    with Client(JOB, socket=d.socket) as c:
        assert torch.equal(c.load(2)["w"], state_of(2)["w"])  # the shared copy, verified
        wait_until(lambda: verdicts(port, "corrupt") == 1, 20, "the daemon to confirm the corruption")
        assert copies(d, 2) == [False, True]
        assert metric(scrape(port), "ckptstage_corrupt_parts_total", tier="local") == 1
        assert c.latest() == 2  # still restorable from the shared tier
    assert cli(["--socket", str(d.socket), "ls", JOB]) == 0
    listing = capsys.readouterr().out
    assert "quarantined: step 2 rank 0 local copy" in listing and ".corrupt-rank-00000-" in listing


def listed(d: Any) -> list[dict[str, Any]]:
    with d.connection() as conn:
        resp = conn.call("ListCheckpoints", pb.ListRequest(job=JOB))
    return [{"step": q.step, "tier": q.tier, "path": q.path, "bytes": q.bytes, "chunk": q.chunk}
            for q in resp.quarantined]


def part_copies(copies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The quarantined parts among ``copies``; an incremental part's bad chunk (or its pack) is a copy too."""
    return [q for q in copies if not q["chunk"]]


def test_quarantined_copies_are_listed_after_a_restart_on_every_tier_then_removed_in_time(
        daemon_factory: Any) -> None:
    port = free_port()
    d = daemon_factory(**{"metrics.listen": f"127.0.0.1:{port}", "memory.enabled": False}).start()
    saved(d, range(1, 3))
    flip_data_byte(layout.part_dir(d.shared, JOB, 1, 0), 4096 + 13)
    flip_data_byte(layout.part_dir(d.local, JOB, 2, 0), 4096 + 13)
    with d.connection() as conn:
        for step, tier in ((1, pb.SHARED), (2, pb.LOCAL)):
            conn.call("ReportCorrupt", pb.ReportCorruptRequest(job=JOB, step=step, rank=0, tier=tier, detail="test"))
    wait_until(lambda: verdicts(port, "corrupt") == 2, 20, "both copies quarantined")
    text = scrape(port)
    before = listed(d)
    assert sorted((q["step"], q["tier"]) for q in part_copies(before)) == [(1, pb.SHARED), (2, pb.LOCAL)]
    local_copies = [q for q in before if q["tier"] == pb.LOCAL]
    assert metric(text, "ckptstage_quarantined_copies", tier="local") == len(local_copies)
    assert metric(text, "ckptstage_quarantined_bytes", tier="shared") > 200_000
    d.stop()

    again = daemon_factory("again", **{"local.dir": str(d.local), "shared.dir": str(d.shared)}).start()
    wait_until(lambda: sorted(q["path"] for q in listed(again)) == sorted(q["path"] for q in before), 20,
               "the shared tier's quarantined copies listed once it is indexed")
    assert sorted((q["step"], q["tier"]) for q in part_copies(listed(again))) == [(1, pb.SHARED), (2, pb.LOCAL)]
    paths = [q["path"] for q in listed(again)]
    assert all(".corrupt-rank-00000-" in q["path"] for q in part_copies(listed(again)))
    assert all(Path(p).exists() for p in paths)
    again.stop()

    short = daemon_factory("short", **{"local.dir": str(d.local), "shared.dir": str(d.shared),
                                       "retention.quarantine_keep_s": 1, "retention.interval_s": 0.3}).start()
    wait_until(lambda: not any(Path(p).exists() for p in paths), 20, "old quarantined copies removed")
    assert listed(short) == []
    assert "removed the quarantined" in short.log.read_text()
    with Client(JOB, socket=short.socket) as c:  # what was intact is untouched
        assert torch.equal(c.load(1)["w"], state_of(1)["w"]) and torch.equal(c.load(2)["w"], state_of(2)["w"])


def test_beyond_quarantine_max_bytes_the_oldest_copies_go_first(tmp_path: Path) -> None:
    from ckptstage.daemon.catalog.index import Catalog
    from ckptstage.daemon.catalog.quarantine import Quarantine
    from ckptstage.daemon.metrics import Metrics
    from ckptstage.daemon.tiers.fs import FsTier
    from ckptstage.daemon.tiers.interface import TierName

    tier = FsTier(tmp_path / "t", "node")
    moved = []
    for step in (1, 2, 3):
        part = layout.part_dir(tmp_path / "t", JOB, step, 0)
        part.mkdir(parents=True)
        (part / layout.DATA_FILE).write_bytes(b"x" * 1000)
        moved.append(tier.quarantine_part(part))
        time.sleep(0.03)  # distinct change times, whatever the file system's clock granularity
    now = [10_000.0]
    q = Quarantine(Catalog(tmp_path / "pins.json"), Metrics(), {TierName.LOCAL: tier}, keep_s=3600,
                   max_bytes=2500, clock=lambda: now[0])
    assert q.load_tier(TierName.LOCAL) == 3 and q.load_tier(TierName.LOCAL) == 0  # each copy listed once
    assert q.usage(TierName.LOCAL) == (3, 3000)
    ctimes = {p: p.stat().st_ctime_ns for p in moved}
    assert q.expire(TierName.LOCAL) == 1  # 3000 > 2500: the oldest goes, 2000 are kept
    assert [p for p in moved if not p.exists()] == [moved[0]]
    assert q.usage(TierName.LOCAL) == (2, 2000)
    now[0] = max(ctimes.values()) / 1e9 + 3601  # all of them older than keep_s
    assert q.expire(TierName.LOCAL) == 2 and q.usage(TierName.LOCAL) == (0, 0)
    assert not (tmp_path / "t" / JOB / layout.step_dirname(1)).exists()  # the emptied step directory went too
