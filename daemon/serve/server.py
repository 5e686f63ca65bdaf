"""The control plane's server: the gRPC service on the daemon's Unix socket, on one asyncio loop.

``grpc.aio`` answers every RPC from one event loop on a thread of its own;
the servicer hands domain calls to bounded thread pools (see
:mod:`ckptstage.daemon.serve.servicer`). A synchronous gRPC server would hold one
thread per open ``Attach`` stream: 64 idle ranks used to take every server
thread, and ``Status`` and new clients timed out until they closed.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc

from ckptstage.daemon.node.node import Node
from ckptstage.daemon.serve.servicer import Servicer
from ckptstage.protos.v1 import ckptstage_pb2_grpc as pb_grpc

MAX_MESSAGE_BYTES = 256 << 20
LOOP_THREAD = "rpc-loop"
_PR_SET_NAME = 15  # prctl(2)

T = TypeVar("T")


class RpcServer:
    """Serves :class:`Servicer` on ``socket_path`` (0600; its directory is the caller's)."""

    def __init__(self, node: Node, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.servicer = Servicer(node, str(socket_path))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=LOOP_THREAD, daemon=True)
        self._server: grpc.aio.Server | None = None
        self._heartbeat: asyncio.Task[None] | None = None

    def set_metrics_url(self, url: str) -> None:
        self.servicer.metrics_url = url

    def start(self) -> None:
        """Binds the socket and serves; requests are answered once this returns."""
        self._thread.start()
        self._call(self._start())
        os.chmod(self.socket_path, 0o600)

    def start_heartbeat(self, interval_s: float, beat: Callable[[], None]) -> None:
        """Calls ``beat`` every ``interval_s`` seconds on the loop that answers RPCs (after :meth:`start`).

        The beats are the loop's proof of life (systemd's watchdog pings): while the loop is stuck,
        none are made. ``beat`` must return at once.
        """
        async def spawn() -> None:
            self._heartbeat = asyncio.get_running_loop().create_task(self._beat(interval_s, beat))

        self._call(spawn())

    @staticmethod
    async def _beat(interval_s: float, beat: Callable[[], None]) -> None:
        while True:
            beat()
            await asyncio.sleep(interval_s)

    async def _stop_heartbeat(self) -> None:
        assert self._heartbeat is not None
        self._heartbeat.cancel()
        await asyncio.gather(self._heartbeat, return_exceptions=True)

    def _run_loop(self) -> None:
        # The kernel's name of this thread too (ps -L, top -H, /proc/PID/task/*/comm), so an operator
        # or a debugger can tell the RPC loop from the daemon's other threads.
        try:
            ctypes.CDLL(None).prctl(_PR_SET_NAME, LOOP_THREAD.encode(), 0, 0, 0)
        except (OSError, AttributeError):  # not Linux: the Python name is enough
            pass
        self._loop.run_forever()

    async def _start(self) -> None:
        # Created on the loop that serves it.
        self._server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        pb_grpc.add_CheckpointerServicer_to_server(self.servicer, self._server)
        self._server.add_insecure_port(f"unix:{self.socket_path}")
        await self._server.start()

    def discard(self) -> None:
        """Closes the loop of a server that never started (the daemon's start failed): left to the
        collector, it is closed at exit after the sockets it polls, which prints a traceback."""
        if not self._thread.is_alive():
            self._loop.close()

    def begin_shutdown(self) -> None:
        """Ends every session stream with SHUTTING_DOWN; new saves are refused by the node."""
        self.servicer.begin_shutdown()

    def stop(self, grace: float) -> None:
        """Stops serving: calls in flight get ``grace`` seconds, then the loop ends."""
        if self._server is not None:
            self._call(self._server.stop(grace), timeout=grace + 5)
        if self._heartbeat is not None:
            self._call(self._stop_heartbeat(), timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self.servicer.close()

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)
