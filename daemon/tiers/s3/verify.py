"""Re-reading a part on the object store: every byte, by ranged reads, checked against its manifest.

The object-store counterpart of :func:`ckptstage.protos.chunks.verify_part`
(which reads files): sizes first, then each block's digest, a part's own
objects and the chunks of an incremental part alike.
"""

from __future__ import annotations

from pathlib import Path

from ckptstage.daemon.tiers.interface import Manifest
from ckptstage.daemon.tiers.s3.compression import open_object
from ckptstage.daemon.tiers.s3.io import Transfers
from ckptstage.daemon.tiers.s3.keys import Keys
from ckptstage.protos import chunks, layout

VERIFY_PIECE_BYTES = 64 << 20  # read at once (as several ranged GETs) by verify_part


def verify_part(part: Path, manifest: Manifest, keys: Keys, transfers: Transfers) -> None:
    """Reads every byte of the part at ``part`` (its objects, or its chunks) by ranges and checks it against
    its ``manifest``; raises :class:`layout.ChecksumMismatch` naming the object, or ManifestError caused by
    the OSError of a read that failed."""
    piece = memoryview(bytearray(VERIFY_PIECE_BYTES))
    for name, entry in layout.manifest_files(manifest).items():
        verifier = layout.BlockVerifier(entry, part / name)
        for ext in chunks.extents(part, manifest, name, chunks.loose(chunks.store_of(part, manifest))):
            verifier.path = ext.path  # a bad block is named by the object its last bytes came from
            try:
                reader = open_object(transfers, keys.key(ext.path))  # a compressed chunk: what it decodes to
            except FileNotFoundError as e:
                raise layout.ChecksumMismatch(ext.path, f"missing: {e}") from e
            except OSError as e:
                raise layout.ManifestError(f"{keys.url_of(ext.path)}: unreadable: {e}") from e
            wrong = ext.size_error(reader.size)
            if wrong:
                raise layout.ChecksumMismatch(ext.path, wrong)
            reader.seek(ext.lo - ext.base)
            left = ext.hi - ext.lo
            while left:
                try:
                    n = reader.readinto(piece[:min(len(piece), left)]) or 0
                except OSError as e:
                    raise layout.ManifestError(f"{keys.url_of(ext.path)}: unreadable: {e}") from e
                if not n:
                    raise layout.ChecksumMismatch(ext.path, "shorter than the manifest says")
                verifier.feed(piece[:n])
                left -= n
        chunks.check_block_count(part / name, entry, verifier)
