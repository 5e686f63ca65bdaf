"""Checksums of a part's files.

xxh3-64 digests per block, their verification (a mismatch names the file and block), and the fsyncs that make
a written file durable.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from ckptstage.protos.layout.names import CHECKSUM, DIGEST_BLOCK_BYTES, ChecksumMismatch


@dataclass(frozen=True)
class FileEntry:
    size: int
    chunk_bytes: int
    digests: tuple[str, ...]

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> FileEntry:
        return cls(int(obj["size"]), int(obj["chunk_bytes"]), tuple(obj[CHECKSUM]))

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "chunk_bytes": self.chunk_bytes, CHECKSUM: list(self.digests)}


def chunk_digest(data: Any) -> str:
    """xxh3_64 of one chunk (any buffer), as 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


def digest_block_bytes(chunk_bytes: int) -> int:
    """The digest block for a daemon writing chunks of ``chunk_bytes``: blocks never straddle a chunk."""
    return DIGEST_BLOCK_BYTES if chunk_bytes % DIGEST_BLOCK_BYTES == 0 else chunk_bytes


def block_digests(data: Any, block: int) -> list[str]:
    """The digests of ``data`` (any buffer) cut into blocks of ``block`` bytes; one digest when empty."""
    view = memoryview(data).cast("B")
    return [chunk_digest(view[i:i + block]) for i in range(0, max(len(view), 1), block)]


# Where bytes [lo, hi) of a data file are kept, as a suffix for an error message (" (chunk files: ...)"),
# or "" where the file is where its path says. Asked only once a block failed.
Locate = Callable[[int, int], str]


def block_mismatch(path: Path, entry: FileEntry, index: int, got: str,
                   locate: Locate | None = None) -> ChecksumMismatch:
    """The error for block ``index`` of a file whose bytes hash to ``got``: the one message every verifying
    reader of a part gives (the block, its first byte, both digests, and where the block is kept)."""
    bs = entry.chunk_bytes
    want = entry.digests[index] if index < len(entry.digests) else None
    held = locate(index * bs, min((index + 1) * bs, entry.size)) if locate is not None else ""
    return ChecksumMismatch(path, f"chunk {index} (bytes {index * bs}..) {CHECKSUM} {got} != "
                                  f"{want or 'nothing'} in the manifest{held}")


def verify_block(data: Any, entry: FileEntry, index: int, path: Path, locate: Locate | None = None) -> None:
    """Checks block ``index`` of a file (``data``: its bytes) against the manifest's digest of it.

    Raises :class:`ChecksumMismatch` naming ``path`` and the block (:func:`block_mismatch`).
    """
    got = xxhash.xxh3_64_hexdigest(data)
    if index >= len(entry.digests) or got != entry.digests[index]:
        raise block_mismatch(path, entry, index, got, locate)


def verify_blocks(data: Any, entry: FileEntry, first: int, path: Path, locate: Locate | None = None) -> None:
    """Checks consecutive blocks of a file, ``first`` and on (``data``: their bytes, whole blocks but for the
    file's last one, which may be short; empty: the empty file's one block).

    Raises :class:`ChecksumMismatch` for the first block that differs (:func:`block_mismatch`).
    """
    view = memoryview(data).cast("B")
    bs, digests = entry.chunk_bytes, entry.digests
    for index, at in enumerate(range(0, max(len(view), 1), bs), first):
        got = xxhash.xxh3_64_hexdigest(view[at:at + bs])
        if index >= len(digests) or got != digests[index]:
            raise block_mismatch(path, entry, index, got, locate)


class BlockVerifier:
    """Checks a file's bytes as they arrive: fed in file order from ``pos`` (a block's first byte), in pieces
    of any size, each block is hashed as its bytes go by and checked once it is complete (the file's last
    one at its end), so a reader verifies while it copies, without a second pass.

    Raises :class:`ChecksumMismatch` for the first block that differs (:func:`block_mismatch`).
    """

    __slots__ = ("entry", "path", "pos", "_block", "_hasher", "_locate")

    def __init__(self, entry: FileEntry, path: Path, pos: int = 0, locate: Locate | None = None) -> None:
        if pos % entry.chunk_bytes:
            raise ValueError(f"a verifier starts on a block: {pos} is not a multiple of {entry.chunk_bytes}")
        self.entry = entry
        self.path = path
        self.pos = pos  # the next byte expected
        self._block = entry.chunk_bytes
        self._hasher = xxhash.xxh3_64()
        self._locate = locate

    def feed(self, data: Any) -> None:
        """The next bytes of the file (any buffer of bytes)."""
        block, size = self._block, self.entry.size
        while data:
            take = block - self.pos % block
            if take < len(data):
                self._hasher.update(data[:take])
                data = data[take:]
            else:
                self._hasher.update(data)
                take, data = len(data), b""
            self.pos += take
            if self.pos % block == 0 or self.pos == size:
                self._check((self.pos - 1) // block)

    def finish(self, end: int) -> None:
        """Checks that bytes up to ``end`` (a block's end, or the file's) were all fed; the empty file's one
        block is checked here (no byte ever completes it)."""
        if self.pos != end:
            raise ChecksumMismatch(self.path, f"bytes {self.pos}..{end} were not read")
        if end == 0 == self.entry.size:
            self._check(0)

    def _check(self, index: int) -> None:
        got = self._hasher.hexdigest()
        self._hasher.reset()
        digests = self.entry.digests
        if index >= len(digests) or got != digests[index]:
            raise block_mismatch(self.path, self.entry, index, got, self._locate)


def chunk_count(size: int, chunk_bytes: int) -> int:
    return max(1, -(-size // chunk_bytes))


def fsync_path(path: Path, directory: bool = False) -> None:
    """Makes a file's bytes durable (written through another descriptor, or by another process), or a
    directory's entries (creations, renames, unlinks)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Makes a directory's entries (creations, renames, unlinks) durable."""
    fsync_path(path, directory=True)
