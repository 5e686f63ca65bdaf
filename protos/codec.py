"""Compressed chunks: zstd, or zstd over byte planes for floating-point data, in a small self-describing frame.

A chunk is named by the xxh3-128 of its bytes as saved; a tier may keep it
compressed (the object store does, by ``[shared] compression``), and every
reader checks the *decoded* bytes against the name. The frame:

    magic "CKZ1" | version u8 = 1 | group u8 | 2 bytes zero | length u64 |
    group x (kind u8, stored length u64) | the planes' bytes, back to back

(little-endian). ``length`` is the chunk's decoded size. With ``group`` g > 1
the chunk's bytes are split into g planes: plane i holds byte i of every
g-byte element (the exponent bytes of bf16 or fp32 values are skewed, their
mantissa bytes are noise: zstd's entropy coder gains on the first and
nothing on the second, so grouping doubles what it saves on model states;
docs/BENCHMARKS.md, "Compression: what it would buy"). A plane whose sample
does not shrink by :data:`MIN_GAIN` is stored as it is (kind 0), the others
as one zstd frame each (kind 1). g = 1 is plain zstd of the whole chunk.

:func:`encode` picks g from 1, 2 and 4 by compressing a sample of each
choice, so nothing about the tensor's dtype needs to reach the tier; a chunk
that no choice shrinks comes back ``None`` (keep it as it is).
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import zstandard

MAGIC = b"CKZ1"
VERSION = 1
LEVEL = 1                # zstd -1: level 3 saves nothing more on model states at 60% of the speed
SAMPLE = 256 << 10       # bytes of a plane compressed to judge it
MIN_GAIN = 0.05          # a plane (or chunk) kept compressed saves at least this share of its bytes
GROUPS = (1, 2, 4)       # byte groupings tried: none, 16-bit and 32-bit elements
_HEAD = struct.Struct("<4sBB2xQ")
_PLANE = struct.Struct("<BQ")
RAW, ZSTD = 0, 1


class CodecError(ValueError):
    """A frame that cannot be decoded (damaged, or not a frame)."""


_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    c = getattr(_local, "c", None)
    if c is None:
        c = _local.c = zstandard.ZstdCompressor(level=LEVEL)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


def _planes(data: memoryview, group: int) -> list[memoryview]:
    if group == 1:
        return [data]
    split = np.frombuffer(data, dtype=np.uint8).reshape(-1, group).T.copy()
    return [memoryview(split[i]) for i in range(group)]


def _sampled(data: memoryview, group: int) -> list[float]:
    """Per plane of ``data`` grouped by ``group``, the share of its first bytes (:data:`SAMPLE` in all) that
    zstd keeps."""
    head = data[:SAMPLE - SAMPLE % group]
    return [len(_compressor().compress(p)) / max(1, len(p)) for p in _planes(head, group)]


def encode(data: memoryview | bytes, grouped: bool = True) -> bytes | None:
    """``data`` as a frame, or None when compressing would save less than :data:`MIN_GAIN` of it. ``grouped``:
    try byte planes (else plain zstd)."""
    data = memoryview(data).cast("B")
    n = len(data)
    choices = [g for g in (GROUPS if grouped else (1,)) if n % g == 0]
    samples = {g: _sampled(data, g) for g in choices}
    kept = {g: sum(min(1.0, r) for r in s) / g for g, s in samples.items()}  # a plane that grows goes raw
    group = min(kept, key=lambda g: kept[g])
    if kept[group] > 1 - MIN_GAIN:
        return None
    stored: list[tuple[int, bytes | memoryview]] = []
    for plane, ratio in zip(_planes(data, group), samples[group]):
        packed = _compressor().compress(plane) if ratio <= 1 - MIN_GAIN else None
        stored.append((ZSTD, packed) if packed is not None and len(packed) < len(plane) else (RAW, plane))
    head = _HEAD.pack(MAGIC, VERSION, group, n) + b"".join(_PLANE.pack(kind, len(b)) for kind, b in stored)
    if len(head) + sum(len(b) for _, b in stored) > n * (1 - MIN_GAIN):
        return None
    return b"".join([head, *(b for _, b in stored)])


def decoded_size(frame: bytes | memoryview) -> int:
    """The decoded size a frame declares (its header only)."""
    return _header(frame)[1]


def _header(frame: bytes | memoryview) -> tuple[int, int]:
    """The frame's group and decoded length, checked."""
    if len(frame) < _HEAD.size:
        raise CodecError(f"a compressed chunk of {len(frame)} bytes is shorter than its header")
    magic, version, group, n = _HEAD.unpack_from(frame)
    if magic != MAGIC or version != VERSION or group not in GROUPS:
        raise CodecError(f"not a version {VERSION} compressed chunk (magic {magic!r}, version {version}, "
                         f"group {group})")
    return group, n


def decode(frame: bytes | bytearray | memoryview) -> bytes | memoryview:
    """The chunk's bytes; raises :class:`CodecError` when the frame does not hold them whole."""
    frame = memoryview(frame).cast("B")
    group, n = _header(frame)
    if n % group:
        raise CodecError(f"a compressed chunk of {n} bytes cannot be in {group}-byte elements")
    planes = _planes_of(frame, group)
    end = _HEAD.size + group * _PLANE.size + sum(len(b) for _, b in planes)
    if end != len(frame):
        raise CodecError(f"a compressed chunk has {len(frame) - end} bytes past its last plane")
    if group == 1:
        return _decoded(planes[0], 0, n)
    out = np.empty((n // group, group), dtype=np.uint8)  # plane i goes into column i: the elements again
    for i, (kind, body) in enumerate(planes):
        out[:, i] = np.frombuffer(_decoded((kind, body), i, n // group), dtype=np.uint8)
    return out.data.cast("B")


def _planes_of(frame: memoryview, group: int) -> list[tuple[int, memoryview]]:
    """Each plane's kind and stored bytes, as the header lists them."""
    pos = _HEAD.size + group * _PLANE.size
    out = []
    for i in range(group):
        kind, size = _PLANE.unpack_from(frame, _HEAD.size + i * _PLANE.size)
        body = frame[pos:pos + size]
        pos += size
        if len(body) != size:
            raise CodecError(f"a compressed chunk ends inside plane {i} ({len(frame)} bytes)")
        out.append((kind, body))
    return out


def _decoded(plane: tuple[int, memoryview], i: int, size: int) -> bytes | memoryview:
    """Plane ``i``'s bytes (``size`` of them), decompressed when it was."""
    kind, body = plane
    try:
        got: bytes | memoryview | None = body if kind == RAW else \
            _decompressor().decompress(body, max_output_size=size) if kind == ZSTD else None
    except zstandard.ZstdError as e:
        raise CodecError(f"plane {i} of a compressed chunk does not decompress: {e}") from None
    if got is None or len(got) != size:
        raise CodecError(f"plane {i} of a compressed chunk holds {0 if got is None else len(got)} bytes, "
                         f"not {size} (kind {kind})")
    return got
