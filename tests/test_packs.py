"""Chunk packs (protos/packs.py): a store's chunks in pack files found through their indexes.

The index format and its checks, the lookup of a store mixing packs and chunk files; then a real daemon's
incremental steps, whose new chunks it writes as one pack per part: read by the client's restore, the
daemon's own verification and the drain (which writes packs on the shared tier), a corrupt chunk in a pack,
and the documented way to read a step without ckptstage.
"""

from __future__ import annotations

import errno
import mmap
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from ckptstage.client import Client
from ckptstage.daemon import fsutil
from ckptstage.daemon.catalog.chunkstore import ChunkStore, PartChunks
from ckptstage.daemon.tiers.fs import FsTier
from ckptstage.protos import chunks, layout, packs
from support import small_tmpfs

JOB = "packed"
INCREMENTAL = {"persist.incremental": True, "memory.enabled": False, "shared.drain_every": 1000}
NAMES = [f"{i:032x}" for i in range(1, 4)]


def to_pack(store: Path, pack_id: str = "p1") -> dict[str, tuple[int, int]]:
    """Moves every loose chunk of ``store`` into one pack (each at a page-aligned offset, filler between), as a
    writer of packs would leave it; returns name -> (offset, length)."""
    loose = sorted(p for p in store.glob("??/*") if chunks.is_chunk_name(p.name))
    entries, offset = [], 0
    packs.packs_dir(store).mkdir(exist_ok=True)
    with open(packs.pack_path(store, pack_id), "wb") as out:
        for p in loose:
            data = p.read_bytes()
            out.seek(offset)
            out.write(data)
            entries.append((p.name, offset, len(data)))
            offset = -(-(offset + len(data) + 1) // packs.PAGE) * packs.PAGE  # a page of filler at least
        out.write(b"\xee" * 100)  # the pack goes on past its last chunk
    packs.index_path(store, pack_id).write_bytes(packs.encode_index(entries))
    for p in loose:
        p.unlink()
    packs.store_index(store).reset()
    return {n: (o, ln) for n, o, ln in entries}


def _index_of(entry: str) -> bytes:
    """An index listing one entry as written (its trailer right)."""
    return layout.with_trailer(f'{{"format":"{packs.FORMAT}","chunks":[{entry}]}}'.encode())


def test_an_index_round_trips_and_every_damage_is_refused(tmp_path: Path) -> None:
    entries = [(NAMES[0], 0, 10), (NAMES[1], 4096, 5000), (NAMES[2], 12288, 1, 70)]  # the last one compressed
    raw = packs.encode_index(entries)
    assert f'"{NAMES[0]}",0,10]'.encode() in raw  # a decoded size only for a chunk kept compressed
    assert f'"{NAMES[2]}",12288,1,70]'.encode() in raw
    assert packs.decode_index(raw, tmp_path / "x.idx") == [
        packs.Entry(NAMES[0], 0, 10), packs.Entry(NAMES[1], 4096, 5000), packs.Entry(NAMES[2], 12288, 1, size=70)]
    flipped = bytearray(raw)
    flipped[20] ^= 1
    bad = {
        "a changed byte": bytes(flipped),
        "torn": raw[:-5],
        "overlapping": packs.encode_index([(NAMES[0], 0, 5000), (NAMES[1], 4096, 10)]),
        "off a page": packs.encode_index([(NAMES[0], 100, 10)]),
        "not a chunk name": packs.encode_index([("xyz", 0, 10)]),
        "empty chunk": packs.encode_index([(NAMES[0], 0, 0)]),
        "no decoded size": _index_of(f'["{NAMES[0]}",0,10,0]'),
        "five fields": _index_of(f'["{NAMES[0]}",0,10,20,1]'),
        "another format": layout.with_trailer(b'{"format":"other","chunks":[]}'),
    }
    for why, data in bad.items():
        with pytest.raises(packs.PackError, match="x.idx"):
            packs.decode_index(data, tmp_path / "x.idx")
            pytest.fail(why)
    assert packs.pack_id_of("p1.pack") == "p1" and packs.pack_id_of("p1.idx") == "p1"
    assert packs.pack_id_of("../p1.idx") is None and packs.pack_id_of("p1.json") is None


def test_a_store_finds_packed_and_loose_chunks_and_looks_again_once_a_pack_is_gone(tmp_path: Path) -> None:
    store = tmp_path / "chunks"
    for name in NAMES:
        path = chunks.chunk_path(store, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(name.encode())
    where = to_pack(store)
    loose = chunks.chunk_path(store, NAMES[0])
    loose.write_bytes(NAMES[0].encode())  # also loose: either copy serves
    index = packs.StoreIndex(store)
    found = index.find_all(NAMES + ["f" * 32])
    assert found["f" * 32] is None
    for name in NAMES:
        place = found[name]
        assert place is not None and not place.whole and (place.offset, place.length) == where[name]
    assert chunks.missing(store, NAMES + ["f" * 32]) == ["f" * 32]
    packs.pack_path(store, "p1").unlink()  # a sweep removed the pack after its index was read
    again = index.find_all(NAMES)
    assert again[NAMES[0]] == packs.Place(loose, 0, 32, whole=True) and again[NAMES[1]] is None


def test_reusing_chunks_touches_each_pack_they_are_in_once_and_says_which_the_store_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pack's modification time stands for all its chunks: on a shared file system a part reusing hundreds of
    a base model's chunks makes one call per pack, not one per chunk."""
    tier = FsTier(tmp_path / "tier", "n")
    store = chunks.store_dir(tier.root, JOB)
    for name in NAMES:
        path = chunks.chunk_path(store, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(name.encode())
    to_pack(store)
    loose = "e" * 32
    chunks.chunk_path(store, loose).parent.mkdir(parents=True, exist_ok=True)
    chunks.chunk_path(store, loose).write_bytes(b"loose")
    os.utime(packs.pack_path(store, "p1"), (1, 1))
    touched: list[str] = []
    real = os.utime
    monkeypatch.setattr(os, "utime", lambda path, *a, **k: (touched.append(str(path)), real(path, *a, **k))[1])
    store_of_chunks = ChunkStore(tier, grace_s=600)
    assert store_of_chunks.reuse(JOB, [*NAMES, loose, "f" * 32]) == {*NAMES, loose}
    assert sorted(touched) == sorted([str(packs.pack_path(store, "p1")), str(chunks.chunk_path(store, loose))])
    assert packs.pack_path(store, "p1").stat().st_mtime > 1  # relied on now: no sweep takes it within the grace
    store_of_chunks.release(JOB, [*NAMES, loose, "f" * 32])


def test_neighbours_in_a_pack_are_read_together_and_every_other_chunk_alone(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pack", tmp_path / "b.pack"
    n = [f"{i:032x}" for i in range(1, 9)]
    places = [(n[0], packs.Place(a, 0, 5000, whole=False)),
              (n[1], packs.Place(a, 8192, 4096, whole=False)),     # right after n[0]'s padding
              (n[2], packs.Place(a, 12288, 100, whole=False)),
              (n[3], packs.Place(a, 20480, 100, whole=False)),     # a page skipped: a chunk not asked for
              (n[4], packs.Place(b, 0, 3 * 4096, whole=False)),    # another pack
              (n[5], packs.Place(b, 3 * 4096, 30_000, whole=False)),  # would make the run too long
              (n[6], packs.Place(tmp_path / n[6], 0, 77, whole=True)),
              (n[7], packs.Place(a, 24576, 10, whole=False))]     # follows n[3]'s page
    got = packs.runs(reversed(places), max_bytes=32 * 1024)
    assert got == [
        packs.Run(tmp_path / n[6], 0, 77, ((n[6], 0, 77),), whole=True),
        packs.Run(a, 0, 12388, ((n[0], 0, 5000), (n[1], 8192, 4096), (n[2], 12288, 100))),
        packs.Run(a, 20480, 4106, ((n[3], 0, 100), (n[7], 4096, 10))),
        packs.Run(b, 0, 12288, ((n[4], 0, 12288),)),
        packs.Run(b, 12288, 30_000, ((n[5], 0, 30_000),))]
    assert got[0].sized(80) == ((n[6], 0, 80),) and got[1].sized(1) == got[1].chunks  # a pack's run is as listed
    assert packs.runs([], 1) == []


def test_one_pass_over_a_unit_gives_its_block_checksums_and_its_chunks_names() -> None:
    rng = random.Random(7)
    for _ in range(200):
        n = rng.choice([0, 1, 4096, 1 << 20, 3 * (1 << 20) + 17, rng.randrange(1, 5 << 20)])
        data = rng.randbytes(n)
        block = rng.choice([4096, 1 << 16, 1 << 20])
        start = block * rng.randrange(0, 4)
        points = sorted({start, start + n, *(start + rng.randrange(0, n + 1) for _ in range(rng.randrange(8)))})
        cuts = [(lo, hi) for lo, hi in zip(points, points[1:]) if hi > lo]
        blocks, names = chunks.hash_unit(data, start, block, cuts)
        assert blocks == layout.block_digests(data, block)
        assert names == [chunks.digest(data[lo - start:hi - start]) for lo, hi in cuts]


def test_a_batch_writes_a_run_at_once_and_keeps_no_reserved_space(tmp_path: Path) -> None:
    tier = FsTier(tmp_path / "tier", "daemon")
    batch = tier.new_chunks(JOB)
    one, two, big = b"a" * 5000, b"b" * 100, os.urandom(3 << 20)
    run = bytearray(one) + bytes(4096 * 2 - len(one)) + bytearray(two)
    names = [chunks.digest(one), chunks.digest(two), chunks.digest(big)]
    batch.write(names[2], memoryview(big), direct_io=True)
    batch.write_run([(names[0], 0, len(one)), (names[1], 8192, len(two))], memoryview(run), direct_io=True)
    batch.publish()
    store = chunks.store_dir(tmp_path / "tier", JOB)
    held = packed(store)
    assert {name: (off, length) for name, (_, off, length) in held.items()} == {
        names[2]: (0, len(big)), names[0]: (3 << 20, len(one)), names[1]: ((3 << 20) + 8192, len(two))}
    pack = next(iter(held.values()))[0]
    assert pack.stat().st_size == (3 << 20) + 8192 + len(two)  # what was reserved beyond it is given back
    for name, data in zip(names, (one, two, big)):
        with tier.open_chunk(JOB, name) as f:
            assert f.read(1 << 30) == data


def test_a_unit_s_new_chunks_side_by_side_go_in_one_write_and_a_chunk_the_store_holds_splits_them(
        tmp_path: Path) -> None:
    tier = FsTier(tmp_path / "tier", "daemon")
    store = ChunkStore(tier, grace_s=600)
    mib = 1 << 20
    data = memoryview(bytearray(os.urandom(5 * mib)))
    held = tier.new_chunks(JOB)  # chunk 2's bytes are in the store already
    held.write(chunks.digest(data[2 * mib:3 * mib]), data[2 * mib:3 * mib], direct_io=False)
    held.publish()
    writer = tier.begin_part(JOB, 1, 0, replace=lambda f: True)
    part = PartChunks(store, JOB, 5 * mib, [(i * mib, mib) for i in range(5)], 8 * mib, writer, direct_io=True)
    writes: list[list[tuple[str, int, int]]] = []
    real = part._new.write_run

    def spy(run: Any, view: memoryview, direct_io: bool) -> None:
        writes.append(list(run))
        real(run, view, direct_io)

    part._new.write_run = spy  # type: ignore[method-assign]
    assert part.write(0, data, 0, mib) == layout.block_digests(data, mib)
    names = [chunks.digest(data[i * mib:(i + 1) * mib]) for i in range(5)]
    assert writes == [[(names[0], 0, mib), (names[1], mib, mib)], [(names[3], 0, mib), (names[4], mib, mib)]]
    assert part.reused_bytes == mib
    assert part.publish() == [[n, mib] for n in names]
    part.release()
    writer.abort()
    for i, name in enumerate(names):
        with tier.open_chunk(JOB, name) as f:
            assert f.read(2 * mib) == data[i * mib:(i + 1) * mib]


def test_a_pack_that_cannot_reserve_ahead_reserves_what_it_writes_and_fails_only_when_that_does_not_fit(
        tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "small", "8m") as root:
        tier = FsTier(root / "tier", "daemon")
        fits = os.urandom(3 << 20)  # the 256 MiB a pack reserves ahead cannot be had: these 3 MiB can
        batch = tier.new_chunks(JOB)
        batch.write(chunks.digest(fits), memoryview(fits), direct_io=True)
        batch.publish()
        with tier.open_chunk(JOB, chunks.digest(fits)) as f:
            assert f.read(8 << 20) == fits
        (pack,) = packs.packs_dir(chunks.store_dir(root / "tier", JOB)).glob("*.pack")
        assert pack.stat().st_size == len(fits)
        too_big = os.urandom(6 << 20)  # more than is left
        batch = tier.new_chunks(JOB)
        with pytest.raises(OSError) as info:
            batch.write(chunks.digest(too_big), memoryview(too_big), direct_io=True)
        assert info.value.errno == errno.ENOSPC
        batch.discard()  # what the failed save does: nothing of it stays, its room comes back
        assert list(packs.packs_dir(chunks.store_dir(root / "tier", JOB)).glob("*.pack")) == [pack]
        assert os.statvfs(root).f_bfree * os.statvfs(root).f_frsize >= 4 << 20


def test_a_write_puts_its_aligned_pages_and_its_tail_where_they_belong(tmp_path: Path) -> None:
    for length in (4096 * 3, 4096 * 3 + 5, 17, 0):
        out = fsutil.DataFile(tmp_path / f"f{length}", 0, direct_io=True, reserve=False)
        buf = mmap.mmap(-1, 4096 * 4)
        buf[:length] = os.urandom(length)
        out.write(memoryview(buf)[:length], 4096)
        out.sync()
        out.close()
        assert (tmp_path / f"f{length}").read_bytes() == (bytes(4096) + buf[:length] if length else b"")


def save_steps(d: Any, steps: range, tier: str = "local") -> dict[int, dict[str, torch.Tensor]]:
    """Saves ``steps``, each once it is on ``tier``."""
    states = {}
    with Client(JOB, socket=d.socket) as c:
        for step in steps:
            g = torch.Generator().manual_seed(step)
            states[step] = {"frozen": torch.ones(300_000), "w": torch.randn(50_000, generator=g),
                            "tail": torch.arange(step + 10, dtype=torch.float64)}
            c.save(step, states[step]).wait(tier, timeout=30)
    return states


def packed(store: Path) -> dict[str, tuple[Path, int, int]]:
    """What the packs of ``store`` hold, read afresh: name -> (pack, offset, length)."""
    index = packs.StoreIndex(store)
    index.refresh()
    return {name: (p.path, p.offset, p.length) for name, p in index.packed().items()}


def test_each_part_s_new_chunks_are_one_pack_that_loads_verifies_and_drains(daemon_factory: Any) -> None:
    d = daemon_factory(**INCREMENTAL).start()
    states = save_steps(d, range(1, 3))
    store = chunks.store_dir(d.local, JOB)
    held = packed(store)
    assert not list(store.glob("??/*")) and len(held) > 3  # no chunk file of its own
    assert len({pack for pack, _, _ in held.values()}) == 2  # step 2's new chunks: a pack of their own
    where = {name: (offset, length) for name, (_, offset, length) in held.items()}
    tier = FsTier(d.local)
    for step in (1, 2):
        part = layout.part_dir(d.local, JOB, step, 0)
        tier.verify_part(part)  # the daemon's own check reads the pack's ranges
        with Client(JOB, socket=d.socket) as c:
            got = c.load(step)
            assert c.last_load_tier == "local"
        assert all(torch.equal(got[k], v) for k, v in states[step].items())
    some = next(iter(where))
    assert tier.chunk_size(JOB, some) == where[some][1] and tier.touch_chunk(JOB, some)
    with tier.open_chunk(JOB, some) as f:
        data = f.read(1 << 30)
    assert len(data) == where[some][1] and chunks.digest(data) == some
    d.stop()
    again = daemon_factory("again", **{**INCREMENTAL, "local.dir": str(d.local), "shared.dir": str(d.shared),
                                       "shared.drain_every": 1}).start()
    with Client(JOB, socket=again.socket) as c:  # the drain copies the chunks out of the pack
        c.wait_step(2, "shared", timeout=60)
    for step in (1, 2):
        chunks.verify_part(layout.part_dir(d.shared, JOB, step, 0))
    assert set(packed(chunks.store_dir(d.shared, JOB))) == set(held)  # into packs on the shared tier too


def test_a_flipped_byte_in_a_pack_is_caught_the_load_reads_the_other_copy_and_the_pack_goes_aside(
        daemon_factory: Any) -> None:
    d = daemon_factory(**{**INCREMENTAL, "shared.drain_every": 1}).start()
    states = save_steps(d, range(1, 2))
    with Client(JOB, socket=d.socket) as c:
        c.wait_step(1, "shared", timeout=30)
    store = chunks.store_dir(d.local, JOB)
    name, (pack, offset, length) = max(packed(store).items(), key=lambda kv: kv[1][2])
    with open(pack, "r+b") as f:
        f.seek(offset + length // 2)
        byte = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(layout.ChecksumMismatch, match=str(pack)):
        chunks.verify_part(layout.part_dir(d.local, JOB, 1, 0))
    with Client(JOB, socket=d.socket) as c:
        got = c.load(1)
        assert c.last_load_tier == "shared"
    assert all(torch.equal(got[k], v) for k, v in states[1].items())
    # The daemon's own read confirms it: the pack's intact chunks go into a new pack, the pack goes aside.
    from support import wait_until
    wait_until(lambda: not os.path.exists(pack), timeout=20, what="the pack moved aside")
    assert set(packed(store)) == set(chunks.referenced(layout.read_manifest(
        layout.part_dir(d.shared, JOB, 1, 0)))) - {name}


def format_doc_script() -> str:
    """docs/FORMAT.md's script that rebuilds an incremental part's data file without ckptstage."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "FORMAT.md").read_text()
    after = text[text.index("**Packs.**"):]
    start = after.index("```python\n") + len("```python\n")
    return after[start:after.index("```", start)]


@pytest.mark.parametrize("dedup", ["job", "user"])
def test_the_documented_script_rebuilds_a_packed_part_without_ckptstage(daemon_factory: Any, dedup: str) -> None:
    d = daemon_factory(**INCREMENTAL, **{"persist.dedup": dedup}).start()
    states = save_steps(d, range(1, 3))
    scope = {"part": str(layout.part_dir(d.local, JOB, 2, 0)), "tier": str(d.local)}
    exec(format_doc_script(), scope)  # noqa: S102 - the documentation's own code, run as a reader would
    tensors = scope["tensors"]
    assert torch.equal(tensors["['w']"], states[2]["w"]) and torch.equal(tensors["['tail']"], states[2]["tail"])


def test_the_documented_script_rebuilds_a_part_a_shared_directory_keeps_compressed(daemon_factory: Any) -> None:
    d = daemon_factory(**{**INCREMENTAL, "shared.drain_every": 1, "shared.compression": "bg-zstd"}).start()
    states = save_steps(d, range(1, 3), tier="shared")
    store = chunks.store_dir(d.shared, JOB)
    assert any(e.size for idx in packs.packs_dir(store).glob("*.idx") for e in packs.read_index(idx))
    scope = {"part": str(layout.part_dir(d.shared, JOB, 2, 0)), "tier": str(d.shared)}
    exec(format_doc_script(), scope)  # noqa: S102 - the documentation's own code, run as a reader would
    tensors = scope["tensors"]
    assert all(torch.equal(tensors[f"['{k}']"], v) for k, v in states[2].items())
