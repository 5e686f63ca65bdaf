"""What a trainer process that ends without ``close()`` leaves behind, and how it exits.

Every save it started reaches the daemon and is committed (the client waits
for its snapshots in flight at interpreter exit, at most ``exit_timeout``),
and the process exits with Python's own status: never an abort from a
client thread left inside a gRPC call ("terminate called without an active
exception", status 134), whatever error came before. Real trainer processes
(subprocesses) against a real daemon.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from ckptstage.client import Client

from test_shm_space import SHM_BYTES, small_shm  # noqa: F401 - the fixture


def run_script(body: str, *args: str, timeout: float = 120, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(body), *args], capture_output=True, text=True,
                          timeout=timeout, input=stdin)


def state_of(step: int) -> dict[str, Any]:
    return {"w": torch.full((1 << 20,), float(step)), "step": step}


SAVES_AND_ENDS = """
    import sys, torch
    from ckptstage.client import Client
    c = Client("ends", socket=sys.argv[1])
    for step in range(1, 6):
        c.save(step, {"w": torch.full((1 << 20,), float(step)), "step": step})
    # no wait, no close(): the script just ends
"""


def test_a_script_that_saves_and_ends_gets_its_last_step_committed(daemon: Any) -> None:
    done = run_script(SAVES_AND_ENDS, str(daemon.socket))
    assert done.returncode == 0, done.stderr
    assert "terminate called" not in done.stderr
    with Client("ends", socket=daemon.socket) as c:
        # The daemon commits what it holds whole after the trainer is gone: give it the moment it takes.
        deadline = time.monotonic() + 30
        while c.latest() != 5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.latest() == 5
        loaded = c.load(5)
        assert loaded["step"] == 5 and torch.equal(loaded["w"], state_of(5)["w"])


WAITS_THEN_GIVES_UP = """
    import sys, torch
    from ckptstage.client import Client
    c = Client("gives-up", socket=sys.argv[1], exit_timeout=float(sys.argv[2]))
    c.save(1, {"w": torch.ones(4)}).wait("local", timeout=30)
    print("ready", flush=True)
    sys.stdin.readline()  # the daemon is stopped meanwhile
    c.save(2, {"w": torch.ones(1 << 20)})
"""


def test_the_wait_at_exit_is_bounded_by_exit_timeout_and_says_what_it_gave_up(daemon: Any) -> None:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(WAITS_THEN_GIVES_UP), str(daemon.socket), "2"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            _, stderr = proc.communicate("go\n", timeout=60)
            elapsed = time.monotonic() - t0
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert 2.0 <= elapsed <= 2.0 + 3.0, f"exited after {elapsed:.1f}s with exit_timeout=2"
    assert "gave up after" in stderr and "[2]" in stderr and "exit_timeout" in stderr, stderr
    assert "terminate called" not in stderr


FAILS_THEN_EXITS = """
    import sys, torch
    from ckptstage.client import ArenaFull, Client
    c = Client("fails", socket=sys.argv[1])
    try:
        c.save(1, {"w": torch.ones(1 << 20)}).wait("local", timeout=30)
    except ArenaFull as e:
        print("ArenaFull", flush=True)
    if sys.argv[2] == "exit-3":
        sys.exit(3)
"""


@pytest.mark.parametrize("how,status", [("falls-off-the-end", 0), ("exit-3", 3)])
def test_a_process_whose_save_failed_exits_with_its_own_status(daemon_factory: Any, small_shm: Path,
                                                              how: str, status: int) -> None:
    d = daemon_factory(**{"arena.dir": str(small_shm)}).start()
    with open(small_shm / "someone-else", "wb") as f:  # no room for an arena
        os.posix_fallocate(f.fileno(), 0, SHM_BYTES - 512 * 1024)
    # The abort came from a thread inside a gRPC call at interpreter finalization, a race: several tries,
    # at once (each process mostly waits for its imports).
    with ThreadPoolExecutor(4) as pool:
        tries = list(pool.map(lambda _: run_script(FAILS_THEN_EXITS, str(d.socket), how), range(4)))
    for done in tries:
        assert done.stdout.strip() == "ArenaFull", done.stdout + done.stderr
        assert "terminate called" not in done.stderr
        assert done.returncode == status, f"exit status {done.returncode}: {done.stderr[-2000:]}"
