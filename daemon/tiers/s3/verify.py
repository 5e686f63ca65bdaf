"""Re-reading a part on the object store: every byte, by ranged reads, checked against its manifest.

The object-store counterpart of :func:`ckptstage.protos.chunks.verify_part`
(which reads files): sizes first, then each block's digest, a part's own
objects and the chunks of an incremental part alike (a chunk in a pack read
as its range, one kept compressed as what it decodes to).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from ckptstage.daemon.tiers.interface import Manifest, Reader
from ckptstage.daemon.tiers.s3.chunks import S3Chunks
from ckptstage.daemon.tiers.s3.compression import open_object
from ckptstage.daemon.tiers.s3.io import Transfers
from ckptstage.daemon.tiers.s3.keys import Keys
from ckptstage.protos import chunks, layout

VERIFY_PIECE_BYTES = 64 << 20  # read at once (as several ranged GETs) by verify_part


def verify_part(part: Path, manifest: Manifest, keys: Keys, transfers: Transfers, stores: S3Chunks) -> None:
    """Reads every byte of the part at ``part`` (its objects, or its chunks in ``stores``) by ranges and checks
    it against its ``manifest``; raises :class:`layout.ChecksumMismatch` naming the object, or ManifestError
    caused by the OSError of a read that failed."""
    piece = memoryview(bytearray(VERIFY_PIECE_BYTES))
    for name, entry in layout.manifest_files(manifest).items():
        verifier = layout.BlockVerifier(entry, part / name)
        for where, size, open_it in _sources(part, manifest, name, keys, transfers, stores):
            verifier.path = where  # a bad block is named by the object its last bytes came from
            try:
                reader = open_it()
            except FileNotFoundError as e:
                raise layout.ChecksumMismatch(where, f"missing: {e}") from e
            except OSError as e:
                raise layout.ManifestError(f"{keys.url_of(where)}: unreadable: {e}") from e
            with reader:
                if reader.size != size:
                    raise layout.ChecksumMismatch(where, f"size {reader.size} != {size} in the manifest")
                left = size
                while left:
                    try:
                        n = reader.readinto(piece[:min(len(piece), left)]) or 0
                    except OSError as e:
                        raise layout.ManifestError(f"{keys.url_of(where)}: unreadable: {e}") from e
                    if not n:
                        raise layout.ChecksumMismatch(where, "shorter than the manifest says")
                    verifier.feed(piece[:n])
                    left -= n
        chunks.check_block_count(part / name, entry, verifier)


def _sources(part: Path, manifest: Manifest, name: str, keys: Keys, transfers: Transfers, stores: S3Chunks
             ) -> Iterator[tuple[Path, int, Callable[[], Reader]]]:
    """What file ``name`` of the part is made of, in order: (the object to name, its bytes, how to open them)."""
    listed = chunks.manifest_chunks(manifest, name)
    if listed is None:
        size = layout.manifest_files(manifest)[name].size
        yield part / name, size, lambda: open_object(transfers, keys.key(part / name))
        return
    store = chunks.store_key(manifest)
    found = stores.packs.index(store).find_all(c.name for c in listed)
    for c in listed:
        place = found.get(c.name)
        if place is None:
            def lost(chunk: str = c.name) -> Reader:
                raise FileNotFoundError(f"no chunk {chunk} in {keys.url_of(keys.store(store))}")
            yield keys.chunk_location(store, c.name), c.hi - c.lo, lost
        else:
            yield place.path, c.hi - c.lo, lambda place=place: stores.open_place(place)  # type: ignore[misc]
