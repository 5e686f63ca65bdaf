"""Nodes with a peer tier for tests: real daemons on loopback ports sharing a token, one shared directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import grpc
from ckptstage.client import Client
from ckptstage.protos.v1 import ckptstage_pb2 as pb
from ckptstage.protos.v1 import ckptstage_pb2_grpc as pb_grpc
from support import free_port

TOKEN = "0123456789abcdef0123456789abcdef"
TOKEN_KEY = "x-ckptstage-peer-token"
NEVER = 1_000_000  # a drain_every no test step reaches: nothing leaves the nodes


def token_file(root: Path, token: str = TOKEN) -> Path:
    path = root / "peer.token"
    path.write_text(token + "\n")
    os.chmod(path, 0o600)
    return path


def peer_nodes(daemon_factory: Any, root: Path, n: int, metrics: bool = False, **settings: Any) -> list[Any]:
    """``n`` started daemons, each with its own local tier and peer port, all on one shared directory
    (drained to only at steps that are multiples of :data:`NEVER` unless ``settings`` say otherwise);
    ``metrics``: each exports its metrics on a port of its own (``metrics_port``)."""
    root.mkdir(parents=True, exist_ok=True)
    token = token_file(root)
    shared = root / "shared"
    nodes = []
    for i in range(n):
        port = free_port()
        own = {"metrics.listen": f"127.0.0.1:{free_port()}"} if metrics else {}
        d = daemon_factory(f"node-{chr(ord('a') + i)}", **{
            "shared.dir": str(shared), "shared.drain_every": NEVER, "peers.listen": f"127.0.0.1:{port}",
            "peers.advertise": f"127.0.0.1:{port}", "peers.token_file": str(token), **own, **settings})
        d.metrics_port = int(own["metrics.listen"].rsplit(":", 1)[1]) if metrics else None
        d.peer = f"127.0.0.1:{port}"
        nodes.append(d.start())
    return nodes


def join(clients: list[Client], nodes: list[Any]) -> None:
    """What the clients' process group does when they start (gathers every daemon's peer address), for
    clients of one process: each tells its daemon the job's nodes."""
    addresses = sorted({d.peer for d in nodes})
    for c in clients:
        c._session.join_peers(addresses)


def peer_stub(node: Any, token: str | None = TOKEN) -> tuple[pb_grpc.PeerStub, tuple[tuple[str, str], ...]]:
    """A stub of ``node``'s peer port, and the metadata a call sends (``token``; None: none)."""
    channel = grpc.insecure_channel(node.peer)
    return pb_grpc.PeerStub(channel), ((TOKEN_KEY, token),) if token is not None else ()


def holdings(node: Any, job: str) -> list[pb.HeldPart]:
    stub, metadata = peer_stub(node)
    return list(stub.Holdings(pb.HoldingsRequest(job=job), metadata=metadata, timeout=10).parts)


def replicas_held(node: Any, job: str) -> set[tuple[int, int]]:
    """(step, rank) of the replicas ``node`` keeps of ``job``."""
    return {(h.step, h.rank) for h in holdings(node, job) if h.replica}
