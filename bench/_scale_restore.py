"""The scale simulator's restore at another world size: bytes read from the shared tier, per node.

For ``bench_scale.py``, after the saves: every rank saves one more step with a
plain (unsharded) state, the hosts reopen their W ranks as clients of a world
of 2W (a restart at another world size), and two loads run, one node at a
time (the node's ranks at once, the other nodes idle), so that what is read in
a node's window is that node's:

* **plain**: each rank's real ``Client.load(step)`` of the plain step; at
  another world size every rank gets rank 0's plain values (client/loader.py,
  ``tree_rank``), so every node needs rank 0's part once;
* **box**: each rank reads its own resharding box of the newest sharded step
  (half of its fragment and half of the next, ``Client.open_step`` then
  ``StepView.read_box``), what ``reshard()`` does for rank W/2 alone.

**read**, per node: on a directory, the bytes that the rank hosts and that
node's daemon (where a fetch reads) got from files under the shared directory,
counted with ``strace -y`` (:func:`_syscounts.count_reads`; data files apart
from manifests, indexes and records); on an object store, the bytes of object
bodies the server sent in the window (its own counter, less the daemons' idle
rate times the window), and the daemon's ``ckptstage_fetched_bytes``.
**need**: the unique data bytes the node's ranks need that the node holds no
copy of (the plan: the whole of rank 0's data file; the rows of the boxes in
parts of other nodes; on an object store each such part's manifest object
too, since the server's byte counter cannot tell objects apart). **ratio** =
read (directory: data files; object store: all bytes sent) / need; the
target is <= 1.0 (each shared byte read at most once per node, and only the
bytes needed); a node that needs nothing but reads is ``inf``. Times are taken under strace in
directory mode: not reported as times there.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _harness as h
from _scale_ranks import COLS, JOB, Ranks, box_of, visible
from _scale_s3 import S3Shared, Snapshot
from _syscounts import READS, FileReads, Tracer, count_reads

FETCHED = "ckptstage_fetched_bytes_total"
PHASES = ("plain", "box")


@dataclass
class NodeReads:
    """One node's reads in one load (bytes; NaN where the mode cannot tell)."""

    node: int
    ranks: int
    need: int
    s3: bool = False
    read: float = math.nan          # every byte read from the shared tier (data and metadata)
    read_data: float = math.nan     # directory: data files only; object store: what the daemon fetched
    unique_data: float = math.nan   # directory: distinct bytes of the data files read
    read_meta: float = math.nan     # directory: manifests, step indexes, commit records
    unique_meta: float = math.nan
    requests: dict[str, int] = field(default_factory=dict)  # object store: by type, in the node's window
    tiers: dict[str, int] = field(default_factory=dict)    # where the ranks' loads read (last_load_tier)
    ok: bool = True
    slowest_s: float = math.nan
    window_s: float = math.nan

    @property
    def ratio(self) -> float:
        """Shared bytes read (directory: of data files; object store: all the server sent) / unique bytes
        needed; infinite where the node needs none but read some (over 1 KiB), NaN where neither."""
        got = self.read if self.s3 else self.read_data
        if self.need:
            return got / self.need
        return math.inf if got > 1024 else math.nan

    @property
    def repeats(self) -> float:
        """Directory: data bytes read / distinct data bytes read (> 1: some byte read twice on the node)."""
        return self.read_data / self.unique_data if self.unique_data else math.nan


def node_ranks(world: int, nodes: int, node: int) -> list[int]:
    return [r for r in range(world) if r * nodes // world == node]


def _held(daemon: h.Daemon, step: int, rank: int) -> bool:
    from ckptstage.protos import layout

    return (layout.part_dir(daemon.local, JOB, step, rank) / layout.DATA_FILE).exists()


def needs(world: int, nodes: int, rows: int, daemons: Sequence[h.Daemon], plain: int, sharded: int,
          manifests: bool) -> dict[str, list[int]]:
    """Per load, per node: the unique data bytes its ranks need from parts it holds no copy of (the whole
    of rank 0's data file; the rows of the boxes), with ``manifests`` each such part's manifest too."""
    from ckptstage.protos import layout

    def size(step: int, rank: int, name: str) -> int:  # the owner's local copy: the same bytes
        part = layout.part_dir(daemons[rank * nodes // world].local, JOB, step, rank)
        if name == layout.MANIFEST_FILE:
            return (part / name).stat().st_size
        return layout.manifest_files(layout.read_manifest(part))[name].size  # its own file, or its chunks

    def manifest(step: int, rank: int) -> int:
        return size(step, rank, layout.MANIFEST_FILE) if manifests else 0

    out: dict[str, list[int]] = {"plain": [], "box": []}
    row_bytes = COLS * 4
    for n, d in enumerate(daemons):
        out["plain"].append(0 if _held(d, plain, 0) else size(plain, 0, layout.DATA_FILE) + manifest(plain, 0))
        wanted: set[int] = set()
        for r in node_ranks(world, nodes, n):
            lo = box_of(r, world, rows)
            wanted.update(range(lo, lo + rows))
        away = {row // rows for row in wanted if not _held(d, sharded, row // rows)}
        out["box"].append(sum(row_bytes for row in wanted if row // rows in away)
                          + sum(manifest(sharded, p) for p in away))
    return out


def restore(ranks: Ranks, daemons: Sequence[h.Daemon], tier: Path | S3Shared, world: int, rows: int,
            plain: int, sharded: int, logs: Path, idle: Snapshot | None = None,
            idle_s: float = math.nan) -> dict[str, list[NodeReads]]:
    """The plain step ``plain`` (already saved by every rank) loaded by W ranks at world size 2W, then each
    rank's box of the sharded step ``sharded``, one node at a time; per load, per node, what was read.

    ``idle``/``idle_s``: the object store's requests and bytes in an idle window of that length (every
    daemon's polling), taken off each node's window pro rata."""
    from ckptstage.client.rpc import Connection
    from ckptstage.protos import layout

    nodes = len(daemons)
    for d in daemons:  # every node's index names the plain step before any load
        with Connection(d.socket) as conn:
            visible(conn, plain, 0)
    s3 = isinstance(tier, S3Shared)
    need = needs(world, nodes, rows, daemons, plain, sharded, manifests=s3)
    if any(r != "ready" for r in ranks.ask("reopen", 2 * world)):
        raise RuntimeError("a rank host could not reopen its ranks at world size 2W")
    tracer = None if s3 else Tracer([*ranks.pids, *(d.pid for d in daemons)], logs, calls=READS, strings=8)
    out: dict[str, list[NodeReads]] = {p: [] for p in PHASES}
    windows: dict[str, tuple[float, float]] = {}
    try:
        for phase, step in (("plain", plain), ("box", sharded)):
            cmd = "load_plain" if phase == "plain" else "read_box"
            for n, d in enumerate(daemons):
                mine = node_ranks(world, nodes, n)
                fig = NodeReads(n, len(mine), need[phase][n], s3)
                fetched = d.scrape().get(FETCHED, 0.0)
                window = tier.server.window() if isinstance(tier, S3Shared) else None
                t0 = time.time()
                got: dict[int, tuple[bool, str | None, float]] = {}
                for host in ranks.ask(cmd, (step, mine)):
                    got.update(host)
                windows[f"{phase}{n}"] = (t0, time.time())
                if window is not None:
                    delta, took = window.stop()
                    _s3_reads(fig, delta, took, idle, idle_s)
                fig.read_data = d.scrape().get(FETCHED, 0.0) - fetched if s3 else math.nan
                fig.window_s = windows[f"{phase}{n}"][1] - t0
                fig.ok = len(got) == len(mine) and all(ok for ok, _, _ in got.values())
                fig.tiers = dict(Counter(str(t) for _, t, _ in got.values() if t is not None))
                fig.slowest_s = max((s for _, _, s in got.values()), default=math.nan)
                out[phase].append(fig)
    finally:
        if tracer is not None:
            tracer.stop()
    if tracer is not None and isinstance(tier, Path):
        _dir_reads(out, tracer.logs, len(ranks.pids), tier, windows)
    return out


def _s3_reads(fig: NodeReads, delta: Snapshot, took: float, idle: Snapshot | None, idle_s: float) -> None:
    """The server's bytes sent and requests in a node's window, less the idle polling's share of it."""
    scale = took / idle_s if idle is not None and idle_s > 0 else 0.0
    base_sent = idle.sent * scale if idle is not None else 0.0
    fig.read = max(0.0, delta.sent - base_sent)
    fig.requests = dict(delta.requests)


def _dir_reads(out: dict[str, list[NodeReads]], logs: Sequence[Path], hosts: int, shared: Path,
               windows: dict[str, tuple[float, float]]) -> None:
    """Per node window: what the rank hosts (all of them: only that node's ranks ran) and that node's daemon
    read from files under ``shared``."""
    from ckptstage.protos import layout

    per_log = [count_reads(log, shared, windows) for log in logs]
    for phase, figs in out.items():
        for fig in figs:
            name = f"{phase}{fig.node}"
            files: dict[str, FileReads] = {}
            for got in [*per_log[:hosts], per_log[hosts + fig.node]]:
                for path, reads in got[name].items():
                    files.setdefault(path, FileReads()).merge(reads)
            data = [r for p, r in files.items() if Path(p).name == layout.DATA_FILE or "/chunks/" in p]
            meta = [r for p, r in files.items() if not (Path(p).name == layout.DATA_FILE or "/chunks/" in p)]
            fig.read_data, fig.unique_data = sum(r.total for r in data), sum(r.unique for r in data)
            fig.read_meta, fig.unique_meta = sum(r.total for r in meta), sum(r.unique for r in meta)
            fig.read = fig.read_data + fig.read_meta


def worst(figs: Sequence[NodeReads]) -> float:
    """The largest ratio over the nodes that need something (NaN where none does); the nodes that need
    nothing and read all the same are :func:`needless`."""
    ratios = [f.ratio for f in figs if math.isfinite(f.ratio)]
    return max(ratios) if ratios else math.nan


def needless(figs: Sequence[NodeReads]) -> int:
    """Nodes whose ranks need nothing from the shared tier, but that read from it (over 1 KiB)."""
    return sum(math.isinf(f.ratio) for f in figs)


def summary(restores: dict[str, list[NodeReads]]) -> dict[str, Any]:
    """For the JSON record: per load, every node's figures, the worst ratio and the needless readers."""
    return {phase: {"nodes": [vars(f) | {"ratio": f.ratio, "repeats": f.repeats} for f in figs],
                    "max_ratio": worst(figs), "needless_nodes": needless(figs)}
            for phase, figs in restores.items()}
