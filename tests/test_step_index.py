"""The step index: a reader that needs every part of a step opens one file, not each part's manifest, and an
index that is stale or damaged only costs it those opens, never a wrong read. Two real daemons for two
nodes on one shared directory; files opened counted in-process."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import torch

from ckptstage.client import Client, steps
from ckptstage.client.rpc import Connection
from ckptstage.protos import layout
from support import data_extents

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from _scale_ranks import rank_flat  # noqa: E402 - a rank's fragment of a dim-0 sharded tensor, no process group
from _syscounts import OpenCounter  # noqa: E402 - the bench's counter of files this process opens

JOB, WORLD, STEP = "indexed", 4, 5


def state_of(rank: int) -> dict[str, Any]:
    return {"w": torch.full((256,), float(rank)), "rank": rank}


def save_on_two_nodes(a: Any, b: Any) -> None:
    clients = [Client(JOB, socket=(a if r < 2 else b).socket, rank=r, world_size=WORLD, attempt="run")
               for r in range(WORLD)]
    barrier = threading.Barrier(WORLD)
    failed: list[BaseException] = []

    def save(c: Client) -> None:
        try:
            barrier.wait(timeout=10)
            c.save(STEP, state_of(c.rank)).wait("shared", timeout=60)
        except BaseException as e:  # noqa: BLE001 - raised below, in the test's thread
            failed.append(e)

    threads = [threading.Thread(target=save, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in clients:
        c.close()
    assert not failed, failed[0]


def data_files(tiers: list[Path], world: int) -> dict[str, int]:
    """The files that hold the data of the step's parts on ``tiers`` (a data file, or its chunks' files): path ->
    rank."""
    out: dict[str, int] = {}
    for tier in tiers:
        for r in range(world):
            part = layout.part_dir(tier, JOB, STEP, r)
            if part.is_dir():
                out.update({str(e.path): r for e in data_extents(part)})
    return out


def opened_reading_every_part(d: Any) -> tuple[list[str], list[float]]:
    """Files this process opens while it opens the step whole and reads each rank's ``w``."""
    with Client(JOB, socket=d.socket, rank=0, world_size=WORLD) as c:
        with OpenCounter.get().counting([d.local, d.shared]) as opened, c.open_step(STEP) as step:
            values = [float(step.view.read_full("w", tree_rank=r)[0]) for r in range(WORLD)]
        return list(opened), values


def test_a_reader_of_every_part_opens_the_index_not_each_manifest(daemon_factory: Any) -> None:
    a = daemon_factory("node-a")
    assert a.shared is not None
    b = daemon_factory("node-b", **{"shared.dir": str(a.shared)})
    a.start()
    b.start()
    save_on_two_nodes(a, b)
    index = layout.step_dir(a.shared, JOB, STEP) / layout.STEP_INDEX_FILE
    record = layout.read_commit_record(layout.step_dir(a.shared, JOB, STEP))
    assert index.exists() and record is not None
    # The record vouches for the index by its digest; the index holds each part's manifest file as it is.
    parsed = layout.parse_step_index(index.read_bytes(), index, record.index_digest)
    assert parsed.world_size == WORLD and sorted(parsed.sharded) == []
    for r in range(WORLD):
        part = layout.step_dir(a.shared, JOB, STEP) / layout.rank_dirname(r)
        assert parsed.manifest(r) == layout.read_manifest(part, record.parts[r].manifest_digest)

    opened, values = opened_reading_every_part(a)
    assert values == [float(r) for r in range(WORLD)]
    assert [p for p in opened if p.endswith(layout.MANIFEST_FILE)] == []
    # One index, and not the shared tier's: the daemon copied it onto the node once, for all its readers.
    [copy] = [p for p in opened if p.endswith(".json") and not p.endswith(layout.COMMIT_FILE)]
    assert Path(copy).is_relative_to(a.local) and Path(copy).read_bytes() == index.read_bytes()
    files = data_files([a.local, a.shared], WORLD)
    assert sorted(files[p] for p in opened if p in files) == list(range(WORLD))  # the bytes it read, once each

    # A damaged index (or one left by an earlier commit of the step) vouches for nothing: each part's
    # own manifest is read, and the reads are right.
    for damaged in (index, Path(copy)):
        raw = bytearray(damaged.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        damaged.write_bytes(bytes(raw))
    opened, values = opened_reading_every_part(a)
    assert values == [float(r) for r in range(WORLD)]
    assert len([p for p in opened if p.endswith(layout.MANIFEST_FILE)]) == WORLD
    assert "quarantined" not in a.log.read_text()  # the index is no copy of a part: nothing to quarantine


def test_a_step_only_on_the_local_tier_is_read_from_its_manifests(daemon_factory: Any) -> None:
    d = daemon_factory("solo", **{"shared.dir": ""}).start()
    with Client(JOB, socket=d.socket, rank=0, world_size=1) as c:
        c.save(STEP, state_of(0)).wait("local", timeout=30)
        with OpenCounter.get().counting([d.local]) as opened, c.open_step(STEP) as step:
            assert float(step.view.read_full("w")[0]) == 0.0
    assert len([p for p in opened if p.endswith(layout.MANIFEST_FILE)]) == 1
    assert not (layout.step_dir(d.local, JOB, STEP) / layout.STEP_INDEX_FILE).exists()


def test_a_box_reader_plans_from_the_index_and_touches_only_the_parts_it_reads(daemon_factory: Any) -> None:
    """The Locate answer does not list every part, and a box across two fragments opens those two parts'
    data files and the node's copy of the index: nothing grows with the step's world size but the index."""
    world, rows = 8, 4
    a = daemon_factory("node-a")
    assert a.shared is not None
    b = daemon_factory("node-b", **{"shared.dir": str(a.shared)})
    a.start()
    b.start()
    clients = [Client(JOB, socket=(a if r < world // 2 else b).socket, rank=r, world_size=world, attempt="run")
               for r in range(world)]
    try:
        handles = [c.save_flat(STEP, rank_flat(c.rank, world, rows, 16)) for c in clients]
        for handle in handles:
            handle.wait("shared", timeout=60)
    finally:
        for c in clients:
            c.close()
    record = layout.read_commit_record(layout.step_dir(a.shared, JOB, STEP))
    assert record is not None and record.index_digest

    with Connection(b.socket) as conn:
        located = steps.locate(conn, JOB, STEP, rank=5, step_index=True)
        assert located.index is not None and located.index_digest == record.index_digest
        assert sorted(located.parts) == [5]  # the index names the other seven
        out = torch.empty(rows, 16)
        with OpenCounter.get().counting([b.local, a.shared]) as opened, steps.open_step(conn, JOB, STEP, 5) as step:
            step.view.read_box("w", ((5 * rows + rows // 2, 0), (rows, 16)), out)  # half of rank 5's, half of 6's
    assert out[: rows // 2].eq(5).all() and out[rows // 2:].eq(6).all()
    assert not [p for p in opened if p.endswith(layout.MANIFEST_FILE)]
    files = data_files([b.local, a.shared], world)
    assert sorted(files[p] for p in opened if p in files) == [5, 6]
    [index] = [p for p in opened if p.endswith(layout.STEP_INDEX_FILE) or "step-index" in p]
    assert Path(index).is_relative_to(b.local)
