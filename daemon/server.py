"""The control plane's server: the gRPC service on the daemon's Unix socket."""

from __future__ import annotations

import os
from concurrent import futures
from pathlib import Path

import grpc

from ckptstage.daemon.node import Node
from ckptstage.daemon.servicer import Servicer
from ckptstage.protos.v1 import ckptstage_pb2_grpc as pb_grpc

MAX_MESSAGE_BYTES = 256 << 20


class RpcServer:
    """Serves :class:`Servicer` on ``socket_path`` (0600; its directory is the caller's)."""

    def __init__(self, node: Node, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.servicer = Servicer(node, str(socket_path))
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="rpc"),
                                   options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        pb_grpc.add_CheckpointerServicer_to_server(self.servicer, self._server)

    def set_metrics_url(self, url: str) -> None:
        self.servicer.metrics_url = url

    def start(self) -> None:
        """Binds the socket and serves; requests are answered once this returns."""
        self._server.add_insecure_port(f"unix:{self.socket_path}")
        self._server.start()
        os.chmod(self.socket_path, 0o600)

    def begin_shutdown(self) -> None:
        """Ends every session stream with SHUTTING_DOWN; new saves are refused by the node."""
        self.servicer.begin_shutdown()

    def stop(self, grace: float) -> None:
        self._server.stop(grace=grace).wait()
