"""Incremental parts on the peer tier: replicated as their bytes, kept on the peer's disk as chunks it stores once.

A fine-tune's step changes a small adapter and leaves the base weights as
they were: a node that keeps another node's replicas stores the base's
chunks once, each later step's changed chunks only, and lets go of the
chunks no replica names any more, also after a crash. The replicas restore
a lost node's part as whole ones do, and bytes that are not the chunk their
manifest names are never kept (chunks are reused by name: one kept under a
wrong name would corrupt every later replica that names it).
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from ckptstage.client import Client
from ckptstage.daemon.catalog.chunkstore import ChunkStore
from ckptstage.daemon.peers.replicachunks import ChunkSink, WrongChunk
from ckptstage.daemon.tiers.fs import FsTier
from ckptstage.protos import chunks, layout, packs
from ckptstage.protos.v1 import ckptstage_pb2 as pb
from peers_support import holdings, join, peer_nodes, peer_stub, replicas_held
from support import metric, read_data, scrape

JOB = "peers-inc"
BASE = 1 << 20      # fp32 elements of the frozen base: 4 MiB, in chunks of 1 MiB (the tests' persist.chunk_bytes)
ADAPTER = 32 << 10  # fp32 elements of what each step trains: 128 KiB
ARENA = 6 << 20
INCREMENTAL = {"persist.incremental": True, "arena.max_bytes": "6MiB", "peers.keep": 2}


def state_of(step: int, rank: int) -> dict[str, Any]:
    base = torch.Generator().manual_seed(rank)
    trained = torch.Generator().manual_seed(1000 * step + rank)
    return {"base": torch.randn(BASE, generator=base), "adapter": torch.randn(ADAPTER, generator=trained),
            "step": step}


def assert_state(got: dict[str, Any], step: int, rank: int) -> None:
    want = state_of(step, rank)
    assert got["step"] == step
    assert torch.equal(got["base"], want["base"]) and torch.equal(got["adapter"], want["adapter"])


def save(clients: list[Client], step: int) -> None:
    handles = [c.save(step, state_of(step, c.rank)) for c in clients]
    for h in handles:
        h.wait("peer", timeout=60)


def replica(node: Any, step: int, rank: int = 0) -> Path:
    return layout.part_dir(node.local / ".peers", JOB, step, rank)


def store_of(node: Any) -> Path:
    """The chunk store of ``node``'s replicas of the job: the job's, or (dedup = "user") the user's."""
    kept = next((node.local / ".peers" / JOB).glob("step-*/rank-*"), None)
    key = chunks.store_key(layout.read_manifest(kept)) if kept is not None else JOB
    return chunks.store_dir(node.local / ".peers", key)


def pack_bytes(node: Any) -> int:
    """What the packs of ``node``'s replica store of the job hold on disk."""
    return sum(p.stat().st_size for p in packs.packs_dir(store_of(node)).glob(f"*{packs.PACK_SUFFIX}"))


def names_of(part: Path) -> set[str]:
    return chunks.referenced(layout.read_manifest(part))


def stored_names(node: Any) -> set[str]:
    index = packs.StoreIndex(store_of(node))
    index.refresh()
    return set(index.packed())


@pytest.mark.parametrize("dedup", ["job", "user"])
def test_a_fine_tunes_replicas_store_what_changed_drop_what_no_step_names_and_restore_a_lost_node(
        daemon_factory: Any, tmp_path: Path, dedup: str) -> None:
    # The arena budget is the trainers': replicas go to the peers' disks, where chunks are shared.
    a, b, c = peer_nodes(daemon_factory, tmp_path / "nodes", 3, metrics=True, **INCREMENTAL,
                         **{"persist.dedup": dedup})
    clients = [Client(JOB, socket=d.socket, rank=r, world_size=2, attempt="run-1", arena_bytes=ARENA)
               for r, d in enumerate((a, b))]
    try:
        join(clients, [a, b])
        save(clients, 1)
        assert [(h.step, h.rank, h.in_memory) for h in holdings(b, JOB) if h.replica] == [(1, 0, False)]
        assert store_of(b).parent.name == (JOB if dedup == "job" else chunks.USER_STORE)
        part_bytes = layout.part_bytes(layout.read_manifest(replica(b, 1)))
        first = pack_bytes(b)
        assert part_bytes <= first <= 1.05 * part_bytes  # the first replica: every chunk, once

        sent = metric(scrape(a.metrics_port), "ckptstage_peer_sent_bytes_total")
        save(clients, 2)
        delta = pack_bytes(b) - first
        # Sent as the chunks B lacked: the adapters and the runs around them, not the base.
        step_2_sent = metric(scrape(a.metrics_port), "ckptstage_peer_sent_bytes_total") - sent
        assert 0 < step_2_sent <= 0.1 * part_bytes, f"step 2's replica sent {step_2_sent} bytes of {part_bytes}"
        assert "the chunks it lacked" in a.log.read_text()
        assert 0 < delta <= 0.1 * part_bytes, f"step 2's replica stored {delta} bytes of {part_bytes}"
        assert names_of(replica(b, 1)) & names_of(replica(b, 2))  # the base: stored once, named by both
        port = b.metrics_port
        assert metric(scrape(port), "ckptstage_peer_replica_bytes", where="disk") == pytest.approx(
            first + delta, rel=0.02)  # each chunk counted once, not once per replica

        # keep = 2: step 1's replica goes with step 3, but its pack holds the base too and stays (a pack goes
        # whole, or is repacked once most of it is dead); step 2's pack holds only what step 2 changed.
        save(clients, 3)
        after_3 = pack_bytes(b)
        only_2 = names_of(replica(b, 2)) - names_of(replica(b, 3))
        save(clients, 4)  # step 2's replica goes, and with it the chunks only it named
        assert replicas_held(b, JOB) == {(3, 0), (4, 0)}
        held = stored_names(b)
        assert only_2 and not only_2 & held and names_of(replica(b, 4)) <= held
        assert pack_bytes(b) <= after_3 + 4096, "the replicas' store grows with each step"
    finally:
        for cl in clients:
            cl.close()

    # B dies just after removing a replica, before letting go of its chunks: the restart finishes the job.
    only_3 = names_of(replica(b, 3)) - names_of(replica(b, 4))
    b.kill(signal.SIGKILL)
    shutil.rmtree(replica(b, 3))
    b.start()
    assert replicas_held(b, JOB) == {(4, 0)}
    held = stored_names(b)
    assert only_3 and not only_3 & held and names_of(replica(b, 4)) <= held

    # A is lost: its rank restarts on C, which fetches the part from B's chunks and keeps it as chunks too.
    a.kill(signal.SIGKILL)
    shutil.rmtree(a.local)
    readers = [Client(JOB, socket=d.socket, rank=r, world_size=2, attempt="run-2") for r, d in enumerate((c, b))]
    try:
        join(readers, [c, b])
        assert [r.latest() for r in readers] == [4, 4]
        for r in readers:
            assert_state(r.load(), 4, r.rank)
        assert [r.last_load_tier for r in readers] == ["peer", "local"]
    finally:
        for r in readers:
            r.close()
    assert names_of(replica(c, 4)) <= stored_names(c)


def test_bytes_that_are_not_the_chunk_their_name_says_are_refused_and_nothing_is_kept(
        daemon_factory: Any, tmp_path: Path) -> None:
    a, b = peer_nodes(daemon_factory, tmp_path / "nodes", 2, **INCREMENTAL)
    with Client(JOB, socket=a.socket, rank=0, world_size=2, attempt="run-1", arena_bytes=ARENA) as writer:
        writer.save(1, state_of(1, 0)).wait("local", timeout=30)
    part = layout.part_dir(a.local, JOB, 1, 0)
    honest = (part / layout.MANIFEST_FILE).read_bytes()
    name, data = layout.DATA_FILE, read_data(part)
    # A manifest whose block digests are right but whose chunk names one of them wrongly: the blocks verify,
    # the name does not.
    manifest = layout.read_manifest(part)
    listed = manifest["chunks"][name]
    biggest = max(range(len(listed)), key=lambda i: listed[i][1])
    forged = "0" * 31 + "1"
    listed[biggest][0] = forged
    lying = layout.manifest_file_bytes(manifest)
    stub, metadata = peer_stub(b)

    def put(raw: bytes) -> None:
        stub.PutReplica(iter([
            pb.ReplicaChunk(header=pb.ReplicaHeader(job=JOB, step=1, rank=0, sender=a.peer, manifest=raw,
                                                    digest=layout.chunk_digest(raw))),
            *(pb.ReplicaChunk(data=pb.FileData(name=name, offset=at, data=data[at:at + (1 << 20)]))
              for at in range(0, len(data), 1 << 20))]), metadata=metadata, timeout=30)

    with Client(JOB, socket=b.socket, rank=1, world_size=2, attempt="run-1", arena_bytes=ARENA) as member:
        join([member], [a, b])
        with pytest.raises(grpc.RpcError) as info:
            put(lying)
        assert info.value.code() == grpc.StatusCode.DATA_LOSS
        assert f"are not chunk {forged}" in info.value.details()
        assert replicas_held(b, JOB) == set()
        assert not store_of(b).exists() or not stored_names(b)  # no pack of it published
        put(honest)
        assert replicas_held(b, JOB) == {(1, 0)}
        assert names_of(replica(b, 1)) <= stored_names(b)


def test_a_replica_sent_as_chunks_must_bring_every_chunk_the_peer_lacks(daemon_factory: Any, tmp_path: Path) -> None:
    """The receiving side of a replica sent as chunks: asked which it lacks, a node names them and only them; a
    replica that leaves one out is refused (the sender then sends it whole), one that brings them is kept."""
    job = "by-hand"  # A never replicates it: its clients there name no other node
    a, b = peer_nodes(daemon_factory, tmp_path / "nodes", 2, **INCREMENTAL)
    with Client(job, socket=a.socket, rank=0, world_size=2, attempt="run-1", arena_bytes=ARENA) as writer:
        for step in (1, 2):
            writer.save(step, {**state_of(step, 0), "base": state_of(1, 0)["base"]}).wait("local", timeout=30)
    parts = {step: layout.part_dir(a.local, job, step, 0) for step in (1, 2)}
    stub, metadata = peer_stub(b)

    def put(step: int, messages: list[pb.ReplicaChunk], chunks_only: bool) -> None:
        raw = (parts[step] / layout.MANIFEST_FILE).read_bytes()
        header = pb.ReplicaHeader(job=job, step=step, rank=0, sender=a.peer, manifest=raw,
                                  digest=layout.chunk_digest(raw), chunks_only=chunks_only)
        stub.PutReplica(iter([pb.ReplicaChunk(header=header), *messages]), metadata=metadata, timeout=30)

    with Client(job, socket=b.socket, rank=1, world_size=2, attempt="run-1", arena_bytes=ARENA) as member:
        join([member], [a, b])
        data = read_data(parts[1])
        put(1, [pb.ReplicaChunk(data=pb.FileData(name=layout.DATA_FILE, offset=at, data=data[at:at + (1 << 20)]))
                for at in range(0, len(data), 1 << 20)], chunks_only=False)
        names = sorted(names_of(parts[2]))
        lacked = list(stub.MissingChunks(pb.ChunksQuery(job=job, store=job, names=names), metadata=metadata,
                                         timeout=10).names)
        assert set(lacked) == names_of(parts[2]) - names_of(parts[1]) and lacked  # the base is there already
        with pytest.raises(grpc.RpcError) as info:
            put(2, [], chunks_only=True)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert replicas_held(b, job) == {(1, 0)}
        store = chunks.store_of(parts[2], layout.read_manifest(parts[2]))
        put(2, [pb.ReplicaChunk(data=pb.FileData(name=n, offset=0, data=chunks.read_chunk(store, n)))
                for n in lacked], chunks_only=True)
        assert replicas_held(b, job) == {(1, 0), (2, 0)}
        chunks.verify_part(layout.part_dir(b.local / ".peers", job, 2, 0))  # every block, from B's own store


def test_a_replicas_chunks_arrive_in_pieces_that_straddle_them_in_either_form(tmp_path: Path) -> None:
    """The sink alone: a data file's bytes, or the chunks by name, in pieces smaller than a chunk and not on its
    boundaries (a chunk of 8 MiB spans two messages of 4 MiB); a piece out of order is refused."""
    mib = 1 << 20
    data = os.urandom(3 * mib + 5000)
    listed = [chunks.Chunk(lo, hi, chunks.digest(data[lo:hi]))
              for lo, hi in chunks.cut(len(data), [(0, 3 * mib)], 8 * mib, body=mib)]
    manifest = {"job": JOB, "step": 1, "rank": 0, "chunks": {layout.DATA_FILE: chunks.chunk_list(listed)},
                "files": {layout.DATA_FILE: layout.FileEntry(len(data), mib, tuple(layout.block_digests(data, mib)))
                          .to_json()}}
    for by_name in (False, True):
        tier = FsTier(tmp_path / f"by-name-{by_name}", "n")
        sink = ChunkSink(ChunkStore(tier, grace_s=0.0), manifest, tier.begin_part(JOB, 1, 0, replace=lambda f: True),
                         tmp_path / "part")
        if by_name:
            sink.expect()
            for c in listed:
                for at in range(0, c.nbytes, 100_000):
                    sink.write_chunk(c.name, at, data[c.lo + at:min(c.hi, c.lo + at + 100_000)])
            with pytest.raises(WrongChunk, match="was not asked for"):
                sink.write_chunk(listed[0].name, 0, data[:10])
        else:
            for at in range(0, len(data), 100_000):
                sink.write(layout.DATA_FILE, data[at:at + 100_000])
        sink.publish()
        sink.close()
        assert sink.written_bytes == len(data)
        for c in listed:
            assert chunks.read_chunk(chunks.store_dir(tier.root, JOB), c.name) == data[c.lo:c.hi]
