"""A load at another world size reads each shared part once per node: the daemon copies it onto the node's
local tier, once however many of its ranks ask, and they read that copy. Two real daemons for two nodes on
one shared directory: node A saves at world size 2; node B, which holds no copy, loads at world size 3."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstage.client import Client, tree
from ckptstage.protos.v1 import ckptstage_pb2 as pb
from support import metric, scrape

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from _scale_ranks import rank_flat  # noqa: E402 - the scale simulator's sharded state, not a copy

JOB, STEP, ROWS, COLS = "nodecopy", 4, 8, 64


def plain_state(rank: int) -> dict[str, Any]:
    return {"w": torch.full((256,), float(rank)), "rank": rank}


def sharded_state(rank: int, world: int) -> tree.Flat:
    """Rank ``rank``'s rows of one global tensor ``w`` of ``[world * ROWS, COLS]``, as FSDP shards it on dim 0."""
    return rank_flat(rank, world, ROWS, COLS)


def on_threads(n: int, work: Callable[[int], Any]) -> list[Any]:
    """``work(i)`` for i < n, all at once (a barrier first); the results, or the first failure raised."""
    barrier = threading.Barrier(n)
    out: list[Any] = [None] * n
    failed: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=20)
            out[i] = work(i)
        except BaseException as e:  # noqa: BLE001 - raised below, in the test's thread
            failed.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failed, failed[0]
    return out


@pytest.fixture
def nodes(daemon_factory: Any) -> tuple[Any, Any, int]:
    """Node A (saves) and node B (loads, metrics on ``port``), one shared directory."""
    from support import free_port

    a = daemon_factory("node-a").start()
    port = free_port()
    b = daemon_factory("node-b", **{"shared.dir": str(a.shared), "metrics.listen": f"127.0.0.1:{port}"}).start()
    return a, b, port


def save_world_2(a: Any, state: Callable[[int], Any], flat: bool = False) -> None:
    def save(rank: int) -> None:
        with Client(JOB, socket=a.socket, rank=rank, world_size=2, attempt="run") as c:
            handle = c.save_flat(STEP, state(rank)) if flat else c.save(STEP, state(rank))
            handle.wait("shared", timeout=60)

    on_threads(2, save)


def fetched(port: int) -> tuple[float, float]:
    text = scrape(port)
    return metric(text, "ckptstage_fetched_parts_total"), metric(text, "ckptstage_fetched_bytes_total")


def test_rank_0_values_at_another_world_size_are_read_from_the_shared_tier_once_per_node(nodes: Any) -> None:
    a, b, port = nodes
    save_world_2(a, plain_state)

    def load(rank: int) -> tuple[Any, str | None]:
        with Client(JOB, socket=b.socket, rank=rank, world_size=3) as c:
            return c.load(STEP), c.last_load_tier

    loaded = on_threads(3, load)
    for state, tier in loaded:
        assert float(state["w"][0]) == 0.0 and state["rank"] == 0  # rank 0's values: DCP's rule
        assert tier == "local"  # the node's copy, not the shared tier's
    parts, nbytes = fetched(port)
    assert parts == 1  # three ranks asked at once: one copy
    assert nbytes > 0

    # A rank loading its own part at the step's world size reads the shared copy where it is: no node copy.
    with Client(JOB, socket=b.socket, rank=1, world_size=2) as c:
        assert float(c.load(STEP)["w"][0]) == 1.0
        assert c.last_load_tier == "shared"
    assert fetched(port)[0] == 1


def test_a_resharding_load_reads_each_needed_part_from_the_shared_tier_once_per_node(nodes: Any) -> None:
    a, b, port = nodes
    save_world_2(a, lambda r: sharded_state(r, 2), flat=True)

    def load(rank: int) -> torch.Tensor:
        with Client(JOB, socket=b.socket, rank=rank, world_size=3) as c:
            return c.load(STEP)["w"]

    for w in on_threads(3, load):
        assert w.shape == (2 * ROWS, COLS)
        assert w[:ROWS].eq(0).all() and w[ROWS:].eq(1).all()
    assert fetched(port)[0] == 2  # both parts, each once, for three ranks

    # The DCP door (Client.open_step) at another world size reads the node's copies too: nothing fetched again.
    with Client(JOB, socket=b.socket, rank=0, world_size=3) as c, c.open_step(STEP) as opened:
        out = torch.empty(ROWS, COLS)
        opened.view.read_box("w", ((ROWS // 2, 0), (ROWS, COLS)), out)
        assert out[: ROWS // 2].eq(0).all() and out[ROWS // 2:].eq(1).all()
        assert {copies[0][0] for copies in opened.located.parts.values()} == {pb.LOCAL}
    assert fetched(port)[0] == 2


def test_a_node_copy_that_cannot_be_made_falls_back_to_the_shared_copy(daemon_factory: Any, tmp_path: Path) -> None:
    """Node B's local tier is full (a small tmpfs): the copy fails with ENOSPC, the load reads rank 0's part
    from the shared tier where it is, and gets the right values."""
    from support import small_tmpfs

    a = daemon_factory("node-a").start()

    def save(rank: int) -> None:
        with Client(JOB, socket=a.socket, rank=rank, world_size=2, attempt="run") as c:
            c.save(STEP, {"w": torch.full((1 << 20,), float(rank))}).wait("shared", timeout=60)  # 4 MiB parts

    on_threads(2, save)
    with small_tmpfs(tmp_path / "b-local", "1m") as local:
        b = daemon_factory("node-b", **{"shared.dir": str(a.shared), "local.dir": str(local),
                                        "local.min_free_bytes": 0}).start()
        with Client(JOB, socket=b.socket, rank=1, world_size=3) as c:
            state = c.load(STEP)
            assert state["w"].eq(0.0).all() and state["w"].numel() == 1 << 20
            assert c.last_load_tier == "shared"
        b.stop()
