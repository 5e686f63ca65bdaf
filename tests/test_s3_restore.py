"""Restoring from an object-store shared tier on a node that never saw the job (a real SeaweedFS, real daemons).

Node A trains and drains to ``s3://bucket/prefix``; node B, with a local tier of its own and the same prefix,
restores with a plain ``load()``: no prefetch first. An object cannot be opened as a file, so B's daemon fetches
what the reader asks for onto B's local tier, verified, and the reader reads it there:

- only the parts asked for (rank 0's load fetches rank 0's part), each once however many readers ask at once;
- a step whose every part came is a local step (committed there: a later read needs nothing from the store);
- a flipped byte on the store fails the load naming the part, and nothing of it lands on B's local tier;
- incremental parts (content-addressed chunks) are fetched chunk by chunk the same way.

The two daemons and the proxy in front of B's store are shared by the module; each test has a job of its own.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed")
torch = pytest.importorskip("torch")

from ckptstage.client import Client, errors  # noqa: E402
from ckptstage.client.rpc import Connection  # noqa: E402
from ckptstage.daemon.launcher import DaemonProcess  # noqa: E402
from ckptstage.protos import chunks, layout  # noqa: E402
from ckptstage.protos.v1 import ckptstage_pb2 as pb  # noqa: E402
from conftest import DEFAULTS  # noqa: E402
from s3server import BUCKET, S3Server, open_tier, s3_server  # noqa: E402
from support import wait_until  # noqa: E402
from test_s3_faults import FaultProxy  # noqa: E402

_ = s3_server  # the session's server, a fixture
PREFIX = "restore"


class Nodes:
    def __init__(self, server: S3Server, root: Path) -> None:
        self.server = server
        self.proxy = FaultProxy(server.endpoint)  # B's way to the store: what B asks of it is seen
        self.a = self._daemon(root / "a", server.endpoint)
        self.b = self._daemon(root / "b", self.proxy.endpoint)

    def _daemon(self, root: Path, endpoint: str) -> DaemonProcess:
        env = {**self.server.env(), "AWS_MAX_ATTEMPTS": "2"}
        return DaemonProcess(root, {"shared.dir": "", "shared.url": f"s3://{BUCKET}/{PREFIX}",
                                    "shared.endpoint": endpoint, "persist.incremental": False},
                             defaults=DEFAULTS, env=env, log_level="DEBUG").start()

    def close(self) -> None:
        self.a.stop()
        self.b.stop()
        self.proxy.close()


@pytest.fixture(scope="module")
def nodes(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    n = Nodes(s3_server, tmp_path_factory.mktemp("s3-restore"))
    try:
        yield n
    finally:
        n.close()


def _state(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"w": torch.rand(3000, generator=g), "b": torch.rand(17, generator=g), "rank": rank, "step": step}


def _train(socket: Path, job: str, world_size: int, steps: tuple[int, ...], **client: Any) -> None:
    """Every rank's part of every step, committed on the object store (one process plays every rank)."""
    clients = [Client(job, socket=socket, rank=r, world_size=world_size, **client) for r in range(world_size)]
    try:
        for step in steps:
            handles = [c.save(step, _state(c.rank, step)) for c in clients]
            for h in handles:
                h.wait("shared", timeout=60)
    finally:
        for c in clients:
            c.close()


def _complete(client: Client) -> list[int]:
    """The steps ``client``'s daemon lists as restorable. A step's parts can be listed before its commit
    record is: each rank's save is on the store when its part is, the record follows the last one."""
    return [i.step for i in client.list() if i.complete]


def _entry(socket: Path, job: str, step: int) -> pb.CheckpointInfo:
    with Connection(socket) as conn:
        [info] = [c for c in conn.call("ListCheckpoints", pb.ListRequest(job=job)).checkpoints if c.step == step]
    return info


def _data_gets(proxy: FaultProxy, job: str, rank: int) -> int:
    """GETs B made of rank ``rank``'s data object of ``job`` (ranged ones included)."""
    key = re.escape(f"/{BUCKET}/{PREFIX}/{job}/") + r"step-\d+/" + re.escape(f"rank-{rank:05d}/{layout.DATA_FILE}")
    return sum(1 for s in list(proxy.seen) if re.match(rf"GET {key}(\?| )", s))


def _equal(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return (torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])
            and (got["rank"], got["step"]) == (want["rank"], want["step"]))


def test_a_node_that_never_saw_the_job_loads_from_the_store_fetching_only_the_parts_it_reads(nodes: Nodes) -> None:
    _train(nodes.a.socket, "fresh", 2, (1, 2))
    reader0 = Client("fresh", socket=nodes.b.socket, rank=0, world_size=2)
    reader1 = Client("fresh", socket=nodes.b.socket, rank=1, world_size=2)
    try:
        wait_until(lambda: _complete(reader0) == [1, 2], 20, "B listing the store")
        assert _entry(nodes.b.socket, "fresh", 2).ranks_local == []

        assert _equal(reader0.load(), _state(0, 2))  # no prefetch: the load fetches what it reads
        entry = _entry(nodes.b.socket, "fresh", 2)
        assert list(entry.ranks_local) == [0] and not entry.committed_local  # rank 1's part stayed on the store
        assert _data_gets(nodes.proxy, "fresh", 1) == 0

        assert _equal(reader1.load(), _state(1, 2))
        entry = _entry(nodes.b.socket, "fresh", 2)
        assert list(entry.ranks_local) == [0, 1] and entry.committed_local  # whole here now: a local step
        part = nodes.b.local / "fresh" / layout.step_dirname(2) / layout.rank_dirname(0)
        assert (part / layout.MANIFEST_FILE).is_file()

        # Read again: from the local copy, nothing more asked of the store.
        before = _data_gets(nodes.proxy, "fresh", 0)
        assert _equal(reader0.load(), _state(0, 2))
        assert _data_gets(nodes.proxy, "fresh", 0) == before == 1

        # An older step, asked for by number, comes the same way.
        assert _equal(reader1.load(step=1), _state(1, 1))
        assert list(_entry(nodes.b.socket, "fresh", 1).ranks_local) == [1]
    finally:
        reader0.close()
        reader1.close()


def test_many_readers_of_every_part_at_once_fetch_each_part_once(nodes: Nodes) -> None:
    _train(nodes.a.socket, "crowd", 3, (5,))
    readers = [Client("crowd", socket=nodes.b.socket, rank=r, world_size=3) for r in range(3)]
    try:
        wait_until(lambda: _complete(readers[0]) == [5], 20, "B listing the store")
        barrier = threading.Barrier(len(readers) * 2)
        seen: list[Any] = []

        def read(client: Client) -> None:
            barrier.wait()
            try:
                with client.open_step() as opened:  # every rank's part, as the DCP reader and consolidation do
                    values = [opened.view.read_full("w", tree_rank=r) for r in range(3)]  # fetched as first read
                    assert all(torch.equal(v, _state(r, 5)["w"]) for r, v in enumerate(values))
                    seen.append(sorted(opened.located.parts))
            except Exception as e:  # noqa: BLE001 - reported below
                seen.append(e)

        threads = [threading.Thread(target=read, args=(c,)) for c in readers for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert seen == [[0, 1, 2]] * 6
        assert [_data_gets(nodes.proxy, "crowd", r) for r in range(3)] == [1, 1, 1]
        assert _entry(nodes.b.socket, "crowd", 5).committed_local
    finally:
        for c in readers:
            c.close()


def test_a_flipped_byte_on_the_store_fails_the_load_naming_the_part_and_lands_nothing(
        nodes: Nodes, s3_server: S3Server) -> None:
    _train(nodes.a.socket, "rot", 1, (3,))
    tier = open_tier(s3_server, "vandal", prefix=PREFIX)
    key = f"{PREFIX}/rot/{layout.step_dirname(3)}/{layout.rank_dirname(0)}/{layout.DATA_FILE}"
    conn = tier.connection
    data = bytearray(conn.client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    conn.client.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))

    with Client("rot", socket=nodes.b.socket) as reader:
        wait_until(lambda: _complete(reader) == [3], 20, "B listing the store")
        with pytest.raises(errors.CkptStageError, match=r"rot step 3 rank 0.*(checksum|digest|xxh3)") as caught:
            reader.load()
        assert f"s3://{BUCKET}/{key}: " in str(caught.value)  # the object, by its URL
    assert not (nodes.b.local / "rot").exists() or not any((nodes.b.local / "rot").rglob(layout.MANIFEST_FILE))
    # The daemon's own read agrees: the store's copy is moved aside, and named by its URL.
    with Connection(nodes.b.socket) as conn:
        moved = wait_until(lambda: conn.call("ListCheckpoints", pb.ListRequest(job="rot")).quarantined, 20,
                           "the store's copy quarantined")
        assert conn.call("ListCheckpoints", pb.ListRequest(job="rot")).checkpoints == []
    assert [(q.step, q.rank, q.tier) for q in moved] == [(3, 0, pb.SHARED)]
    assert moved[0].path.startswith(f"s3://{BUCKET}/{PREFIX}/rot/{layout.step_dirname(3)}/.corrupt-rank-0"), moved


def test_prefetch_of_ranks_outside_the_step_is_refused_naming_the_rank(nodes: Nodes) -> None:
    _train(nodes.a.socket, "few", 2, (1,))
    with Connection(nodes.b.socket) as conn:
        wait_until(lambda: [c.step for c in conn.call("ListCheckpoints", pb.ListRequest(job="few")).checkpoints
                            if c.complete] == [1], 20, "B listing")
        with pytest.raises(errors.InvalidRequest, match=r"rank 7 is not a rank of few step 1 \(world size 2\)"):
            conn.call("Prefetch", pb.PrefetchRequest(job="few", step=1, ranks=[7]))
        got = conn.call("Prefetch", pb.PrefetchRequest(job="few", step=1, ranks=[1]), timeout=60)
        assert (got.step, got.parts) == (1, 1)
    assert list(_entry(nodes.b.socket, "few", 1).ranks_local) == [1]


@pytest.mark.parametrize("dedup", ["job", "user"])
def test_incremental_parts_are_restored_chunk_by_chunk(s3_server: S3Server, tmp_path: Path, dedup: str) -> None:
    env = {**s3_server.env(), "AWS_MAX_ATTEMPTS": "2"}
    settings = {"shared.dir": "", "shared.url": f"s3://{BUCKET}/{PREFIX}-inc-{dedup}",
                "shared.endpoint": s3_server.endpoint, "persist.incremental": True, "persist.dedup": dedup}
    a = DaemonProcess(tmp_path / "a", settings, defaults=DEFAULTS, env=env).start()
    b = DaemonProcess(tmp_path / "b", settings, defaults=DEFAULTS, env=env).start()
    try:
        _train(a.socket, "inc", 1, (1, 2))
        with Client("inc", socket=b.socket) as reader:
            wait_until(lambda: _complete(reader) == [1, 2], 20, "B listing the store")
            assert _equal(reader.load(), _state(0, 2))
            assert _equal(reader.load(step=1), _state(0, 1))
        # Fetched into the store the parts name on B's local tier: the job's, or the user's.
        assert any(chunks.store_dir(b.local, "inc" if dedup == "job" else chunks.USER_STORE).rglob("*/*"))
    finally:
        a.stop()
        b.stop()


def test_a_resharding_reader_fetches_only_the_parts_its_box_crosses(nodes: Nodes) -> None:
    """It plans from the step's index, which B's daemon copies from the store once, and asks B's daemon
    for a part only when it reads from it: one part of four, not every part of the step."""
    from test_node_copy import rank_flat  # the scale simulator's sharded state

    rows, cols, world = 8, 16, 4

    def fragment(rank: int) -> Any:
        return rank_flat(rank, world, rows, cols)

    savers = [Client("boxes", socket=nodes.a.socket, rank=r, world_size=world, attempt="run") for r in range(world)]
    try:
        for h in [c.save_flat(6, fragment(c.rank)) for c in savers]:
            h.wait("shared", timeout=60)
    finally:
        for c in savers:
            c.close()
    with Client("boxes", socket=nodes.b.socket, rank=0, world_size=world) as reader:
        wait_until(lambda: _complete(reader) == [6], 20, "B listing the store")
        with reader.open_step(6) as opened:
            out = torch.empty(rows // 2, cols)
            opened.view.read_box("w", ((2 * rows + rows // 4, 0), (rows // 2, cols)), out)  # inside rank 2's rows
            assert out.eq(2.0).all()
    assert [_data_gets(nodes.proxy, "boxes", r) > 0 for r in range(world)] == [False, False, True, False]
    assert list(_entry(nodes.b.socket, "boxes", 6).ranks_local) == [2]
