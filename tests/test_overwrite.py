"""``save(..., overwrite=True)``: a committed step replaced whole on each tier, never torn, never lost."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch
from support import drain, two_ranks, wait_until

from ckptstage.client import AlreadyCommitted, Client, InvalidRequest
from ckptstage.client.restore import read_part
from ckptstage.daemon import fsutil
from ckptstage.daemon.tiers.fs import FsTier
from ckptstage.protos import layout
from ckptstage.protos.v1 import ckptstage_pb2 as pb


def _state(tag: float, n: int = 4096) -> dict[str, torch.Tensor]:
    return {"w": torch.full((n,), tag), "b": torch.full((3,), tag)}


def _tag(state: dict[str, torch.Tensor]) -> float:
    values = {float(t.unique().item()) for t in state.values()}
    assert len(values) == 1, f"a torn state: {values}"
    return values.pop()


def _shared_tag(shared: Path, job: str, step: int) -> float:
    """The step as the shared tier's files hold it: its record names the parts, which verify and agree."""
    record = layout.read_commit_record(layout.step_dir(shared, job, step))
    assert record is not None
    manifests = [layout.read_manifest(layout.part_dir(shared, job, step, r)) for r in range(record.world_size)]
    assert all(layout.manifest_attempt(m) == record.attempt for m in manifests)
    return _tag(read_part(layout.part_dir(shared, job, step, 0), None)[1])


def test_without_overwrite_a_committed_step_is_refused_naming_the_option(daemon):
    with Client("ow-refuse", socket=daemon.socket) as c:
        c.save(1, _state(1.0)).wait("local", timeout=30)
        with pytest.raises(AlreadyCommitted, match="overwrite=True"):
            c.save(1, _state(2.0)).wait("local", timeout=30)
        assert _tag(c.load(1)) == 1.0


def test_overwrite_replaces_the_step_on_both_tiers(daemon):
    with Client("ow-both", socket=daemon.socket) as c:
        c.save(5, _state(1.0)).wait("shared", timeout=30)
        old = layout.read_commit_record(layout.step_dir(daemon.shared, "ow-both", 5))
        c.save(5, _state(2.0), overwrite=True).wait("shared", timeout=30)
        assert _tag(c.load(5)) == 2.0
        assert [i.step for i in c.list()] == [5] and c.latest() == 5
    new = layout.read_commit_record(layout.step_dir(daemon.shared, "ow-both", 5))
    assert new is not None and old is not None and old.fingerprint() in new.replaces
    assert _shared_tag(daemon.shared, "ow-both", 5) == 2.0
    # The old parts are gone from both tiers (nothing left in the staging area either).
    for tier in (daemon.local, daemon.shared):
        assert sorted(p.name for p in layout.step_dir(tier, "ow-both", 5).iterdir()) == [
            "commit.json", "rank-00000"]
        assert not list((tier / ".tmp").rglob("rank-*"))


def test_replacements_faster_than_the_drain_reach_the_shared_tier_as_the_newest(daemon_factory):
    d = daemon_factory("ow-chain", **{"shared.max_bandwidth": "8MiB/s"}).start()
    with Client("ow-chain", socket=d.socket) as c:
        c.save(3, _state(1.0, n=1 << 20)).wait("shared", timeout=60)
        c.save(3, _state(2.0, n=1 << 20), overwrite=True).wait("local", timeout=30)
        c.save(3, _state(3.0, n=1 << 20), overwrite=True).wait("shared", timeout=60)
        assert _tag(c.load(3)) == 3.0
    drain(d)
    assert _shared_tag(d.shared, "ow-chain", 3) == 3.0


class _Reader:
    """Loads ``step`` in a loop on a thread while the test replaces it: the tags seen, the errors raised."""

    def __init__(self, client: Client, step: int) -> None:
        self.seen: list[float] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(client, step))

    def _run(self, client: Client, step: int) -> None:
        while not self._stop.is_set() and not self.errors:
            try:
                self.seen.append(_tag(client.load(step)))
            except BaseException as e:  # noqa: BLE001 - the test asserts on it
                self.errors.append(e)

    def __enter__(self) -> _Reader:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_readers_see_the_old_or_the_new_step_whole_while_it_is_replaced(daemon):
    with Client("ow-read", socket=daemon.socket) as writer, Client("ow-read", socket=daemon.socket) as reader:
        writer.save(7, _state(1.0, n=4 << 20)).wait("local", timeout=30)
        with _Reader(reader, 7) as r:
            wait_until(lambda: len(r.seen) >= 2 or r.errors, 30, "the reader's first loads")
            writer.save(7, _state(2.0, n=4 << 20), overwrite=True).wait("local", timeout=60)
            count = len(r.seen)
            wait_until(lambda: len(r.seen) >= count + 2 or r.errors, 30, "loads after the replacement")
    assert not r.errors, r.errors[0]
    assert set(r.seen) <= {1.0, 2.0} and r.seen[0] == 1.0 and r.seen[-1] == 2.0
    assert r.seen == sorted(r.seen), "the old step came back after the new one was read"


def test_a_multi_rank_step_is_replaced_once_every_rank_has_saved(daemon):
    c0 = Client("ow-ranks", socket=daemon.socket, rank=0, world_size=2, attempt="run")
    c1 = Client("ow-ranks", socket=daemon.socket, rank=1, world_size=2, attempt="run")
    try:
        for c in (c0, c1):
            c.save(2, _state(1.0)).wait("local", timeout=30)
        c0.save(2, _state(2.0), overwrite=True).wait("local", timeout=30)
        assert _tag(c1.load(2)) == 1.0  # rank 1's replacement has not come: the step is still the old one
        c1.save(2, _state(2.0), overwrite=True).wait("local", timeout=30)
        assert _tag(c0.load(2)) == 2.0 and _tag(c1.load(2)) == 2.0
        c1.close()
        with pytest.raises(InvalidRequest, match=r"ranks \[1\] of 2 have no session here"):
            c0.save(2, _state(3.0), overwrite=True).wait("local", timeout=30)
        assert _tag(c0.load(2)) == 2.0
    finally:
        c0.close()
        c1.close()


def test_sigkill_before_the_replacement_is_in_place_leaves_the_old_step(daemon_factory):
    # The drain is slow: the daemon dies while the replacement is being assembled on the shared tier.
    d = daemon_factory("ow-kill", **{"shared.max_bandwidth": "2MiB/s"}).start()
    with Client("ow-kill", socket=d.socket) as c:
        c.save(4, _state(1.0, n=1 << 20)).wait("local", timeout=30)
    drain(d, timeout=60)
    with Client("ow-kill", socket=d.socket) as c:
        c.save(4, _state(2.0, n=1 << 20), overwrite=True).wait("local", timeout=30)
    # The part's temporary (<job>.<step>.<rank>.<id>) on the shared tier: its data (file or new chunks) is on its way.
    wait_until(lambda: list((d.shared / ".tmp").glob("*/ow-kill.4.0.*")), 20, "the replacement's copy started")
    d.kill()
    assert _shared_tag(d.shared, "ow-kill", 4) == 1.0  # the shared tier still has the old step, whole
    d.start()
    drain(d, timeout=60)  # the restarted daemon drains the replacement again, and swaps it in
    assert _shared_tag(d.shared, "ow-kill", 4) == 2.0
    with Client("ow-kill", socket=d.socket) as c:
        assert _tag(c.load(4)) == 2.0


def _staged_step(tier: Path, owner: str, job: str, step: int, tag: bytes, record: bool) -> Path:
    sdir = FsTier(tier, owner).staged_location(job, step, 0).parent
    (sdir / "rank-00000").mkdir(parents=True)
    (sdir / "rank-00000" / "marker").write_bytes(tag)
    if record:
        rec = layout.CommitRecord(job, step, "new", 1, 1.0, {0: layout.CommittedPart(1, "0" * 16)})
        (sdir / layout.COMMIT_FILE).write_bytes(layout.commit_record_bytes(rec))
    return sdir


@pytest.mark.parametrize("old_in_place,record,expect", [
    (False, True, b"new"),   # a crash between the two renames: the replacement goes in
    (True, True, b"old"),    # a crash before the swap (or after the exchange): the step in place stays
    (False, False, None),    # never sealed: nothing becomes a step
])
def test_recovery_keeps_exactly_one_of_the_two(tmp_path, old_in_place, record, expect):
    tier, owner, job = tmp_path / "tier", "node-a", "job"
    _staged_step(tier, owner, job, 9, b"new", record)
    final = layout.step_dir(tier, job, 9)
    if old_in_place:
        (final / "rank-00000").mkdir(parents=True)
        (final / "rank-00000" / "marker").write_bytes(b"old")
    FsTier(tier, owner).recover_staged()
    fsutil.clean_temporaries(tier, owner)
    marker = final / "rank-00000" / "marker"
    assert (marker.read_bytes() if marker.exists() else None) == expect
    assert not (layout.tmp_root(tier, owner)).exists() or not any(layout.tmp_root(tier, owner).iterdir())


def test_a_crashed_runs_committed_step_never_replaces_its_successors_on_the_shared_tier(daemon_factory, tmp_path):
    # Node A commits step 1 locally and dies before draining it; the job restarts on node B, which saves
    # step 1 again (another attempt) and drains it. When A comes back, its stale step 1 is a straggler:
    # it never replaces B's on the shared tier (only a record that names B's commit in `replaces` could).
    shared = tmp_path / "shared"
    a = daemon_factory("stale-a", **{"shared.dir": str(shared), "shared.max_bandwidth": "1MiB/s"}).start()
    with Client("stale", socket=a.socket) as c:
        c.save(1, _state(1.0, n=2 << 20)).wait("local", timeout=30)
    a.kill()
    b = daemon_factory("stale-b", **{"shared.dir": str(shared)}).start()
    with Client("stale", socket=b.socket) as c:
        c.save(1, _state(2.0)).wait("shared", timeout=30)
    a.start()
    with a.connection() as conn:
        resp = conn.call("Drain", pb.DrainRequest(wait=True, timeout_s=30), timeout=40)
    assert resp.failed == 1 and resp.pending == 0
    assert _shared_tag(shared, "stale", 1) == 2.0
    assert "straggler" in a.log.read_text()


def test_a_step_replaced_right_after_it_committed_drains_its_new_version(daemon_factory):
    # The old part's drain may finish after the replacement took its place: it is the old part's drain,
    # not the new one's (drained marks name the manifest), so the new version still goes to the shared tier.
    d = daemon_factory("ow-race", **{"local.keep_last": 100, "shared.keep_last": 100}).start()
    with Client("ow-race", socket=d.socket) as c:
        for step in range(12):
            n = 1 << (14 + step % 4)
            c.save(step, _state(1.0, n)).wait("local", timeout=30)
            c.save(step, _state(2.0, n), overwrite=True).wait("shared", timeout=30)
            assert _shared_tag(d.shared, "ow-race", step) == 2.0, f"step {step}"
    drain(d)
    assert {_shared_tag(d.shared, "ow-race", s) for s in range(12)} == {2.0}


def test_readers_never_fail_while_a_local_only_step_is_replaced_again_and_again(daemon_factory):
    # With one tier a reader's copy can vanish or change under it: it reads the step again and never
    # reports the copy corrupt (which would quarantine a good checkpoint).
    d = daemon_factory("ow-local", **{"shared.dir": ""}).start()
    with Client("ow-local", socket=d.socket) as writer, Client("ow-local", socket=d.socket) as reader:
        writer.save(7, _state(0.0)).wait("local", timeout=30)
        with _Reader(reader, 7) as r:
            for tag in range(1, 40):
                writer.save(7, _state(float(tag)), overwrite=True).wait("local", timeout=30)
    assert not r.errors, r.errors[0]
    assert r.seen and r.seen == sorted(r.seen) and r.seen[-1] <= 39.0
    assert "quarantined" not in d.log.read_text()


def test_a_rank_replaced_before_its_step_is_complete_never_tears_the_shared_step(daemon):
    # Rank 0 is saved, drained, then saved again before rank 1 ever saved: the shared step is sealed
    # from the new rank 0 and rank 1, never from the old rank 0 still on the shared tier.
    c0, c1 = two_ranks(daemon, "ow-torn")
    with c0, c1:
        c0.save(5, _state(1.0)).wait("shared", timeout=30)
        c0.save(5, _state(2.0), overwrite=True).wait("local", timeout=30)
        c1.save(5, _state(2.0)).wait("shared", timeout=30)
        assert _tag(c0.load(5)) == 2.0
    drain(daemon)
    assert _shared_tag(daemon.shared, "ow-torn", 5) == 2.0
    record = layout.read_commit_record(layout.step_dir(daemon.shared, "ow-torn", 5))
    assert record is not None and record.world_size == 2
    assert {_tag(read_part(layout.part_dir(daemon.shared, "ow-torn", 5, r), None)[1]) for r in (0, 1)} == {2.0}


def test_a_step_partly_drained_then_replaced_reaches_the_shared_tier_whole(daemon_factory):
    # Step 5 is committed locally with rank 0 already on the shared tier and rank 1 waiting behind a slow
    # drain; both ranks are then replaced. The shared tier gets the new step whole, never old + new.
    d = daemon_factory("ow-part", **{"shared.max_bandwidth": "1MiB/s", "shared.max_concurrent": 1}).start()
    c0, c1 = two_ranks(d, "ow-part")
    with c0, c1, Client("ow-busy", socket=d.socket) as busy:
        c0.save(5, _state(1.0)).wait("shared", timeout=30)
        busy.save(1, _state(9.0, n=(2 << 20) // 4)).wait("local", timeout=30)  # holds the one drain slot
        c1.save(5, _state(1.0)).wait("local", timeout=30)
        handles = [c.save(5, _state(2.0), overwrite=True) for c in (c0, c1)]
        for h in handles:
            h.wait("local", timeout=30)
        assert _tag(c1.load(5)) == 2.0
    drain(d, timeout=90)
    assert _shared_tag(d.shared, "ow-part", 5) == 2.0
    assert {_tag(read_part(layout.part_dir(d.shared, "ow-part", 5, r), None)[1]) for r in (0, 1)} == {2.0}


def test_a_replacement_swapped_in_just_before_a_crash_is_drained_not_taken_for_the_old_part(daemon_factory):
    # The state a SIGKILL leaves right after the local exchange: the new step is in place on the local
    # tier, the daemon's drained marks still speak of the old one. The restarted daemon must drain the
    # new step (it is not on the shared tier) before retention may remove it locally.
    d = daemon_factory("ow-crash", **{"local.keep_last": 2}).start()
    with Client("ow-crash", socket=d.socket, attempt="run") as c:
        c.save(5, _state(1.0)).wait("shared", timeout=30)
    d.kill()
    # Another daemon (the same job and attempt, its own tiers) replaces a copy of that step: its local
    # tier then holds exactly what the exchange would have put in place. The job's directory is copied
    # whole (its only step, and the chunk store an incremental part's data lies in).
    e = daemon_factory("ow-crash-e", **{"shared.dir": ""})
    fsutil.makedirs_durable(e.local)
    shutil.copytree(d.local / "ow-crash", e.local / "ow-crash")
    e.start()
    with Client("ow-crash", socket=e.socket, attempt="run") as c:
        c.save(5, _state(2.0), overwrite=True).wait("local", timeout=30)
    e.stop()
    shutil.rmtree(d.local / "ow-crash")
    shutil.copytree(e.local / "ow-crash", d.local / "ow-crash")
    d.start()
    drain(d)
    assert _shared_tag(d.shared, "ow-crash", 5) == 2.0
    with Client("ow-crash", socket=d.socket, attempt="run") as c:
        for step in (6, 7, 8):
            c.save(step, _state(float(step))).wait("shared", timeout=30)
        assert _tag(c.load(5)) == 2.0  # from the shared tier once retention took it off the local one


def test_a_step_saved_again_with_the_same_bytes_still_reaches_the_shared_tier(daemon_factory):
    # A re-save of an unchanged state (Lightning saving one step as its top-k and its last checkpoint) has
    # the same data but a new manifest. Here the first version is still being copied when the second one
    # takes its place locally: the shared tier must take the new part, not keep the old one as if it were
    # it (else the step is never sealed there, and retention removes it as a straggler).
    d = daemon_factory("ow-same", **{"local.keep_last": 100, "shared.keep_last": 100,
                                     "shared.max_bandwidth": "1MiB/s"}).start()
    with Client("ow-same", socket=d.socket) as c:
        for step in range(1, 4):
            c.save(step, _state(float(step), n=1 << 16)).wait("local", timeout=30)
            c.save(step, _state(float(step), n=1 << 16), overwrite=True).wait("shared", timeout=30)
    drain(d)
    for step in range(1, 4):
        assert _shared_tag(d.shared, "ow-same", step) == float(step)
