"""How daemons reach each other: gRPC over TCP, every call carrying the job's shared token or a TLS client cert.

The token travels in each call's metadata (:data:`TOKEN_KEY`) and is compared
in constant time (:func:`hmac.compare_digest`); with ``tls_*`` set, the
channel is mutual TLS (the server asks for, and checks, the client's
certificate against ``tls_ca``), and the token, when also set, is checked
inside it. :class:`Dialer` keeps one channel per peer address.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable
from typing import Any

import grpc

from ckptstage.daemon.configpeers import PeersConfig
from ckptstage.protos.v1 import ckptstage_pb2_grpc as pb_grpc

TOKEN_KEY = "x-ckptstage-peer-token"
MAX_MESSAGE_BYTES = 8 << 20
# A peer that does not answer within this long is taken as unreachable for this call (a lost node's address
# may black-hole packets: nothing must wait on it for long).
CONNECT_TIMEOUT_S = 2.0
_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000)]


def _read(path: Any) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def server_credentials(config: PeersConfig) -> grpc.ServerCredentials | None:
    """Mutual TLS for the peer port (None: plain TCP, the token alone)."""
    if config.tls_cert is None:
        return None
    return grpc.ssl_server_credentials([(_read(config.tls_key), _read(config.tls_cert))],
                                       root_certificates=_read(config.tls_ca), require_client_auth=True)


def server_options() -> list[tuple[str, Any]]:
    return list(_OPTIONS)


class TokenCheck(grpc.ServerInterceptor):  # type: ignore[misc]  # grpc ships no type hints
    """Refuses every call whose metadata lacks the token (UNAUTHENTICATED); ``refused(peer, method, why)``
    is told of each refusal (the log and a metric)."""

    def __init__(self, token: bytes, refused: Callable[[str, str, str], None]) -> None:
        self._token = token
        self._refused = refused

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        given = next((v for k, v in details.invocation_metadata if k == TOKEN_KEY), None)
        if given is not None and hmac.compare_digest(given.encode() if isinstance(given, str) else given,
                                                     self._token):
            return continuation(details)
        why = "no token" if given is None else "a wrong token"
        method = details.method
        refused = self._refused

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            refused(context.peer(), method, why)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"refused: {why} (the peer token differs between "
                                                           "nodes, or the caller is not a ckptstage daemon)")

        handler = continuation(details)
        if handler is None:
            return None
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


class Dialer:
    """One channel per peer address, with this node's credentials; :meth:`stub` for calls,
    :meth:`metadata` to send with each."""

    def __init__(self, config: PeersConfig) -> None:
        token = config.read_token()
        self._metadata: tuple[tuple[str, str], ...] = ((TOKEN_KEY, token.decode()),) if token else ()
        self._credentials = None
        if config.tls_cert is not None:
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(config.tls_ca), private_key=_read(config.tls_key),
                certificate_chain=_read(config.tls_cert))
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def stub(self, address: str) -> pb_grpc.PeerStub:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = (grpc.secure_channel(address, self._credentials, options=_OPTIONS)
                           if self._credentials is not None else grpc.insecure_channel(address, options=_OPTIONS))
                self._channels[address] = channel
        return pb_grpc.PeerStub(channel)

    def close(self) -> None:
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
        for channel in channels:
            channel.close()
