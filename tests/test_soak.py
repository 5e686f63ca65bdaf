"""Flat and clean under load: the daemon's memory does not grow with saves, and nothing is left behind.

Per settled save the daemon keeps a record of a few hundred bytes, the newest
1024 at most (it used to keep each save's whole manifest for an hour: 1.4 MB
per save of a 500-tensor state).
"""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from ckptstage.client import Client
from support import drain, wait_until

pytestmark = pytest.mark.slow


def rss_anon_kib(pid: int) -> int:
    """Private memory of the process: the arena (shared memory) is not in it."""
    m = re.search(r"RssAnon:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    assert m is not None
    return int(m.group(1))


def fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def test_daemon_memory_is_flat_over_hundreds_of_saves_of_a_500_tensor_state(daemon_factory: Any) -> None:
    """4 MiB over 400 saves: a leak of 10 KiB per save shows (keeping each save's manifest was 1.4 MB)."""
    d = daemon_factory(**{"shared.dir": "", "local.keep_last": 2}).start()
    state = {f"layer{i}.weight": torch.randn(16) for i in range(500)}
    with Client("rss", socket=d.socket) as c:
        for step in range(1, 101):  # warm up: pools, caches, the allocator's arenas
            c.save(step, state).wait("local", timeout=30)
        before = rss_anon_kib(d.proc.pid)
        for step in range(101, 501):
            c.save(step, state).wait("local", timeout=30)
        grown = rss_anon_kib(d.proc.pid) - before
    assert grown < 4096, f"daemon private memory grew {grown} KiB over 400 saves"


WORKER = r"""
import sys, torch
from ckptstage.client import Client


def state(step):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(4096, generator=g), "b": torch.arange(step % 50, dtype=torch.int16),
            "h": torch.randn(64, generator=g).to(torch.bfloat16), "step": step}


def same(got, want):
    return got["step"] == want["step"] and all(
        got[k].dtype == want[k].dtype and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8))
        for k in ("w", "b", "h"))


socket, job, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
c = Client(job, socket=socket)
pending = []
for step in range(1, n + 1):
    pending.append(c.save(step, state(step)))
    if len(pending) == 2:  # two saves in flight: retention deletes while the next one persists
        pending.pop(0).wait("local", timeout=60)
    if step % 3 == 0:  # and loads race with retention and drains
        latest = c.latest()
        assert latest is not None and same(c.load(latest), state(latest)), latest
    if step % 25 == 0:  # a new session now and then: what a session holds must go with it
        for h in pending:
            h.wait("local", timeout=60)
        pending = []
        c.close()
        c = Client(job, socket=socket)
for h in pending:
    h.wait("local", timeout=60)
c.close()
print("OK", flush=True)
"""
STATE_OF_WORKER = WORKER.split("socket, job, n")[0]


def threads(pid: int) -> int:
    m = re.search(r"Threads:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
    assert m is not None
    return int(m.group(1))


def run_workers(d: Any, jobs: list[str], n: int) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(d.socket), job, str(n)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for job in jobs]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0 and "OK" in out, out


def test_several_processes_saving_and_loading_leave_nothing_behind(daemon_factory: Any) -> None:
    d = daemon_factory(**{"local.keep_last": 2, "shared.keep_last": 2, "retention.interval_s": 0.5}).start()
    pid = d.proc.pid
    n, jobs = 80, [f"job{i}" for i in range(4)]
    # Warm up with twice the concurrency: the daemon's pools (writers, drainers, the RPC executors) grow to
    # their bounds on demand and keep their threads; what is measured afterwards is growth per save or session.
    scope: dict[str, Any] = {}
    exec(STATE_OF_WORKER, scope)  # the workers' state() and same()

    def warm(job: str) -> None:
        with Client(job, socket=d.socket) as c:
            for step in range(1, 7):
                c.save(step, scope["state"](step)).wait("local", timeout=60)
                assert scope["same"](c.load(step), scope["state"](step))

    with ThreadPoolExecutor(2 * len(jobs)) as pool:
        list(pool.map(warm, [f"warm{i}" for i in range(2 * len(jobs))]))
    drain(d)
    wait_until(lambda: not d.connection().status().sessions, 10, "the warm-up sessions to close")
    fds_before, threads_before = fds(pid), threads(pid)
    run_workers(d, jobs, n)
    drain(d)
    wait_until(lambda: not d.connection().status().sessions, 10, "every session to close")
    for tier in (d.local, d.shared):
        assert tier is not None
        wait_until(lambda t=tier: not list(t.glob(".tmp/*/*")), 10,
                   f"no temporaries left on {tier}: {sorted(p.name for p in tier.glob('.tmp/*/*'))}")
    assert not list(Path("/dev/shm").glob(f"ckptstage-{pid}-*"))
    # The memory tier keeps each job's newest part (one rank each here): two descriptors apiece (the arena's
    # own, for handing over, and its mapping's), bounded by the jobs, not growing per save or session.
    wait_until(lambda: fds(pid) <= fds_before + 2 + 2 * len(jobs), 10,
               f"the daemon's descriptors back to {fds_before} + {2 * len(jobs)} (now {fds(pid)})")
    # The pools had their threads already; nothing grows per save or per session.
    wait_until(lambda: threads(pid) <= threads_before + 4, 10,
               f"the daemon's threads back to {threads_before} (now {threads(pid)})")
    for job in jobs:
        with Client(job, socket=d.socket) as c:
            steps = [i.step for i in c.list()]
            assert c.latest() == n and steps[-2:] == [n - 1, n], steps
            for step in steps[-2:]:  # bit-exact, from both tiers' newest
                assert scope["same"](c.load(step), scope["state"](step)), (job, step)
