"""The per-block verification of a data file against its manifest (protos/layout/checksums.py).

One error for every verifying reader: ``chunk i (bytes a..) xxh3_64 x != y in
the manifest``, naming the file, the block and its first byte. Checked for a
block at a time (:func:`layout.verify_block`), a run of whole blocks
(:func:`layout.verify_blocks`) and bytes fed as they arrive
(:class:`layout.BlockVerifier`), on real digests of real bytes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstage.protos import layout

BLOCK = 4096
PATH = Path("/tier/job/step-000000000001/rank-00000") / layout.DATA_FILE


def entry_of(data: bytes, block: int = BLOCK) -> layout.FileEntry:
    return layout.FileEntry(len(data), block, tuple(layout.block_digests(data, block)))


def flipped(data: bytes, at: int) -> bytes:
    raw = bytearray(data)
    raw[at] ^= 0x01
    return bytes(raw)


def message(index: int, got: bytes, entry: layout.FileEntry, where: str = "") -> str:
    """The message the helpers give for block ``index`` whose bytes are ``got`` (built here, not by them)."""
    return (f"{PATH}: chunk {index} (bytes {index * entry.chunk_bytes}..) xxh3_64 {xxhash.xxh3_64_hexdigest(got)} "
            f"!= {entry.digests[index]} in the manifest{where}")


def blocks_of(data: bytes, block: int = BLOCK) -> list[bytes]:
    return [data[i:i + block] for i in range(0, len(data), block)]


# Three whole blocks and a short last one.
DATA = os.urandom(3 * BLOCK + 1000)
ENTRY = entry_of(DATA)

# (block, byte within it) of a flipped byte: every block, at its first, a middle and its last byte.
POSITIONS = [(b, at) for b, size in enumerate(len(x) for x in blocks_of(DATA)) for at in (0, size // 2, size - 1)]


def test_good_data_passes_every_helper() -> None:
    for i, block in enumerate(blocks_of(DATA)):
        layout.verify_block(block, ENTRY, i, PATH)
    layout.verify_blocks(DATA, ENTRY, 0, PATH)
    layout.verify_blocks(memoryview(DATA)[2 * BLOCK:], ENTRY, 2, PATH)  # a run that starts later, to the end
    v = layout.BlockVerifier(ENTRY, PATH)
    v.feed(DATA)
    v.finish(len(DATA))
    assert v.pos == len(DATA)


@pytest.mark.parametrize(("block", "at"), POSITIONS)
def test_a_flipped_byte_fails_naming_its_block(block: int, at: int) -> None:
    bad = flipped(DATA, block * BLOCK + at)
    bad_block = blocks_of(bad)[block]
    want = re.escape(message(block, bad_block, ENTRY))
    for i, piece in enumerate(blocks_of(bad)):
        if i != block:
            layout.verify_block(piece, ENTRY, i, PATH)
    with pytest.raises(layout.ChecksumMismatch, match=f"^{want}$") as caught:
        layout.verify_block(bad_block, ENTRY, block, PATH)
    assert caught.value.path == PATH
    assert caught.value.detail.startswith(f"chunk {block} (bytes {block * BLOCK}..) ")
    with pytest.raises(layout.ChecksumMismatch, match=f"^{want}$"):
        layout.verify_blocks(bad, ENTRY, 0, PATH)
    with pytest.raises(layout.ChecksumMismatch, match=f"^{want}$"):
        layout.verify_blocks(memoryview(bad)[block * BLOCK:], ENTRY, block, PATH)
    v = layout.BlockVerifier(ENTRY, PATH)
    with pytest.raises(layout.ChecksumMismatch, match=f"^{want}$"):
        v.feed(bad)
    assert v.pos == min(len(DATA), (block + 1) * BLOCK)  # it stopped at the end of the bad block


def test_the_short_last_block_is_checked_at_the_end_of_the_file() -> None:
    last = len(DATA) // BLOCK
    assert len(DATA) % BLOCK == 1000 and len(ENTRY.digests) == last + 1
    v = layout.BlockVerifier(ENTRY, PATH, last * BLOCK)
    v.feed(DATA[last * BLOCK:-1])  # all but the file's last byte: nothing is complete yet
    v.feed(DATA[-1:])
    v.finish(len(DATA))
    v = layout.BlockVerifier(ENTRY, PATH, last * BLOCK)
    v.feed(DATA[last * BLOCK:-1])
    with pytest.raises(layout.ChecksumMismatch, match=f"^{PATH}: bytes {len(DATA) - 1}..{len(DATA)} were not read$"):
        v.finish(len(DATA))
    with pytest.raises(layout.ChecksumMismatch, match=f"chunk {last} "):
        layout.verify_block(DATA[last * BLOCK:-1], ENTRY, last, PATH)  # a short read of the short block


def test_a_block_the_manifest_does_not_list_and_the_empty_file() -> None:
    with pytest.raises(layout.ChecksumMismatch, match=r"chunk 4 \(bytes 16384\.\.\) xxh3_64 [0-9a-f]{16} != nothing "
                                                      r"in the manifest$"):
        layout.verify_block(b"more", ENTRY, 4, PATH)
    short = layout.FileEntry(len(DATA), BLOCK, ENTRY.digests[:2])  # a digest list that does not cover the file
    with pytest.raises(layout.ChecksumMismatch, match="chunk 2 .* != nothing in the manifest"):
        layout.verify_blocks(DATA, short, 0, PATH)
    empty = entry_of(b"")
    layout.verify_blocks(b"", empty, 0, PATH)
    layout.BlockVerifier(empty, PATH).finish(0)
    wrong = layout.FileEntry(0, BLOCK, ENTRY.digests[:1])
    with pytest.raises(layout.ChecksumMismatch, match="chunk 0 "):
        layout.verify_blocks(b"", wrong, 0, PATH)
    with pytest.raises(layout.ChecksumMismatch, match="chunk 0 "):
        layout.BlockVerifier(wrong, PATH).finish(0)


def test_where_a_block_is_kept_is_asked_only_when_it_fails() -> None:
    asked: list[tuple[int, int]] = []

    def locate(lo: int, hi: int) -> str:
        asked.append((lo, hi))
        return f" (chunk files: c{lo // BLOCK})"

    layout.verify_blocks(DATA, ENTRY, 0, PATH, locate)
    v = layout.BlockVerifier(ENTRY, PATH, 0, locate)
    v.feed(DATA)
    assert asked == []
    last = len(DATA) // BLOCK
    bad = flipped(DATA, len(DATA) - 1)
    with pytest.raises(layout.ChecksumMismatch) as caught:
        layout.verify_blocks(bad, ENTRY, 0, PATH, locate)
    assert str(caught.value) == message(last, blocks_of(bad)[last], ENTRY, f" (chunk files: c{last})")
    assert asked == [(last * BLOCK, len(DATA))]  # the short last block's own range


def test_a_verifier_starts_on_a_block() -> None:
    with pytest.raises(ValueError, match="100 is not a multiple of 4096"):
        layout.BlockVerifier(ENTRY, PATH, 100)


@settings(max_examples=150, deadline=None)
@given(size=st.integers(0, 5 * 64), block=st.sampled_from([16, 64, 100]), cuts=st.lists(st.integers(0, 400)),
       flip=st.one_of(st.none(), st.integers(0, 5 * 64 - 1)), seed=st.binary(min_size=5 * 64, max_size=5 * 64))
def test_fed_in_any_pieces_a_verifier_fails_exactly_at_the_flipped_block(
        size: int, block: int, cuts: list[int], flip: int | None, seed: bytes) -> None:
    data = seed[:size]
    entry = entry_of(data, block)
    if flip is not None and flip < size:
        data = flipped(data, flip)
    else:
        flip = None
    bounds = sorted({0, size, *(c for c in cuts if c < size)})
    v = layout.BlockVerifier(entry, PATH)
    try:
        for lo, hi in zip(bounds, bounds[1:]):
            v.feed(memoryview(data)[lo:hi])
        v.finish(size)
    except layout.ChecksumMismatch as e:
        assert flip is not None, e
        assert e.detail.startswith(f"chunk {flip // block} (bytes {flip // block * block}..) ")
        assert v.pos == min(size, (flip // block + 1) * block)
    else:
        assert flip is None
