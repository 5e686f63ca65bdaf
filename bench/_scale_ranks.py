"""The scale simulator's ranks: W light clients on threads, a few host processes, driven by command.

For ``bench_scale.py``: rank r of a world of W saves one fragment of one
global fp32 tensor ``w`` (rows ``[r * rows, (r + 1) * rows)``, FSDP's dim-0
layout) with ``Client.save_flat``, or a plain state (``save_plain``); each is
a real ``ckptstage.client.Client`` speaking gRPC to its node's daemon. For the
restore at another world size the hosts close their clients and open new ones
that say another world size (``reopen``), then load (``load_plain``: the
real ``Client.load``, which at another world size reads rank 0's plain
values) or read a box (``read_box``: ``Client.open_step`` then
``StepView.read_box``, as a resharding load does), for the ranks named.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

JOB = "scale"
ATTEMPT = "scale-1"
RESTORE_ATTEMPT = "scale-restore"
COLS = 1024  # fp32 row = 4 KiB
LATEST_CALLS = 5
RANKS_PER_HOST = 256


def rank_flat(rank: int, world: int, rows: int, cols: int = COLS) -> Any:
    """Rank ``rank``'s state: rows ``[rank * rows, (rank + 1) * rows)`` of ``w`` (``[world * rows, cols]``),
    each row holding its rank: what FSDP saves of a tensor sharded on dim 0, built without a process group."""
    import torch

    from ckptstage.client import shards, tree

    flat = tree.Flat({"d": [[{"s": "w"}, {"D": {"fqn": "w", "dtype": "float32", "shape": [world * rows, cols]}}]]})
    flat.tensors.append(torch.full((rows, cols), float(rank)))
    flat.paths.append("['w']")
    flat.fqns.append("w")
    flat.fragments.append(shards.Fragment("w", (world * rows, cols), (rank * rows, 0)))
    return flat


def rank_plain(rank: int, rows: int) -> dict[str, Any]:
    """Rank ``rank``'s plain (unsharded) state: a ``[rows, COLS]`` tensor holding its rank, and the rank."""
    import torch

    return {"w": torch.full((rows, COLS), float(rank)), "rank": rank}


def box_of(rank: int, world: int, rows: int) -> int:
    """The first row of rank ``rank``'s resharding box (``rows`` rows): half of its own fragment and half of
    the next (a change of world size moves the boundaries); the last rank reads its own rows."""
    return rank * rows + rows // 2 if rank < world - 1 else rank * rows


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


def _load_plain(client: Any, step: int) -> tuple[bool, str | None, float]:
    """``Client.load(step)``: (whether it returned rank 0's values, the tier read, seconds)."""
    t0 = time.perf_counter()
    state = client.load(step)
    took = time.perf_counter() - t0
    ok = state["rank"] == 0 and float(state["w"].abs().max()) == 0.0
    return ok, client.last_load_tier, took


def _read_box(client: Any, step: int, rank: int, world: int, rows: int) -> tuple[bool, str | None, float]:
    """Rank ``rank``'s box of ``w`` in ``step`` (saved at ``world``), as a resharding load reads it."""
    import torch

    lo = box_of(rank, world, rows)
    out = torch.empty(rows, COLS)
    t0 = time.perf_counter()
    with client.open_step(step) as opened:
        opened.view.read_box("w", ((lo, 0), (rows, COLS)), out)
    took = time.perf_counter() - t0
    ok = out[0, 0].item() == lo // rows and out[-1, 0].item() == (lo + rows - 1) // rows
    return ok, None, took


def rank_host(conn: Any, spec: dict[str, Any]) -> None:
    """A process holding many ranks, one ``Client`` and one thread each; serves the parent's commands."""
    import torch

    from ckptstage.client import Client

    torch.set_num_threads(1)
    ranks: list[tuple[int, str]] = spec["ranks"]
    world, rows = spec["world"], spec["rows"]
    pool = ThreadPoolExecutor(max_workers=max(1, len(ranks)))

    def open_all(world_size: int, attempt: str, arena_bytes: int) -> dict[int, Any]:
        def open_one(rs: tuple[int, str]) -> tuple[int, Any]:
            return rs[0], Client(JOB, socket=rs[1], rank=rs[0], world_size=world_size, attempt=attempt,
                                 arena_bytes=arena_bytes, connect_timeout=120.0)

        return dict(pool.map(open_one, ranks))

    def save_plain(r: int, step: int) -> None:
        clients[r].save(step, rank_plain(r, rows)).wait("local")

    try:
        clients = open_all(world, ATTEMPT, spec["arena_bytes"])
        conn.send("ready")
        while True:
            cmd, arg = conn.recv()
            if cmd == "save":
                conn.send(list(pool.map(lambda r: _save_one(clients[r], arg, rank_flat(r, world, rows)),
                                        clients)))
            elif cmd == "save_plain":
                conn.send(list(pool.map(lambda r: save_plain(r, arg), clients)))
            elif cmd == "latest":
                conn.send({r: _latest_times(clients[r], LATEST_CALLS) for r in arg if r in clients})
            elif cmd == "reopen":  # the same ranks, as clients of another world size (a restart of the job)
                list(pool.map(lambda c: c.close(), clients.values()))
                # readers only: no arena (0 reserves none), so the budget the closed sessions held, and the
                # memory tier's copies of their parts, need not be given back before they open
                clients = open_all(arg, RESTORE_ATTEMPT, 0)
                conn.send("ready")
            elif cmd == "load_plain":
                step, some = arg
                mine = [r for r in some if r in clients]
                conn.send(dict(zip(mine, pool.map(lambda r: _load_plain(clients[r], step), mine))))
            elif cmd == "read_box":
                step, some = arg
                mine = [r for r in some if r in clients]
                conn.send(dict(zip(mine, pool.map(lambda r: _read_box(clients[r], step, r, world, rows), mine))))
            else:
                list(pool.map(lambda c: c.close(), clients.values()))
                conn.send("closed")
                return
    finally:
        pool.shutdown(wait=False)


def visible(conn: Any, step: int, rank: int, timeout: float = 60.0) -> float:
    """Until the daemon on ``conn`` locates every part of ``step`` (its index of the shared tier lags the
    tier: it may answer NOT_FOUND for a step whose commit record is there); returns the seconds waited.
    The bare ``Locate``: on an object store, nothing is fetched (a load would ``Prefetch`` what it names)."""
    from ckptstage.client import errors
    from ckptstage.protos.v1 import ckptstage_pb2 as pb

    t0 = time.monotonic()
    while True:
        try:
            conn.call("Locate", pb.LocateRequest(job=JOB, rank=rank, step=step, all_ranks=True))
            return time.monotonic() - t0
        except errors.CheckpointNotFound:
            if time.monotonic() - t0 > timeout:
                raise
            time.sleep(0.02)


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

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

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


def wait_commit(shared: Path, step: int, job: str = JOB, timeout: float = 600.0) -> float:
    """Until ``step``'s commit record is in the shared directory (polled every 2 ms, untraced); returns that
    moment (monotonic)."""
    from ckptstage.protos import layout

    path = layout.commit_path(shared, job, step)
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {step} never completed on the shared tier ({path})")
        time.sleep(0.002)
    return time.monotonic()
