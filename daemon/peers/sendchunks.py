"""Sending an incremental part to a peer as the chunks it lacks.

A fine-tune's step changes its adapters and leaves the base as it was: a
peer that keeps the job's replicas on disk holds the base's chunks already
(:mod:`.replicachunks`). So before sending such a part whole, the sender asks
the peer which of its chunks it lacks (``MissingChunks``); when those are at
most :data:`CHUNKS_ONLY_SHARE` of the part, it sends only them, by name
(``ReplicaHeader.chunks_only``), and the peer keeps the replica on disk
beside the chunks it holds, each new one checked against its name. A peer
that holds too little (one keeping replicas in memory holds no chunks), that
cannot say (an earlier version), or whose sweep took a chunk after it
answered (``FAILED_PRECONDITION``) gets the part whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

from ckptstage.daemon.catalog.parts import Part
from ckptstage.daemon.peers.replicaio import READ_BYTES
from ckptstage.daemon.peers.transport import CONNECT_TIMEOUT_S
from ckptstage.protos import chunks, layout
from ckptstage.protos.v1 import ckptstage_pb2 as pb

# The most of a part its peer may lack for it to go as chunks; more, and it goes whole (the peer may then keep
# it in memory, where a restore reads it fastest).
CHUNKS_ONLY_SHARE = 0.5


def send_chunks(stub: Any, metadata: Any, part: Part, raw: bytes, manifest: dict[str, Any], sender: str,
                pace: Callable[[int], None], stopping: Callable[[], bool], timeout: float) -> int | None:
    """Sends ``part`` (its manifest ``raw``, parsed as ``manifest``) to ``stub``'s node as the chunks it lacks;
    returns the bytes sent, or None when the part should go whole instead (see the module docstring).
    ``pace(n)`` before each piece of ``n`` bytes; ``stopping()`` ends the send (OSError)."""
    files = layout.manifest_files(manifest)
    listed = {name: chunks.manifest_chunks(manifest, name) for name in files}
    if not files or any(v is None for v in listed.values()):
        return None
    sizes = {c.name: c.nbytes for v in listed.values() for c in v or ()}
    try:
        missing = stub.MissingChunks(pb.ChunksQuery(job=part.job, store=chunks.store_key(manifest),
                                                    names=sorted(sizes)),
                                     timeout=CONNECT_TIMEOUT_S * 5, metadata=metadata).names
    except grpc.RpcError:
        return None  # a peer of an earlier version, or one not answering: the whole part's send tells which
    wanted = [n for n in dict.fromkeys(missing) if n in sizes]
    nbytes = sum(sizes[n] for n in wanted)
    if nbytes > CHUNKS_ONLY_SHARE * part.nbytes:
        return None
    header = pb.ReplicaHeader(job=part.job, step=part.step, rank=part.rank, sender=sender, manifest=raw,
                              digest=part.digest, chunks_only=True)
    try:
        stub.PutReplica(_messages(header, chunks.store_of(part.path, manifest), wanted, pace, stopping),
                        timeout=timeout, metadata=metadata)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # type: ignore[attr-defined]  # grpc.Call
            return None  # a sweep there took a chunk it held when asked
        raise
    return nbytes


def _messages(header: pb.ReplicaHeader, store: Any, wanted: list[str], pace: Callable[[int], None],
              stopping: Callable[[], bool]) -> Iterator[pb.ReplicaChunk]:
    yield pb.ReplicaChunk(header=header)
    for name in wanted:
        data = memoryview(chunks.read_chunk(store, name))
        for at in range(0, len(data), READ_BYTES):
            if stopping():
                raise OSError("the daemon is stopping")
            piece = data[at:at + READ_BYTES]
            pace(len(piece))
            yield pb.ReplicaChunk(data=pb.FileData(name=name, offset=at, data=bytes(piece)))
