"""Compressed chunks on an object-store shared tier: the codec, the choice per chunk, and a real round trip.

The codec (:mod:`ckptstage.protos.codec`) must give back every byte of any
chunk, refuse a damaged frame, and keep a chunk that does not shrink as it
is. "auto" compresses only when that makes an upload finish sooner, from
what it measured. On a real SeaweedFS, with two daemons: node A drains
model-like state (fp32 and bf16 values) with ``compression = "bg-zstd"``, the
store holds fewer bytes than the chunks, and node B, which never saw the job,
loads every step back exactly; a flipped byte in a compressed object fails
the load naming the part, and nothing of it lands on B's disk.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ckptstage.protos import codec, packs

pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed")
torch = pytest.importorskip("torch")

from ckptstage.client import Client, errors  # noqa: E402
from ckptstage.daemon.launcher import DaemonProcess  # noqa: E402
from ckptstage.daemon.tiers.compression import PROBE_EVERY, Compression  # noqa: E402
from conftest import DEFAULTS  # noqa: E402
from s3server import BUCKET, S3Server, s3_server  # noqa: E402
from support import wait_until  # noqa: E402

_ = s3_server  # the session's server, a fixture
JOB = "squeezed"


def _weights(seed: int, dtype: Any, n: int = 1 << 18) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02).to(dtype).view(torch.uint8).numpy().tobytes()


# ------------------------------------------------------------------ the codec


@pytest.mark.parametrize("dtype,least", [(torch.float32, 1.12), (torch.bfloat16, 1.35)])
def test_byte_planes_of_float_weights_round_trip_and_shrink_more_than_plain_zstd(dtype: Any, least: float) -> None:
    raw = _weights(1, dtype)
    grouped, plain = codec.encode(raw), codec.encode(raw, grouped=False)
    assert grouped is not None and codec.decode(grouped) == raw and codec.decoded_size(grouped) == len(raw)
    assert len(raw) / len(grouped) >= least  # docs/BENCHMARKS.md: 1.19 on fp32 weights, 1.46 on bf16
    assert plain is None or (codec.decode(plain) == raw and len(plain) > len(grouped))


def test_what_does_not_shrink_is_kept_as_it_is_and_odd_sizes_round_trip() -> None:
    assert codec.encode(os.urandom(1 << 20)) is None  # noise: kept raw
    zeros = codec.encode(bytes(3 << 20))
    assert zeros is not None and len(zeros) < 1000 and codec.decode(zeros) == bytes(3 << 20)
    odd = (b"ckptstage " * 50_001)[:500_009]  # not a multiple of 2 or 4: plain zstd
    frame = codec.encode(odd)
    assert frame is not None and codec.decode(frame) == odd


def test_a_damaged_frame_is_refused_or_decodes_to_other_bytes_never_silently_to_the_chunk() -> None:
    raw = _weights(2, torch.float32)
    frame = codec.encode(raw)
    assert frame is not None
    for damaged in (frame[:len(frame) // 2], frame[:10], b"XXXX" + frame[4:], frame + b"\0"):
        with pytest.raises(codec.CodecError):
            codec.decode(damaged)
    flipped = bytearray(frame)
    flipped[len(flipped) - 100] ^= 0x40  # in the last plane's bytes
    try:
        assert codec.decode(bytes(flipped)) != raw  # the reader's check against the chunk's name catches it
    except codec.CodecError:
        pass


# ------------------------------------------------------------------ the choice


def test_auto_compresses_only_where_the_codec_outruns_the_upload() -> None:
    data = memoryview(_weights(3, torch.bfloat16))
    fast = Compression("auto")
    frame = fast.encode(data)
    assert frame is not None  # nothing measured yet: the first chunk probes
    assert fast.figures().stored_share == pytest.approx(len(frame) / len(data))  # what it saw, not a prior
    fast.sent(10 << 20, (10 << 20) / 20e9)  # a stream at 20 GB/s: no codec saves time there
    assert fast.pays() is False
    chosen = [fast.encode(data) is not None for _ in range(2 * PROBE_EVERY)]
    assert sum(chosen) == 2  # one probe in each PROBE_EVERY chunks keeps the figures current
    slow = Compression("auto")
    slow.encode(data)
    slow.sent(10 << 20, 1.0)  # 10 MiB/s
    assert slow.pays() is True and all(slow.encode(data) is not None for _ in range(5))
    assert Compression("none").encode(data) is None and Compression("bg-zstd").encode(data) is not None
    with pytest.raises(ValueError, match="compression must be one of"):
        Compression("lz4")


def test_behind_a_cap_that_binds_auto_compresses_once_the_codec_outruns_one_stream() -> None:
    """Writes that spend most of their time waiting for the tier's cap share a fixed rate: compressing pays as
    soon as the codec is faster than one stream (the others send while it compresses), though its savings
    alone would not outrun the stream. The same stream speed without the waits does not compress."""
    data = memoryview(_weights(4, torch.float32))
    for capped in (True, False):
        z = Compression("auto")
        z.encode(data)  # the probe: the codec's speed and the share it keeps, measured
        figures = z.figures()
        assert figures.codec_bytes_per_s is not None and figures.stored_share is not None
        codec_s = figures.codec_bytes_per_s
        # A stream a little slower than the codec, but faster than the codec's savings.
        stream = codec_s * (1 - figures.stored_share) * 2
        assert stream < codec_s
        seconds = (10 << 20) / stream
        z.sent(10 << 20, seconds, waited=0.8 * seconds if capped else 0.0)
        assert z.pays() is capped, (capped, z.figures())


# ------------------------------------------------------------------ a real store


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w32": torch.randn(1 << 18, generator=g) * 0.02,
            "w16": (torch.randn(1 << 18, generator=g) * 0.02).to(torch.bfloat16),
            "noise": torch.randint(0, 255, (1 << 16,), dtype=torch.uint8, generator=g), "step": step}


def _equal(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return all(torch.equal(got[k], want[k]) for k in ("w32", "w16", "noise")) and got["step"] == want["step"]


def _packed(server: S3Server, prefix: str) -> list[tuple[str, packs.Entry]]:
    """Every chunk in the packs of the job's store on the object store: (its pack's key, its index entry)."""
    client = server.client()
    where = f"{prefix}/{JOB}/chunks/packs/"
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=where, Delimiter="/").get("Contents", [])
    out = []
    for o in listed:
        if o["Key"].endswith(packs.INDEX_SUFFIX):
            raw = client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()
            pack = o["Key"][:-len(packs.INDEX_SUFFIX)] + packs.PACK_SUFFIX
            out += [(pack, e) for e in packs.decode_index(raw, Path(o["Key"]))]
    return out


def test_bg_zstd_on_the_store_holds_fewer_bytes_and_a_node_that_never_saw_the_job_loads_it_back(
        s3_server: S3Server, tmp_path: Path) -> None:
    prefix = "compressed"
    env = {**s3_server.env(), "AWS_MAX_ATTEMPTS": "2"}
    settings = {"shared.dir": "", "shared.url": f"s3://{BUCKET}/{prefix}", "shared.endpoint": s3_server.endpoint,
                "persist.incremental": True, "shared.compression": "bg-zstd", "persist.chunk_bytes": "256KiB"}
    a = DaemonProcess(tmp_path / "a", settings, defaults=DEFAULTS, env=env).start()
    b = DaemonProcess(tmp_path / "b", settings, defaults=DEFAULTS, env=env).start()
    try:
        with Client(JOB, socket=a.socket) as c:
            for step in (1, 2):
                c.save(step, _state(step)).wait("shared", timeout=60)
        entries = _packed(s3_server, prefix)
        squeezed = [(pack, e) for pack, e in entries if e.size]  # recorded per chunk in its pack's index
        logical = sum(e.size or e.length for _, e in entries)
        stored = sum(e.length for _, e in entries)
        assert squeezed and all(e.length < e.size for _, e in squeezed)
        assert len(squeezed) < len(entries)  # the noise stays as it is
        assert stored < 0.85 * logical, (stored, logical)
        with Client(JOB, socket=b.socket) as reader:
            wait_until(lambda: [i.step for i in reader.list() if i.complete] == [1, 2], 20, "B listing the store")
            assert _equal(reader.load(step=2), _state(2))
            # A flipped byte in one of step 1's compressed chunks, in its pack.
            client = s3_server.client()
            key, entry = next((k, e) for k, e in squeezed if e.name not in _fetched(b.local))
            body = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
            body[entry.offset + entry.length // 2] ^= 0x01
            client.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))
            with pytest.raises(errors.CkptStageError, match=rf"{JOB} step 1 rank 0") as caught:
                reader.load(step=1)
            assert entry.name in str(caught.value)  # the chunk, by name
    finally:
        a.stop()
        b.stop()


def _fetched(local: Path) -> set[str]:
    """The chunk names B's local tier holds (fetched for step 2)."""
    from ckptstage.daemon.tiers.fs import FsTier

    return set(FsTier(local).list_chunks(JOB))


def test_the_documented_decoder_reads_a_frame_without_ckptstage() -> None:
    """``decoded`` of docs/FORMAT.md's boto3 block, run verbatim (with the block's imports), on frames of every
    grouping; tests/test_s3_docs.py runs the whole block against a drained step."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "FORMAT.md").read_text()
    block = text[text.index("With boto3,"):].split("```python\n", 1)[1].split("```", 1)[0]
    imports = "\n".join(line for line in block.splitlines() if line.startswith(("import ", "from ")))
    function = block[block.index("def decoded("):].split("\n\n\n", 1)[0]
    scope: dict[str, Any] = {}
    exec(imports + "\n" + function, scope)  # noqa: S102 - the documentation's own code
    for raw in (_weights(4, torch.float32), _weights(5, torch.bfloat16), bytes(1 << 20),
                (b"odd bytes " * 9_999)[:99_991]):
        frame = codec.encode(raw)
        assert frame is not None and scope["decoded"](frame) == raw
