"""Flat and clean under load: the daemon's memory does not grow with saves, and nothing is left behind.

Per settled save the daemon keeps a record of a few hundred bytes, the newest
1024 at most (it used to keep each save's whole manifest for an hour: 1.4 MB
per save of a 500-tensor state).
"""

from __future__ import annotations

import re
import subprocess
import sys
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


def test_daemon_memory_is_flat_over_a_thousand_saves_of_a_500_tensor_state(daemon_factory: Any) -> None:
    d = daemon_factory(**{"shared.dir": "", "local.keep_last": 2}).start()
    state = {f"layer{i}.weight": torch.randn(16) for i in range(500)}
    with Client("rss", socket=d.socket) as c:
        for step in range(1, 201):  # warm up: pools, caches, the allocator's arenas
            c.save(step, state).wait("local", timeout=30)
        before = rss_anon_kib(d.proc.pid)
        for step in range(201, 1001):
            c.save(step, state).wait("local", timeout=30)
        grown = rss_anon_kib(d.proc.pid) - before
    assert grown < 4096, f"daemon private memory grew {grown} KiB over 800 saves"


WORKER = r"""
import sys, torch
from ckptstage.client import Client
socket, job, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
with Client(job, socket=socket) as c:
    for step in range(1, n + 1):
        state = {"w": torch.full((4096,), float(step)), "b": torch.arange(step), "step": step}
        c.save(step, state).wait("local", timeout=60)
        latest = c.latest()
        got = c.load(latest)
        assert got["step"] == latest and torch.equal(got["w"], torch.full((4096,), float(latest))), latest
print("OK", flush=True)
"""


def test_several_processes_saving_and_loading_leave_nothing_behind(daemon_factory: Any) -> None:
    d = daemon_factory(**{"local.keep_last": 2, "shared.keep_last": 2, "retention.interval_s": 0.5}).start()
    pid = d.proc.pid
    with Client("warm", socket=d.socket) as c:  # the pools' threads exist from here on
        c.save(1, {"w": torch.ones(4)}).wait("local", timeout=30)
    wait_until(lambda: not d.connection().status().sessions, 10, "the warm-up session to close")
    fds_before, threads_before = fds(pid), int(re.search(r"Threads:\s+(\d+)",
                                                          Path(f"/proc/{pid}/status").read_text()).group(1))
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(d.socket), f"job{i}", "80"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(3)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0 and "OK" in out, out
    drain(d)
    wait_until(lambda: not d.connection().status().sessions, 10, "every session to close")
    for tier in (d.local, d.shared):
        assert tier is not None
        wait_until(lambda t=tier: not list(t.glob(".tmp/*/*")), 10, f"no temporaries left on {tier}")
    assert not list(Path("/dev/shm").glob(f"ckptstage-{pid}-*"))
    wait_until(lambda: fds(pid) <= fds_before + 2, 10, f"the daemon's descriptors back to {fds_before}")
    threads_after = int(re.search(r"Threads:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1))
    # Pools grow to their bounds and stay; nothing grows per save or per session.
    assert threads_after <= threads_before + 16, (threads_before, threads_after)
    with Client("job0", socket=d.socket) as c:
        assert c.latest() == 80 and c.load(80)["step"] == 80
