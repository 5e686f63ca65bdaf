"""The restore path (client/restore.py): O_DIRECT into aligned tensors, the page-cache probe, fallbacks.

Parts are written by a real daemon; ``read_part`` then reads them the way
``Client.load`` does, under each condition it chooses between.
"""

from __future__ import annotations

import fcntl
import os
from typing import Any

import pytest
import torch
from support import data_extents, evict, flip_data_byte, read_data, refuse_o_direct, write_part

from ckptstage.client import pagemem, readmodes, restore
from ckptstage.protos import layout

PAGE = 4096
# What the direct path does once chosen; which mode a device gets is test_restore_io's (and the disk's) business.
DIRECT = readmodes.Fixed(readmodes.DIRECT)


def odd_state() -> dict[str, Any]:
    """Large tensors at offsets that are not page-aligned, one spanning several 1 MiB chunks."""
    g = torch.Generator().manual_seed(21)
    return {"big": torch.randn(3 * (1 << 18) + 77, generator=g),                # 3 MiB + 308 B, over chunks
            "mid": torch.randn(300_001, generator=g, dtype=torch.float64),      # 2.3 MiB, odd start
            "small": torch.randn(1000, generator=g),                             # read through the cache
            "half": torch.randn(1 << 20, generator=g).to(torch.bfloat16),        # 2 MiB, 2-byte elements
            "last": torch.randint(0, 255, ((1 << 20) + 13,), dtype=torch.uint8, generator=g),  # ends mid-page
            "step": 3}


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert torch.equal(got[k].contiguous().view(torch.uint8), v.contiguous().view(torch.uint8)), k
        else:
            assert got[k] == v


def reads(monkeypatch: Any) -> dict[str, int]:
    """Counts read_part's reads by kind (O_DIRECT or through the cache); page-cache probes are not counted."""
    counts = {"direct": 0, "cached": 0}
    real = os.preadv

    def counting(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
        if not flags:  # RWF_NOWAIT marks the probe
            counts["direct" if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT else "cached"] += 1
        return real(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "preadv", counting)
    return counts


def test_cold_part_is_read_with_o_direct_into_aligned_tensors(daemon, monkeypatch):
    state = odd_state()
    part = write_part(daemon, "cold", state)
    entries = {t["name"]: t for t in layout.read_manifest(part)["tensors"]}
    assert any(t["offset"] % PAGE for n, t in entries.items() if n != "['small']")  # the case worth testing
    evict(part)
    first = data_extents(part)[0].path  # the data file, or the pack or chunk file its first bytes are in
    probe = pagemem.PageCache(first)
    try:
        if probe.cached(0, first.stat().st_size):
            pytest.skip(f"{part} stays in memory after eviction (tmpfs?): nothing here reads cold")
    finally:
        probe.close()
    counts = reads(monkeypatch)
    _, got = restore.read_part(part, policy=DIRECT)
    assert_same(got, state)
    assert counts["direct"] > 0
    for name in ("big", "mid", "half", "last"):
        t = got[name]
        slack = t.untyped_storage().nbytes() - t.numel() * t.element_size()
        assert 0 <= slack <= 3 * PAGE, (name, slack)  # the window around it, nothing more
        # Memory and file agree within a page: what lets the disk write into the tensor itself.
        assert (t.data_ptr() - entries[f"['{name}']"]["offset"]) % PAGE == 0, name


def test_cached_part_is_read_through_the_page_cache(daemon, monkeypatch):
    state = odd_state()
    part = write_part(daemon, "warm", state)
    read_data(part)  # now every page is cached
    counts = reads(monkeypatch)
    _, got = restore.read_part(part)
    assert_same(got, state)
    assert counts["direct"] == 0 and counts["cached"] > 0


def test_a_file_system_without_o_direct_falls_back_to_cached_reads(daemon, monkeypatch):
    # tmpfs refused O_DIRECT before Linux 6.6, as some network file systems still do: open() fails
    # with EINVAL. Simulated at restore's own call, since this machine's file systems all accept it.
    state = odd_state()
    part = write_part(daemon, "nodirect", state)
    evict(part)
    refuse_o_direct(monkeypatch)
    counts = reads(monkeypatch)
    _, got = restore.read_part(part)
    assert_same(got, state)
    assert counts["direct"] == 0 and counts["cached"] > 0


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_flipped_byte_in_a_directly_read_tensor_fails_verification(daemon, warm):
    state = odd_state()
    part = write_part(daemon, f"flip-{int(warm)}", state)
    offset = next(t["offset"] for t in layout.read_manifest(part)["tensors"] if t["name"] == "['mid']") + 12345
    flip_data_byte(part, offset)
    if warm:
        read_data(part)
    else:
        evict(part)
    chunk = layout.manifest_files(layout.read_manifest(part))[layout.DATA_FILE].chunk_bytes
    with pytest.raises(layout.ChecksumMismatch, match=f"chunk {offset // chunk} "):
        restore.read_part(part, policy=DIRECT)


def test_into_existing_tensors_after_an_allocating_read(daemon):
    state = odd_state()
    part = write_part(daemon, "into", state)
    evict(part)
    into = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    into["mid"] = torch.empty(600_002, dtype=torch.float64)[::2]  # strided: read, then copied in
    _, got = restore.read_part(part, into=into)
    assert all(got[k] is into[k] for k in state if isinstance(state[k], torch.Tensor))
    assert_same(got, state)
