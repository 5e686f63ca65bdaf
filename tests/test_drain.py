"""Draining to the shared tier, against a real daemon with real faults.

Faults are real: a read-only bind mount over the shared directory, a full
small tmpfs as the shared tier, SIGKILL in the middle of a drain, a flipped
byte in a committed data file. Tests that need ``mount`` skip when the
machine does not allow it (not root, or no mount namespace rights).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from ckptstage.client import Client
from ckptstage.client.errors import SaveFailed
from ckptstage.daemon.tiers.limiter import RateLimiter
from ckptstage.protos import chunks, layout
from support import (data_size, drain, flip_data_byte, free_port, metric, read_data, read_only_mount, scrape,
                     small_tmpfs, wait_metric, wait_until)

MiB = 1 << 20
JOB = "drainjob"


# --- helpers ------------------------------------------------------------------------


def steps_on_disk(tier: Path, job: str = JOB) -> set[int]:
    """Steps of ``job`` with a committed part on the tier, as a scan of the directory sees them."""
    for _ in range(50):
        try:
            return {ref.step for ref in layout.scan_tier(tier) if ref.job == job}
        except FileNotFoundError:  # the daemon deleted a step while we listed it: look again
            time.sleep(0.01)
    raise AssertionError(f"{tier} kept changing under the scan")


def data_of(tier: Path, step: int, rank: int = 0, job: str = JOB) -> bytes:
    """The part's data file on ``tier`` (stored whole or as chunks)."""
    return read_data(layout.part_dir(tier, job, step, rank))


def state_of(step: int, nbytes: int = 64 << 10) -> dict[str, Any]:
    """A small state whose bytes depend on the step."""
    n = nbytes // 4
    return {"w": torch.arange(step * n, (step + 1) * n, dtype=torch.int32), "step": step}


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def temporaries(shared: Path) -> list[Path]:
    """Everything under the shared tier's ``.tmp/<node>/`` directories."""
    root = shared / layout.TMP_DIR
    return [p for owner in root.iterdir() for p in owner.iterdir()] if root.is_dir() else []


def assert_no_torn_parts(shared: Path) -> None:
    """Every rank-* directory on the tier has a manifest and verifies."""
    for job_dir in (p for p in shared.iterdir() if p.name != layout.TMP_DIR):
        for rank_dir in job_dir.glob("step-*/rank-*"):
            assert (rank_dir / layout.MANIFEST_FILE).is_file(), f"torn part without manifest: {rank_dir}"
            chunks.verify_part(rank_dir)


def fill(path: Path) -> Path:
    """Fills the file system holding ``path`` until ENOSPC; returns the filler file."""
    filler = path / "filler"
    with open(filler, "wb") as f:
        block = b"\0" * (64 << 10)
        with pytest.raises(OSError):
            while True:
                f.write(block)
                f.flush()
    return filler


def save_all(client: Client, steps: range, **kw: Any) -> list[Any]:
    handles = [client.save(s, state_of(s, **kw)) for s in steps]
    for h in handles:
        h.wait("local", timeout=30)
    return handles


# --- tests ------------------------------------------------------------------------------


def test_drained_copy_is_bit_exact_and_loads_from_shared_alone(daemon_factory: Any) -> None:
    d = daemon_factory().start()
    state: dict[str, Any] = {"f32": torch.randn(300, 1000), "bf16": torch.randn(700, 513).to(torch.bfloat16),
             "i64": torch.arange(100_000), "nested": {"empty": torch.empty(0), "scalar": torch.tensor(2.5)},
             "step": 7}
    with Client(JOB, socket=d.socket) as c:
        h = c.save(7, state)
        h.wait("shared", timeout=60)
        # wait("shared") returned: the shared copy is committed (renamed into place, manifest inside).
        shared_part = layout.part_dir(d.shared, JOB, 7, 0)
        local_part = layout.part_dir(d.local, JOB, 7, 0)
        assert (shared_part / layout.MANIFEST_FILE).is_file()
        assert read_data(local_part) == read_data(shared_part)
        assert layout.read_manifest(shared_part) == layout.read_manifest(local_part)
        chunks.verify_part(shared_part)
        wait_until(lambda: [i.tiers for i in c.list()] == [("local", "shared")], 10, "list to show both tiers")
    d.stop()
    shutil.rmtree(local_part)
    d.start()
    with Client(JOB, socket=d.socket) as c:
        assert [(i.step, i.tiers) for i in c.list()] == [(7, ("shared",))]
        assert c.latest() == 7
        assert same_state(c.load()["nested"], state["nested"])
        loaded = c.load(7)
    assert loaded["step"] == 7
    for key in ("f32", "bf16", "i64"):
        assert loaded[key].dtype == state[key].dtype and torch.equal(loaded[key], state[key])
    assert not local_part.exists()  # a load reads the shared copy in place; it does not stage it back


def test_wait_shared_raises_without_a_shared_tier(daemon_factory: Any) -> None:
    d = daemon_factory(**{"shared.dir": ""}).start()
    with Client(JOB, socket=d.socket) as c:
        h = c.save(1, state_of(1))
        h.wait("local", timeout=30)
        with pytest.raises(SaveFailed, match="no shared tier"):
            h.wait("shared", timeout=30)
        assert [i.drain_state for i in c.list()] == ["disabled"]


def test_unwritable_shared_dir_retries_keeps_local_and_catches_up(daemon_factory: Any) -> None:
    port = free_port()
    d = daemon_factory(**{"metrics.listen": f"127.0.0.1:{port}", "local.keep_last": 2}).start()
    assert d.shared is not None and d.shared.is_dir()
    with read_only_mount(d.shared) as writable, Client(JOB, socket=d.socket) as c:
        save_all(c, range(1, 6))  # local saves keep working
        wait_until(lambda: metric(scrape(port), "ckptstage_drain_retries_total") >= 3, 20, "drain retries")
        text = scrape(port)
        assert metric(text, "ckptstage_shared_tier_up") == 0
        assert metric(text, "ckptstage_drain_queue_parts") == 5
        assert metric(text, "ckptstage_evictions_total", tier="local", rule="keep_last") == 0
        # Nothing left the local tier meanwhile, although keep_last is 2: none is on the shared tier.
        assert steps_on_disk(d.local) == {1, 2, 3, 4, 5}
        assert steps_on_disk(d.shared) == set()
        assert {i.drain_state for i in c.list()} <= {"pending", "draining"}
        assert "retrying in" in d.log.read_text()
        writable()
        drain(d)
        wait_until(lambda: steps_on_disk(d.local) == {4, 5}, 10, "local retention after the drain")
        assert steps_on_disk(d.shared) == {1, 2, 3, 4, 5}  # shared keep_last is 5 by default
        assert_no_torn_parts(d.shared)
        wait_metric(port, 3, "ckptstage_evictions_total", tier="local", rule="keep_last")
        text = scrape(port)
        assert metric(text, "ckptstage_shared_tier_up") == 1
        assert metric(text, "ckptstage_drain_queue_parts") == 0
        assert temporaries(d.shared) == []  # failed attempts left nothing behind
        for s in (1, 5):
            assert same_state(c.load(s), state_of(s))


def test_full_tmpfs_shared_tier_retries_and_catches_up(daemon_factory: Any, tmp_path: Path) -> None:
    port = free_port()
    d = daemon_factory(**{"metrics.listen": f"127.0.0.1:{port}", "shared.keep_last": 2})
    assert d.shared is not None
    with small_tmpfs(d.shared, "8M"):
        d.start()
        filler = fill(d.shared)
        with Client(JOB, socket=d.socket) as c:
            save_all(c, range(1, 5), nbytes=1 * MiB)
            wait_until(lambda: metric(scrape(port), "ckptstage_drain_retries_total") >= 3, 20, "drain retries")
            assert "No space left on device" in d.log.read_text()
            assert steps_on_disk(d.local) == {1, 2, 3, 4}  # undrained: all kept despite keep_last 2
            assert steps_on_disk(d.shared) == set()
            filler.unlink()
            drain(d)
            wait_until(lambda: steps_on_disk(d.shared) == {3, 4} and steps_on_disk(d.local) == {3, 4}, 10,
                       "both tiers within keep_last 2 after the drain")
            assert_no_torn_parts(d.shared)
            assert temporaries(d.shared) == []
            assert same_state(c.load(4), state_of(4, nbytes=1 * MiB))
        d.stop()


def test_small_local_tier_evicts_oldest_drained_never_undrained(daemon_factory: Any) -> None:
    port = free_port()
    part = 1 * MiB
    d = daemon_factory(**{"metrics.listen": f"127.0.0.1:{port}", "local.keep_last": 10,
                          "local.max_bytes": int(2.5 * part), "shared.keep_last": 10}).start()
    assert d.shared is not None
    with read_only_mount(d.shared) as writable, Client(JOB, socket=d.socket) as c:
        save_all(c, range(1, 6), nbytes=part)
        wait_until(lambda: metric(scrape(port), "ckptstage_drain_retries_total") >= 1, 20, "drain retries")
        # Five parts on a tier capped at 2.5: all stay, since none is drained yet.
        assert steps_on_disk(d.local) == {1, 2, 3, 4, 5}
        writable()
        drain(d)
        wait_until(lambda: steps_on_disk(d.local) == {4, 5}, 10, "max_bytes eviction after the drain")
        assert steps_on_disk(d.shared) == {1, 2, 3, 4, 5}
        wait_metric(port, 3, "ckptstage_evictions_total", tier="local", rule="max_bytes")
        assert metric(scrape(port), "ckptstage_evictions_total", tier="local", rule="keep_last") == 0
        assert [(i.step, i.tiers) for i in c.list()] == [
            (1, ("shared",)), (2, ("shared",)), (3, ("shared",)), (4, ("local", "shared")), (5, ("local", "shared"))]
        assert same_state(c.load(1), state_of(1, nbytes=part))


def test_backlog_drains_newest_first_then_oldest_so_a_small_local_tier_keeps_the_newest(
        daemon_factory: Any) -> None:
    part = 1 * MiB
    d = daemon_factory(**{"shared.max_bandwidth": "4MiB/s", "shared.max_concurrent": 1, "local.keep_last": 10,
                          "local.max_bytes": int(2.5 * part), "shared.keep_last": 10}).start()
    assert d.shared is not None
    with Client(JOB, socket=d.socket) as c:
        handles = [c.save(s, state_of(s, nbytes=part)) for s in range(1, 6)]  # faster than the drain
        for h in handles:
            h.wait("shared", timeout=30)
        wait_until(lambda: steps_on_disk(d.local) == {4, 5}, 10, "max_bytes eviction after the drain")
    order = [int(m) for m in re.findall(rf"drained {JOB} step (\d+) rank 0", d.log.read_text())]
    assert sorted(order) == [1, 2, 3, 4, 5]
    # Whatever was drained first, the newest came next, then the backlog oldest first.
    rest = order[order.index(5) + 1:]
    assert rest == sorted(rest) and order.index(5) <= 1, order
    assert steps_on_disk(d.shared) == {1, 2, 3, 4, 5}


def test_sigkill_mid_drain_resumes_without_torn_parts(daemon_factory: Any) -> None:
    d = daemon_factory(**{"shared.max_bandwidth": "20MiB/s"}).start()
    assert d.shared is not None
    big = 40 * MiB
    with Client(JOB, socket=d.socket) as c:
        c.save(1, state_of(1, nbytes=big)).wait("local", timeout=60)

        def copying() -> bool:
            return any(f.stat().st_size > 0 for t in temporaries(d.shared) for f in t.glob("*"))

        wait_until(copying, 20, "the drain to start writing a temporary")
    d.kill(signal.SIGKILL)
    # The kill left temporaries (the part's; an incremental drain's new chunks too), never a part directory.
    left = len(temporaries(d.shared))
    assert left
    assert steps_on_disk(d.shared) == set()
    assert not layout.part_dir(d.shared, JOB, 1, 0).exists()

    d.write_config(**{"shared.max_bandwidth": None})  # uncapped, to finish quickly
    d.start()
    drain(d)
    assert steps_on_disk(d.shared) == {1}
    assert_no_torn_parts(d.shared)
    assert data_of(d.local, 1) == data_of(d.shared, 1)
    assert temporaries(d.shared) == []  # the crash's temporary is gone
    assert f"{left} temporaries removed" in d.log.read_text()
    with Client(JOB, socket=d.socket) as c:
        assert [(i.step, i.tiers, i.drain_state) for i in c.list()] == [(1, ("local", "shared"), "drained")]


def test_two_daemons_drain_ranks_of_one_job_into_one_shared_dir(daemon_factory: Any) -> None:
    """Two nodes, one rank each, one shared directory: both drain and both apply the shared rules
    (keep_last 2) to the same steps, deleting each other's parts too."""
    rules = {"retention.interval_s": 0.3, "shared.keep_last": 2}
    a = daemon_factory("node-a", **rules)
    assert a.shared is not None
    shared = a.shared
    b = daemon_factory("node-b", **{"shared.dir": str(shared), **rules})
    a.start()
    b.start()
    steps = (1, 2, 3, 4)
    states: dict[int, dict[int, dict[str, Any]]] = {
        r: {s: {"w": torch.full((1 << 18,), 100 * s + r, dtype=torch.int32), "rank": r} for s in steps}
        for r in (0, 1)}
    with Client(JOB, socket=a.socket, rank=0, world_size=2) as ca, \
            Client(JOB, socket=b.socket, rank=1, world_size=2) as cb:
        handles = []
        for s in steps:
            handles += [ca.save(s, states[0][s]), cb.save(s, states[1][s])]
        for h in handles:
            h.wait("shared", timeout=60)
        # Each daemon learns of the other's ranks: the checkpoints are complete and restorable from both.
        for c in (ca, cb):
            wait_until(lambda c=c: [(i.step, i.complete) for i in c.list()] == [(3, True), (4, True)],  # type: ignore[misc]
                       10, "each node to see the two newest steps complete, and only those")
            assert c.latest() == 4
        wait_until(lambda: steps_on_disk(shared) == {3, 4}, 10, "shared retention on both nodes")
        for s in (3, 4):
            for r in (0, 1):
                part = layout.part_dir(shared, JOB, s, r)
                chunks.verify_part(part)
                assert layout.read_manifest(part)["rank"] == r
        assert_no_torn_parts(shared)
        owners = [p.name for p in (shared / layout.TMP_DIR).iterdir()]
        assert len(owners) == 2, f"each daemon keeps its own temporaries, got {owners}"
        wait_until(lambda: temporaries(shared) == [], 5, "no temporaries left on the shared tier")
        assert same_state(ca.load(3), states[0][3])
        assert same_state(cb.load(3), states[1][3])
    for d in (a, b):
        assert "retention could not delete" not in d.log.read_text()
    # Node a is lost: a fresh daemon on an empty local tier restores rank 0 from the shared tier.
    a.stop()
    shutil.rmtree(a.local)
    a.start()
    with Client(JOB, socket=a.socket, rank=0, world_size=2) as ca:
        assert ca.latest() == 4
        assert same_state(ca.load(), states[0][4])


def test_flipped_byte_on_local_loads_the_shared_copy_and_reports_it(daemon_factory: Any) -> None:
    port = free_port()
    d = daemon_factory(**{"metrics.listen": f"127.0.0.1:{port}"}).start()
    state: dict[str, Any] = {"w": torch.randn(1 << 18), "step": 3}
    with Client(JOB, socket=d.socket) as c:
        c.save(3, state).wait("shared", timeout=60)
        local = layout.part_dir(d.local, JOB, 3, 0)
        tensor = layout.read_manifest(local)["tensors"][0]
        flip_data_byte(local, tensor["offset"] + 12345)
        loaded = c.load(3)
        assert torch.equal(loaded["w"], state["w"])  # the shared copy's bytes, not the flipped ones
        # The report makes the daemon re-read the copy; its own read confirms the corruption.
        wait_metric(port, 1, "ckptstage_corrupt_parts_total", tier="local")
        assert metric(scrape(port), "ckptstage_corrupt_parts_total", tier="shared") == 0
        log = d.log.read_text()
        assert re.search(rf"quarantined the local copy of {JOB} step 3 rank 0 as .*chunk", log), log[-2000:]
        # The bad copy is out of the index (kept aside for forensics); reads go to the shared copy.
        assert not local.exists()
        assert list(local.parent.glob(".corrupt-*"))
        assert [(i.step, i.tiers) for i in c.list()] == [(3, ("shared",))]
        assert torch.equal(c.load()["w"], state["w"])


def test_bandwidth_cap_is_held_and_used(daemon_factory: Any) -> None:
    port = free_port()
    rate = 50 * MiB
    # Uncompressed: the cap counts the bytes stored, and these would compress (tests/test_fs_compression.py).
    d = daemon_factory(**{"metrics.listen": f"127.0.0.1:{port}", "shared.max_bandwidth": "50MiB/s",
                          "shared.compression": "none"}).start()
    nbytes = 128 * MiB
    with Client(JOB, socket=d.socket) as c:
        h = c.save(1, {"w": torch.arange(nbytes // 8, dtype=torch.int64)})
        h.wait("shared", timeout=60)
    text = scrape(port)
    assert metric(text, "ckptstage_drain_duration_seconds_count") == 1
    took = metric(text, "ckptstage_drain_duration_seconds_sum")
    size = data_size(layout.part_dir(d.shared, JOB, 1, 0))
    expected = size / rate
    # Held: never beaten by more than the bucket's burst. Used: the drain's time also holds what the cap
    # does not govern (the fsync of 128 MiB, sealing the step: 0.1-0.4 s idle, over 1 s on a busy 2-core
    # machine), so the upper bound only catches a throttle that wastes most of the allowed bandwidth.
    assert 0.9 * expected <= took <= 1.6 * expected, f"{size} bytes drained in {took:.2f}s, cap says {expected:.2f}s"
    assert metric(text, "ckptstage_drain_bandwidth_bytes_per_second") == pytest.approx(size / took, rel=0.01)


def test_same_part_name_from_two_daemons_is_refused_not_overwritten_nor_reused(daemon_factory: Any) -> None:
    """Two daemons that both think they hold rank 0 of a job (a misconfiguration, or a job name reused
    with old checkpoints on the shared tier): the second copy must neither replace the first nor be
    taken as drained because a part of that name exists."""
    a = daemon_factory("node-a")
    assert a.shared is not None
    # b must not learn of a's step 1 by its periodic re-read before its own save of it begins (it would
    # refuse that save at once, AlreadyCommitted): what is tested is the drain meeting a's part.
    b = daemon_factory("node-b", **{"shared.dir": str(a.shared), "shared.watch_interval_s": 600})
    a.start()
    b.start()
    with Client(JOB, socket=a.socket, attempt="one") as ca, Client(JOB, socket=b.socket, attempt="one") as cb:
        ca.save(1, state_of(1)).wait("shared", timeout=30)
        h = cb.save(1, state_of(2))
        with pytest.raises(SaveFailed, match="different checkpoint"):
            h.wait("shared", timeout=30)
        assert data_of(a.local, 1) == data_of(a.shared, 1)
        assert data_of(b.local, 1) != data_of(a.shared, 1)
        assert [(i.drain_state, i.attempt) for i in cb.list()] == [("failed", "one")]
        assert same_state(cb.load(1), state_of(2))  # b's only copy stays (committed on b's local tier)
    # Another attempt saving a step committed on the shared tier: refused there as a straggler.
    with Client(JOB, socket=b.socket, attempt="two") as cb:
        h = cb.save(2, state_of(2))
        h.wait("shared", timeout=30)
    with Client(JOB, socket=a.socket, attempt="three") as ca:
        h = ca.save(2, state_of(3))
        with pytest.raises(SaveFailed, match="committed .* by attempt 'two'"):
            h.wait("shared", timeout=30)
    assert data_of(b.local, 2) == data_of(a.shared, 2)


def test_rate_limiter_sleeps_off_its_debt() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(t: float) -> None:
        slept.append(t)
        now[0] += t

    limiter = RateLimiter(100, burst_s=0.5, clock=lambda: now[0], sleep=sleep)
    limiter.acquire(50)  # within the burst
    assert slept == []
    limiter.acquire(100)
    assert slept == [pytest.approx(1.0)]
    now[0] += 10  # idle time refills the bucket up to one request (150 > the 50 of burst), no further
    limiter.acquire(150)
    assert len(slept) == 1
    limiter.acquire(150)
    assert slept[-1] == pytest.approx(1.5)
    now[0] += 1.0  # the time the caller spent writing the last request counts towards the next one
    limiter.acquire(200)
    assert slept[-1] == pytest.approx(1.0)
    start = now[0]
    for _ in range(100):
        limiter.acquire(10)
    assert now[0] - start == pytest.approx(10.0)  # 1000 bytes at 100 bytes/s, the debt already paid
    unlimited = RateLimiter(None, sleep=sleep)
    unlimited.acquire(10**12)
    assert len(slept) == 103


def test_a_commit_record_that_does_not_fit_is_written_once_there_is_room(daemon_factory: Any) -> None:
    # The shared tier has room for the part's files and not one page more: the part lands, its step's
    # commit record does not (ENOSPC). The drain tries again (the part already there is reused) until the
    # record fits, instead of leaving the step unsealed until the shared tier's next timer pass.
    state = {"w": torch.arange(float(1 << 18))}
    probe = daemon_factory("probe", **{"shared.dir": ""}).start()
    with Client(JOB, socket=probe.socket) as c:
        c.save(1, state).wait("local", timeout=30)
    # The part's files, wherever they are kept: its directory and, written incrementally, its job's chunk store.
    kept = [p for p in (probe.local / JOB).rglob("*") if p.is_file() and p.name != layout.COMMIT_FILE]
    pages = sum(-(-p.stat().st_size // 4096) for p in kept)
    probe.stop()
    d = daemon_factory(**{"retention.interval_s": 3600})
    assert d.shared is not None
    with small_tmpfs(d.shared, "4M"):
        filler = fill(d.shared)
        fd = os.open(filler, os.O_WRONLY | os.O_APPEND)  # to the last page: 64 KiB writes may leave a few
        try:
            with pytest.raises(OSError):
                while True:
                    os.write(fd, b"\0" * 4096)
        finally:
            os.close(fd)
        os.truncate(filler, filler.stat().st_size - pages * 4096)  # room for the part, none for the record
        d.start()
        with Client(JOB, socket=d.socket) as c:
            c.save(1, state).wait("local", timeout=30)
            wait_until(lambda: (layout.part_dir(d.shared, JOB, 1, 0) / layout.MANIFEST_FILE).exists() and
                       "No space left on device" in d.log.read_text(), 20, "the part on the shared tier, unsealed")
            assert not (layout.step_dir(d.shared, JOB, 1) / layout.COMMIT_FILE).exists()
            filler.unlink()
            c.wait_step(1, "shared", timeout=15)  # sealed by the drain's retry, long before any timer
        assert (layout.step_dir(d.shared, JOB, 1) / layout.COMMIT_FILE).exists()
        d.stop()
