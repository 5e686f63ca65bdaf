"""Jobs whose ranks do not all save: ``world_size=1`` declared (only rank 0 saves), and steps left incomplete."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from dist_harness import RankContext, run_ranks
from support import free_port, metric, scrape, wait_until

from ckptstage.client import Client, InvalidRequest


def _digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode() + state[key].numpy().tobytes())
    return h.hexdigest()


def rank0_saves_everyone_loads(ctx: RankContext, job: str) -> dict[str, Any]:
    import torch.distributed as dist

    state = {"w": torch.arange(1000, dtype=torch.float32) + 1, "b": torch.ones(3)}  # replicated, as under DDP
    with Client(job, socket=ctx.socket, world_size=1) as c:
        refused = ""
        if ctx.rank == 0:
            c.save(5, state).wait("local", timeout=60)
        else:
            try:
                c.save(5, state)
            except InvalidRequest as e:
                refused = str(e)
        dist.barrier()
        latest = c.latest()
        loaded = c.load(latest)
        info = next(i for i in c.list() if i.step == 5)
        return {"rank": c.rank, "world": c.world_size, "latest": latest, "digest": _digest(loaded),
                "complete": info.complete, "parts_world": info.world_size, "refused": refused}


def test_world_size_1_in_every_rank_means_only_rank_0_saves(daemon) -> None:
    out = run_ranks(rank0_saves_everyone_loads, 2, str(daemon.socket), args=("r0-only",), timeout=120)
    want = _digest({"w": torch.arange(1000, dtype=torch.float32) + 1, "b": torch.ones(3)})
    for r in out:
        assert (r["rank"], r["world"], r["latest"], r["complete"], r["parts_world"]) == (0, 1, 5, True, 1), r
        assert r["digest"] == want
    assert out[0]["refused"] == ""
    assert "rank 1 of its process group" in out[1]["refused"] and "world_size=1" in out[1]["refused"]


def test_steps_that_stay_incomplete_are_reported(daemon_factory) -> None:
    port = free_port()
    d = daemon_factory("incomplete", **{"metrics.listen": f"127.0.0.1:{port}", "retention.interval_s": 0.2,
                                        "retention.incomplete_after_s": 1}).start()
    # Rank 0 of a declared world of 2 saves; rank 1 never does (a DDP job that forgot world_size=1).
    with Client("half-job", socket=d.socket, rank=0, world_size=2, attempt="run-1") as c:
        c.save(3, {"w": torch.ones(10)}).wait("local", timeout=30)
        assert metric(scrape(port), "ckptstage_incomplete_steps") == 0  # just saved: late, not stuck
        wait_until(lambda: metric(scrape(port), "ckptstage_incomplete_steps") == 1, 10, "the step reported stuck")
        (info,) = c.list()
        assert (info.complete, info.ranks_missing) == (False, (1,))
    warned = wait_until(lambda: [line for line in d.log.read_text().splitlines() if "half-job step 3" in line
                                 and "still not complete" in line], 5, "the warning in the daemon's log")
    assert "ranks [1] of attempt 'run-1' (world size 2)" in warned[0] and "world_size=1" in warned[0]
    # Once the missing rank saves, the step completes and is no longer counted; it was logged only once.
    with Client("half-job", socket=d.socket, rank=1, world_size=2, attempt="run-1") as c:
        c.save(3, {"w": torch.ones(10)}).wait("local", timeout=30)
    wait_until(lambda: metric(scrape(port), "ckptstage_incomplete_steps") == 0, 10, "the step no longer counted")
    assert sum("half-job step 3" in line and "still not complete" in line
               for line in d.log.read_text().splitlines()) == 1
