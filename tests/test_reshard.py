"""Resharding reads: boxes filled from fragments, only the bytes they need, verified, with clear errors.

Two in-process clients stand for two ranks (rank 0 and 1 of one attempt) and
save hand-built fragments through ``Client.save_flat``, so the reading side is
exercised without a process group; tests/test_sharded.py does the same with
real FSDP2/TP ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstage.client import Client, shards, tree
from ckptstage.client.reshard import StepView
from ckptstage.protos import layout
from ckptstage.protos.v1 import ckptstage_pb2 as pb
from support import drain

ROWS, COLS = 64, 4096  # 1 MiB of fp32 per 16 rows; the test daemon's chunks are 1 MiB


def test_overlap_and_byte_span() -> None:
    assert shards.overlap(((0, 0), (4, 4)), ((2, 2), (4, 4))) == ((2, 2), (2, 2))
    assert shards.overlap(((0, 0), (2, 4)), ((2, 0), (2, 4))) is None  # touching is not overlapping
    assert shards.overlap(((), ()), ((), ())) == ((), ())  # 0-d: the one element
    # rows 2-3 of a [4, 8] tensor of fp32 at global (4, 0): elements 16..31 of it
    assert shards.byte_span(((6, 0), (2, 8)), (4, 0), (4, 8), 4) == (64, 128)
    # a column box spans from its first element to its last, gaps included
    assert shards.byte_span(((4, 2), (2, 2)), (4, 0), (4, 8), 4) == (8, 48)


def _global() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def _fragment_state(rank: int, world: int, extra: dict[str, Any]) -> tree.Flat:
    """A flat state holding rank's dim-0 fragment of the global tensor 'w' plus per-rank plain values."""
    per = ROWS // world
    local = _global()[rank * per:(rank + 1) * per].clone()
    state = {"w": torch.empty(0), **extra}  # placeholder: replaced by the sharded node below
    flat = tree.flatten_state(state)
    node = {"D": {"fqn": "w", "dtype": "float32", "shape": [ROWS, COLS]}}
    items = flat.tree["d"]
    assert items[0][0] == {"s": "w"}
    items[0][1] = node
    # drop the placeholder tensor (tensor 0) and put the fragment first
    flat.tensors[0] = local
    flat.fragments[0] = shards.Fragment("w", (ROWS, COLS), (rank * per, 0))
    return flat


@pytest.fixture
def saved(daemon: Any) -> dict[int, list[Path]]:
    """Step 1 of job 'rs': 'w' in two dim-0 fragments, saved by ranks 0 and 1; returns where each part lies."""
    clients = [Client("rs", socket=daemon.socket, rank=r, world_size=2, attempt="a1") for r in range(2)]
    try:
        handles = [c.save_flat(1, _fragment_state(r, 2, {"mine": torch.full((2,), float(r)), "r": r}))
                   for r, c in enumerate(clients)]
        for h in handles:
            h.wait("local")
        clients[0].wait_step(1, "local", timeout=30)
    finally:
        for c in clients:
            c.close()
    with daemon.connection() as conn:
        resp = conn.call("Locate", pb.LocateRequest(job="rs", step=1, all_ranks=True))
    return {p.rank: [Path(loc.dir) for loc in p.locations] for p in resp.parts}


def test_a_dim0_quarter_reads_a_quarter_of_the_bytes(saved: dict[int, list[Path]]) -> None:
    nbytes = ROWS * COLS * 4
    for q in range(4):
        view = StepView.open(saved)
        try:
            box = ((q * ROWS // 4, 0), (ROWS // 4, COLS))
            out = torch.empty(box[1])
            view.read_box("w", box, out)
            assert torch.equal(out, _global()[q * ROWS // 4:(q + 1) * ROWS // 4])
            # a quarter, give or take the header chunk that the first quarter shares with it
            assert view.bytes_read <= nbytes / 4 + (1 << 20), (q, view.bytes_read)
        finally:
            view.close()


def test_boxes_across_fragments_and_columns(saved: dict[int, list[Path]]) -> None:
    view = StepView.open(saved)
    try:
        for box in [((20, 100), (30, 17)), ((31, 0), (2, COLS)), ((0, 4000), (ROWS, 96)), ((63, 4095), (1, 1))]:
            out = torch.empty(box[1])
            view.read_box("w", box, out)
            assert torch.equal(out, _global()[shards.box_slices(box, (0, 0))]), box
        assert torch.equal(view.read_full("w"), _global())
    finally:
        view.close()


def test_load_at_another_world_size_gives_rank0_plain_values(daemon: Any, saved: dict[int, list[Path]]) -> None:
    with Client("rs", socket=daemon.socket, rank=0, world_size=1, attempt="b") as c:
        state = c.load(1)
    assert torch.equal(state["w"], _global())
    assert state["r"] == 0 and torch.equal(state["mine"], torch.zeros(2))
    with Client("rs", socket=daemon.socket, rank=1, world_size=2, attempt="b") as c:
        state = c.load(1)  # the same world size: rank 1 gets its own plain values, and the whole tensor
    assert state["r"] == 1 and torch.equal(state["mine"], torch.ones(2))
    assert torch.equal(state["w"], _global())


def test_load_into_names_mismatches_and_missing_keys(daemon: Any, saved: dict[int, list[Path]]) -> None:
    with Client("rs", socket=daemon.socket, rank=0, world_size=1, attempt="b") as c:
        with pytest.raises(ValueError, match=r"'w'.*\[64, 4096\].*\[64, 4095\]"):
            c.load(1, into={"w": torch.empty(ROWS, COLS - 1)})
        with pytest.raises(ValueError, match=r"'w'.*torch.float32.*torch.float64"):
            c.load(1, into={"w": torch.empty(ROWS, COLS, dtype=torch.float64)})
        with pytest.raises(KeyError, match="'bias'"):
            c.load(1, into={"w": torch.empty(ROWS, COLS), "bias": torch.empty(3)})
        target = torch.zeros(ROWS, COLS)
        state = c.load(1, into={"w": target, "mine": torch.zeros(2), "r": 0})
        assert state["w"] is target and torch.equal(target, _global())


def test_flipped_byte_falls_back_to_the_shared_copy(daemon: Any, saved: dict[int, list[Path]]) -> None:
    drain(daemon)
    with daemon.connection() as conn:
        resp = conn.call("Locate", pb.LocateRequest(job="rs", step=1, all_ranks=True))
    rank1 = next(p for p in resp.parts if p.rank == 1)
    assert [loc.tier for loc in rank1.locations] == [pb.LOCAL, pb.SHARED]
    data = Path(rank1.locations[0].dir) / layout.DATA_FILE
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with Client("rs", socket=daemon.socket, rank=0, world_size=1, attempt="b") as c:
        state = c.load(1)
    assert torch.equal(state["w"], _global())
