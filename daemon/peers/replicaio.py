"""The bytes of a replica: checked as they arrive and written where they are kept, read back in pieces.

A replica arrives as its files' bytes in order (:func:`assemble` checks every
block against the manifest as it comes), or, for an incremental part sent as
the chunks this node lacked, as those chunks by name (each checked against its
name: :class:`~.replicachunks.ChunkSink`). :func:`write_files` puts either
into a part being written on the replica store's disk. Reading back goes
through :func:`part_pieces` (a part's file, whole or rebuilt from its chunks)
and :func:`checked` (every block checked again).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from ckptstage.daemon.errors import DaemonError, InvalidRequest
from ckptstage.daemon.peers.replicachunks import ChunkSink
from ckptstage.daemon.tiers.interface import Manifest, PartWriter
from ckptstage.protos import chunks, layout

# A message of a replica's file. Measured here (grpcio, loopback): 1 MiB messages stream at 0.45 GiB/s,
# 4 MiB at 0.69, 16 MiB at 0.27; the channels allow 8 MiB (transport.MAX_MESSAGE_BYTES).
READ_BYTES = 4 << 20


class CorruptReplica(DaemonError):
    """A replica's bytes differ from its manifest (on arrival, or read back later)."""


def write_files(writer: PartWriter, entries: dict[str, layout.FileEntry], data: Iterable[tuple[str, int, bytes]],
                where: Path, durable: bool, chunked: ChunkSink | None, chunks_only: bool) -> None:
    """Writes a replica's ``data`` into the part ``writer`` stages: files stored whole into files of their own
    (fsynced when ``durable``), chunked ones into ``chunked`` (published here, before the manifest that names
    them); ``chunks_only``: ``data`` are the chunks this node lacked, by name."""
    if chunks_only:
        if chunked is None or not all(chunked.takes(name) for name in entries):
            raise InvalidRequest(f"{where}: only a part all of whose files are chunks is sent as chunks")
        chunked.expect()
    files = {name: writer.create_file(name, e.size, direct_io=False) for name, e in entries.items()
             if chunked is None or not chunked.takes(name)}

    def write(name: str, offset: int, piece: bytes) -> None:
        if name in files:
            files[name].write(memoryview(piece), offset)
        else:
            assert chunked is not None
            chunked.write(name, piece)

    try:
        if chunks_only:
            assert chunked is not None
            for name, offset, piece in data:
                chunked.write_chunk(name, offset, piece)
        else:
            assemble(entries, data, write, where)
        for file in files.values() if durable else ():
            file.sync()
    finally:
        for file in files.values():
            file.close()
    if chunked is not None:
        chunked.publish()  # the chunks before the manifest that names them


def assemble(entries: dict[str, layout.FileEntry], data: Iterable[tuple[str, int, bytes]],
              write: Callable[[str, int, bytes], None], where: Path) -> None:
    """Feeds every piece to ``write`` once its file's verifier took it; every file must arrive whole, in order."""
    verifiers = {name: layout.BlockVerifier(e, where / name) for name, e in entries.items()}
    try:
        for name, offset, chunk in data:
            verifier = verifiers.get(name)
            if verifier is None:
                raise InvalidRequest(f"{where}: no file {name!r} in its manifest")
            if offset != verifier.pos or offset + len(chunk) > entries[name].size:
                raise InvalidRequest(f"{where / name}: bytes {offset}..{offset + len(chunk)} arrived where "
                                     f"{verifier.pos} was expected (the file has {entries[name].size})")
            verifier.feed(chunk)
            write(name, offset, chunk)
        for name, verifier in verifiers.items():
            verifier.finish(entries[name].size)
    except layout.ChecksumMismatch as e:
        raise CorruptReplica(f"{e.path}: {e.detail}") from None


def memory_pieces(buf: mmap.mmap, size: int) -> Iterator[bytes]:
    for at in range(0, size, READ_BYTES):
        yield buf[at:min(size, at + READ_BYTES)]


def part_pieces(part: Path, manifest: Manifest, name: str, drop_cache: bool = False) -> Iterator[bytes]:
    """A part's file (its own, or rebuilt from its chunks) from its start, in pieces of :data:`READ_BYTES`;
    raises :class:`layout.ChecksumMismatch` naming what is missing or short (:func:`chunks.read_pieces`)."""
    buffer = memoryview(bytearray(READ_BYTES))
    for _, piece in chunks.read_pieces(part, manifest, name, buffer, drop_cache):
        yield bytes(piece)


def checked(pieces: Iterable[bytes], entry: layout.FileEntry, where: Path) -> Iterator[bytes]:
    """``pieces`` of a file, passed on as each is fed to its verifier; raises :class:`layout.ChecksumMismatch`
    at the first block that differs, or when the file is longer or shorter than its manifest says."""
    verifier = layout.BlockVerifier(entry, where)
    for piece in pieces:
        verifier.feed(piece)
        yield piece
    verifier.finish(entry.size)
