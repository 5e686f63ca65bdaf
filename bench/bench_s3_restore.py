"""Restore from an S3-compatible object store on a node that never saw the job, next to ``aws s3 cp``'s
engine and ``torch.load``, in one run.

    .venv/bin/python bench/bench_s3_restore.py                        # 512 MiB and 1 GiB, 3 rounds
    .venv/bin/python bench/bench_s3_restore.py --gib 1 --rounds 5

One SeaweedFS on loopback (``tests/s3server.py``, as ``bench_s3.py`` starts it)
per run. For each state size a writer daemon saves the state and drains it to
``s3://<bucket>/bench`` (untimed), then stops: from then on the object store
holds the only copy. Each round then times, in a rotating order:

* ``prefetch``        ``Prefetch`` of the step's part by a second daemon that
                      never saw the job: the part copied from the store onto its
                      local tier (ranged GETs, every block checked, written
                      O_DIRECT and synced);
* ``load``            ``Client.load()`` against such a daemon, end to end: Locate
                      names the part only the store holds, the daemon fetches it
                      as above, the client reads the local copy into tensors.
                      The daemon's own fetch time (its log line) is split out;
* ``download_file``   s3transfer's ``download_file`` of the part's data object to
                      a file on the same disk (``aws s3 cp``'s engine, its
                      defaults: 8 MiB ranges, 10 at once; written through the
                      page cache and not synced, as ``aws s3 cp`` leaves it; the
                      fsync it would need to be durable is timed after, apart);
* ``download_file tuned`` the same with the daemon's read shape (8 MiB ranges,
                      8 at once);
* ``get_object``      one GET of the object, streamed into a file;
* ``torch.load``      of a ``torch.save`` file of the same state on the same disk:
                      "the read once it is local".

Cold every time: each daemon measurement uses a fresh second daemon with an
empty local tier of its own (started, and shown the step, before the clock
starts; stopped and its directory removed after), every peer's file is removed
after its run, and the store's own files (SeaweedFS's volumes) and the
``torch.save`` file are evicted from the page cache before every measurement.
CPU seconds of the mover (the daemon, or this process for the SDK peers) and
of the store's processes are recorded with each run: on 2 cores they say
what limits the figure.

Targets: fetch bandwidth >= 80% of ``download_file``'s (as the drain's);
``load`` / (``download_file`` + ``torch.load``) is reported.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness as h
import bench_s3

TARGET_OF_CP = bench_s3.TARGET_OF_CP
JOB = "s3restore"
STEP = 1
FETCHED = re.compile(r"fetched \d+ part\(s\) of .*?: (\d+) bytes in ([0-9.]+)s")
TICK = os.sysconf("SC_CLK_TCK")
DAEMON_READ_BYTES = 64 * h.MiB  # what the fetch asks of an object at once (copier.PartCopier._copy_file's piece)
PEERS = ("prefetch", "load", "download_file", "download_file.tuned", "get_object", "torch.load")


def cpu_s(*pids: int) -> float:
    """User + system CPU seconds of processes ``pids`` (0: this process, all its threads)."""
    total = 0.0
    for pid in pids:
        if pid == 0:
            use = resource.getrusage(resource.RUSAGE_SELF)
            total += use.ru_utime + use.ru_stime
            continue
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14 and 15)
    return total


class Run:
    """One state size's measurements: seconds per peer per round, CPU seconds, load averages."""

    def __init__(self) -> None:
        self.runs: dict[str, list[float]] = {}
        self.cpu: dict[str, list[tuple[float, float]]] = {}  # peer -> [(mover, store)]
        self.loads: list[tuple[float, float, float]] = []

    def add(self, name: str, seconds: float, mover_cpu: float = math.nan, store_cpu: float = math.nan) -> None:
        self.runs.setdefault(name, []).append(seconds)
        self.cpu.setdefault(name, []).append((mover_cpu, store_cpu))

    def median(self, name: str) -> float:
        return h.median(self.runs.get(name, []))


class Restore:
    """The store, the peers and fresh second daemons for one size: everything a round needs."""

    def __init__(self, args: argparse.Namespace, work: Path, droot: Path, server: Any, state: Any) -> None:
        import torch

        from ckptstage.client import Client
        from ckptstage.daemon.tiers.s3.io import READ_PIECE_BYTES
        from ckptstage.protos import layout

        self.args, self.work, self.droot, self.server, self.state = args, work, droot, server, state
        self.s3 = bench_s3.s3server()
        self.store_pids = [p.pid for p in server.procs]
        self.fresh = 0
        writer = self.node("writer")
        try:
            writer.start()
            with Client(JOB, socket=writer.socket) as client:
                client.save(STEP, state).wait("shared")
        finally:
            writer.stop()
            h.drop_tree(writer.root)
            h.drop_tree(writer.local)
        self.key = "/".join((bench_s3.PREFIX, JOB, layout.step_dirname(STEP), layout.rank_dirname(0),
                             layout.DATA_FILE))
        reads_at_once = max(1, DAEMON_READ_BYTES // READ_PIECE_BYTES)
        self.peers = bench_s3.Peers(server, self.s3.BUCKET, READ_PIECE_BYTES, reads_at_once)
        self.tuned_note = f"{READ_PIECE_BYTES // h.MiB} MiB x {reads_at_once}"
        self.data_bytes = int(self.peers.client.head_object(Bucket=self.s3.BUCKET, Key=self.key)["ContentLength"])
        self.pt = work / "state.pt"
        torch.save(state, self.pt)
        os.sync()  # the store's volumes and the torch file on disk: evictable from the cache below

    def node(self, name: str) -> h.Daemon:
        self.fresh += 1
        root = self.droot / f"{name}-{self.fresh}"
        upload = 64 * h.MiB, 8  # [shared] multipart_bytes and multipart_concurrency: their defaults
        return bench_s3.node(root, self.work / f"{name}-{self.fresh}-local", self.server, *upload, metrics=False,
                             **{"arena.max_bytes": bench_s3.arena_bytes(h.state_bytes(self.state))})

    def cold(self) -> None:
        """Every measurement starts here: nothing of the store's files or the torch file cached, idle."""
        h.drop_page_cache(self.server.directory / "volume")
        h.drop_page_cache(self.pt)
        h.settle(self.args.settle)

    # --- ckptstage ---------------------------------------------------------------------------

    def on_fresh_node(self, measure: Callable[[h.Daemon], float]) -> tuple[float, float, float, str]:
        """(seconds, CPU seconds of the daemon and this client, the store's, the daemon's log) of ``measure``
        run against a daemon
        that never saw the job, once it lists the step; the daemon and its local tier are gone after."""
        from ckptstage.client import Client

        d = self.node("reader")
        try:
            d.start()
            with Client(JOB, socket=d.socket) as probe:
                deadline = time.monotonic() + 30
                while STEP not in [i.step for i in probe.list()]:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the reader daemon does not list {JOB} step {STEP}; log {d.log}")
                    time.sleep(0.1)
            self.cold()
            mover, store = cpu_s(d.pid, 0), cpu_s(*self.store_pids)
            seconds = measure(d)
            mover, store = cpu_s(d.pid, 0) - mover, cpu_s(*self.store_pids) - store
            log = d.log.read_text(errors="replace")
        finally:
            d.stop()
            h.drop_tree(d.root)
            h.drop_tree(d.local)
        return seconds, mover, store, log

    def prefetch(self, run: Run) -> None:
        from ckptstage.client.rpc import Connection
        from ckptstage.protos.v1 import ckptstage_pb2 as pb

        def measure(d: h.Daemon) -> float:
            with Connection(d.socket) as conn, h.Timer() as t:
                got = conn.call("Prefetch", pb.PrefetchRequest(job=JOB, step=STEP, ranks=[0]), timeout=600)
            if got.parts != 1:
                raise RuntimeError(f"Prefetch copied {got.parts} parts, not the one the store holds")
            return t.s

        seconds, mover, store, _ = self.on_fresh_node(measure)
        run.add("prefetch", seconds, mover, store)

    def load(self, run: Run, check: bool) -> None:
        from ckptstage.client import Client

        loaded: list[Any] = []

        def measure(d: h.Daemon) -> float:
            with Client(JOB, socket=d.socket) as client, h.Timer() as t:
                loaded.append(client.load())
            return t.s

        seconds, mover, store, log = self.on_fresh_node(measure)
        fetched = FETCHED.findall(log)
        if len(fetched) != 1 or int(fetched[0][0]) < self.data_bytes:
            raise RuntimeError(f"the load did not fetch the part once from the store: {fetched}")
        run.add("load", seconds, mover, store)
        run.add("load.fetch", float(fetched[0][1]))
        if check:  # once per size, untimed: the bytes that came back are the state's
            import torch

            same = all(torch.equal(a, b) for a, b in zip(h.tensors_of(loaded[0]), h.tensors_of(self.state)))
            if not same or len(h.tensors_of(loaded[0])) != len(h.tensors_of(self.state)):
                raise RuntimeError("load() from the store returned other tensors than were saved")

    # --- the peers -----------------------------------------------------------------------

    def sdk(self, run: Run, name: str, move: Callable[[Path], float], sync: bool = False) -> None:
        target = self.work / f"{name}.bin"
        try:
            self.cold()
            mover, store = cpu_s(0), cpu_s(*self.store_pids)
            seconds = move(target)
            run.add(name, seconds, cpu_s(0) - mover, cpu_s(*self.store_pids) - store)
            if target.stat().st_size != self.data_bytes:
                raise RuntimeError(f"{name} wrote {target.stat().st_size} bytes of {self.data_bytes}")
            if sync:  # what it would take to make the download durable, as the fetch is
                fd = os.open(target, os.O_RDONLY)
                try:
                    run.add(f"{name}.fsync", h.timed(lambda: os.fsync(fd)))
                finally:
                    os.close(fd)
        finally:
            target.unlink(missing_ok=True)

    def torch_load(self, run: Run) -> None:
        import torch

        self.cold()
        mover = cpu_s(0)
        with h.Timer() as t:
            got = torch.load(self.pt)
        run.add("torch.load", t.s, cpu_s(0) - mover, 0.0)
        del got

    def round(self, run: Run, r: int) -> None:
        steps: list[tuple[str, Callable[[], None]]] = [
            ("prefetch", lambda: self.prefetch(run)),
            ("load", lambda: self.load(run, check=r == 0)),
            ("download_file", lambda: self.sdk(run, "download_file",
                                               lambda p: self.peers.download_file(self.key, p), sync=True)),
            ("download_file.tuned", lambda: self.sdk(run, "download_file.tuned",
                                                     lambda p: self.peers.download_file(self.key, p, tuned=True))),
            ("get_object", lambda: self.sdk(run, "get_object", lambda p: self.peers.get_object(self.key, p))),
            ("torch.load", lambda: self.torch_load(run)),
        ]
        for _, step in steps[r % len(steps):] + steps[:r % len(steps)]:
            step()
        run.loads.append(h.load())


def empty(server: Any) -> None:
    """Deletes every object of the bucket and has SeaweedFS reclaim their room."""
    client, bucket = server.client(), bench_s3.s3server().BUCKET
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})
    server.vacuum()


def bench_size(args: argparse.Namespace, gib: float, work: Path, droot: Path, server: Any,
               out: Callable[[str], None]) -> dict[str, Any]:
    state = h.make_state(int(gib * h.GiB))
    restore = Restore(args, work, droot, server, state)
    n = restore.data_bytes
    out(f"\n=== state {gib:.2f} GiB (data object {n / h.GiB:.3f} GiB), {args.rounds} rounds, load {h.load()}")
    run = Run()
    try:
        for r in range(args.rounds):
            restore.round(run, r)
            last = {k: v[-1] for k, v in run.runs.items()}
            out(f"  round {r + 1}/{args.rounds}: prefetch {last['prefetch']:.2f} s, load {last['load']:.2f} s "
                f"(fetch {last['load.fetch']:.2f} s), download_file {last['download_file']:.2f} s "
                f"(+fsync {last['download_file.fsync']:.2f} s), tuned {last['download_file.tuned']:.2f} s, "
                f"get_object {last['get_object']:.2f} s, torch.load {last['torch.load']:.2f} s  (load {run.loads[-1]})")
    finally:
        restore.pt.unlink(missing_ok=True)
    return report(run, n, restore.tuned_note, out)


def report(run: Run, n: int, tuned_note: str, out: Callable[[str], None]) -> dict[str, Any]:
    def row(name: str, note: str) -> h.Row:
        return h.Row(name, run.median(name), n, run.runs[name], run.loads, note)

    rows = [
        row("prefetch", "Prefetch on a fresh daemon: store -> local tier, verified, O_DIRECT + fsync"),
        row("load", "Client.load() on a fresh daemon: fetch + read into tensors"),
        row("load.fetch", "the daemon's fetch within load() (its log line)"),
        row("download_file", "s3transfer, aws s3 cp's defaults (8 MiB x 10), not synced"),
        row("download_file.fsync", "fsync of that file after it"),
        row("download_file.tuned", f"s3transfer, the daemon's read shape ({tuned_note})"),
        row("get_object", "one GET streamed to a file"),
        row("torch.load", "torch.load of a torch.save file, cold, same disk"),
    ]
    h.print_table(f"[{n / h.GiB:.3f} GiB data object] restore from S3 vs the SDK alone (median of rounds)",
                  rows, "prefetch", out)
    out("\n  CPU seconds per run (median; mover = the daemon and this process, which is the client, the SDK "
        "and torch.load):")
    for name in PEERS:
        mover = h.median([c[0] for c in run.cpu[name]])
        store = h.median([c[1] for c in run.cpu[name]])
        out(f"    {name:20} mover {mover:5.2f} s  store (SeaweedFS) {store:5.2f} s  "
            f"({n / run.median(name) / 1e6:6.1f} MB/s)")
    cp = run.median("download_file")
    local = cp + run.median("torch.load")
    out(f"\n  load / (download_file + torch.load) = {run.median('load'):.2f} s / {local:.2f} s "
        f"= {run.median('load') / local:.2f}x time")
    verdicts = [h.verdict("fetch bw (prefetch) / download_file bw", cp / run.median("prefetch") * 100, ">=",
                          TARGET_OF_CP * 100, "%"),
                h.verdict("fetch bw (within load) / download_file bw", cp / run.median("load.fetch") * 100, ">=",
                          TARGET_OF_CP * 100, "%")]
    return {"rows": rows, "runs": run.runs, "cpu": run.cpu, "loads": run.loads, "bytes": n,
            "load_over_download_and_torch_load": run.median("load") / local, "verdicts": verdicts}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = h.run_args(__doc__ or "", "the local tiers, the peers' files and SeaweedFS's data live")
    p.add_argument("--gib", type=float, nargs="+", default=[0.5, 1.0], help="state sizes in GiB (default 0.5 1)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per size (default 3)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    result: dict[str, Any] = {"bench": "s3_restore", "argv": sys.argv, "sizes": {}}
    verdicts: list[tuple[str, bool]] = []
    with h.bench_dirs(args.dir, "s3restore") as (work, droot, info):
        result["machine"] = info
        server = bench_s3.s3server().start(work / "seaweedfs")
        print(f"SeaweedFS at {server.endpoint}, serving after {server.start_s:.1f} s")
        try:
            for gib in args.gib:
                got = bench_size(args, gib, work, droot, server, print)
                verdicts += [(f"{line} [{gib:g} GiB]", ok) for line, ok in got["verdicts"]]
                got["verdicts"] = [{"line": line.strip(), "pass": ok} for line, ok in got["verdicts"]]
                result["sizes"][str(gib)] = got
                empty(server)  # the next size starts from an empty store
        finally:
            server.stop()
    print("\n  targets:")
    for line, _ in verdicts:
        print(line)
    result["elapsed_s"] = elapsed = time.perf_counter() - started
    print(f"\ndone in {elapsed:.0f} s, load {h.load()}")
    h.write_json(args.json, result)
    return 1 if args.strict and any(not ok for _, ok in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
