"""The peer tier: each committed part replicated to another node of the job, restored from there after a node is lost.

Real daemons stand for the nodes: each its own local tier and its own peer
port on loopback, one token between them, one shared directory whose drain
never runs (``drain_every`` beyond every step here), so a lost node's steps
exist nowhere but on the nodes that keep its replicas. The job's ranks are
real gloo ranks where the exchange of addresses over the process group is
what is tested; elsewhere, clients of one process tell their daemons the
job's nodes the way the group would (``peers_support.join``).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from ckptstage.client import Client
from ckptstage.client.errors import SaveFailed
from ckptstage.daemon.peers import placement
from ckptstage.protos import layout
from ckptstage.protos.v1 import ckptstage_pb2 as pb
from ckptstage.protos.v1 import ckptstage_pb2_grpc as pb_grpc
from dist_harness import RankContext, run_ranks
from peers_support import holdings, join, peer_nodes, peer_stub, replicas_held
from support import data_size, flip_data_byte, free_port, metric, read_data, scrape, wait_until

JOB = "peers"


def state_of(step: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step * 100 + rank)
    return {"w": torch.randn(64, 1024, generator=g), "b": torch.arange(17, dtype=torch.int64) * step, "step": step}


def assert_state(got: dict[str, Any], step: int, rank: int) -> None:
    want = state_of(step, rank)
    assert got["step"] == step
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])


def save_all(clients: list[Client], step: int, peer: bool = True) -> None:
    handles = [c.save(step, state_of(step, c.rank)) for c in clients]
    for h in handles:
        h.wait("local", timeout=30)
        if peer:
            h.wait("peer", timeout=30)


def save_on(nodes: list[Any], step: int, **client_args: Any) -> None:
    """A job with rank r on ``nodes[r]``: its clients start (and name the job's nodes), save ``step``, wait
    for its replicas, and exit."""
    clients = [Client(JOB, socket=d.socket, rank=r, world_size=len(nodes), attempt="run-1", **client_args)
               for r, d in enumerate(nodes)]
    try:
        join(clients, nodes)
        save_all(clients, step)
    finally:
        for cl in clients:
            cl.close()


def lose(node: Any) -> None:
    """The node goes away: its daemon killed, its SSD gone."""
    node.kill(signal.SIGKILL)
    shutil.rmtree(node.local)


# --- placement ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_placement_puts_no_two_copies_on_one_node_for_any_node_count(n: int, replicas: int) -> None:
    nodes = [f"10.0.0.{i}:7461" for i in range(n)]
    kept: dict[str, int] = {a: 0 for a in nodes}
    for me in nodes:
        targets = placement.targets(reversed(nodes), me, replicas)  # any order: every node computes the same
        assert me not in targets and len(set(targets)) == len(targets) == min(replicas, n - 1)
        assert targets == placement.targets(nodes, me, replicas)
        for t in targets:
            kept[t] += 1
    assert len(set(kept.values())) == 1  # every node keeps as many replicas as it sends: odd n included


# --- a node lost --------------------------------------------------------------------------


def rank_save(ctx: RankContext, steps: list[int]) -> list[str]:
    with Client(JOB, socket=ctx.socket) as client:
        for step in steps:
            h = client.save(step, state_of(step, ctx.rank))
            h.wait("local", timeout=30)
            h.wait("peer", timeout=30)
        return client._peers


def rank_restore(ctx: RankContext) -> tuple[int | None, dict[str, Any], str | None]:
    with Client(JOB, socket=ctx.socket) as client:
        step = client.latest()
        state = client.load()
        return step, state, client.last_load_tier


def test_a_job_that_loses_a_node_restarts_on_another_from_the_replica(daemon_factory: Any, tmp_path: Path) -> None:
    a, b, c = peer_nodes(daemon_factory, tmp_path / "nodes", 3)
    # Two gloo ranks, one on A and one on B: their clients exchange the daemons' addresses when they start.
    peers = run_ranks(rank_save, 2, lambda r: str((a, b)[r].socket), args=([1, 2],), timeout=120)
    assert peers == [[b.peer], [a.peer]]
    assert replicas_held(b, JOB) == {(2, 0)} and replicas_held(a, JOB) == {(2, 1)}  # keep = 1: step 1 went
    assert f"kept a replica of {JOB} step 2 rank 0 from {a.peer} on memory" in b.log.read_text()

    lose(a)
    # The job restarts on C (rank 0) and B (rank 1): rank 0's part exists only as B's replica.
    got = run_ranks(rank_restore, 2, lambda r: str((c, b)[r].socket), timeout=120)
    for rank, (step, state, tier) in enumerate(got):
        assert step == 2
        assert_state(state, 2, rank)
    assert [tier for _, _, tier in got] == ["peer", "memory"]  # B's own part: its memory tier kept it
    assert f"fetched {JOB} step 2 rank 0 from {b.peer}" in c.log.read_text()


def test_replicas_on_disk_when_the_budget_is_in_use_survive_the_daemon_and_restore(daemon_factory: Any,
                                                                                 tmp_path: Path) -> None:
    # Each node's whole arena budget is its trainer's arena: replicas go to the local SSD.
    a, b, c = peer_nodes(daemon_factory, tmp_path / "nodes", 3, **{"arena.max_bytes": "4MiB"})
    save_on([a, b], 5, arena_bytes=4 << 20)
    kept = [h for h in holdings(b, JOB) if h.replica]
    assert [(h.step, h.rank, h.in_memory) for h in kept] == [(5, 0, False)]
    assert layout.read_manifest(layout.part_dir(b.local / ".peers", JOB, 5, 0))["rank"] == 0
    b.restart()  # replicas on disk are found again
    assert replicas_held(b, JOB) == {(5, 0)}

    lose(a)
    readers = [Client(JOB, socket=d.socket, rank=r, world_size=2, attempt="run-2") for r, d in enumerate((c, b))]
    try:
        join(readers, [c, b])
        assert [r.latest() for r in readers] == [5, 5]
        for r in readers:
            assert_state(r.load(), 5, r.rank)
        assert [r.last_load_tier for r in readers] == ["peer", "local"]
    finally:
        for r in readers:
            r.close()


# --- who may talk to a peer ---------------------------------------------------------------


def test_calls_without_the_token_are_refused_and_counted(daemon_factory: Any, tmp_path: Path) -> None:
    port = free_port()
    (a,) = peer_nodes(daemon_factory, tmp_path / "nodes", 1, **{"metrics.listen": f"127.0.0.1:{port}"})
    for token in (None, "not-the-token-at-all-0123456789"):
        stub, metadata = peer_stub(a, token)
        with pytest.raises(grpc.RpcError) as info:
            stub.Holdings(pb.HoldingsRequest(job=JOB), metadata=metadata, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            list(stub.ReadFile(pb.PeerFileRequest(part=pb.PeerPart(job=JOB, step=1, rank=0), name="data"),
                               metadata=metadata, timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            stub.PutReplica(iter([pb.ReplicaChunk(header=pb.ReplicaHeader(job=JOB, step=1, rank=0))]),
                            metadata=metadata, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    log = a.log.read_text()
    assert "refused a call from" in log and "no token" in log and "a wrong token" in log
    assert metric(scrape(port), "ckptstage_peer_refused_total", reason="unauthenticated") == 6


def test_a_daemon_cannot_be_used_to_plant_a_replica_of_a_job_it_does_not_run(daemon_factory: Any,
                                                                              tmp_path: Path) -> None:
    a, b = peer_nodes(daemon_factory, tmp_path / "nodes", 2)
    with Client(JOB, socket=a.socket, rank=0, world_size=2, attempt="run-1") as writer:
        writer.save(1, state_of(1, 0)).wait("local", timeout=30)
        part = layout.part_dir(a.local, JOB, 1, 0)
    raw = (part / layout.MANIFEST_FILE).read_bytes()
    name, data = layout.DATA_FILE, read_data(part)
    stub, metadata = peer_stub(b)

    def put(sender: str) -> None:
        stub.PutReplica(iter([
            pb.ReplicaChunk(header=pb.ReplicaHeader(job=JOB, step=1, rank=0, sender=sender, manifest=raw,
                                                    digest=layout.chunk_digest(raw))),
            pb.ReplicaChunk(data=pb.FileData(name=name, offset=0, data=data))]), metadata=metadata, timeout=10)

    # B has had no session of the job: it keeps nothing of it, from anyone.
    with pytest.raises(grpc.RpcError) as info:
        put(a.peer)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "refused a replica" in b.log.read_text() and replicas_held(b, JOB) == set()
    # Once the job runs on B too, only its nodes may send: not a node it does not name.
    with Client(JOB, socket=b.socket, rank=1, world_size=2, attempt="run-1") as member:
        join([member], [a, b])
        with pytest.raises(grpc.RpcError) as info:
            put("10.9.9.9:7461")
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        put(a.peer)
        assert replicas_held(b, JOB) == {(1, 0)}


# --- never in the trainer's way -----------------------------------------------------------


def test_a_dead_or_stopped_peer_never_delays_a_save(daemon_factory: Any, tmp_path: Path) -> None:
    a, b = peer_nodes(daemon_factory, tmp_path / "nodes", 2)
    clients = [Client(JOB, socket=d.socket, rank=r, world_size=2, attempt="run-1") for r, d in enumerate((a, b))]
    try:
        join(clients, [a, b])
        save_all(clients, 1)
        b.proc.send_signal(signal.SIGSTOP)  # hung: it takes the connection and never answers
        try:
            for step in (2, 3, 4):
                began = time.monotonic()
                h = clients[0].save(step, state_of(step, 0))
                h.wait("local", timeout=30)
                assert time.monotonic() - began < 5.0
                with pytest.raises(TimeoutError):
                    h.wait("peer", timeout=0.5)
        finally:
            b.proc.send_signal(signal.SIGCONT)
        # Only the newest step still queued is sent once the peer answers: 2 and 3 were dropped for it.
        wait_until(lambda: (4, 0) in replicas_held(b, JOB), 30, "step 4's replica on B")
        h = clients[0].save(5, state_of(5, 0))
        h.wait("peer", timeout=30)
        b.kill(signal.SIGKILL)
        began = time.monotonic()
        clients[0].save(6, state_of(6, 0)).wait("local", timeout=30)  # dead: refused at once, retried behind
        assert time.monotonic() - began < 5.0
    finally:
        for cl in clients:
            cl.close()


def test_wait_peer_says_why_a_part_has_no_replica(daemon_factory: Any, tmp_path: Path) -> None:
    (a,) = peer_nodes(daemon_factory, tmp_path / "nodes", 1)
    with Client(JOB, socket=a.socket) as alone:
        h = alone.save(1, state_of(1, 0))
        with pytest.raises(SaveFailed, match="runs on no other node"):
            h.wait("peer", timeout=10)


# --- placement on real nodes, and copies that go bad or go -------------------------------


@pytest.mark.parametrize("n", [3, 5])
def test_every_part_lands_where_placement_says(daemon_factory: Any, tmp_path: Path, n: int) -> None:
    nodes = peer_nodes(daemon_factory, tmp_path / "nodes", n, **{"peers.replicas": 2})
    save_on(nodes, 1)
    addresses = [d.peer for d in nodes]
    for holder in nodes:
        want = {(1, r) for r, d in enumerate(nodes) if holder.peer in placement.targets(addresses, d.peer, 2)}
        assert replicas_held(holder, JOB) == want
        assert len(want) == 2


def test_a_flipped_byte_in_a_replica_falls_back_to_another_copy(daemon_factory: Any, tmp_path: Path) -> None:
    # Replicas on disk (the budget is the trainers' arenas), two of each part: A's part is on two nodes.
    a, b, c, d = peer_nodes(daemon_factory, tmp_path / "nodes", 4, **{"arena.max_bytes": "4MiB",
                                                                       "peers.replicas": 2})
    three = [a, b, c]
    save_on(three, 1, arena_bytes=4 << 20)
    holders = [n for n in three if (1, 0) in replicas_held(n, JOB)]
    assert len(holders) == 2
    first = min(holders, key=lambda n: n.peer)  # asked first by the reader below
    part = layout.part_dir(first.local / ".peers", JOB, 1, 0)
    flip_data_byte(part, data_size(part) // 2)  # in the file, or in the pack that holds that chunk

    lose(a)
    reader = Client(JOB, socket=d.socket, rank=0, world_size=3, attempt="run-2")
    try:
        join([reader], [d, b, c])
        assert reader.latest() == 1
        assert_state(reader.load(), 1, 0)
        assert reader.last_load_tier == "peer"
    finally:
        reader.close()
    assert "fails its checksums" in first.log.read_text()  # the holder checked what it sent, and dropped it
    assert (1, 0) not in replicas_held(first, JOB)


def test_a_replica_that_was_evicted_is_not_counted_by_latest(daemon_factory: Any, tmp_path: Path) -> None:
    a, b, c = peer_nodes(daemon_factory, tmp_path / "nodes", 3)
    clients = [Client(JOB, socket=d.socket, rank=r, world_size=2, attempt="run-1") for r, d in enumerate((a, b))]
    try:
        join(clients, [a, b])
        save_all(clients, 1)
        # Step 2: only rank 0 saves before its node is lost. Its replica takes the place of step 1's (keep = 1).
        clients[0].save(2, state_of(2, 0)).wait("peer", timeout=30)
    finally:
        for cl in clients:
            cl.close()
    assert replicas_held(b, JOB) == {(2, 0)}
    lose(a)
    reader = Client(JOB, socket=c.socket, rank=0, world_size=2, attempt="run-2")
    try:
        join([reader], [c, b])
        # Step 2 lacks rank 1; step 1's rank 0 is gone with A and its replica was evicted: nothing to restart from.
        assert reader.latest() is None
        listed = {i.step: i for i in reader.list()}
        assert not listed[2].complete and listed[2].ranks_missing == (1,)
    finally:
        reader.close()


def test_a_session_that_needs_the_memory_moves_replicas_to_disk(daemon_factory: Any, tmp_path: Path) -> None:
    a, b = peer_nodes(daemon_factory, tmp_path / "nodes", 2, **{"arena.max_bytes": "8MiB"})
    writer = Client(JOB, socket=a.socket, rank=0, world_size=2, attempt="run-1", arena_bytes=1 << 20)
    reader = Client(JOB, socket=b.socket, rank=1, world_size=2, attempt="run-1", arena_bytes=0)
    try:
        join([writer, reader], [a, b])
        save_all([writer], 1)
        assert [(h.rank, h.in_memory) for h in holdings(b, JOB) if h.replica] == [(0, True)]
        # B's trainer now takes the whole budget: the replica makes way by moving to B's SSD, not by going.
        with Client("other-job", socket=b.socket, arena_bytes=8 << 20):
            assert [(h.rank, h.in_memory) for h in holdings(b, JOB) if h.replica] == [(0, False)]
            assert layout.read_manifest(layout.part_dir(b.local / ".peers", JOB, 1, 0))["rank"] == 0
    finally:
        writer.close()
        reader.close()


def _certificates(root: Path) -> dict[str, Path]:
    """A CA, and a certificate for 127.0.0.1 signed by it (every node here uses the one: loopback)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed: no certificates to test mutual TLS with")
    root.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=root, timeout=60)

    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
        "-subj", "/CN=ckptstage-test-ca", "-keyout", "ca.key", "-out", "ca.crt")
    run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", "node.key", "-out", "node.csr")
    (root / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "node.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
        "-extfile", "san.ext", "-out", "node.crt")
    (root / "node.key").chmod(0o600)
    return {"peers.tls_cert": root / "node.crt", "peers.tls_key": root / "node.key", "peers.tls_ca": root / "ca.crt"}


def test_mutual_tls_replicates_and_refuses_a_caller_without_a_certificate(daemon_factory: Any,
                                                                         tmp_path: Path) -> None:
    tls = {k: str(v) for k, v in _certificates(tmp_path / "pki").items()}
    a, b = peer_nodes(daemon_factory, tmp_path / "nodes", 2, **{**tls, "peers.token_file": ""})
    save_on([a, b], 1)
    pki = tmp_path / "pki"
    creds = grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes(), (pki / "node.key").read_bytes(),
                                         (pki / "node.crt").read_bytes())
    stub = pb_grpc.PeerStub(grpc.secure_channel(b.peer, creds))
    held = stub.Holdings(pb.HoldingsRequest(job=JOB), timeout=10).parts
    assert {(h.step, h.rank) for h in held if h.replica} == {(1, 0)}
    # TLS without a client certificate, and plain TCP: no call gets through.
    ca_only = grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes())
    anonymous = pb_grpc.PeerStub(grpc.secure_channel(b.peer, ca_only))
    for s in (anonymous, peer_stub(b)[0]):
        with pytest.raises(grpc.RpcError) as info:
            s.Holdings(pb.HoldingsRequest(job=JOB), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_replicas_wait_while_a_checkpoint_is_loaded_on_the_sending_node(daemon_factory: Any, tmp_path: Path) -> None:
    """A restart reading its step on A comes first: A's replicas wait at its load gate, then go."""
    a, b = peer_nodes(daemon_factory, tmp_path / "nodes", 2)
    clients = [Client(JOB, socket=d.socket, rank=r, world_size=2, attempt="run-1") for r, d in enumerate((a, b))]
    try:
        join(clients, [a, b])
        with a.connection() as conn:
            conn.call("Loading", pb.LoadingRequest(lease="restart", ttl_s=30))
            handles = [c.save(1, state_of(1, c.rank)) for c in clients]
            for h in handles:
                h.wait("local", timeout=30)
            handles[1].wait("peer", timeout=30)  # B's part reaches A: A's load does not hold B back
            time.sleep(1.0)
            assert (1, 0) not in replicas_held(b, JOB), "A sent its replica during the load"
            conn.call("Loading", pb.LoadingRequest(lease="restart", done=True))
            handles[0].wait("peer", timeout=30)
        assert (1, 0) in replicas_held(b, JOB)
    finally:
        for cl in clients:
            cl.close()
