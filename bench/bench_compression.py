"""What compressing checkpoint data would buy per tier: ratios and throughputs on real model states.

    .venv/bin/python bench/bench_compression.py                     # ~3 min on 2 cores
    .venv/bin/python bench/bench_compression.py --sample-mib 0                      # whole states, ~6 min
    .venv/bin/python bench/bench_compression.py --steps 2 --repeats 1 --sample-mib 64   # a quick look
    .venv/bin/python bench/bench_compression.py --dir /local_ssd/x --json out.json

States (nothing downloaded): GPT-2 124M built from ``GPT2Config()``, trained
``--steps`` AdamW steps (lr 6e-4, weight decay 0.1) on random tokens so the
weights have left their exact init distribution, then

* ``weights-fp32``  its parameters (the tied head stored once), fp32;
* ``weights-bf16``  the same parameters cast to bf16;
* ``exp_avg``, ``exp_avg_sq``  AdamW's moments (fp32).

Each state is laid out as ckptstage's data file holds it (tensors back to
back) and cut into ``--chunk-mib`` chunks (64 MiB, the daemon's unit); to fit
in a few minutes on 2 cores, ``--sample-mib`` (256) of them, spread evenly from
the first chunk to the last, are measured (``--sample-mib 0``: all). Codecs,
each chunk an independent frame:

* ``memcpy``       a copy into a fresh buffer (the floor: what "no codec" costs);
* ``lz4``          ``lz4.block`` fast mode (acceleration 1);
* ``zstd-1``, ``zstd-3``  ``zstandard`` at levels 1 and 3;
* ``bg-zstd-1``    byte-grouped: the chunk's elements split into byte planes
                   (byte 0 of every element, then byte 1, ...; 2 planes for
                   bf16, 4 for fp32), each plane compressed by zstd -1 (the idea
                   behind ZipNN: exponent bytes are skewed, mantissa bytes are noise);
* ``bg-zstd-1-skip``  the same, but a plane whose first 256 KiB does not shrink
                   by at least 5% under zstd -1 is stored raw (only the
                   exponent-carrying planes pay for the codec).

Per state x codec: ratio (uncompressed / compressed bytes), compress and
decompress throughput in GB/s (1e9 bytes/s) of *uncompressed* bytes, with 1
thread and with ``--threads`` threads (a pool over chunks; both libraries release
the GIL), medians of ``--repeats`` rounds, codecs round-robin within a round.
Every decompressed chunk is compared with its original, byte for byte, after each
timed round (an ``AssertionError`` otherwise). ``zstd-1`` is also run on 1 MiB
blocks to show what block size does.

Buffers: on this VM a fresh 64 MiB allocation costs a host page fault per page
(see ``_harness.settle``), which would dominate every codec. A daemon compresses
into buffers it reuses, so the process keeps freed heap memory
(``mallopt``: no mmap for large blocks, no trim) and outputs land in warm pages;
one extra row (``zstd-1 fresh buffers``) shows the cost of not doing that.

Disk: ``dd oflag=direct conv=fsync`` writes and ``dd iflag=direct`` reads of
``--dd-gib`` in ``--dir`` (medians), then per tier (that disk, and shared tiers of
1 GB/s and 200 MB/s) the drain rate in uncompressed bytes with each codec,
``min(C, r * B)`` (compressor throughput C, ratio r, tier bandwidth B; compression
overlapped with I/O), and the restore rate ``min(D, r * R)``. Not a test.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lz4.block
import numpy as np
import zstandard

import _harness as h

GB = 1e9
SKIP_PROBE = 256 << 10
SKIP_MIN_RATIO = 1.05
SHARED_TIERS = {"shared 1 GB/s": 1.0 * GB, "shared 200 MB/s": 0.2 * GB}

# glibc mallopt parameters
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
DEFAULT_MMAP_THRESHOLD = 128 << 10


def keep_heap_warm(on: bool) -> None:
    """Large blocks from the heap, freed memory kept (``on``), or glibc's default mmap per block.

    One arena for every thread: a thread's own arena is at most 64 MiB, so a
    64 MiB output in a worker thread would be freshly mapped every time.
    """
    libc = ctypes.CDLL("libc.so.6")
    if on:
        libc.mallopt(M_ARENA_MAX, 1)
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1)
    else:
        libc.mallopt(M_MMAP_THRESHOLD, DEFAULT_MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_MMAP_THRESHOLD)


def prefault_heap(nbytes: int, block: int) -> None:
    """Grows the heap by ``nbytes`` of written pages and frees them: later outputs reuse warm memory."""
    held = [bytearray(block) for _ in range(max(1, nbytes // block))]
    for b in held:
        b[::4096] = b"\1" * len(range(0, block, 4096))
    del held


# ------------------------------------------------------------------ states


@dataclass
class State:
    name: str
    data: np.ndarray  # uint8, the tensors back to back
    itemsize: int

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def gpt2_states(steps: int, batch: int, seq: int) -> tuple[list[State], str]:
    """GPT-2 124M after ``steps`` AdamW steps on random tokens: weights fp32 and bf16, both moments."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())
    params = list(model.parameters())  # the tied head is wte: stored once, as a checkpoint does
    opt = torch.optim.AdamW(params, lr=6e-4, weight_decay=0.1)
    with h.Timer() as t:
        for _ in range(steps):
            ids = torch.randint(0, model.config.vocab_size, (batch, seq))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    note = (f"GPT-2 124M, {sum(p.numel() for p in params) / 1e6:.1f} M parameters, {steps} AdamW steps "
            f"(batch {batch} x {seq} random tokens) in {t.s:.0f} s")

    def flat(tensors: Sequence[Any]) -> np.ndarray:
        return torch.cat([x.detach().contiguous().view(-1).view(torch.uint8) for x in tensors]).numpy()

    with torch.no_grad():
        states = [State("weights-fp32", flat(params), 4),
                  State("weights-bf16", flat([p.to(torch.bfloat16) for p in params]), 2),
                  State("exp_avg", flat([opt.state[p]["exp_avg"] for p in params]), 4),
                  State("exp_avg_sq", flat([opt.state[p]["exp_avg_sq"] for p in params]), 4)]
    return states, note


def chunks_of(data: np.ndarray, size: int) -> list[np.ndarray]:
    return [data[i:i + size] for i in range(0, data.nbytes, size)]


def sample_chunks(data: np.ndarray, chunk: int, sample_bytes: int) -> list[np.ndarray]:
    """``chunk``-sized pieces spread evenly over the whole state, about ``sample_bytes`` in all (0 = every piece)."""
    pieces = chunks_of(data, chunk)
    k = len(pieces) if not sample_bytes else max(1, min(len(pieces), round(sample_bytes / chunk)))
    return [pieces[i] for i in sorted({round(x) for x in np.linspace(0, len(pieces) - 1, k)})]


# ------------------------------------------------------------------ codecs


class Codec:
    """One chunk in, one opaque frame out, and back; ``size`` = the frame's bytes on disk."""

    name = ""

    def compress(self, chunk: np.ndarray, itemsize: int) -> Any:
        raise NotImplementedError

    def decompress(self, frame: Any, nbytes: int, itemsize: int) -> Any:
        raise NotImplementedError

    def size(self, frame: Any) -> int:
        return len(frame)


class Memcpy(Codec):
    name = "memcpy"

    def compress(self, chunk: np.ndarray, itemsize: int) -> Any:
        return chunk.tobytes()

    def decompress(self, frame: Any, nbytes: int, itemsize: int) -> Any:
        return bytearray(frame)  # a copy (bytes(frame) would hand back the same object)


class Lz4(Codec):
    name = "lz4"

    def compress(self, chunk: np.ndarray, itemsize: int) -> Any:
        return lz4.block.compress(chunk, mode="fast", store_size=False)

    def decompress(self, frame: Any, nbytes: int, itemsize: int) -> Any:
        return lz4.block.decompress(frame, uncompressed_size=nbytes)


class Zstd(Codec):
    """zstd at ``level``; a compressor per thread (a ``ZstdCompressor`` is not for concurrent use)."""

    def __init__(self, level: int) -> None:
        self.level = level
        self.name = f"zstd-{level}"
        self._local = threading.local()

    def _c(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = zstandard.ZstdCompressor(level=self.level)
        return c

    def _d(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "d", None)
        if d is None:
            d = self._local.d = zstandard.ZstdDecompressor()
        return d

    def compress(self, chunk: np.ndarray, itemsize: int) -> Any:
        return self._c().compress(chunk.data)

    def decompress(self, frame: Any, nbytes: int, itemsize: int) -> Any:
        return self._d().decompress(frame, max_output_size=nbytes)


class ByteGrouped(Zstd):
    """Byte planes of the elements, each a zstd frame; with ``skip``, planes that do not shrink are stored raw."""

    def __init__(self, level: int, skip: bool) -> None:
        super().__init__(level)
        self.skip = skip
        self.name = f"bg-zstd-{level}" + ("-skip" if skip else "")

    def compress(self, chunk: np.ndarray, itemsize: int) -> Any:
        planes = chunk.reshape(-1, itemsize).T.copy()  # row i = byte i of every element
        c = self._c()
        frames: list[tuple[bool, bytes]] = []
        for plane in planes:
            if self.skip and len(c.compress(plane[:SKIP_PROBE].data)) * SKIP_MIN_RATIO > min(SKIP_PROBE, plane.nbytes):
                frames.append((False, plane.tobytes()))
            else:
                frames.append((True, c.compress(plane.data)))
        return frames

    def decompress(self, frame: Any, nbytes: int, itemsize: int) -> Any:
        out = np.empty(nbytes, np.uint8)
        elements = out.reshape(-1, itemsize)
        d = self._d()
        for i, (packed, data) in enumerate(frame):
            raw = d.decompress(data, max_output_size=nbytes // itemsize) if packed else data
            elements[:, i] = np.frombuffer(raw, np.uint8)
        return out

    def size(self, frame: Any) -> int:
        return sum(len(data) for _, data in frame)


def codecs() -> list[Codec]:
    return [Memcpy(), Lz4(), Zstd(1), Zstd(3), ByteGrouped(1, skip=False), ByteGrouped(1, skip=True)]


# ------------------------------------------------------------------ measuring


@dataclass
class Result:
    state: str
    codec: str
    block: int
    threads: int
    nbytes: int
    stored: int = 0
    comp_s: list[float] = field(default_factory=list)
    decomp_s: list[float] = field(default_factory=list)
    loads: list[tuple[float, float, float]] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.nbytes / self.stored if self.stored else math.nan

    @property
    def comp_gbs(self) -> float:
        return self.nbytes / h.median(self.comp_s) / GB

    @property
    def decomp_gbs(self) -> float:
        return self.nbytes / h.median(self.decomp_s) / GB


def same(a: Any, b: np.ndarray) -> bool:
    return memoryview(a).cast("B") == b.data


def measure_once(codec: Codec, state: State, chunks: list[np.ndarray], pool: ThreadPoolExecutor | None,
                 result: Result) -> None:
    """One round: compress every chunk (timed), decompress every frame (timed), then verify each bit-exactly."""
    def comp(c: np.ndarray) -> Any:
        return codec.compress(c, state.itemsize)

    def decomp(fc: tuple[Any, np.ndarray]) -> Any:
        return codec.decompress(fc[0], fc[1].nbytes, state.itemsize)

    run: Callable[..., list[Any]] = (lambda f, xs: list(pool.map(f, xs))) if pool else (lambda f, xs: list(map(f, xs)))
    result.loads.append(h.load())
    with h.Timer() as tc:
        frames = run(comp, chunks)
    with h.Timer() as td:
        outs = run(decomp, list(zip(frames, chunks)))
    for out, chunk in zip(outs, chunks):
        assert same(out, chunk), f"{codec.name} on {state.name}: a chunk did not round-trip"
    stored = sum(codec.size(f) for f in frames)
    assert result.stored in (0, stored), f"{codec.name} on {state.name}: sizes differ between rounds"
    result.stored = stored
    result.comp_s.append(tc.s)
    result.decomp_s.append(td.s)


def measure_state(state: State, regions: list[np.ndarray], cs: list[Codec], block: int, threads: int,
                  repeats: int, pools: dict[int, ThreadPoolExecutor]) -> list[Result]:
    """Every codec on ``regions`` (parts of ``state``) cut into ``block``-sized frames, 1 and ``threads`` threads."""
    chunks = [c for r in regions for c in chunks_of(r, block)]
    nbytes = sum(c.nbytes for c in chunks)
    results = {(c.name, t): Result(state.name, c.name, block, t, nbytes) for c in cs for t in (1, threads)}
    for _ in range(repeats):
        for c in cs:  # round-robin: load noise spreads over every codec alike
            for t in dict.fromkeys((1, threads)):
                measure_once(c, state, chunks, pools.get(t), results[(c.name, t)])
    return list(results.values())


def fresh_buffer_row(state: State, chunks: list[np.ndarray], block: int, repeats: int) -> Result:
    """zstd-1, one thread, with glibc's default allocation (every 64 MiB output freshly mapped)."""
    keep_heap_warm(False)
    try:
        r = Result(state.name, "zstd-1 fresh buffers", block, 1, sum(c.nbytes for c in chunks))
        for _ in range(repeats):
            measure_once(Zstd(1), state, chunks, None, r)
        return r
    finally:
        keep_heap_warm(True)


# ------------------------------------------------------------------ the disk

_DD_RE = re.compile(r"^(\d+) bytes .* copied, ([0-9.]+) s", re.MULTILINE)


def dd_read_direct(path: Path, bs: int = 64 * h.MiB) -> float:
    """Bytes/s of ``dd if=path iflag=direct bs=64M of=/dev/null``."""
    out = subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={bs}", "iflag=direct"],
                         capture_output=True, text=True, check=True)
    m = _DD_RE.search(out.stderr)
    assert m is not None, out.stderr
    return int(m.group(1)) / float(m.group(2))


def disk_bandwidth(directory: Path, nbytes: int, repeats: int) -> tuple[float, float, list[float], list[float]]:
    """Median write (``dd oflag=direct conv=fsync``) and read (``dd iflag=direct``) bandwidth, bytes/s."""
    writes = [h.dd_fsync(directory, nbytes, direct=True).bandwidth for _ in range(repeats)]
    path = directory / f".ckptbench-ddread-{os.getpid()}"
    count = max(1, nbytes // (64 * h.MiB))
    subprocess.run(["dd", "if=/dev/urandom", f"of={path}", "bs=64M", f"count={count}", "oflag=direct",
                    "conv=fsync"], capture_output=True, check=True)
    try:
        reads = [dd_read_direct(path) for _ in range(repeats)]
    finally:
        path.unlink(missing_ok=True)
    return h.median(writes), h.median(reads), writes, reads


# ------------------------------------------------------------------ reporting


def load_range(rs: Sequence[Result]) -> str:
    ones = [lo[0] for r in rs for lo in r.loads]
    return f"{min(ones):.2f}-{max(ones):.2f}" if ones else "-"


def print_state_table(state: State, rs: list[Result], threads: int) -> None:
    by = {(r.codec, r.threads): r for r in rs}
    names = list(dict.fromkeys(r.codec for r in rs))
    print(f"\n{state.name}: {rs[0].nbytes / h.MiB:.0f} of {state.nbytes / h.MiB:.0f} MiB, in "
          f"{rs[0].block / 1024:.0f} KiB frames; 1-min load {load_range(rs)} (now {h.load()})")
    print(f"  {'codec':22} {'ratio':>6}  {'comp 1T':>8} {f'comp {threads}T':>8}  {'dec 1T':>8} {f'dec {threads}T':>8}"
          f"   GB/s of uncompressed bytes; comp 1T runs (s)")
    for n in names:
        r1, rt = by[(n, 1)], by.get((n, threads))
        comp_t = f"{rt.comp_gbs:8.2f}" if rt and rt is not r1 else f"{'':8}"
        dec_t = f"{rt.decomp_gbs:8.2f}" if rt and rt is not r1 else f"{'':8}"
        runs = " ".join(f"{x:.3f}" for x in r1.comp_s)
        print(f"  {n:22} {r1.ratio:6.3f}  {r1.comp_gbs:8.2f} {comp_t}  {r1.decomp_gbs:8.2f} {dec_t}   {runs}")


@dataclass
class Mix:
    """A set of states taken together: bytes-weighted ratio and throughput."""

    name: str
    codec: str
    threads: int
    nbytes: int
    stored: int
    comp_s: float
    decomp_s: float

    @property
    def ratio(self) -> float:
        return self.nbytes / self.stored

    @property
    def comp(self) -> float:
        return self.nbytes / self.comp_s

    @property
    def decomp(self) -> float:
        return self.nbytes / self.decomp_s


def mix(name: str, rs: list[Result], sizes: dict[str, int], states: Sequence[str], codec: str,
        threads: int) -> Mix:
    """The states together, each sample scaled to its whole state's bytes."""
    sel = [r for r in rs if r.state in states and r.codec == codec and r.threads == threads and r.block == rs[0].block]
    assert len(sel) == len(states), (name, codec, threads)
    k = {r.state: sizes[r.state] / r.nbytes for r in sel}
    return Mix(name, codec, threads, sum(sizes[r.state] for r in sel), round(sum(r.stored * k[r.state] for r in sel)),
               sum(h.median(r.comp_s) * k[r.state] for r in sel), sum(h.median(r.decomp_s) * k[r.state] for r in sel))


def print_tiers(mixes: list[Mix], tiers: dict[str, tuple[float, float]]) -> None:
    """Drain ``min(C, r*B)`` and restore ``min(D, r*R)`` per tier, in GB/s of uncompressed bytes."""
    print("\nPer tier, GB/s of uncompressed bytes moved (compression overlapped with I/O):")
    print("  drain = min(compress GB/s, ratio x tier write); restore = min(decompress GB/s, ratio x tier read)")
    for mix_name in dict.fromkeys(m.name for m in mixes):
        ms = [m for m in mixes if m.name == mix_name]
        print(f"\n  {mix_name}")
        head = "".join(f"  {t[:18]:>18}" for t in tiers)
        print(f"  {'codec':16} {'thr':>3} {'ratio':>6}{head}")
        print(f"  {'':16} {'':>3} {'':>6}" + "".join(f"  {'drain':>8} {'restore':>9}" for _ in tiers))
        for m in ms:
            cells = ""
            for w, r in tiers.values():
                cells += f"  {min(m.comp, m.ratio * w) / GB:8.2f} {min(m.decomp, m.ratio * r) / GB:9.2f}"
            print(f"  {m.codec:16} {m.threads:>3} {m.ratio:6.3f}{cells}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="AdamW steps before measuring (default 20)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="rounds per measurement; medians reported")
    ap.add_argument("--threads", type=int, default=2, help="pool size for the multi-thread columns")
    ap.add_argument("--chunk-mib", type=int, default=64)
    ap.add_argument("--block-kib", type=int, default=1024, help="the small-block run of zstd-1")
    ap.add_argument("--sample-mib", type=int, default=256,
                    help="measure this many MiB per state, in chunks spread over all of it (0 = whole states)")
    ap.add_argument("--dir", type=Path, default=None, help="where dd measures the local disk (default /tmp)")
    ap.add_argument("--dd-gib", type=float, default=1.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    keep_heap_warm(True)
    info = h.machine_info(args.dir or Path("/tmp"))
    h.print_machine(info)
    print(f"zstandard {zstandard.__version__} (libzstd {'.'.join(map(str, zstandard.ZSTD_VERSION))}), "
          f"lz4 {lz4.__version__} (liblz4 {lz4.library_version_string()}), numpy {np.__version__}")

    states, note = gpt2_states(args.steps, args.batch, args.seq)
    print(f"\n{note}; load {h.load()}")
    block = args.chunk_mib * h.MiB
    small = args.block_kib * 1024
    # room for one state's frames and its decompressed copies, plus a byte-grouped chunk's planes
    samples = {s.name: sample_chunks(s.data, block, args.sample_mib * h.MiB) for s in states}
    prefault_heap(2 * max(sum(c.nbytes for c in v) for v in samples.values()) + 4 * block, block)
    pools = {t: ThreadPoolExecutor(t) for t in {1, args.threads} if t > 1}
    results: list[Result] = []
    try:
        for s in states:
            rs = measure_state(s, samples[s.name], codecs(), block, args.threads, args.repeats, pools)
            if s.name == "weights-fp32":
                rs.append(fresh_buffer_row(s, samples[s.name], block, args.repeats))
            print_state_table(s, rs, args.threads)
            small_rs = measure_state(s, samples[s.name], [Zstd(1)], small, args.threads, args.repeats, pools)
            print_state_table(s, small_rs, args.threads)
            results += rs + small_rs
    finally:
        for p in pools.values():
            p.shutdown()

    directory = args.dir or Path("/tmp")
    with h.workdir(directory, "ckptbench-comp-") as d:
        w, r, ws, rs_ = disk_bandwidth(d, int(args.dd_gib * h.GiB), args.repeats)
    print(f"\nlocal disk ({directory}): dd oflag=direct conv=fsync {w / GB:.2f} GB/s "
          f"({' '.join(f'{x / GB:.2f}' for x in ws)}), dd iflag=direct {r / GB:.2f} GB/s "
          f"({' '.join(f'{x / GB:.2f}' for x in rs_)}); load {h.load()}")
    tiers = {"local disk": (w, r), **{k: (v, v) for k, v in SHARED_TIERS.items()}}
    main_rs = [x for x in results if x.block == block and not x.codec.endswith("fresh buffers")]
    groups = {"checkpoint: fp32 weights + exp_avg + exp_avg_sq": ["weights-fp32", "exp_avg", "exp_avg_sq"],
              "weights-bf16 alone": ["weights-bf16"], "weights-fp32 alone": ["weights-fp32"]}
    sizes = {s.name: s.nbytes for s in states}
    mixes = [mix(g, main_rs, sizes, names, c.name, t) for g, names in groups.items() for c in codecs()
             for t in dict.fromkeys((1, args.threads))]
    print_tiers(mixes, tiers)
    print(f"\nload at the end: {h.load()}")
    h.write_json(args.json, {"machine": info, "note": note, "disk": {"write": ws, "read": rs_},
                             "results": [{**r.__dict__, "ratio": r.ratio, "comp_gbs": r.comp_gbs,
                                          "decomp_gbs": r.decomp_gbs} for r in results]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
