"""Compressed chunks on a shared file system, end to end: real daemons, one shared directory, trainers reading it.

A shared directory that keeps chunks compressed (``[shared] compression``)
is still read in place by trainers on other nodes: what they read, what a
prefetch copies back to a node's SSD, and what verification re-reads must be
the saved bytes exactly, and a damaged frame must never load. The local tier
never compresses. "auto" compresses when the tier takes a stream slower than
the codec shrinks it: behind a bandwidth cap, it does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstage.client import Client
from ckptstage.client.cli import main as cli
from ckptstage.protos import chunks, codec, layout, packs
from ckptstage.protos.v1 import ckptstage_pb2 as pb
from support import data_extents, flip_data_byte, free_port, metric, read_data, scrape

JOB = "zjob"


def _state(step: int) -> dict[str, Any]:
    """Model-state-like tensors that byte-grouped zstd shrinks (normal floats, zeros, counters) and one that it
    does not (random bytes), all new at every step."""
    g = torch.Generator().manual_seed(step)
    return {"f32": torch.randn(256, 1024, generator=g), "bf16": torch.randn(512, 1024, generator=g).to(torch.bfloat16),
            "zeros": torch.zeros(300_000), "i64": torch.arange(50_000) * step,
            "noise": torch.randint(0, 256, (1 << 20,), generator=g, dtype=torch.uint8), "step": step}


def _equal(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return got.keys() == want.keys() and all(
        torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v for k, v in want.items())


def _entries(tier: Path) -> list[packs.Entry]:
    """Every entry of every pack index in the job's store on ``tier``."""
    where = packs.packs_dir(chunks.store_dir(tier, JOB))
    return [e for idx in sorted(where.glob(f"*{packs.INDEX_SUFFIX}")) for e in packs.read_index(idx)]


def _pack_bytes(tier: Path) -> int:
    return sum(p.stat().st_size for p in packs.packs_dir(chunks.store_dir(tier, JOB)).glob(f"*{packs.PACK_SUFFIX}"))


def test_a_compressed_shared_directory_reads_in_place_verifies_and_prefetches_bit_exact(daemon_factory: Any,
                                                                                       capsys: Any) -> None:
    a = daemon_factory("a", **{"shared.compression": "bg-zstd"}).start()
    state = _state(1)
    with Client(JOB, socket=a.socket) as c:
        c.save(1, state).wait("shared", timeout=60)
    local, shared = (layout.part_dir(t, JOB, 1, 0) for t in (a.local, a.shared))
    coded = [e for e in _entries(a.shared) if e.size]
    assert coded and all(e.length < e.size for e in coded), _entries(a.shared)
    assert any(not e.size for e in _entries(a.shared))  # the random bytes: kept as they are
    assert not any(e.size for e in _entries(a.local))  # the local tier never compresses
    assert _pack_bytes(a.shared) < 0.9 * _pack_bytes(a.local)
    assert read_data(shared) == read_data(local)
    chunks.verify_part(shared)  # verification decodes, then checks every block
    # What the step stores on each tier, a compressed chunk at what it takes there.
    assert cli(["--socket", str(a.socket), "gc"]) == 0  # a retention pass weighs every part
    capsys.readouterr()
    assert cli(["--socket", str(a.socket), "ls", JOB, "--json"]) == 0
    [listed] = json.loads(capsys.readouterr().out)["checkpoints"]
    assert listed["stored_local"] == listed["bytes"], listed
    assert listed["stored_shared"] == sum(e.length for e in _entries(a.shared)) < 0.9 * listed["bytes"], listed

    # Another node, nothing on its SSD: its trainer reads the shared directory in place, frames decoded.
    b = daemon_factory("b", **{"shared.dir": str(a.shared)}).start()
    with Client(JOB, socket=b.socket) as c:
        assert _equal(c.load(1), state)
    # Its prefetch copies the step back onto its SSD as the chunks' own bytes.
    with b.connection() as conn:
        assert conn.call("Prefetch", pb.PrefetchRequest(job=JOB, step=1)).parts == 1
    staged = layout.part_dir(b.local, JOB, 1, 0)
    chunks.verify_part(staged)
    assert not any(e.size for e in _entries(b.local)) and read_data(staged) == read_data(shared)
    with Client(JOB, socket=b.socket) as c:
        assert _equal(c.load(1), state)


def test_a_damaged_compressed_chunk_never_loads_and_is_named(daemon_factory: Any) -> None:
    a = daemon_factory("a", **{"shared.compression": "bg-zstd"}).start()
    state = _state(2)
    with Client(JOB, socket=a.socket) as c:
        c.save(2, state).wait("shared", timeout=60)
    shared = layout.part_dir(a.shared, JOB, 2, 0)
    ext = next(e for e in data_extents(shared) if e.coded and e.hi - e.lo >= 256 << 10)  # a chunk of a float tensor
    assert flip_data_byte(shared, (ext.lo + ext.hi) // 2) == ext.path
    with pytest.raises(layout.ChecksumMismatch) as bad:
        chunks.verify_part(shared)
    assert bad.value.path == ext.path
    b = daemon_factory("b", **{"shared.dir": str(a.shared)}).start()
    with Client(JOB, socket=b.socket) as c, pytest.raises(Exception) as failed:
        c.load(2)
    assert ext.path.name in str(failed.value), failed.value
    with Client(JOB, socket=a.socket) as c:
        assert _equal(c.load(2), state)  # node a's own copy is intact


def test_auto_compresses_behind_a_bandwidth_cap(daemon_factory: Any) -> None:
    """Capped at 8 MiB/s a write stream is far slower than the codec's savings are fast: "auto" (the default)
    keeps the chunks that shrink compressed, and the cap counts what is stored; the metrics show both."""
    port = free_port()
    a = daemon_factory("a", **{"shared.max_bandwidth": "8MiB/s", "metrics.listen": f"127.0.0.1:{port}"}).start()
    with Client(JOB, socket=a.socket) as c:
        for step in (1, 2, 3):
            c.save(step, _state(step)).wait("shared", timeout=60)
    store = chunks.store_dir(a.shared, JOB)
    coded = [e for e in _entries(a.shared) if e.size]
    would = [e for e in _entries(a.shared) if not e.size and codec.encode(chunks.read_chunk(store, e.name)) is not None]
    assert len(coded) >= 3 * len(would), (len(coded), len(would))  # all but the first few, before it measured
    for step in (1, 2, 3):
        chunks.verify_part(layout.part_dir(a.shared, JOB, step, 0))
    text = scrape(port)
    compressed = metric(text, "ckptstage_compression_chunks_total", tier="shared", kept="compressed")
    logical, stored = (metric(text, "ckptstage_compression_bytes_total", tier="shared", form=f)
                       for f in ("logical", "stored"))
    assert compressed == len(coded) and stored == sum(e.length for e in _entries(a.shared)) < 0.9 * logical
    assert 0 < metric(text, "ckptstage_compression_stream_bytes_per_second", tier="shared") <= 9 << 20
    assert metric(text, "ckptstage_compression_chunks_total", tier="local", kept="raw") == 0  # never compresses
