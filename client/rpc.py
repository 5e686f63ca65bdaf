"""A connection to the node daemon: the gRPC channel on its Unix socket, errors typed."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import grpc

from ckptstage.client.errors import DaemonTimeout, DaemonUnavailable, from_rpc_error
from ckptstage.protos import paths
from ckptstage.protos.v1 import ckptstage_pb2 as pb
from ckptstage.protos.v1 import ckptstage_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# Unary calls that should answer at once; blocking calls pass their own timeout.
DEFAULT_TIMEOUT_S = 30.0
# Copying a step's parts onto the local tier (Prefetch): bound by the shared tier's bandwidth, so minutes.
FETCH_TIMEOUT_S = 3600.0
# Reconnecting to a restarted daemon: gRPC backs off up to 120 s between attempts by default, so a
# client that lived through a long outage could not reach the daemon for seconds after it was back.
# On a Unix socket an attempt costs microseconds: retry every 100-250 ms. gRPC reads
# min_reconnect_backoff_ms as how long one connection attempt may take (its handshake): left at
# 100 ms, a daemon busy or stopped for that long looked absent; 20 s (gRPC's default) lets a call's
# own deadline decide, so a hung daemon reads as one that does not answer (DaemonTimeout).
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20),
    ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 20_000),
    ("grpc.max_reconnect_backoff_ms", 250),
]


def resolve_socket(socket: str | os.PathLike[str] | None) -> Path:
    if socket is not None:
        return Path(socket)
    env = os.environ.get("CKPTSTAGE_SOCKET")
    return Path(env) if env else paths.default_socket_path()


class Connection:
    """One channel to ``ckptstaged``; ``call`` raises :mod:`ckptstage.client.errors` types."""

    def __init__(self, socket: str | os.PathLike[str] | None = None) -> None:
        self.socket = resolve_socket(socket)
        self.channel = grpc.insecure_channel(f"unix:{self.socket}", options=_CHANNEL_OPTIONS)
        self.stub = pb_grpc.CheckpointerStub(self.channel)
        self.answered = False  # a call has answered on this connection: a later refusal means it went away

    def call(self, method: str, request: Any, timeout: float | None = DEFAULT_TIMEOUT_S,
             wait_for_ready: bool = False) -> Any:
        """One unary call; ``wait_for_ready`` waits (within ``timeout``) for a daemon that is not up yet."""
        try:
            answer = getattr(self.stub, method)(request, timeout=timeout, wait_for_ready=wait_for_ready)
        except grpc.RpcError as e:
            raise from_rpc_error(e, str(self.socket), method, timeout, self.answered) from None
        self.answered = True
        return answer

    def start(self, method: str, request: Any, timeout: float | None = DEFAULT_TIMEOUT_S) -> Pending:
        """Sends a unary call without waiting; calling the result waits for its answer (errors typed)."""
        return Pending(getattr(self.stub, method).future(request, timeout=timeout), str(self.socket), method,
                       timeout, self.answered)

    def status(self, timeout: float = 5.0) -> pb.StatusResponse:
        return self.call("Status", pb.StatusRequest(), timeout=timeout)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Pending:
    """A unary call on its way: ``wait(t)`` says whether it has answered, calling it returns the answer."""

    def __init__(self, future: Any, socket: str, method: str, timeout: float | None,
                 answered_before: bool = False) -> None:
        self._future, self._socket, self._method, self._timeout = future, socket, method, timeout
        self._answered_before = answered_before

    def wait(self, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds; True once the call has answered (or failed)."""
        try:
            self._future.exception(timeout=timeout)
        except grpc.FutureTimeoutError:
            return False
        except grpc.FutureCancelledError:
            pass
        return True

    def __call__(self) -> Any:
        try:
            return self._future.result()
        except grpc.RpcError as e:
            raise from_rpc_error(e, self._socket, self._method, self._timeout, self._answered_before) from None


def call_when_up(conn: Connection, method: str, request: Any, wait_s: float) -> Any:
    """``conn.call``, waiting up to ``wait_s`` in all for a daemon that is not answering yet (starting,
    restarting, or hung).

    One deadline covers the whole wait: the first call is bounded by it too,
    else against a daemon that accepts connections but never answers (stopped,
    hung) it would first sit out gRPC's connection-attempt timeout (20 s, see
    ``_CHANNEL_OPTIONS``) before the wait asked for began. Where no daemon
    listens at all the first call fails at once; gRPC then retries the
    connection every 100-250 ms until the deadline, and one log line says
    that the client waits.
    """
    deadline = time.monotonic() + wait_s
    try:
        return conn.call(method, request, timeout=wait_s if wait_s > 0 else DEFAULT_TIMEOUT_S)
    except DaemonUnavailable:
        if wait_s <= 0:
            raise
    except DaemonTimeout as e:
        if wait_s <= 0:
            raise
        raise _not_up(conn, wait_s, e) from None
    log.warning("ckptstage: no daemon answering on %s yet; waiting up to %.0fs for it to start", conn.socket, wait_s)
    try:
        return conn.call(method, request, timeout=max(0.0, deadline - time.monotonic()), wait_for_ready=True)
    except (DaemonTimeout, DaemonUnavailable) as e:
        raise _not_up(conn, wait_s, e) from None


def _not_up(conn: Connection, wait_s: float, cause: Exception) -> DaemonUnavailable:
    return DaemonUnavailable(
        f"no ckptstaged answered on {conn.socket} within {wait_s:g}s ({cause}); check that the daemon runs "
        "(`ckptstage status`, `systemctl status ckptstaged@<instance>`, its log) and that this is its socket "
        "(Client(socket=...), $CKPTSTAGE_SOCKET, `socket` in its config)")
