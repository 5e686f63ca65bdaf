"""The peer port: the ``Peer`` service on ``[peers] listen``, every call authenticated.

A synchronous gRPC server on TCP with a small pool of its own (replicas and
reads are streams of megabytes; none of it shares a thread with the trainers'
control plane on the Unix socket). The token is checked before any handler
runs (:class:`~ckptstage.daemon.peers.transport.TokenCheck`); with
``tls_*`` the port speaks mutual TLS. Each handler calls one method of
:class:`~ckptstage.daemon.peers.tier.PeerTier` and maps domain errors to a
status code, as the control plane's servicer does.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from ckptstage.daemon.configpeers import PeersConfig
from ckptstage.daemon.errors import InvalidRequest
from ckptstage.daemon.logs import fields
from ckptstage.daemon.metrics import Metrics
from ckptstage.daemon.peers import transport
from ckptstage.daemon.peers.replicachunks import ChunksMissing
from ckptstage.daemon.peers.replicaio import CorruptReplica
from ckptstage.daemon.peers.store import NoRoom
from ckptstage.daemon.peers.tier import NotAMember, PeerTier
from ckptstage.daemon.serve.servicer import status_of
from ckptstage.daemon.tiers.interface import TierName
from ckptstage.protos import layout
from ckptstage.protos.v1 import ckptstage_pb2 as pb
from ckptstage.protos.v1 import ckptstage_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

THREADS = 8

# What only the peer port raises; every other domain error gets the control plane's code (status_of).
_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (NotAMember, grpc.StatusCode.PERMISSION_DENIED),
    (CorruptReplica, grpc.StatusCode.DATA_LOSS),
    (layout.ChecksumMismatch, grpc.StatusCode.DATA_LOSS),
    (FileNotFoundError, grpc.StatusCode.NOT_FOUND),  # a part removed while it was asked for
    (NoRoom, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ChunksMissing, grpc.StatusCode.FAILED_PRECONDITION),  # the sender sends the whole part instead
]

F = TypeVar("F", bound=Callable[..., Any])


def _streamed(method: F) -> F:
    """A streaming handler whose domain errors (raised while it streams, too) abort the call with their code."""
    @functools.wraps(method)
    def wrapper(self: PeerServicer, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from method(self, request, context)
        except grpc.RpcError:
            raise
        except Exception as e:  # noqa: BLE001 - every error reaches the peer with a code
            _abort(context, e, method.__name__)

    return wrapper  # type: ignore[return-value]


def _unary(context: grpc.ServicerContext, call: Callable[[], Any]) -> Any:
    """``call()``, its domain errors aborting the call with their code."""
    try:
        return call()
    except grpc.RpcError:
        raise
    except Exception as e:  # noqa: BLE001 - every error reaches the peer with a code
        _abort(context, e, getattr(call, "__name__", "call"))


def _abort(context: grpc.ServicerContext, error: Exception, method: str) -> None:
    for cls, code in _CODES:
        if isinstance(error, cls):
            context.abort(code, str(error))  # raises
    context.abort(*status_of(error, f"peer call {method}"))


class PeerServicer(pb_grpc.PeerServicer):  # type: ignore[misc]  # generated code has no type hints
    def __init__(self, peers: PeerTier) -> None:
        self._peers = peers

    def PutReplica(self, request_iterator: Iterator[pb.ReplicaChunk], context: grpc.ServicerContext
                   ) -> pb.PutReplicaResponse:
        try:
            first = next(request_iterator)
        except StopIteration:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a replica begins with its header")
        if first.WhichOneof("kind") != "header":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a replica begins with its header")
        h = first.header

        def data() -> Iterator[tuple[str, int, bytes]]:
            for chunk in request_iterator:
                if chunk.WhichOneof("kind") != "data":
                    raise InvalidRequest("a replica has one header, first")
                yield chunk.data.name, chunk.data.offset, chunk.data.data

        return _unary(context, lambda: pb.PutReplicaResponse(kept_in=self._peers.put_replica(
            h.job, h.step, h.rank, h.sender, h.manifest, h.digest, data(), chunks_only=h.chunks_only)))

    def MissingChunks(self, request: pb.ChunksQuery, context: grpc.ServicerContext) -> pb.ChunksMissing:
        return _unary(context, lambda: pb.ChunksMissing(names=self._peers.missing_chunks(
            request.job, request.store, list(request.names))))

    def Holdings(self, request: pb.HoldingsRequest, context: grpc.ServicerContext) -> pb.HoldingsResponse:
        def answer() -> pb.HoldingsResponse:
            return pb.HoldingsResponse(parts=[
                pb.HeldPart(step=h.part.step, rank=h.part.rank, world_size=h.part.world_size, attempt=h.part.attempt,
                            digest=h.part.digest, bytes=h.part.nbytes, created=h.part.created, replica=h.replica,
                            metrics=h.part.metrics, in_memory=h.in_memory)
                for h in self._peers.holdings(request.job)])
        return _unary(context, answer)

    def ReadManifest(self, request: pb.PeerPart, context: grpc.ServicerContext) -> pb.PeerManifest:
        return _unary(context, lambda: pb.PeerManifest(manifest=self._peers.read_manifest(
            request.job, request.step, request.rank, request.digest)))

    @_streamed
    def ReadFile(self, request: pb.PeerFileRequest, context: grpc.ServicerContext) -> Iterator[pb.FileData]:
        p = request.part
        offset = 0
        for piece in self._peers.read_file(p.job, p.step, p.rank, p.digest, request.name):
            yield pb.FileData(name=request.name, offset=offset, data=piece)
            offset += len(piece)



class PeerServer:
    """Serves :class:`PeerServicer` on ``config.listen``."""

    def __init__(self, config: PeersConfig, peers: PeerTier, metrics: Metrics) -> None:
        self._config = config
        self._metrics = metrics
        interceptors = []
        token = config.read_token()
        if token is not None:
            interceptors.append(transport.TokenCheck(token, self._refused))
        self._server = grpc.server(ThreadPoolExecutor(THREADS, thread_name_prefix="peer-rpc"),
                                   interceptors=interceptors, options=transport.server_options())
        pb_grpc.add_PeerServicer_to_server(PeerServicer(peers), self._server)
        credentials = transport.server_credentials(config)
        assert config.listen is not None
        try:
            bound = (self._server.add_secure_port(config.listen, credentials) if credentials is not None
                     else self._server.add_insecure_port(config.listen))
        except RuntimeError:
            bound = 0
        if not bound:
            raise OSError(f"cannot listen on {config.listen} for peers ([peers] listen): the port is in use or "
                          "the address is not this host's")
        self.port = bound

    def start(self) -> None:
        self._server.start()

    def stop(self, grace: float) -> None:
        self._server.stop(grace).wait(grace + 1)

    def _refused(self, peer: str, method: str, why: str) -> None:
        self._metrics.peer_refused.labels("unauthenticated").inc()
        log.warning("refused a call from %s on the peer port (%s): %s", peer, method, why,
                    extra=fields(peer=peer, rpc=method, tier=TierName.PEER))

