"""Resharding reads: boxes filled from fragments, only the bytes they need, verified, with clear errors.

Two in-process clients stand for two ranks (rank 0 and 1 of one attempt) and
save hand-built fragments through ``Client.save_flat``, so the reading side is
exercised without a process group; tests/test_sharded.py does the same with
real FSDP2/TP ranks.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstage.client import Client, errors, shards, tree
from ckptstage.client.reshard import StepView
from ckptstage.protos.v1 import ckptstage_pb2 as pb
from support import data_extents, data_size, drain, flip_data_byte

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


def test_only_the_parts_a_load_reads_hold_a_descriptor(saved: dict[int, list[Path]]) -> None:
    # The parts' directories and the files that hold their data (the data file, or chunk and pack files).
    files = {r: {str(e.path) for d in dirs for e in data_extents(d)} for r, dirs in saved.items()}
    roots = [str(d) for dirs in saved.values() for d in dirs] + [f for paths in files.values() for f in paths]

    def fds() -> list[str]:
        """This process's descriptors open on the step's files (others come and go with gRPC's threads)."""
        out = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            if any(target.startswith(root) for root in roots):
                out.append(target)
        return sorted(out)

    assert fds() == []
    view = StepView.open(saved)  # manifests read, no data file open yet
    try:
        assert fds() == []
        view.read_box("w", ((0, 0), (ROWS // 4, COLS)), torch.empty(ROWS // 4, COLS))  # rank 0's fragment only
        held = fds()  # rank 0's files, one descriptor per extent at most (a pack's chunks are extents each)
        assert held and set(held) <= files[0] and len(held) <= len(data_extents(saved[0][0])), (held, files[0])
    finally:
        view.close()
    assert fds() == []


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
    local = Path(rank1.locations[0].dir)
    flip_data_byte(local, data_size(local) // 2)
    with Client("rs", socket=daemon.socket, rank=0, world_size=1, attempt="b") as c:
        state = c.load(1)
    assert torch.equal(state["w"], _global())


def _sharded_flat(frags: dict[str, tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]],
                  plain: dict[str, Any]) -> tree.Flat:
    """A flat state: top-level keys of ``frags`` as sharded tensors (local fragment, global shape, offset),
    then the plain entries of ``plain``."""
    flat = tree.flatten_state({**{k: torch.empty(0) for k in frags}, **plain})
    for i, (key, (local, shape, offset)) in enumerate(frags.items()):
        assert flat.tree["d"][i][0] == {"s": key} and flat.fqns[i] == key
        flat.tree["d"][i][1] = {"D": {"fqn": key, "dtype": "float32", "shape": list(shape)}}
        flat.tensors[i] = local
        flat.fragments[i] = shards.Fragment(key, shape, offset)
    return flat


def _save_ranks(d: Any, job: str, flats: list[tree.Flat]) -> None:
    clients = [Client(job, socket=d.socket, rank=r, world_size=len(flats), attempt="a1") for r in range(len(flats))]
    try:
        for c, flat in zip(clients, flats):
            c.save_flat(1, flat).wait("local", timeout=30)
        clients[0].wait_step(1, "local", timeout=30)
    finally:
        for c in clients:
            c.close()


def test_pipeline_stages_all_come_back_at_another_world_size(daemon: Any) -> None:
    """Each rank holds other tensors (pipeline stages): a load at world size 1 gets every stage's."""
    w0, w1 = torch.arange(6.0).reshape(2, 3), -torch.arange(4.0)
    _save_ranks(daemon, "pp", [
        _sharded_flat({"layers.0.w": (w0, (2, 3), (0, 0))}, {"stage": 0}),
        _sharded_flat({"layers.1.w": (w1, (4,), (0,))}, {"stage": 1, "opt": {"step": torch.tensor(7.0)}})])
    with Client("pp", socket=daemon.socket, rank=0, world_size=1, attempt="b") as c:
        state = c.load(1)
    assert torch.equal(state["layers.0.w"], w0) and torch.equal(state["layers.1.w"], w1)
    assert state["stage"] == 0  # plain values: rank 0's
    with Client("pp", socket=daemon.socket, rank=1, world_size=2, attempt="b") as c:
        own = c.load(1)  # at the saving world size a rank gets its own tree
    assert set(own) == {"layers.1.w", "stage", "opt"} and torch.equal(own["opt"]["step"], torch.tensor(7.0))


def test_keys_that_join_to_the_same_name_load_by_position_and_are_refused_by_name(daemon: Any) -> None:
    t1, t2 = torch.ones(3), torch.full((3,), 2.0)
    w = torch.arange(4.0)
    _save_ranks(daemon, "clash", [_sharded_flat({"w": (w, (4,), (0,))}, {"a.b": t1, "a": {"b": t2}})])
    with Client("clash", socket=daemon.socket, rank=0, world_size=1, attempt="b") as c:
        state = c.load(1)
        assert torch.equal(state["a.b"], t1) and torch.equal(state["a"]["b"], t2)
        with pytest.raises(ValueError, match=r"'a\.b' names several tensors"):
            c.load(1, into={"w": torch.empty(4), "a.b": torch.empty(3), "a": {"b": torch.empty(3)}})


def test_a_corrupt_only_copy_read_by_several_threads_is_a_corrupt_checkpoint(daemon_factory: Any) -> None:
    d = daemon_factory("solo", **{"shared.dir": ""}).start()  # one copy of every part: nothing to fall back to
    big = torch.arange(float(ROWS * COLS)).reshape(ROWS, COLS)
    _save_ranks(d, "solo", [_sharded_flat({"w": (big, (ROWS, COLS), (0, 0))}, {})])
    with d.connection() as conn:
        part = Path(conn.call("Locate", pb.LocateRequest(job="solo", step=1)).locations[0].dir)
    size = data_size(part)
    for at in range(size // 8, size, size // 8):  # a flipped byte in several blocks
        flip_data_byte(part, at)
    with Client("solo", socket=d.socket, rank=0, world_size=1, attempt="b") as c:
        with pytest.raises(errors.CorruptCheckpoint, match="verif"):
            c.load(1)
