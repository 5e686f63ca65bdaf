"""Incremental parts through a real daemon: what each tier stores, drains and sweeps.

A daemon with ``[persist] incremental`` writes each part as content-addressed
chunks in its job's store (protos/chunks.py); these tests check what lands on
disk (only the chunks a tier lacks), that the files still verify and read
without ckptstage, and that retention's sweep removes exactly the chunks no
part refers to, whatever runs beside it.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from ckptstage.client import Client
from ckptstage.daemon.catalog.chunkstore import CONDEMNED_DIR, ChunkStore
from ckptstage.daemon.catalog import repack
from ckptstage.daemon.tiers import fspacks
from ckptstage.daemon.tiers.fs import FsTier
from ckptstage.protos import chunks, codec, layout, packs

from support import wait_until

JOB = "incr"
INCREMENTAL = {"persist.incremental": True, "persist.chunk_grace_s": 0.01}


def lora_like(step: int) -> dict[str, Any]:
    """A frozen base (big tensors, never changing) with small adapters and their optimizer state that do."""
    g = torch.Generator().manual_seed(0)
    base = {f"layer{i}.weight": torch.randn(256, 1024, generator=g) for i in range(4)}  # 1 MiB each
    torch.manual_seed(step)
    adapters = {f"layer{i}.lora_{ab}": torch.randn(8, 256) for i in range(4) for ab in "AB"}
    return {"model": {**base, **adapters}, "optim": {k: torch.randn(8, 256) for k in adapters}, "step": step}


def store(tier: Path, job: str = JOB) -> dict[str, int]:
    """The chunks in a job's store on a tier, in packs or files of their own: name -> bytes (what a compressed
    one decodes to)."""
    root = chunks.store_dir(tier, job)
    index = packs.StoreIndex(root)
    index.refresh()
    out = {name: place.nbytes for name, place in index.packed().items()}
    for p in root.glob("??/*"):
        try:
            if chunks.is_chunk_name(p.name):
                out[p.name] = p.stat().st_size
        except FileNotFoundError:
            pass  # swept while we looked
    return out


def read_without_ckptstage(part: Path) -> dict[str, torch.Tensor]:
    """The part's data file rebuilt from its manifest and the store's packs and chunk files alone, as
    docs/FORMAT.md's script does (run verbatim by test_packs)."""
    manifest = json.loads(part.joinpath(layout.MANIFEST_FILE).read_bytes().split(b"\n")[0])
    index = packs.StoreIndex(part.parent.parent / "chunks")
    data = b"".join(read_place(index.find(name)) for name, _ in manifest["chunks"]["data.safetensors"])
    from safetensors.torch import load

    header = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])
    assert header["__metadata__"]["format"] == layout.FORMAT
    return load(data)


def swept(tier: Path, named: set[str], job: str = JOB) -> bool:
    """Whether the job's store on ``tier`` holds every chunk in ``named`` and what a sweep leaves of the rest:
    no chunk file of its own that nothing names, no pack that nothing in it is named, no pack worth repacking
    (its dead bytes are at most a small share of it: :mod:`ckptstage.daemon.catalog.repack`). Raises if a named
    chunk is missing."""
    held = store(tier, job)
    missing = named - set(held)
    assert not missing, f"named chunks gone from the store: {sorted(missing)[:3]}"
    stored = fspacks.list_packs(chunks.store_dir(tier, job))
    packed = {n for p in stored for n in p.names}
    if any(n not in named and n not in packed for n in held):
        return False  # a chunk file of its own that nothing names
    return all(any(n in named for n in p.names) and not repack.worth_repacking(p, named) for p in stored)


def read_place(place: packs.Place | None) -> bytes:
    assert place is not None
    with open(place.path, "rb") as f:
        f.seek(place.offset)
        data = f.read(place.length)
    return bytes(codec.decode(data)) if place.size else data


def save(c: Client, step: int, state: dict[str, Any], tier: str = "local") -> None:
    c.save(step, state).wait(tier, timeout=60)


def test_unchanged_tensors_cost_nothing_on_either_tier(daemon_factory):
    d = daemon_factory("n", **INCREMENTAL).start()
    with Client(JOB, socket=d.socket) as c:
        save(c, 1, lora_like(1), "shared")
        first_local, first_shared = store(d.local), store(d.shared)
        assert first_local == first_shared and sum(first_local.values()) >= 4 << 20
        part = layout.part_dir(d.local, JOB, 1, 0)
        assert sorted(os.listdir(part)) == [layout.MANIFEST_FILE]  # no data file: its chunks are in the store
        save(c, 2, lora_like(2), "shared")
        added = {n: b for n, b in store(d.local).items() if n not in first_local}
        full = layout.read_manifest(layout.part_dir(d.local, JOB, 2, 0))["files"][layout.DATA_FILE]["size"]
        # The adapters and their optimizer state changed (64 KiB of the 4.2 MiB); the base did not.
        assert 0 < sum(added.values()) <= 0.1 * full, (sum(added.values()), full)
        assert {n for n in store(d.shared) if n not in first_shared} == set(added)  # the drain copied those only
        for tier in (d.local, d.shared):
            for step in (1, 2):
                chunks.verify_part(layout.part_dir(tier, JOB, step, 0))
        got = read_without_ckptstage(layout.part_dir(d.shared, JOB, 2, 0))
        want = lora_like(2)
        assert torch.equal(got["['model']['layer3.weight']"], want["model"]["layer3.weight"])
        assert torch.equal(got["['optim']['layer1.lora_B']"], want["optim"]["layer1.lora_B"])


def test_a_changed_state_costs_a_full_part_and_identical_chunks_are_stored_once(daemon_factory):
    d = daemon_factory("n", **INCREMENTAL, **{"shared.dir": ""}).start()
    zeros = {"m": torch.zeros(1 << 20), "v": torch.zeros(1 << 20)}  # like AdamW's state before its first step
    with Client(JOB, socket=d.socket) as c:
        save(c, 1, zeros)
        first = sum(store(d.local).values())
        assert first <= 3 << 20  # 8 MiB of zeros: each distinct chunk once
        save(c, 2, {"m": torch.randn(1 << 20), "v": torch.randn(1 << 20)})
        assert sum(store(d.local).values()) - first >= 8 << 20  # every byte changed: a full part


def test_retention_sweeps_the_chunks_no_retained_step_refers_to(daemon_factory):
    d = daemon_factory("n", **INCREMENTAL, **{"shared.dir": "", "local.keep_last": 1}).start()
    with Client(JOB, socket=d.socket) as c:
        save(c, 1, lora_like(1))
        only_1 = set(store(d.local))
        save(c, 2, lora_like(2))
        refs_2 = chunks.referenced(layout.read_manifest(layout.part_dir(d.local, JOB, 2, 0)))
        # Step 1 goes (keep_last 1): the base's chunks stay (step 2 has them), and with them in their pack step 1's
        # adapters (a small share of it: not worth a repack); step 2's own pack holds its adapters.
        wait_until(lambda: swept(d.local, refs_2), timeout=10, what="step 1's own chunks swept")
        assert only_1 - refs_2 and only_1 & refs_2
        chunks.verify_part(layout.part_dir(d.local, JOB, 2, 0))
        assert torch.equal(c.load(2)["model"]["layer0.weight"], lora_like(2)["model"]["layer0.weight"])
        save(c, 3, lora_like(3))
        refs_3 = chunks.referenced(layout.read_manifest(layout.part_dir(d.local, JOB, 3, 0)))
        # Step 2 goes: its pack held nothing step 3 names, and goes whole.
        wait_until(lambda: swept(d.local, refs_3) and not (refs_2 - only_1) & set(store(d.local)), timeout=10,
                   what="step 2's pack removed")
        dead = sum(n for name, n in store(d.local).items() if name not in refs_3)
        assert dead == sum(n for name, n in store(d.local).items() if name in only_1 - refs_3) and dead < 1 << 20


def test_a_sweep_puts_back_a_condemned_chunk_a_part_published_meanwhile_refers_to(tmp_path):
    # Another node's drain touches a chunk just before this sweep condemns it, and publishes its part
    # before the sweep marks again: the chunk must come back, not go.
    tier = tmp_path / "tier"
    s = ChunkStore(FsTier(tier, "node-a"), grace_s=0)
    name = chunks.digest(b"x" * 4096)
    path = s.path(JOB, name)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"x" * 4096)
    os.utime(path, (time.time() - 10, time.time() - 10))
    marks = iter([set(), {name}])
    swept = s.sweep(JOB, mark=lambda: next(marks))
    assert swept.restored == 1 and swept.removed == 0 and path.read_bytes() == b"x" * 4096
    marks = iter([set(), set()])
    assert s.sweep(JOB, mark=lambda: next(marks)).removed == 1 and not path.exists()


def test_a_chunk_leased_by_a_save_in_flight_is_never_swept(tmp_path):
    tier = tmp_path / "tier"
    s = ChunkStore(FsTier(tier, "node-a"), grace_s=0)
    name = chunks.digest(b"y")
    path = s.path(JOB, name)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"y")
    assert s.reuse(JOB, [name]) == {name}  # a save relies on it; its manifest is not published yet
    assert s.sweep(JOB, mark=set).removed == 0 and path.exists()
    # Released during a sweep (the part was published after the sweep's first mark): still kept by it.
    marks = iter([set(), set()])

    def mark() -> set[str]:
        m = next(marks)
        s.release(JOB, [name])
        return m

    assert s.sweep(JOB, mark=mark).removed == 0 and path.exists()
    assert s.sweep(JOB, mark=set).removed == 1 and not path.exists()


def test_a_sweep_killed_midway_is_finished_by_the_next_daemon(daemon_factory):
    d = daemon_factory("n", **INCREMENTAL, **{"shared.dir": ""}).start()
    with Client(JOB, socket=d.socket) as c:
        save(c, 1, lora_like(1))
    d.kill()
    # As a SIGKILL between condemning and marking again leaves it: the live pack condemned (its index first,
    # then its file), an orphan chunk condemned, and a pack a writer left without its index.
    root = chunks.store_dir(d.local, JOB)
    [live] = fspacks.list_packs(root)
    condemned = packs.packs_dir(root) / CONDEMNED_DIR
    condemned.mkdir()
    for path in (packs.index_path(root, live.pack_id), packs.pack_path(root, live.pack_id)):
        os.rename(path, condemned / path.name)
    (root / CONDEMNED_DIR).mkdir()
    orphan = chunks.digest(b"orphan")
    (root / CONDEMNED_DIR / orphan).write_bytes(b"orphan")
    unpublished = packs.pack_path(root, "cut-short")
    unpublished.write_bytes(b"x" * 8192)
    os.utime(unpublished, (time.time() - 3600, time.time() - 3600))
    d.start()
    wait_until(lambda: not any((root / CONDEMNED_DIR).iterdir()) and not any(condemned.iterdir())
               and not unpublished.exists(), timeout=10, what="the sweep finished")
    assert [p.pack_id for p in fspacks.list_packs(root)] == [live.pack_id]
    assert not chunks.chunk_path(root, orphan).exists()
    chunks.verify_part(layout.part_dir(d.local, JOB, 1, 0))


def test_a_corrupt_chunk_is_quarantined_and_written_again_by_the_next_save(daemon_factory):
    d = daemon_factory("n", **INCREMENTAL, **{"shared.dir": ""}).start()
    with Client(JOB, socket=d.socket) as c:
        save(c, 1, lora_like(1))
        part = layout.part_dir(d.local, JOB, 1, 0)
        manifest = layout.read_manifest(part)
        big = max(chunks.manifest_chunks(manifest) or [], key=lambda ch: ch.nbytes)
        root = chunks.store_dir(d.local, JOB)
        place = packs.StoreIndex(root).find(big.name)
        assert place is not None and not place.whole
        with open(place.path, "r+b") as f:
            f.seek(place.offset + 100)
            byte = f.read(1)
            f.seek(place.offset + 100)
            f.write(bytes([byte[0] ^ 1]))
        with pytest.raises(layout.ChecksumMismatch):
            chunks.verify_part(part)
        with pytest.raises(Exception):  # noqa: B017 - no other copy: the load fails, and reports it
            c.load(1)
        wait_until(lambda: not place.path.exists(), timeout=10, what="the pack moved aside")
        # The pack's intact chunks were copied into a new pack first; the bad one is out of the store.
        assert set(store(d.local)) == chunks.referenced(manifest) - {big.name}
        [aside] = [p for p in (root / chunks.CORRUPT_DIR).iterdir() if p.suffix == ".pack"]
        assert any(q.location == aside for q in FsTier(d.local).list_quarantined())
        save(c, 2, lora_like(1))  # the same bytes again: the chunk is written anew, not reused
        assert big.name in store(d.local)
        chunks.verify_part(layout.part_dir(d.local, JOB, 2, 0))


def test_a_pack_mostly_dead_is_repacked_and_its_space_comes_back(daemon_factory):
    """A small frozen tensor beside a large one that changes every step: once step 1 goes, its pack holds one
    live chunk (the frozen one) among megabytes no step names; the sweep copies that chunk into a new pack and
    removes the old one. (Step 2's save touched the old pack when it reused the frozen chunk: a sweep within the
    grace of that touch leaves the pack to the next one, here the timer's.)"""
    d = daemon_factory("n", **INCREMENTAL, **{"shared.dir": "", "local.keep_last": 1,
                                              "retention.interval_s": 0.5}).start()

    def state(step):
        torch.manual_seed(step)
        return {"frozen": torch.ones(128 << 10), "w": torch.randn(1 << 20)}  # 512 KiB frozen, 4 MiB changing

    with Client(JOB, socket=d.socket) as c:
        save(c, 1, state(1))
        root = chunks.store_dir(d.local, JOB)
        [first] = fspacks.list_packs(root)
        save(c, 2, state(2))
        named = chunks.referenced(layout.read_manifest(layout.part_dir(d.local, JOB, 2, 0)))
        wait_until(lambda: set(store(d.local)) == named and first.pack_id not in
                   {p.pack_id for p in fspacks.list_packs(root)}, timeout=10, what="step 1's pack repacked away")
        assert "repacked pack" in d.log.read_text()
        on_disk = sum(p.stat().st_size for p in packs.packs_dir(root).glob("*.pack"))
        assert on_disk <= sum(store(d.local).values()) + 2 * len(named) * packs.PAGE  # dead bytes gone
        chunks.verify_part(layout.part_dir(d.local, JOB, 2, 0))
        assert torch.equal(c.load(2)["w"], state(2)["w"])


def _orphans(root: Path, n: int) -> set[str]:
    """``n`` chunk files no part refers to (a crashed save's, say), old enough for any sweep."""
    names = set()
    old = time.time() - 3600
    for i in range(n):
        data = i.to_bytes(4, "little")
        name = chunks.digest(data)
        path = chunks.chunk_path(root, name)
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
        os.utime(path, (old, old))
        names.add(name)
    return names


def test_sigkill_during_a_sweep_loses_no_chunk_a_part_refers_to(daemon_factory):
    d = daemon_factory("n", **INCREMENTAL, **{"shared.dir": ""}).start()
    with Client(JOB, socket=d.socket) as c:
        save(c, 1, lora_like(1))
    d.kill()
    part = layout.part_dir(d.local, JOB, 1, 0)
    live = chunks.referenced(layout.read_manifest(part))
    root = chunks.store_dir(d.local, JOB)
    orphans = _orphans(root, 20_000)
    d.start(wait=False)  # its start-up retention pass sweeps: kill it in the middle
    left = wait_until(lambda: (n := len(orphans & set(store(d.local)))) < len(orphans) and n, timeout=30,
                      what="the sweep under way")
    d.kill()
    assert 0 < left < len(orphans)  # killed mid-sweep: some condemned or deleted, some not
    assert chunks.missing(root, live) == [] or (root / CONDEMNED_DIR).is_dir()
    d.start()
    wait_until(lambda: not set(store(d.local)) - live and not any((root / CONDEMNED_DIR).glob("*")), timeout=30,
               what="the next daemon's sweep finished")
    assert set(store(d.local)) == live
    chunks.verify_part(part)


def test_saves_reusing_chunks_that_retention_is_sweeping_always_commit_whole(daemon_factory):
    # Steps alternate between two states, and keep_last 1 deletes (and sweeps) the previous step as each
    # commits: every save reuses chunks that a sweep, run every 0.1 s with a grace of 10 ms, is deciding about.
    d = daemon_factory("n", **INCREMENTAL, **{"shared.dir": "", "local.keep_last": 1,
                                              "retention.interval_s": 0.1}).start()
    states = [lora_like(1), lora_like(2)]
    with Client(JOB, socket=d.socket) as c:
        for step in range(1, 41):
            save(c, step, states[step % 2])
            part = layout.part_dir(d.local, JOB, step, 0)
            if part.is_dir():  # not yet retired by the next pass
                try:
                    chunks.verify_part(part)
                except layout.ChecksumMismatch:
                    if part.is_dir():  # a part that still exists must verify
                        raise
    named = chunks.referenced(layout.read_manifest(layout.part_dir(d.local, JOB, 40, 0)))
    wait_until(lambda: swept(d.local, named), timeout=10, what="only what step 40 names left, pack by pack")


def test_a_sweep_on_another_node_never_tears_a_step_this_node_drains(daemon_factory):
    # Node B shares the shared tier and sweeps it every 0.1 s with a 10 ms grace: shorter than a drain, so
    # B condemns chunks that A's drain has just touched. A's check after publishing puts them back, and
    # no step is sealed while a chunk is missing: every step sealed on the shared tier verifies.
    a = daemon_factory("a", **INCREMENTAL, **{"shared.keep_last": 1, "local.keep_last": 1}).start()
    b = daemon_factory("b", **INCREMENTAL, **{"shared.dir": str(a.shared), "shared.keep_last": 1,
                                              "retention.interval_s": 0.1}).start()
    states = [lora_like(1), lora_like(2), lora_like(3)]
    with Client(JOB, socket=a.socket) as c:
        for step in range(1, 31):
            save(c, step, states[step % 3], "shared")
            record = layout.commit_path(a.shared, JOB, step)
            part = layout.part_dir(a.shared, JOB, step, 0)
            if record.exists() and part.is_dir():
                try:
                    chunks.verify_part(part)
                except layout.ChecksumMismatch:
                    if record.exists():  # not deleted by retention since: it must verify
                        raise
    assert b.proc.poll() is None


def test_stored_bytes_counts_each_chunk_once_with_the_newest_step_that_names_it():
    from ckptstage.daemon.catalog.chunkstore import stored_bytes

    got = stored_bytes([(1, 999, [("a", 10), ("b", 5)]), (2, 999, [("a", 10), ("c", 7)]), (3, 100, None),
                        (2, 999, [("d", 1)])])
    assert got == {1: 5, 2: 18, 3: 100}  # deleting step 1 frees b only: a lives on in step 2


def test_the_local_size_limit_counts_what_the_tier_holds_not_each_steps_full_size(daemon_factory):
    # Six LoRA-like steps of 4.2 MiB each hold about 4.9 MiB on the tier: a 5.5 MiB limit keeps them all
    # (counting each step's full size, it would keep one).
    d = daemon_factory("n", **INCREMENTAL, **{"local.keep_last": 20, "local.max_bytes": "5.5MiB"}).start()
    with Client(JOB, socket=d.socket) as c:
        for step in range(1, 7):
            save(c, step, lora_like(step), "shared")
        c.save(7, lora_like(7)).wait("shared", timeout=60)  # a pass after the sixth drained
        held = {ref.step for ref in layout.scan_tier(d.local, JOB)}
        assert len(held) >= 6, held
        total = sum(store(d.local).values())
        assert total <= 5.5 * (1 << 20) + 300_000, total


def _manifest_naming(part: Path, names: list[str]) -> None:
    manifest = {"format": layout.FORMAT, "job": JOB, "step": 1, "rank": 0, "world_size": 1, "tensors": [],
                "tree": {}, "files": {layout.DATA_FILE: {"size": 4096 * len(names), "chunk_bytes": 1 << 20,
                                                         layout.CHECKSUM: ["0" * 16]}},
                "chunks": {layout.DATA_FILE: [[n, 4096] for n in names]}}
    tmp = part / "manifest.new"
    tmp.write_bytes(layout.manifest_file_bytes(manifest))
    os.rename(tmp, part / layout.MANIFEST_FILE)  # a new file, as every writer makes one


def test_a_mark_rereads_a_manifest_replaced_since_the_last_one(tmp_path):
    from ckptstage.daemon.catalog.chunkstore import referenced

    part = layout.part_dir(tmp_path, JOB, 1, 0)
    part.mkdir(parents=True)
    x, y = chunks.digest(b"x"), chunks.digest(b"y")
    seen: dict[Any, Any] = {}
    fs = FsTier(tmp_path, "node-a")
    _manifest_naming(part, [x])
    assert referenced(fs, JOB, seen) == {x}
    _manifest_naming(part, [y])  # the step saved again with overwrite: same path, another manifest
    assert referenced(fs, JOB, seen) == {y}
    assert referenced(fs, JOB, seen) == {y} and list(seen) == [part / layout.MANIFEST_FILE]


def test_added_bytes_counts_each_chunk_once_with_the_oldest_step_that_names_it():
    from ckptstage.daemon.catalog.storedbytes import added_bytes

    got = added_bytes([(2, 999, (("a", 10), ("c", 7))), (1, 999, (("a", 10), ("b", 5))), (3, 100, None),
                       (2, 999, (("d", 1), ("c", 7)))])
    assert got == {1: 15, 2: 8, 3: 100}  # step 2 adds c (once, though two of its parts name it) and d


def test_ls_and_metrics_show_what_each_step_stores_next_to_its_size(daemon_factory, capsys):
    from ckptstage.client.cli import main as cli
    from support import free_port, metric, scrape

    port = free_port()
    d = daemon_factory("n", **INCREMENTAL, **{"metrics.listen": f"127.0.0.1:{port}", "local.keep_last": 5,
                                              "shared.keep_last": 5}).start()
    with Client(JOB, socket=d.socket) as c:
        for step in (1, 2, 3):
            save(c, step, lora_like(step), "shared")
    assert cli(["--socket", str(d.socket), "gc"]) == 0  # a retention pass weighs every part
    capsys.readouterr()
    assert cli(["--socket", str(d.socket), "ls", JOB, "--json"]) == 0
    listed = {c["step"]: c for c in json.loads(capsys.readouterr().out)["checkpoints"]}
    full = listed[1]["bytes"]
    for tier in ("stored_local", "stored_shared"):
        assert listed[1][tier] >= 0.95 * full, (tier, listed[1])  # the first step stores the base
        assert all(0 < listed[s][tier] <= 0.05 * full for s in (2, 3)), (tier, listed)  # then the adapters only
    assert cli(["--socket", str(d.socket), "ls", JOB]) == 0
    text = capsys.readouterr().out
    assert "LOCAL STORED" in text and "SHARED STORED" in text and "%)" in text
    scraped = scrape(port)
    held = sum(listed[s]["stored_local"] for s in (1, 2, 3))
    assert metric(scraped, "ckptstage_tier_stored_bytes", tier="local") == held
    assert metric(scraped, "ckptstage_tier_used_bytes", tier="local") == sum(listed[s]["bytes"] for s in (1, 2, 3))


def test_after_retention_removes_a_pack_the_next_drain_still_reuses_what_the_store_holds(daemon_factory):
    """A sweep that removes a pack makes the daemon read the store's indexes again: each later drain must find
    the base's chunks there and write only the adapters, not the whole base again."""
    d = daemon_factory("n", **INCREMENTAL, **{"shared.keep_last": 1, "local.keep_last": 1}).start()
    shared_store = chunks.store_dir(d.shared, JOB) if d.shared else Path()
    written = []
    with Client(JOB, socket=d.socket) as c:
        for step in range(1, 6):
            before = {p.pack_id for p in fspacks.list_packs(shared_store)}
            save(c, step, lora_like(step), "shared")
            written.append(sum(p.nbytes for p in fspacks.list_packs(shared_store) if p.pack_id not in before))
    full = layout.read_manifest(layout.part_dir(d.shared, JOB, 5, 0))["files"][layout.DATA_FILE]["size"]
    assert written[0] >= 0.95 * full and all(w <= 0.1 * full for w in written[1:]), (written, full)
