"""The restore read paths (client/restore.py) each stay correct: direct, buffered, cached, the adaptive choice.

Parts are written by a real daemon; ``read_part`` reads them under each
policy, cold (evicted) or warm. Every path must place every byte, verify
every byte (a flipped byte anywhere is a ChecksumMismatch naming its block),
fill ``into=`` targets in place, and cope with tensors at offsets that are
not page-aligned and with file systems that refuse O_DIRECT.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from ckptstage.client import Client, pagemem, readmodes, restore
from ckptstage.protos import layout
from support import assert_same, data_extents, data_size, evict, flip_data_byte, read_data, refuse_o_direct, write_part

PAGE = 4096
MiB = 1 << 20

POLICIES = {"direct": readmodes.Fixed(readmodes.DIRECT), "buffered": readmodes.Fixed(readmodes.BUFFERED)}


def unaligned_state(mib: int = 6) -> dict[str, Any]:
    """Large tensors between small ones, so most start off a page boundary; about ``mib`` MiB in all."""
    g = torch.Generator().manual_seed(5)
    state: dict[str, Any] = {}
    for i in range(mib // 2):
        state[f"w{i}"] = torch.randn((1 << 19) + 3 * i + 1, generator=g)           # ~2 MiB, odd length
        state[f"b{i}"] = torch.randn(37 + i, generator=g, dtype=torch.float64)     # small: bounce or cache
    state["half"] = torch.randn(MiB + 5, generator=g).to(torch.bfloat16)           # 2-byte elements
    state["tail"] = torch.randint(0, 255, (MiB + 13,), dtype=torch.uint8, generator=g)  # ends mid-page
    state["step"] = 9
    return state


def warm(part: Path) -> None:
    read_data(part)


def device_of(part: Path) -> Any:
    """The device a restore measures the part's reads under (restore.read_part): parts kept as chunks apart."""
    extents = data_extents(part)
    device = os.stat(extents[0].path).st_dev
    return (device, "chunks") if extents[0].path != part / layout.DATA_FILE else device


def cached_pages(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        pages = pagemem._cachestat_pages(fd, 0, path.stat().st_size)
    finally:
        os.close(fd)
    assert pages is not None
    return pages


def fresh_like(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.full_like(v, 7) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


@pytest.fixture(scope="module")
def parts(tmp_path_factory: Any) -> Any:
    """One daemon for the module, and the part the tests that flip no byte share."""
    from conftest import DaemonProc

    d = DaemonProc(tmp_path_factory.mktemp("restore-io")).start()
    try:
        state = unaligned_state()
        yield d, state, write_part(d, "clean", state)
    finally:
        d.stop()


@pytest.mark.parametrize("cache", ["cold", "warm"])
@pytest.mark.parametrize("into", [False, True], ids=["alloc", "into"])
@pytest.mark.parametrize("how", ["direct", "buffered"])
def test_every_path_reads_every_byte(parts, how, into, cache):
    _, state, part = parts
    evict(part) if cache == "cold" else warm(part)
    target = fresh_like(state) if into else None
    _, got = restore.read_part(part, into=target, policy=POLICIES[how])
    assert_same(got, state)
    if target is not None:
        assert all(got[k] is target[k] for k in state if isinstance(state[k], torch.Tensor))
    stats = restore.last_stats
    assert sum(stats.bytes.values()) == data_size(part)
    if how == "direct":
        # Cold: every byte O_DIRECT (small tensors and into= targets through the bounce buffer).
        # Warm: nothing goes around the cache that holds it.
        assert set(stats.bytes) == ({"direct"} if cache == "cold" else {"cached"}), stats
    else:
        assert set(stats.bytes) == {"buffered"}, stats


@pytest.mark.parametrize("cache", ["cold", "warm"])
@pytest.mark.parametrize("how", ["direct", "buffered"])
@pytest.mark.parametrize("where", ["large", "small", "header", "last"])
def test_a_flipped_byte_is_found_on_every_path(parts, how, where, cache):
    d, state, _ = parts
    part = write_part(d, f"flip-{how}-{where}-{cache}", state)
    tensors = {t["name"]: t for t in layout.read_manifest(part)["tensors"]}
    size = data_size(part)
    offset = {"large": tensors["['w1']"]["offset"] + 4097,      # inside a window (direct) tensor
              "small": tensors["['b1']"]["offset"] + 3,         # read through the bounce buffer
              "header": 10,                                     # the safetensors header
              "last": size - 1}[where]                          # the file's last byte, mid-page
    flip_data_byte(part, offset)
    evict(part) if cache == "cold" else warm(part)
    chunk = layout.manifest_files(layout.read_manifest(part))[layout.DATA_FILE].chunk_bytes
    for into in (None, fresh_like(state)):
        with pytest.raises(layout.ChecksumMismatch, match=f"chunk {offset // chunk} "):
            restore.read_part(part, into=into, policy=POLICIES[how])


def test_the_adaptive_policy_compares_both_modes_then_keeps_the_faster(parts, monkeypatch):
    d, _, _ = parts
    state = unaligned_state(24)
    part = write_part(d, "adaptive", state)
    monkeypatch.setattr(restore, "_UNIT", MiB)  # 1 MiB units: the comparison fits in a small file
    policy = readmodes.Adaptive(retrial_every=3)
    evict(part)
    _, got = restore.read_part(part, policy=policy)
    assert_same(got, state)
    first = restore.last_stats
    assert set(first.trial) == {"direct", "buffered"} and all(r > 0 for r in first.trial.values()), first
    assert {"direct", "buffered"} <= set(first.bytes), first  # both really read part of the file
    kept = policy.best(device_of(part))
    assert kept is not None and first.chosen == kept.kind
    # The winner reads the next restore from the device whole, without comparing again...
    evict(part)
    _, got = restore.read_part(part, policy=policy)
    assert_same(got, state)
    assert not restore.last_stats.trial and set(restore.last_stats.bytes) == {kept.kind}, restore.last_stats
    # ... until retrial_every restores later, when it measures again.
    evict(part)
    restore.read_part(part, policy=policy)
    evict(part)
    restore.read_part(part, policy=policy)
    assert set(restore.last_stats.trial) == {"direct", "buffered"}, restore.last_stats


def test_a_file_too_small_to_compare_decides_nothing(parts, monkeypatch):
    # Fewer units than a comparison needs: the file is read one way and no mode is kept for the device
    # (one slice alone would make the mode it did not reach look infinitely slow).
    d, _, _ = parts
    state = unaligned_state(6)
    part = write_part(d, "small", state)
    monkeypatch.setattr(restore, "_UNIT", MiB)
    policy = readmodes.Adaptive()
    evict(part)
    _, got = restore.read_part(part, policy=policy)
    assert_same(got, state)
    assert not restore.last_stats.trial and policy.best(device_of(part)) is None, restore.last_stats


@pytest.mark.parametrize(("rates", "want"), [
    ({"direct": 1.0, "buffered": 2.0}, "buffered"),   # clearly faster: taken
    ({"direct": 1.0, "buffered": 1.05}, "direct"),    # within the margin: direct keeps its place
    ({"direct": 2.0, "buffered": 1.0}, "direct"),
    ({"direct": 0.0, "buffered": 0.5}, "buffered"),
])
def test_the_adaptive_decision(rates, want):
    policy = readmodes.Adaptive()
    modes = {m.kind: m for m in policy.candidates}
    assert policy.choose(1, can_direct=True) == list(policy.candidates)  # a device never measured
    assert policy.record(1, {modes[k]: v for k, v in rates.items()}).kind == want
    assert policy.choose(1, can_direct=True) == [modes[want]]
    assert policy.choose(2, can_direct=False) == [readmodes.BUFFERED]  # no O_DIRECT: nothing to compare


def test_without_o_direct_every_policy_reads_buffered(parts, monkeypatch):
    # tmpfs refused O_DIRECT before Linux 6.6, as some network file systems still do: open() fails
    # with EINVAL. Simulated at restore's own call, since this machine's file systems all accept it.
    _, state, part = parts
    evict(part)
    refuse_o_direct(monkeypatch)
    for policy in (readmodes.Fixed(readmodes.DIRECT), readmodes.Adaptive()):
        evict(part)
        _, got = restore.read_part(part, into=fresh_like(state), policy=policy)
        assert_same(got, state)
        assert set(restore.last_stats.bytes) == {"buffered"}, restore.last_stats


def test_a_part_on_tmpfs_restores(daemon_factory):
    # Real tmpfs: since Linux 6.6 it accepts O_DIRECT (as a copy), before that it refuses it (the test above).
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    d = daemon_factory("tmpfs", **{"local.dir": str(shm / f"ckptstage-test-{os.getpid()}")}).start()
    try:
        state = unaligned_state()
        with Client("tmpfs", socket=d.socket) as c:
            c.save(1, state).wait("local", timeout=60)
            assert_same(c.load(), state)
            into = fresh_like(state)
            got = c.load(into=into)
            assert_same(got, state)
            assert got["w0"] is into["w0"]
    finally:
        d.stop()
        shutil.rmtree(shm / f"ckptstage-test-{os.getpid()}", ignore_errors=True)


@pytest.mark.parametrize("use_cachestat", [True, False], ids=["cachestat", "nowait-read"])
def test_the_page_cache_probe_answers_without_reading_ahead(parts, use_cachestat):
    _, _, part = parts
    data = data_extents(part)[0].path  # the data file, or the pack holding the part's chunks
    evict(part)
    probe = pagemem.PageCache(data, use_cachestat=use_cachestat)
    try:
        size = data.stat().st_size
        assert size >= 5 * MiB, size
        assert not probe.cached(0, 4 * MiB)
        assert not probe.cached(2 * MiB, 3 * MiB)
        # A probe may bring in the page it asks about, never the megabytes a readahead would.
        assert cached_pages(data) <= 2, cached_pages(data)
        data.read_bytes()
        assert probe.cached(0, 4 * MiB) and probe.cached(size - MiB, size)
    finally:
        probe.close()


def test_the_prefaulter_maps_the_pages_of_fresh_tensors():
    if pagemem._MADVISE is None:
        pytest.skip("no madvise here")
    # A fresh anonymous mapping, untouched: no page of it is resident yet (malloc could hand back
    # memory an earlier test already touched).
    region = mmap.mmap(-1, 32 * MiB)
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1])
    pagemem.Prefaulter([(address, 32 * MiB)])._run()  # what its thread does, here and whole
    with open("/proc/self/statm") as f:
        after = int(f.read().split()[1])
    assert (after - before) * os.sysconf("SC_PAGE_SIZE") >= 24 * MiB, (before, after)
