"""The measurements behind two design choices, re-runnable in one command.

1. Which checksum: per-chunk checksums are computed by the daemon while it
   writes and by the client while it restores. Candidates, same buffer, same
   run: xxh3-64 and xxh3-128 (``xxhash``, what ckptstage uses), CRC32
   (``zlib``), BLAKE2b and SHA-256 (``hashlib``), and CRC32C and BLAKE3 when
   their packages are installed.
2. How to write: the persister's pattern (64 MiB ``pwrite``s from page-aligned
   shared memory, two writer threads, one fsync at the end) through the page
   cache vs with ``O_DIRECT``, next to ``dd ... conv=fsync`` on the same
   directory.

    .venv/bin/python bench/bench_io_choices.py [--dir DIR] [--gib 1]
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import re
import subprocess
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import xxhash

MiB = 1 << 20
CHUNK = 64 * MiB


def checksum_candidates() -> dict[str, Callable[[bytes], object]]:
    algos: dict[str, Callable[[bytes], object]] = {
        "xxh3_64 (xxhash)": xxhash.xxh3_64_intdigest,
        "xxh3_128 (xxhash)": xxhash.xxh3_128_intdigest,
        "crc32 (zlib)": zlib.crc32,
        "blake2b (hashlib)": lambda b: hashlib.blake2b(b).digest(),
        "sha256 (hashlib)": lambda b: hashlib.sha256(b).digest(),
    }
    try:
        import google_crc32c  # type: ignore[import-not-found]

        algos["crc32c (google-crc32c)"] = google_crc32c.value
    except ImportError:
        pass
    try:
        import blake3  # type: ignore[import-not-found]

        algos["blake3"] = lambda b: blake3.blake3(b).digest()
    except ImportError:
        pass
    return algos


def bench_checksums(nbytes: int) -> None:
    # Distinct bytes objects: every candidate accepts them, and none is timed copying.
    chunks = [os.urandom(MiB) * (CHUNK // MiB) for _ in range(max(1, nbytes // CHUNK))]
    total = sum(len(c) for c in chunks)
    print(f"\nchecksum throughput over {total / MiB:.0f} MiB in {CHUNK // MiB} MiB chunks (best of 3)")
    results = {}
    for name, fn in checksum_candidates().items():
        best = min(_time(lambda: [fn(c) for c in chunks]) for _ in range(3))
        results[name] = total / best / 1e9
    ref = results["xxh3_64 (xxhash)"]
    for name, gbs in sorted(results.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<24} {gbs:7.2f} GB/s   {gbs / ref:5.2f}x xxh3_64")


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def write_like_the_persister(directory: Path, src: memoryview, direct: bool, workers: int = 2) -> float:
    """64 MiB pwrites from ``src`` by ``workers`` threads, fallocate first, one fsync; returns seconds."""
    path = directory / f"persist-{'direct' if direct else 'buffered'}.bin"
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.posix_fallocate(fd, 0, len(src))
    wfd = os.open(path, os.O_WRONLY | os.O_DIRECT) if direct else fd
    offsets = list(range(0, len(src), CHUNK))

    def work(k: int) -> None:
        for off in offsets[k::workers]:
            view = src[off:off + CHUNK]
            while view:
                n = os.pwrite(wfd, view, off)
                view, off = view[n:], off + n

    threads = [threading.Thread(target=work, args=(k,)) for k in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    os.fsync(fd)
    if wfd != fd:
        os.close(wfd)
    os.close(fd)
    elapsed = time.perf_counter() - t0
    path.unlink()
    return elapsed


def dd_fsync(directory: Path, nbytes: int) -> float:
    path = directory / "dd.bin"
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={nbytes // CHUNK}", "conv=fsync"],
                   check=True, capture_output=True)
    elapsed = time.perf_counter() - t0
    path.unlink()
    return elapsed


def bench_writes(directory: Path, nbytes: int, repeats: int) -> None:
    src_map = mmap.mmap(-1, nbytes)  # page-aligned, like the arena
    for off in range(0, nbytes, CHUNK):
        src_map[off:off + CHUNK] = os.urandom(MiB) * (CHUNK // MiB)
    src = memoryview(src_map)
    print(f"\nwrite {nbytes / MiB:.0f} MiB + fsync into {directory} (best of {repeats}; load {os.getloadavg()[0]:.2f})")
    runs = {"dd conv=fsync (peer)": [dd_fsync(directory, nbytes) for _ in range(repeats)],
            "pwrite, page cache": [write_like_the_persister(directory, src, False) for _ in range(repeats)],
            "pwrite, O_DIRECT": [write_like_the_persister(directory, src, True) for _ in range(repeats)]}
    dd = min(runs["dd conv=fsync (peer)"])
    for name, times in runs.items():
        best = min(times)
        print(f"  {name:<22} {best:6.2f} s  {nbytes / best / 1e9:5.2f} GB/s  {dd / best:5.2f}x dd"
              f"   (all: {', '.join(f'{t:.2f}' for t in times)})")
    src.release()
    src_map.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=None, help="directory on the disk to measure (default: /tmp)")
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    nbytes = int(args.gib * (1 << 30)) // CHUNK * CHUNK
    bench_checksums(min(nbytes, 512 * MiB))
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="ckptstage-io-") as tmp:
        bench_writes(Path(tmp), nbytes, args.repeats)
    model = Path("/proc/cpuinfo").read_text()
    cpu = re.search(r"model name\s*:\s*(.*)", model)
    print(f"\nmachine: {os.cpu_count()} cores, {cpu.group(1) if cpu else 'unknown cpu'}, {os.uname().release}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
