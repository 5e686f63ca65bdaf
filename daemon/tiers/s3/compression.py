"""Compressed chunks on the object store: how a chunk object says it is one, and the readers that decode it.

Whether a chunk is kept compressed is :mod:`ckptstage.daemon.tiers.compression`'s
choice, as on any shared tier. A compressed chunk stored as an object of its
own (as stores written before packs hold them) carries its decoded size in its
metadata (:data:`SIZE_META`); that is also what tells a reader to decode it.
In a pack, the index's entry says so (:mod:`ckptstage.protos.packs`). Either
way its bytes are the codec's frame, whose decoded bytes every reader checks
against the chunk's name, as it checks a chunk stored as it is.
"""

from __future__ import annotations

from ckptstage.daemon.tiers.compression import DecodedReader
from ckptstage.daemon.tiers.s3.io import ObjectReader, Transfers

SIZE_META = "ckptstage-size"  # x-amz-meta-ckptstage-size: a compressed chunk's decoded size


def open_object(transfers: Transfers, key: str) -> ObjectReader | DecodedReader:
    """The object at ``key`` as a reader of what it holds: read by ranges, or when it is a compressed chunk
    (:data:`SIZE_META` in its metadata), whole and decoded."""
    reader = transfers.reader(key)
    return reader if SIZE_META not in reader.metadata else read_decoded(reader)


def read_decoded(reader: ObjectReader) -> DecodedReader:
    """What ``reader`` holds (a frame: an object, or a chunk's range of a pack), read whole and decoded."""
    frame = bytearray(reader.size)
    with reader:
        got = reader.readinto(memoryview(frame)) or 0
    return DecodedReader(bytes(frame[:got]) if got < len(frame) else frame)


