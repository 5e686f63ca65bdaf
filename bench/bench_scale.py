"""Scale simulator: W ranks over N real daemons sharing one shared tier, counted and timed, slopes fitted.

    .venv/bin/python bench/bench_scale.py                          # W = 16 64 256 x N = 2 8, ~10 min
    .venv/bin/python bench/bench_scale.py --quick                  # W = 16 64 x N = 2 4, a minute or two
    .venv/bin/python bench/bench_scale.py --ranks 64 256 1024 --nodes 8 32 128 --json scale.json

The job (per configuration W, N): N ``ckptstaged`` processes (each its own
local directory and socket, node name and arena; all one shared directory),
W ranks as light clients: real ``ckptstage.client.Client`` objects, one
thread each, hosted by a few processes (so 2 cores hold hundreds of ranks),
speaking the real gRPC protocol to their node's daemon; rank r lives on node
``r * N // W``. Rank r's state is one fragment of one global fp32 tensor
``w`` of ``[W * rows, cols]``: rows ``[r * rows, (r + 1) * rows)``, the
layout FSDP gives a DTensor sharded on dim 0, saved with ``Client.save_flat``
(``--part-kib`` per rank, 64 KiB by default). Nothing is mocked but the
training: the daemons persist, drain, seal and index for real.

What is measured, per configuration:

* **blocked**: per rank, ``save_flat()`` call to ``wait_snapshot()`` return;
  the median and the 99th percentile over ranks, median over ``--rounds`` steps.
* **local / shared**: from the moment every rank is told to save to the last
  rank's ``wait("local")`` return, and to the step's ``commit.json`` appearing
  on the shared tier (polled every 2 ms by this process, untraced).
* **latest()**: ``Client.latest()`` on ranks 0, W/2 and W-1, 5 calls each, median.
* **reshard load** of rank W/2: the box of rows ``[r * rows + rows / 2, ...)``
  (half of each of two saved fragments: what a change of world size does),
  read as a resharding load does, with ``Client.open_step`` (``Locate`` of
  every part, then every part's manifest opened and verified: the *planning*)
  then ``StepView.read_box`` (the bytes, verified). Before it, node 0's
  daemon is asked to locate the step until it does (its index of the shared
  tier lags the commit record): that wait is printed too. Files it opens on any
  tier are counted in-process with an audit hook (``sys.addaudithook``,
  event ``open``: builtin ``open`` and ``os.open``), by path.
* **shared-tier metadata operations**: ``strace -f -ttt -y`` attached to
  every daemon (one strace per daemon, every thread) while the job idles
  ``--idle-s`` seconds, saves one more step (window: save to ``commit.json`` +
  ``--settle-s``) and answers ``latest()`` on one rank 5 times. The daemons
  keep their default retention (2 steps local, 5 shared; the shared tier
  holds at most 5 steps of the job, which the daemons' re-reads list). A
  call counts when a path argument, or the path of a descriptor argument (``-y``), lies
  under the shared directory; calls on the local tier, ``/dev/shm``, sockets
  and Python's own files do not. Categories: create (``openat`` with
  ``O_CREAT``, ``mkdir``, ``link``), open, stat (``stat``/``statx``/
  ``newfstatat``/``fstat``/``access``/``readlink``/``statfs``), list
  (``getdents64`` calls), rename, remove, other; metadata = all of these;
  ``fsync`` is shown apart. **per step** = the whole step window on every
  daemon; **net** = minus each daemon's idle rate times the window (what the
  step itself adds); **idle** = operations per second per daemon while
  nothing happens (the polling of the shared tier). Times are never taken
  under strace.
* **READY against a big shared tier** (once per run): ``--tier-jobs`` x
  ``--tier-steps`` one-part steps written straight in the format
  (``ckptstage.protos.layout``: manifest and commit record, the data file
  hard-linked), then a fresh daemon: start to READY (``sd_notify``), its
  first and second ``latest()`` of one job, and its shared-tier operations
  per second idle for ``--idle-s`` after that.
* **Peer**: DCP's ``FileSystemWriter``/``FileSystemReader``, ``--dcp-ranks``
  gloo processes, each saving the same bytes as a ckptstage rank (a DTensor
  shard): save and same-world load time (slowest rank), and the metadata
  operations of one save and one load on the checkpoint's directory,
  counted the same way (a second run under ``strace -f``).

Slopes: every figure is fitted as ``a * W^b * N^c`` by least squares on
logs over the configurations (``b`` and ``c`` printed; ``-`` where the grid
has one value). Targets: metadata per step exponent in W <= 1.1,
``latest()`` <= 50 ms, reshard load at the largest W <= 1.5x the smallest
W's, READY <= 1 s and first ``latest()`` <= 100 ms against 1,000 jobs x 100
steps. Not a test: exits 0 unless ``--strict`` and a target is missed.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _harness as h
from _syscounts import CATEGORIES, OpenCounter, TRACED, Tracer, count_trace, metadata

JOB = "scale"
ATTEMPT = "scale-1"
COLS = 1024  # fp32 row = 4 KiB
LATEST_CALLS = 5
RANKS_PER_HOST = 256
TARGETS = {"meta_exp_w": 1.1, "latest_ms": 50.0, "reshard_x": 1.5, "ready_s": 1.0, "first_latest_ms": 100.0}


# ------------------------------------------------------------------ the ranks


def rank_flat(rank: int, world: int, rows: int) -> Any:
    """Rank ``rank``'s state: rows ``[rank * rows, (rank + 1) * rows)`` of ``w``, each row holding its rank."""
    import torch

    from ckptstage.client import shards, tree

    flat = tree.Flat({"d": [[{"s": "w"}, {"D": {"fqn": "w", "dtype": "float32", "shape": [world * rows, COLS]}}]]})
    flat.tensors.append(torch.full((rows, COLS), float(rank)))
    flat.paths.append("['w']")
    flat.fqns.append("w")
    flat.fragments.append(shards.Fragment("w", (world * rows, COLS), (rank * rows, 0)))
    return flat


def _save_one(client: Any, step: int, flat: Any) -> tuple[float, float, float, int]:
    """(call, snapshot copied, committed locally: monotonic seconds; times the daemon answered late)."""
    from ckptstage.client import errors

    t0 = time.monotonic()
    handle = client.save_flat(step, flat)
    handle.wait_snapshot()
    t1 = time.monotonic()
    late = 0
    while True:
        try:
            handle.wait("local")
            return t0, t1, time.monotonic(), late
        except errors.DaemonTimeout:  # an overloaded daemon missed its own WaitSave deadline: ask again
            late += 1


def _latest_times(client: Any, calls: int) -> tuple[list[float], list[int | None]]:
    times, got = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        got.append(client.latest())
        times.append(time.perf_counter() - t0)
    return times, got


def rank_host(conn: Any, spec: dict[str, Any]) -> None:
    """A process holding many ranks, one ``Client`` and one thread each; serves the parent's commands."""
    import torch

    from ckptstage.client import Client

    torch.set_num_threads(1)
    ranks: list[tuple[int, str]] = spec["ranks"]
    world, rows = spec["world"], spec["rows"]
    pool = ThreadPoolExecutor(max_workers=max(1, len(ranks)))
    try:
        def open_one(rs: tuple[int, str]) -> tuple[int, Any]:
            return rs[0], Client(JOB, socket=rs[1], rank=rs[0], world_size=world, attempt=ATTEMPT,
                                 arena_bytes=spec["arena_bytes"], connect_timeout=120.0)

        clients = dict(pool.map(open_one, ranks))
        conn.send("ready")
        while True:
            cmd, arg = conn.recv()
            if cmd == "save":
                conn.send(list(pool.map(lambda r: _save_one(clients[r], arg, rank_flat(r, world, rows)),
                                        clients)))
            elif cmd == "latest":
                conn.send({r: _latest_times(clients[r], LATEST_CALLS) for r in arg if r in clients})
            else:
                list(pool.map(lambda c: c.close(), clients.values()))
                conn.send("closed")
                return
    finally:
        pool.shutdown(wait=False)


class Ranks:
    """The job's W ranks, spread over a few host processes (spawned), driven by command."""

    def __init__(self, world: int, sockets: Sequence[Path], rows: int, arena_bytes: int) -> None:
        nodes = len(sockets)
        hosts = min(nodes, max(1, -(-world // RANKS_PER_HOST)))
        per_host: list[list[tuple[int, str]]] = [[] for _ in range(hosts)]
        for r in range(world):
            node = r * nodes // world
            per_host[node % hosts].append((r, str(sockets[node])))
        ctx = mp.get_context("spawn")
        self.conns = []
        self.procs = []
        for ranks in per_host:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_host, args=(child, {"ranks": ranks, "world": world, "rows": rows,
                                                               "arena_bytes": arena_bytes}), daemon=True)
            proc.start()
            child.close()  # so a host that dies is an EOFError here, not a wait forever
            self.conns.append(parent)
            self.procs.append(proc)
        for c in self.conns:
            if c.recv() != "ready":
                raise RuntimeError("a rank host failed to open its clients")

    def ask(self, cmd: str, arg: Any = None) -> list[Any]:
        for c in self.conns:
            c.send((cmd, arg))
        return [c.recv() for c in self.conns]

    def close(self) -> None:
        try:
            self.ask("close")
        finally:
            self.kill(grace_s=30.0)

    def kill(self, grace_s: float = 0.0) -> None:
        """Ends the hosts still running after ``grace_s`` (0: at once, one may be stuck in a save); their
        sessions break and the daemons close them."""
        for p in self.procs:
            p.join(grace_s)
            if p.is_alive():
                p.kill()
                p.join(10)


# ------------------------------------------------------------------ one configuration


@dataclass
class Figures:
    """One configuration's figures (times in seconds, counts per step unless named otherwise)."""

    world: int
    nodes: int
    blocked_s: float = math.nan
    blocked_p99_s: float = math.nan
    local_s: float = math.nan
    shared_s: float = math.nan
    latest_s: float = math.nan
    reshard_plan_s: float = math.nan
    reshard_read_s: float = math.nan
    reshard_files: int = 0
    reshard_manifests: int = 0
    meta_step: float = 0.0         # per traced step (their mean)
    meta_step_net: float = math.nan
    meta_step_max_node: float = 0.0
    meta_step_own: float = math.nan  # calls on the step's own directory and the temporaries only
    idle_per_s_node: float = math.nan
    latest_ops: float = math.nan
    latest_stale: int = 0
    late_answers: int = 0          # WaitSave calls a daemon answered after its own deadline (timed rounds)
    late_answers_traced: int = 0   # the same in the steps under strace
    visible_wait_s: float = math.nan  # after the latest() calls, until node 0 located the step's every part
    step_kinds: dict[str, int] = field(default_factory=dict)
    syncs_step: float = 0.0
    traced_window_s: float = math.nan
    loads: list[tuple[float, float, float]] = field(default_factory=list)  # at the start and the end

    @property
    def reshard_s(self) -> float:
        return self.reshard_plan_s + self.reshard_read_s


def start_daemons(root: Path, shared: Path, nodes: int, per_node: int, arena_bytes: int) -> list[h.Daemon]:
    """N daemons on one shared directory, started together; returns once every one is READY."""
    settings: dict[str, Any] = {"arena.min_session_bytes": "64KiB", "persist.chunk_bytes": "256KiB",
                                "arena.max_bytes": max(4 << 20, 2 * per_node * arena_bytes),
                                # the daemon's own retention (the harness keeps 100 steps), as a job runs
                                "local.keep_last": 2, "shared.keep_last": 5, "shared.drain_on_stop_s": 0}
    daemons = [h.Daemon(root / f"d{i}", root / f"d{i}" / "local", shared, node_name=f"node{i:04d}", **settings)
               for i in range(nodes)]
    try:
        for d in daemons:
            d.start(wait=False)
        for d in daemons:
            d.wait_ready(timeout=max(120.0, 2.0 * nodes))
    except BaseException:
        stop_daemons(daemons)
        raise
    return daemons


def stop_daemons(daemons: Sequence[h.Daemon]) -> None:
    for d in daemons:
        if d.running and d.proc is not None:
            d.proc.terminate()
    for d in daemons:
        d.stop()


def wait_commit(shared: Path, step: int, job: str = JOB, timeout: float = 600.0) -> float:
    """Until ``step``'s commit record is on the shared tier; returns that moment (monotonic)."""
    from ckptstage.protos import layout

    path = layout.commit_path(shared, job, step)
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {step} never completed on the shared tier ({path})")
        time.sleep(0.002)
    return time.monotonic()


def save_step(ranks: Ranks, shared: Path, step: int) -> tuple[list[float], float, float, int]:
    """Every rank saves ``step``: (blocked per rank, to last local commit, to the shared commit record,
    ``WaitSave`` calls the daemons answered too late)."""
    t0 = time.monotonic()
    done = [t for host in ranks.ask("save", step) for t in host]
    shared_at = wait_commit(shared, step)
    return ([t1 - ts for ts, t1, _, _ in done], max(t2 for _, _, t2, _ in done) - t0, shared_at - t0,
            sum(late for *_, late in done))


def measure(world: int, nodes: int, work: Path, droot: Path, args: argparse.Namespace) -> Figures:
    rows = max(1, args.part_kib * 1024 // (COLS * 4)) // 2 * 2 or 2
    arena = rows * COLS * 4 + (256 << 10)
    fig = Figures(world, nodes, loads=[h.load()])
    shared = work / "shared"
    daemons = start_daemons(droot, shared, nodes, -(-world // nodes), arena)
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
        reshard(fig, 0, rows, daemons[0], last, shared, daemons)  # untimed: this process's first read (imports)
        reshard(fig, world // 2, rows, daemons[(world // 2) * nodes // world], last, shared, daemons)
        count_step(fig, ranks, daemons, shared, last + 1, work / "strace", args)
        fig.loads.append(h.load())
        done = True
    finally:
        if ranks is not None:
            ranks.close() if done else ranks.kill()
        stop_daemons(daemons)
    return fig


def reshard(fig: Figures, rank: int, rows: int, daemon: h.Daemon, step: int, shared: Path,
            daemons: Sequence[h.Daemon]) -> None:
    """Rank ``rank`` reads half of each of two saved fragments, as a resharding load does; times and opens."""
    import torch

    from ckptstage.client import steps
    from ckptstage.client.rpc import Connection

    world = fig.world
    lo = rank * rows + rows // 2 if rank < world - 1 else rank * rows
    out = torch.empty(rows, COLS)
    counter = OpenCounter.get()
    with Connection(daemon.socket) as conn:
        waited = visible(conn, step, rank)
        if rank == 0:
            fig.visible_wait_s = waited
    with Connection(daemon.socket) as conn, counter.counting([shared, *(d.local for d in daemons)]) as opened:
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
    fig.reshard_plan_s, fig.reshard_read_s = t1 - t0, t2 - t1
    fig.reshard_files = len(opened)
    fig.reshard_manifests = sum(p.endswith("manifest.json") for p in opened)


def visible(conn: Any, step: int, rank: int, timeout: float = 60.0) -> float:
    """Until the daemon on ``conn`` locates every part of ``step`` (its index of the shared tier lags the
    tier: it may answer NOT_FOUND for a step whose commit record is there); returns the seconds waited."""
    from ckptstage.client import errors, steps

    t0 = time.monotonic()
    while True:
        try:
            steps.locate(conn, JOB, step, rank)
            return time.monotonic() - t0
        except errors.CheckpointNotFound:
            if time.monotonic() - t0 > timeout:
                raise
            time.sleep(0.02)


def count_step(fig: Figures, ranks: Ranks, daemons: Sequence[h.Daemon], shared: Path, step: int,
               logs: Path, args: argparse.Namespace) -> None:
    """Under strace: idle, ``--traced-steps`` more steps, ``latest()`` on one rank; the shared tier's operations
    per window (per step: the mean over the steps traced)."""
    tracer = Tracer([d.pid for d in daemons], logs)
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


# ------------------------------------------------------------------ a big shared tier


def write_big_tier(shared: Path, seed_root: Path, jobs: int, steps_per_job: int) -> int:
    """``jobs`` x ``steps_per_job`` one-part steps written in the format: a seed part saved by a real daemon,
    its manifest re-addressed per step, its data file hard-linked; returns the steps written."""
    from ckptstage.client import Client
    from ckptstage.protos import layout

    seed_shared = seed_root / "shared"
    settings: dict[str, Any] = {"arena.min_session_bytes": "64KiB", "persist.chunk_bytes": "256KiB",
                                "arena.max_bytes": "4MiB"}
    with h.Daemon(seed_root / "d", seed_root / "local", seed_shared, **settings) as d:
        with Client("seed", socket=d.socket, rank=0, world_size=1, arena_bytes=1 << 20) as c:
            c.save_flat(1, rank_flat(0, 1, 16)).wait("local")
        wait_commit(seed_shared, 1, "seed", timeout=60.0)
    part = layout.part_dir(seed_shared, "seed", 1, 0)
    manifest = layout.read_manifest(part)
    record = layout.read_commit_record(part.parent)
    assert record is not None
    nbytes = record.parts[0].nbytes
    source = part / layout.DATA_FILE
    for j in range(jobs):
        job = f"job{j:05d}"
        for s in range(1, steps_per_job + 1):
            dst = layout.part_dir(shared, job, s, 0)
            dst.mkdir(parents=True)
            if (j * steps_per_job + s) % 60000 == 0:  # ext4 allows 65,000 links to one file
                source = shared / f".seed-{j}-{s}"
                shutil.copyfile(part / layout.DATA_FILE, source)
            os.link(source, dst / layout.DATA_FILE)
            raw = layout.manifest_file_bytes({**manifest, "job": job, "step": s})
            (dst / layout.MANIFEST_FILE).write_bytes(raw)
            rec = layout.CommitRecord(job, s, str(manifest["attempt"]), 1, time.time(),
                                      {0: layout.CommittedPart(nbytes, layout.chunk_digest(raw))})
            layout.commit_path(shared, job, s).write_bytes(layout.commit_record_bytes(rec))
    return jobs * steps_per_job


def big_tier(work: Path, droot: Path, args: argparse.Namespace) -> dict[str, float]:
    """READY, first ``latest()`` and idle shared-tier operations of a fresh daemon against a big shared tier."""
    from ckptstage.client import errors, steps
    from ckptstage.client.rpc import Connection

    shared = work / "big-shared"
    with h.Timer() as wt:
        n = write_big_tier(shared, work / "seed", args.tier_jobs, args.tier_steps)
    d = h.Daemon(droot / "big", droot / "big" / "local", shared)
    out: dict[str, float] = {"jobs": args.tier_jobs, "steps": n, "write_s": wt.s}
    with h.Timer() as t:
        d.start()
    try:
        out["ready_s"] = t.s
        job = f"job{args.tier_jobs // 2:05d}"
        with Connection(d.socket) as conn:
            for name in ("first_latest_s", "second_latest_s"):
                t0 = time.perf_counter()
                try:
                    got = steps.complete_steps(conn, job, 1)
                except errors.CkptStageError:
                    got = []
                out[name] = time.perf_counter() - t0
                out[name.replace("_s", "_found")] = float(got == [args.tier_steps])
        tracer = Tracer([d.pid], work / "strace-big")
        t0 = time.time()
        time.sleep(args.idle_s)
        window = (t0, time.time())
        tracer.stop()
        counts = count_trace(tracer.logs[0], shared, {"idle": window})["idle"]
        out["idle_ops_per_s"] = metadata(counts) / (window[1] - window[0])
    finally:
        d.stop()
    shutil.rmtree(shared, ignore_errors=True)
    return out


# ------------------------------------------------------------------ the DCP peer


def dcp_rank(rank: int, world: int, spec: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        rows = spec["rows"]

        def state(fill: float) -> dict[str, Any]:
            local = torch.full((rows, COLS), fill)
            return {"w": DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                            shape=torch.Size([world * rows, COLS]), stride=(COLS, 1))}

        dcp.save(state(float(rank)), storage_writer=dcp.FileSystemWriter(Path(spec["dir"]) / "warm-up"))
        path = Path(spec["dir"]) / "step-1"
        dist.barrier()
        t0, w0 = time.perf_counter(), time.time()
        dcp.save(state(float(rank)), storage_writer=dcp.FileSystemWriter(path))
        save_s = time.perf_counter() - t0
        dist.barrier()
        w1 = time.time()
        into = state(-1.0)
        dist.barrier()
        t0, w2 = time.perf_counter(), time.time()
        dcp.load(into, storage_reader=dcp.FileSystemReader(path))
        load_s = time.perf_counter() - t0
        dist.barrier()
        w3 = time.time()
        ok = bool(into["w"].to_local()[0, 0].item() == rank)
        got: list[Any] = [None] * world
        dist.all_gather_object(got, {"save_s": save_s, "load_s": load_s, "ok": ok})
        if rank == 0:
            Path(spec["out"]).write_text(json.dumps({"ranks": got, "save": [w0, w1], "load": [w2, w3]}))
    finally:
        dist.destroy_process_group()


def dcp_main(world: int, directory: Path, out: Path, rows: int) -> None:
    import torch.multiprocessing as tmp

    spec = {"port": h.free_port(), "dir": str(directory), "out": str(out), "rows": rows}
    tmp.spawn(dcp_rank, args=(world, spec), nprocs=world, join=True)


def dcp_peer(world: int, work: Path, rows: int) -> dict[str, float]:
    """DCP's FileSystemWriter/Reader at ``world`` gloo ranks: times (untraced), then metadata operations
    (a second run under ``strace -f``), on the checkpoint's directory."""
    out: dict[str, float] = {"world": world}
    for traced in (False, True):
        d = work / f"dcp-{world}-{int(traced)}"
        d.mkdir(parents=True)
        result, log = work / f"dcp-{world}.json", work / f"dcp-{world}.strace"
        cmd = [sys.executable, __file__, "--dcp-child", str(world), str(d), str(result), str(rows)]
        if traced:
            cmd = ["strace", "-f", "--seccomp-bpf", "-qq", "-ttt", "-y", "-s", "1024", "-e", f"trace={TRACED}",
                   "-o", str(log), *cmd]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
        res = json.loads(result.read_text())
        if not all(r["ok"] for r in res["ranks"]):
            raise RuntimeError("DCP load read wrong values")
        if traced:
            counts = count_trace(log, d, {"save": tuple(res["save"]), "load": tuple(res["load"])})
            out["save_ops"], out["load_ops"] = metadata(counts["save"]), metadata(counts["load"])
            out["load_opens_per_rank"] = (counts["load"]["open"] + counts["load"]["create"]) / world
        else:
            out["save_s"] = max(r["save_s"] for r in res["ranks"])
            out["load_s"] = max(r["load_s"] for r in res["ranks"])
        shutil.rmtree(d, ignore_errors=True)
    return out


# ------------------------------------------------------------------ slopes and printing


def fit(figs: Sequence[Figures], value: Callable[[Figures], float]) -> tuple[float, float]:
    """Exponents (in W, in N) of ``value`` by log-log least squares; NaN where the grid has one value of it."""
    import numpy as np

    pts = [(f.world, f.nodes, value(f)) for f in figs if value(f) > 0 and math.isfinite(value(f))]
    if len(pts) < 2:
        return math.nan, math.nan
    ws, ns = {p[0] for p in pts}, {p[1] for p in pts}
    cols: list[list[float]] = [[1.0] * len(pts)]
    if len(ws) > 1:
        cols.append([math.log(p[0]) for p in pts])
    if len(ns) > 1:
        cols.append([math.log(p[1]) for p in pts])
    a = np.array(cols).T
    if np.linalg.matrix_rank(a) < a.shape[1]:  # W and N moved together: only the slope in W is told
        a, ns = a[:, :2], {0}
    coef = np.linalg.lstsq(a, np.array([math.log(p[2]) for p in pts]), rcond=None)[0]
    b = float(coef[1]) if len(ws) > 1 else math.nan
    c = float(coef[-1]) if len(ns) > 1 else math.nan
    return b, c


COLUMNS: list[tuple[str, str, Callable[[Figures], float]]] = [
    ("blocked", "ms", lambda f: f.blocked_s * 1e3),
    ("blocked p99", "ms", lambda f: f.blocked_p99_s * 1e3),
    ("local", "s", lambda f: f.local_s),
    ("shared", "s", lambda f: f.shared_s),
    ("meta/step", "ops", lambda f: f.meta_step),
    ("meta/step net", "ops", lambda f: f.meta_step_net),
    ("meta/step max node", "ops", lambda f: f.meta_step_max_node),
    ("meta/step own", "ops", lambda f: f.meta_step_own),
    ("idle/s/node", "ops", lambda f: f.idle_per_s_node),
    ("latest()", "ms", lambda f: f.latest_s * 1e3),
    ("latest() ops/call", "ops", lambda f: f.latest_ops),
    ("latest() stale answers", "", lambda f: f.latest_stale),
    ("WaitSave late", "", lambda f: f.late_answers),
    ("WaitSave late traced", "", lambda f: f.late_answers_traced),
    ("node 0 sees the step", "ms", lambda f: f.visible_wait_s * 1e3),
    ("reshard plan", "ms", lambda f: f.reshard_plan_s * 1e3),
    ("reshard read", "ms", lambda f: f.reshard_read_s * 1e3),
    ("reshard files", "", lambda f: f.reshard_files),
    ("reshard manifests", "", lambda f: f.reshard_manifests),
]


def print_figures(figs: Sequence[Figures]) -> dict[str, tuple[float, float]]:
    """Every figure per configuration, then its fitted exponents in W and N; returns the exponents."""
    head = "".join(f"{'W=' + str(f.world) + ' N=' + str(f.nodes):>16}" for f in figs)
    print(f"\n{'figure':26}{head}{'exp W':>8}{'exp N':>8}")
    slopes = {}
    for name, unit, value in COLUMNS:
        b, c = fit(figs, value)
        slopes[name] = (b, c)
        cells = "".join(f"{value(f):16.4g}" for f in figs)
        print(f"{name + (' (' + unit + ')' if unit else ''):26}{cells}{_exp(b):>8}{_exp(c):>8}")
    print("\nshared-tier calls in the step window, by kind (all daemons):")
    for f in figs:
        print(f"  W={f.world:<5} N={f.nodes:<4} " + " ".join(f"{k}={v}" for k, v in f.step_kinds.items())
              + f"  (window {f.traced_window_s:.1f} s traced)")
    return slopes


def _exp(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


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
    ap.add_argument("--quick", action="store_true", help="W = 16 64, N = 2 4, small tier, DCP at 2 4")
    args = ap.parse_args(argv)
    if args.quick:
        args.ranks, args.nodes, args.rounds, args.idle_s, args.settle_s = [16, 64], [2, 4], 2, 2.0, 1.5
        args.tier_jobs, args.tier_steps, args.dcp_ranks = 100, 10, [2, 4]
    return args


def run(args: argparse.Namespace, work: Path, droot: Path) -> dict[str, Any]:
    """Every configuration, the big tier and the peer; prints as it goes; returns the record."""
    figs: list[Figures] = []
    for nodes in args.nodes:
        for world in args.ranks:
            if world < nodes:
                continue
            print(f"\n== W={world} N={nodes} ({world // nodes} ranks per node), load {h.load()}", flush=True)
            sub = f"w{world}n{nodes}"
            with h.Timer() as t:
                figs.append(measure(world, nodes, work / sub, droot / sub, args))
            f = figs[-1]
            print(f"   {t.s:.0f} s: blocked {f.blocked_s * 1e3:.1f} ms, shared {f.shared_s:.2f} s, "
                  f"meta/step {f.meta_step} (net {f.meta_step_net:.0f}), idle {f.idle_per_s_node:.0f}/s/node, "
                  f"latest {f.latest_s * 1e3:.1f} ms, reshard files {f.reshard_files}", flush=True)
    slopes = print_figures(figs)
    rows = max(1, args.part_kib * 1024 // (COLS * 4)) // 2 * 2 or 2
    big = big_tier(work, droot, args) if args.tier_jobs > 0 else {}
    if big:
        print(f"\nbig shared tier: {big['jobs']:.0f} jobs, {big['steps']:.0f} steps (written in {big['write_s']:.0f} s):"
              f" READY {big['ready_s'] * 1e3:.0f} ms, first latest() {big['first_latest_s'] * 1e3:.0f} ms"
              f" (found: {bool(big['first_latest_found'])}), second {big['second_latest_s'] * 1e3:.0f} ms,"
              f" idle {big['idle_ops_per_s']:.0f} shared-tier ops/s")
    peers = [dcp_peer(w, work, rows) for w in args.dcp_ranks]
    if peers:
        print("\npeer: DCP FileSystemWriter/Reader, gloo (same bytes per rank)")
        print(f"  {'W':>4} {'save (ms)':>10} {'load (ms)':>10} {'save ops':>9} {'per rank':>9} {'load ops':>9}"
              f" {'opens/rank':>10}")
        for p in peers:
            print(f"  {p['world']:4.0f} {p['save_s'] * 1e3:10.1f} {p['load_s'] * 1e3:10.1f} {p['save_ops']:9.0f}"
                  f" {p['save_ops'] / p['world']:9.1f} {p['load_ops']:9.0f} {p['load_opens_per_rank']:10.1f}")
        ours = [f for f in figs if f.meta_step]
        if ours:
            print("  ckptstage, shared-tier metadata per rank per step: " + ", ".join(
                f"W={f.world} N={f.nodes}: {f.meta_step / f.world:.1f} ({f.meta_step_net / f.world:.1f} net)"
                for f in ours))
    verdicts = targets(figs, slopes, big)
    print("\nverdicts:")
    for line, _ in verdicts:
        print(line)
    return {"figures": [vars(f) | {"reshard_s": f.reshard_s} for f in figs],
            "slopes": {k: {"W": b, "N": c} for k, (b, c) in slopes.items()}, "big_tier": big,
            "dcp": peers, "verdicts": verdicts}


def targets(figs: Sequence[Figures], slopes: dict[str, tuple[float, float]],
            big: dict[str, float]) -> list[tuple[str, bool]]:
    out = []
    if not math.isnan(slopes["meta/step"][0]):
        out.append(h.verdict("shared-tier metadata per step, exponent in W", slopes["meta/step"][0], "<=",
                             TARGETS["meta_exp_w"]))
    if figs:
        out.append(h.verdict(f"latest() at W={max(f.world for f in figs)}, ms",
                             max(f.latest_s for f in figs if f.world == max(g.world for g in figs)) * 1e3, "<=",
                             TARGETS["latest_ms"]))
        small = min(figs, key=lambda f: (f.world, f.nodes))
        large = max(figs, key=lambda f: (f.world, -f.nodes))
        if large.world > small.world:
            out.append(h.verdict(f"reshard load per rank, W={large.world} x W={small.world}",
                                 large.reshard_s / small.reshard_s, "<=", TARGETS["reshard_x"]))
    if big:
        out.append(h.verdict(f"READY against {big['steps']:.0f} steps, s", big["ready_s"], "<=", TARGETS["ready_s"]))
        out.append(h.verdict("first latest() there, ms", big["first_latest_s"] * 1e3, "<=",
                             TARGETS["first_latest_ms"]))
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--dcp-child":
        dcp_main(int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]))
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
