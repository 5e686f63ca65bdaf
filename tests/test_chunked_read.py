"""Reading parts stored as chunks (protos/chunks.py): every client reader, verified, descriptors bounded.

Chunked copies of real daemon-written parts are made here (:func:`to_chunks`)
so that the cut is the test's to choose: where the daemon cuts (64 MiB
streaming chunks, 8 MiB tensor bodies) or far finer, so that every kind of
read crosses chunk boundaries, and a thousand chunks for the descriptor
bound. ``read_part`` and the resharding reader must read such a part exactly
as they read the whole one, on every path (O_DIRECT into aligned tensors,
buffered, from the page cache, ``into=``), find a flipped byte in any chunk,
take a missing chunk for a bad copy, and never hold more than a few dozen
descriptors however many chunks there are. The last test loads parts the
daemon wrote incrementally itself (``[persist] incremental``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support import assert_same, drain, evict, read_data, refuse_o_direct, write_part

from ckptstage.client import Client, extentfiles, readmodes, restore, shards, tree
from ckptstage.client.reshard import StepView
from ckptstage.protos import chunks, layout

PAGE = 4096
MiB = 1 << 20
POLICIES = {"direct": readmodes.Fixed(readmodes.DIRECT), "buffered": readmodes.Fixed(readmodes.BUFFERED)}
# How the data file is cut: as the daemon will (64 MiB streaming chunks, 8 MiB bodies), and much finer,
# so that reads of every kind cross many chunk boundaries.
CUTS = {"coarse": (64 << 20, chunks.BODY_BYTES), "fine": (MiB, 64 << 10)}


def to_chunks(part: Path, tier: Path, every: int = 64 << 20, body: int = chunks.BODY_BYTES) -> Path:
    """A copy of a daemon-written part, as an incremental part under directory ``tier``; returns it.

    The data file (however the daemon stored it) is cut by :func:`chunks.cut`,
    each piece written to the job's chunk store under ``tier`` by its digest,
    and the copy's manifest lists them. The daemon knows nothing of the copy.
    """
    manifest = layout.read_manifest(part)
    job = str(manifest["job"])
    dest = layout.part_dir(tier, job, int(manifest["step"]), int(manifest["rank"]))
    data = read_data(part)
    tensors = [(int(t["offset"]), int(t["nbytes"])) for t in manifest["tensors"]]
    store = chunks.store_of(dest, manifest)
    pieces = []
    for lo, hi in chunks.cut(len(data), tensors, every, body):
        name = chunks.digest(data[lo:hi])
        path = chunks.chunk_path(store, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data[lo:hi])
        pieces.append(chunks.Chunk(lo, hi, name))
    manifest["chunks"] = {layout.DATA_FILE: chunks.chunk_list(pieces)}
    dest.mkdir(parents=True)
    (dest / layout.MANIFEST_FILE).write_bytes(layout.manifest_file_bytes(manifest))
    return dest


def chunk_files(part: Path) -> list[Path]:
    return [e.path for e in chunks.extents(part, layout.read_manifest(part))]


def warm(part: Path) -> None:
    for path in chunk_files(part):
        path.read_bytes()


def cold_or_skip(part: Path) -> None:
    evict(part)
    files = extentfiles.ExtentFiles(part / layout.DATA_FILE, chunks.extents(part, layout.read_manifest(part)))
    try:
        if files.cached(0, files.extents[-1].hi):
            pytest.skip(f"{part} stays in memory after eviction (tmpfs?): nothing here reads cold")
    finally:
        files.close()


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def odd_state() -> dict[str, Any]:
    """Large tensors at offsets off a page, between small ones; over 8 MiB, so more than one read unit."""
    g = torch.Generator().manual_seed(7)
    return {"big": torch.randn(3 * (1 << 18) + 77, generator=g),                # 3 MiB + 308 B
            "mid": torch.randn(300_001, generator=g, dtype=torch.float64),      # 2.3 MiB, odd start
            "small": torch.randn(1000, generator=g),                             # through the bounce buffer
            "half": torch.randn(1 << 20, generator=g).to(torch.bfloat16),        # 2 MiB, 2-byte elements
            "tiny": torch.randn(17_000, generator=g),                            # 66 KiB: a chunk of its own
            "wide": torch.randn(3 << 18, generator=g),                           # 3 MiB
            "last": torch.randint(0, 255, ((1 << 20) + 13,), dtype=torch.uint8, generator=g),  # ends mid-page
            "step": 3}


def fresh_like(state: dict[str, Any]) -> dict[str, Any]:
    into = {k: torch.full_like(v, 7) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    into["mid"] = torch.zeros(600_002, dtype=torch.float64)[::2]  # strided: read elsewhere, then copied in
    return into


class FdWatch:
    """The most descriptors this process held open on files under ``root`` at any read (os.preadv)."""

    def __init__(self, root: Path, monkeypatch: Any) -> None:
        self.root = str(root)
        self.most = 0
        self._lock = threading.Lock()
        real = os.preadv

        def counting(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
            n = self.now()
            with self._lock:
                self.most = max(self.most, n)
            return real(fd, buffers, offset, flags)

        monkeypatch.setattr(os, "preadv", counting)

    def now(self) -> int:
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{fd}").startswith(self.root)
            except OSError:
                continue  # closed meanwhile
        return n


@pytest.fixture(scope="module")
def saved(tmp_path_factory: Any) -> Iterator[tuple[Any, dict[str, Any], Path]]:
    """One daemon for the module, and a whole part of :func:`odd_state` it wrote."""
    from conftest import DaemonProc

    d = DaemonProc(tmp_path_factory.mktemp("chunked")).start()
    try:
        state = odd_state()
        yield d, state, write_part(d, "odd", state)
    finally:
        d.stop()


@pytest.fixture(scope="module")
def copies(saved: Any, tmp_path_factory: Any) -> dict[str, Path]:
    """The saved part as chunks, once per cut, each under a tier directory of its own."""
    _, _, part = saved
    return {cut: to_chunks(part, tmp_path_factory.mktemp(f"tier-{cut}"), *CUTS[cut]) for cut in CUTS}


def test_the_copies_are_what_they_should_be(saved: Any, copies: dict[str, Path]) -> None:
    _, _, part = saved
    manifest = layout.read_manifest(copies["fine"])
    extents = chunks.extents(copies["fine"], manifest)
    assert len(extents) > 40 and len(chunks.extents(copies["coarse"], layout.read_manifest(copies["coarse"]))) > 5
    assert b"".join(e.path.read_bytes() for e in extents) == read_data(part)
    assert any(t["offset"] % PAGE for t in manifest["tensors"] if t["nbytes"] >= MiB)  # the case worth testing


@pytest.mark.parametrize("cache", ["cold", "warm"])
@pytest.mark.parametrize("into", [False, True], ids=["alloc", "into"])
@pytest.mark.parametrize("how", ["direct", "buffered"])
@pytest.mark.parametrize("cut", list(CUTS))
def test_every_path_reads_a_chunked_part(saved: Any, copies: dict[str, Path], cut: str, how: str, into: bool,
                                         cache: str) -> None:
    _, state, _ = saved
    part = copies[cut]
    cold_or_skip(part) if cache == "cold" else warm(part)
    target = fresh_like(state) if into else None
    _, got = restore.read_part(part, into=target, policy=POLICIES[how])
    assert_same(got, state)
    stats = restore.last_stats
    assert sum(stats.bytes.values()) == layout.manifest_files(layout.read_manifest(part))[layout.DATA_FILE].size
    if how == "direct":
        assert set(stats.bytes) == ({"direct"} if cache == "cold" else {"cached"}), stats
    else:
        assert set(stats.bytes) == {"buffered"}, stats
    if target is not None:
        assert all(got[k] is target[k] for k in state if isinstance(state[k], torch.Tensor))
    elif how == "direct":
        # Fresh large tensors lie in memory as in the file, within a page: the disk wrote into them.
        offsets = {t["name"]: t["offset"] for t in layout.read_manifest(part)["tensors"]}
        for name in ("big", "mid", "half", "wide", "last"):
            assert (got[name].data_ptr() - offsets[f"['{name}']"]) % PAGE == 0, name


@pytest.mark.parametrize("cache", ["cold", "warm"])
@pytest.mark.parametrize("how", ["direct", "buffered"])
@pytest.mark.parametrize("where", ["window", "small", "header", "last"])
def test_a_flipped_byte_in_a_chunk_fails_verification(saved: Any, tmp_path: Path, where: str, how: str,
                                                      cache: str) -> None:
    _, state, whole = saved
    part = to_chunks(whole, tmp_path, *CUTS["fine"])
    manifest = layout.read_manifest(part)
    tensors = {t["name"]: t for t in manifest["tensors"]}
    entry = layout.manifest_files(manifest)[layout.DATA_FILE]
    offset = {"window": tensors["['mid']"]["offset"] + 123_457,   # read into the tensor itself
              "small": tensors["['small']"]["offset"] + 3,        # through the bounce buffer
              "header": 10,
              "last": entry.size - 1}[where]
    ext = next(e for e in chunks.extents(part, manifest) if e.lo <= offset < e.hi)
    flip(ext.path, offset - ext.base)
    cold_or_skip(part) if cache == "cold" else warm(part)
    for into in (None, fresh_like(state)):
        with pytest.raises(layout.ChecksumMismatch, match=f"chunk {offset // entry.chunk_bytes} ") as caught:
            restore.read_part(part, into=into, policy=POLICIES[how])
        assert str(ext.path) in str(caught.value)  # names the chunk file that holds the bad block


@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_a_missing_chunk_is_a_verification_failure(saved: Any, tmp_path: Path, monkeypatch: Any, which: str) -> None:
    _, _, whole = saved
    part = to_chunks(whole, tmp_path, *CUTS["fine"])
    files = chunk_files(part)
    gone = {"first": files[0], "middle": files[len(files) // 2], "last": files[-1]}[which]
    gone.unlink()
    watch = FdWatch(tmp_path, monkeypatch)
    for how in POLICIES:
        with pytest.raises(layout.ManifestError, match=str(gone)) as caught:
            restore.read_part(part, policy=POLICIES[how])
        assert isinstance(caught.value.__cause__, FileNotFoundError)
        assert layout.is_verification_failure(caught.value)
        assert watch.now() == 0  # nothing left open on the way out


@pytest.mark.parametrize("change", ["longer", "shorter"])
def test_a_chunk_of_the_wrong_size_fails_verification(saved: Any, tmp_path: Path, change: str) -> None:
    _, _, whole = saved
    part = to_chunks(whole, tmp_path, *CUTS["fine"])
    victim = chunk_files(part)[3]
    size = victim.stat().st_size
    os.truncate(victim, size + 1 if change == "longer" else size - 1000)
    for how in POLICIES:
        with pytest.raises(layout.ChecksumMismatch, match=f"{victim}: size"):
            restore.read_part(part, policy=POLICIES[how])


@pytest.mark.parametrize("how", ["direct", "buffered", "cached"])
def test_a_part_of_a_thousand_chunks_holds_few_descriptors(saved: Any, tmp_path: Path, monkeypatch: Any,
                                                           how: str) -> None:
    _, state, whole = saved
    part = to_chunks(whole, tmp_path, 64 << 10, 16 << 10)  # 16 KiB chunks: one file per 4 pages
    n = len(chunk_files(part))
    assert n > 600, n
    evict(part) if how != "cached" else warm(part)
    watch = FdWatch(tmp_path, monkeypatch)
    _, got = restore.read_part(part, policy=POLICIES["direct" if how == "cached" else how])
    assert_same(got, state)
    # At most each reader's extent and one either side of its unit's ends, two kinds each (the probe's and
    # the reads'); holding them all would take n.
    bound = 2 * 3 * readmodes.DIRECT.readers
    assert 0 < watch.most <= bound, (watch.most, bound, n)
    assert watch.now() == 0


def test_a_file_system_without_o_direct_reads_the_chunks_buffered(saved: Any, copies: dict[str, Path],
                                                                  monkeypatch: Any) -> None:
    _, state, _ = saved
    part = copies["fine"]
    evict(part)
    refuse_o_direct(monkeypatch)
    _, got = restore.read_part(part, into=fresh_like(state), policy=POLICIES["direct"])
    assert_same(got, state)
    assert set(restore.last_stats.bytes) == {"buffered"}, restore.last_stats


class Asked:
    """A policy (the project's seam) that reads direct and remembers what it was asked to decide for."""

    def __init__(self) -> None:
        self.keys: list[Any] = []

    def choose(self, device: Any, can_direct: bool) -> list[readmodes.Mode]:
        self.keys.append(device)
        return [readmodes.DIRECT]

    def record(self, device: Any, results: dict[readmodes.Mode, float]) -> readmodes.Mode:
        return readmodes.DIRECT


def test_the_read_mode_is_decided_apart_for_chunked_parts(saved: Any, copies: dict[str, Path]) -> None:
    # Chunks are read file by file, where readahead (so buffered reads) fares otherwise than on one
    # file: an adaptive verdict for the device's whole parts must not decide for its chunked ones.
    _, _, whole = saved
    policy = Asked()
    restore.read_part(whole, policy=policy)
    restore.read_part(copies["coarse"], policy=policy)
    dev = os.stat(chunk_files(copies["coarse"])[0]).st_dev
    stored_whole = not chunks.referenced(layout.read_manifest(whole))  # unless the suite runs incremental
    assert policy.keys == [os.stat(whole).st_dev if stored_whole else (dev, "chunks"), (dev, "chunks")]


# ---------------------------------------------------------------------- resharding, and Client.load

ROWS, COLS = 64, 4096  # 1 MiB of fp32 per 16 rows


def _global() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def _fragment(rank: int, world: int) -> tree.Flat:
    """Rank's dim-0 fragment of 'w', and plain values of its own."""
    per = ROWS // world
    flat = tree.flatten_state({"w": torch.empty(0), "mine": torch.full((300_000,), float(rank)), "r": rank})
    assert flat.tree["d"][0][0] == {"s": "w"}
    flat.tree["d"][0][1] = {"D": {"fqn": "w", "dtype": "float32", "shape": [ROWS, COLS]}}
    flat.tensors[0] = _global()[rank * per:(rank + 1) * per].clone()
    flat.fragments[0] = shards.Fragment("w", (ROWS, COLS), (rank * per, 0))
    return flat


@pytest.fixture(scope="module")
def two_ranks(saved: Any) -> dict[int, Path]:
    """Step 1 of job 'rs': 'w' in two dim-0 fragments saved by ranks 0 and 1; each rank's local part."""
    d = saved[0]
    clients = [Client("rs", socket=d.socket, rank=r, world_size=2, attempt="a1") for r in range(2)]
    try:
        for h in [c.save_flat(1, _fragment(r, 2)) for r, c in enumerate(clients)]:
            h.wait("local", timeout=30)
        clients[0].wait_step(1, "shared", timeout=60)
    finally:
        for c in clients:
            c.close()
    return {r: layout.part_dir(d.local, "rs", 1, r) for r in range(2)}


def test_a_two_rank_step_as_chunks_reshards_like_the_whole_one(two_ranks: dict[int, Path], tmp_path: Path,
                                                                monkeypatch: Any) -> None:
    chunked = {r: to_chunks(p, tmp_path, *CUTS["fine"]) for r, p in two_ranks.items()}
    whole = StepView.open({r: [p] for r, p in two_ranks.items()})
    try:
        want = whole.load(0, None, union=True)
    finally:
        whole.close()
    assert torch.equal(want["w"], _global()) and want["r"] == 0
    watch = FdWatch(tmp_path, monkeypatch)
    view = StepView.open({r: [p] for r, p in chunked.items()})
    try:
        assert_same(view.load(0, None, union=True), want)
        box = ((20, 100), (30, 17))  # across both fragments, a few columns: partly used blocks
        out = torch.empty(box[1])
        view.read_box("w", box, out)
        assert torch.equal(out, _global()[shards.box_slices(box, (0, 0))])
    finally:
        view.close()
    assert 0 < watch.most <= 2 * (2 * 4 + 1), watch.most  # per part: the readers' chunks and a few idle ones
    assert watch.now() == 0


def test_a_missing_chunk_sends_the_resharding_reader_to_the_next_copy(two_ranks: dict[int, Path],
                                                                       tmp_path: Path) -> None:
    first = {r: to_chunks(p, tmp_path / "a", *CUTS["fine"]) for r, p in two_ranks.items()}
    second = {r: to_chunks(p, tmp_path / "b", *CUTS["coarse"]) for r, p in two_ranks.items()}
    files = chunk_files(first[1])
    files[len(files) // 2].unlink()
    reports: list[tuple[int, int, str]] = []
    view = StepView.open({r: [first[r], second[r]] for r in first}, lambda *a: reports.append(a))
    try:
        got = view.load(0, None, union=True)
    finally:
        view.close()
    assert torch.equal(got["w"], _global())
    assert [(r, c) for r, c, _ in reports] == [(1, 0)] and str(files[len(files) // 2]) in reports[0][2]


def test_client_load_of_an_incremental_step_falls_back_to_the_shared_copy(daemon_factory: Any) -> None:
    # Parts the daemon wrote as chunks itself; no memory tier, so that the loads read the disk.
    d = daemon_factory("e2e", **{"memory.enabled": False, "persist.incremental": True}).start()
    state = odd_state()
    with Client("e2e", socket=d.socket) as c:
        c.save(1, state).wait("shared", timeout=60)
    drain(d)
    assert d.shared is not None
    local, shared = (layout.part_dir(t, "e2e", 1, 0) for t in (d.local, d.shared))
    assert not (local / layout.DATA_FILE).exists() and not (shared / layout.DATA_FILE).exists()
    with Client("e2e", socket=d.socket) as c:
        assert_same(c.load(1), state)
        assert c.last_load_tier == "local"
        files = chunk_files(local)
        assert len(files) > 3
        files[len(files) // 2].unlink()
        assert_same(c.load(1, into=fresh_like(state)), state)
        assert c.last_load_tier == "shared"
