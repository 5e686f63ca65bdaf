"""The scale simulator's job: N real daemons on one shared tier (a directory, or a bucket of the object store),
and a step saved by every rank, timed to its local and shared commits.

For ``bench_scale.py`` and its DCP peer (:mod:`_scale_peers`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _harness as h
from _scale_ranks import JOB, Ranks, wait_commit
from _scale_s3 import S3Shared
from _syscounts import strace_from_start

Tier = Path | S3Shared  # the shared tier: a directory, or a bucket's prefix on an object store


# ------------------------------------------------------------------ one configuration


def start_daemons(root: Path, shared: Tier, nodes: int, per_node: int, arena_bytes: int,
                  traces: Path | None = None) -> list[h.Daemon]:
    """N daemons on one shared tier, started together; returns once every one is READY. ``traces``: each
    runs under strace from its start, logging there (:func:`strace_from_start`)."""
    settings: dict[str, Any] = {"arena.min_session_bytes": "64KiB", "persist.chunk_bytes": "256KiB",
                                "arena.max_bytes": max(4 << 20, 2 * per_node * arena_bytes),
                                # the daemon's own retention (the harness keeps 100 steps), as a job runs
                                "local.keep_last": 2, "shared.keep_last": 5, "shared.drain_on_stop_s": 0}
    directory = shared if isinstance(shared, Path) else None
    if isinstance(shared, S3Shared):
        settings.update(shared.settings())
    # metrics on (ckptstage_fetched_bytes); scraped only in the restore, after every count
    daemons = [h.Daemon(root / f"d{i}", root / f"d{i}" / "local", directory, metrics=True,
                        node_name=f"node{i:04d}", **settings) for i in range(nodes)]
    for i, d in enumerate(daemons):
        if isinstance(shared, S3Shared):
            d.env.update(shared.env())
        if traces is not None:
            traces.mkdir(parents=True, exist_ok=True)
            d.wrapper = strace_from_start(traces / f"node{i:04d}.strace", detached=True)
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


def committed(shared: Tier, step: int) -> float:
    """Until ``step``'s commit record is on the shared tier; returns that moment (monotonic)."""
    return shared.wait_commit(JOB, step) if isinstance(shared, S3Shared) else wait_commit(shared, step)


def save_step(ranks: Ranks, shared: Tier, step: int) -> tuple[list[float], float, float, int]:
    """Every rank saves ``step``: (blocked per rank, to last local commit, to the shared commit record,
    ``WaitSave`` calls the daemons answered too late)."""
    t0 = time.monotonic()
    done = [t for host in ranks.ask("save", step) for t in host]
    shared_at = committed(shared, step)
    return ([t1 - ts for ts, t1, _, _ in done], max(t2 for _, _, t2, _ in done) - t0, shared_at - t0,
            sum(late for *_, late in done))
