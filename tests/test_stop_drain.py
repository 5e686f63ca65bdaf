"""A node going away keeps its checkpoints: on SIGTERM, and on ``ckptstage drain --wait``, the daemon
drains the newest step of each job that only this node holds, before anything older and off the
``drain_every`` cadence too.

Real daemons, a real shared directory, real signals; the drain is throttled (``max_bandwidth``) so that
the queue cannot empty by itself before the node goes.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from ckptstage.client import Client
from ckptstage.protos import layout

JOB = "leaving"
MiB = 1 << 20


def state(step: int, nbytes: int) -> dict[str, Any]:
    return {"w": torch.full((nbytes // 4,), float(step)), "step": step}


def on_shared(shared: Path | None, step: int) -> bool:
    """Whether the step is complete on the shared tier: its commit record is there."""
    assert shared is not None
    return layout.commit_path(shared, JOB, step).exists()


def save_local(d: Any, steps: range, nbytes: int) -> None:
    with Client(JOB, socket=d.socket) as c:
        for step in steps:
            c.save(step, state(step, nbytes)).wait("local", timeout=60)


def stop_by_sigterm(d: Any) -> tuple[int, float]:
    started = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    code = d.proc.wait(timeout=90)
    d.stop()  # reaps, closes the notify socket
    return code, time.monotonic() - started


def restore_elsewhere(daemon_factory: Any, shared: Path | None, step: int, nbytes: int) -> None:
    """The replacement node: its own empty local tier, the same shared tier, loads the step as saved."""
    other = daemon_factory("replacement", **{"shared.dir": str(shared)}).start()
    with Client(JOB, socket=other.socket) as c:
        assert c.latest() == step
        got = c.load(step)
    assert got["step"] == step and torch.equal(got["w"], state(step, nbytes)["w"])


def test_sigterm_drains_the_newest_step_first_within_its_time(daemon_factory: Any) -> None:
    nbytes = 2 * MiB
    d = daemon_factory("node", **{"shared.max_bandwidth": "1MiB/s", "shared.drain_on_stop_s": 20}).start()
    save_local(d, range(1, 7), nbytes)  # 12 MiB queued at 1 MiB/s: the drain is far behind
    assert not on_shared(d.shared, 6)
    code, took = stop_by_sigterm(d)
    assert code == 0
    assert on_shared(d.shared, 6), d.log_tail()
    assert not all(on_shared(d.shared, s) for s in range(1, 6)), "the queue could not have emptied by itself"
    assert took < 20, f"the newest step alone takes ~2-4 s at 1 MiB/s, not the whole queue: {took:.1f}s"
    assert f"stopping: drained {JOB} step 6 to the shared tier" in d.log.read_text()
    restore_elsewhere(daemon_factory, d.shared, 6, nbytes)


def test_sigterm_drains_a_step_the_cadence_keeps_off_the_shared_tier(daemon_factory: Any) -> None:
    nbytes = 256 << 10
    d = daemon_factory("node", **{"shared.drain_every": 10, "shared.drain_on_stop_s": 20}).start()
    save_local(d, range(10, 14), nbytes)  # 10 drains by the cadence; 11-13 live on this node's SSD only
    with Client(JOB, socket=d.socket) as c:
        c.wait_step(10, "shared", timeout=60)
    assert not on_shared(d.shared, 13)
    code, _ = stop_by_sigterm(d)
    assert code == 0
    assert on_shared(d.shared, 13) and not on_shared(d.shared, 11) and not on_shared(d.shared, 12)
    restore_elsewhere(daemon_factory, d.shared, 13, nbytes)


def test_drain_on_stop_off_leaves_the_step_and_exits_at_once(daemon_factory: Any) -> None:
    d = daemon_factory("node", **{"shared.drain_every": 10, "shared.drain_on_stop_s": 0}).start()
    save_local(d, range(11, 13), 64 << 10)
    code, took = stop_by_sigterm(d)
    assert code == 0 and took < 10
    assert not on_shared(d.shared, 12)


def test_what_cannot_drain_in_time_is_named_and_the_daemon_still_exits(daemon_factory: Any) -> None:
    # Uncompressed: its state would shrink, and the cap counts the bytes stored.
    d = daemon_factory("node", **{"shared.max_bandwidth": "1MiB/s", "shared.drain_on_stop_s": 1,
                                  "shared.drain_every": 10, "shared.compression": "none"}).start()
    save_local(d, range(11, 12), 4 * MiB)  # 4 s at 1 MiB/s: more than the second it is given
    code, took = stop_by_sigterm(d)
    assert code == 0 and took < 15
    warned = [line for line in d.log.read_text().splitlines() if " WARNING " in line and "stopping:" in line]
    assert len(warned) == 1 and f"{JOB} step 11 is not on the shared tier after 1s" in warned[0], warned


def test_ckptstage_drain_wait_does_the_same_on_demand(daemon_factory: Any) -> None:
    """The Kubernetes preStop hook: `ckptstage drain --wait --timeout S` before the pod's SIGTERM."""
    nbytes = 256 << 10
    d = daemon_factory("node", **{"shared.drain_every": 10, "shared.drain_on_stop_s": 0}).start()
    save_local(d, range(11, 14), nbytes)
    result = subprocess.run([sys.executable, "-m", "ckptstage.client.cli", "--socket", str(d.socket), "drain",
                             "--wait", "--timeout", "30"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert on_shared(d.shared, 13) and not on_shared(d.shared, 12)
    d.stop()
    restore_elsewhere(daemon_factory, d.shared, 13, nbytes)


def test_a_job_killed_with_notice_resumes_from_its_step_on_another_node(daemon_factory: Any, tmp_path: Path) -> None:
    """The whole story: the node gets notice, the trainer (on_preemption) and its daemon both get SIGTERM.
    The trainer's last snapshot (step 17; its periodic saves are every 10 steps, and only every 10th step
    goes to the shared tier) reaches the daemon, the daemon drains it before it exits, and a replacement
    node with an empty SSD resumes from step 17."""
    from preemption_trainer import STOP_AT, model_and_data, train

    d = daemon_factory("node", **{"shared.drain_every": 10, "shared.max_bandwidth": "1MiB/s",
                                  "shared.drain_on_stop_s": 20}).start()
    trainer = subprocess.Popen([sys.executable, str(Path(__file__).parent / "preemption_trainer.py"), str(d.socket),
                                JOB, "default", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        assert trainer.stdout is not None and trainer.stdout.readline().strip() == f"at {STOP_AT}"
        trainer.send_signal(signal.SIGTERM)  # the node's notice reaches the trainer first ...
        assert trainer.wait(timeout=60) == -signal.SIGTERM
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    code, _ = stop_by_sigterm(d)  # ... then its daemon
    assert code == 0 and on_shared(d.shared, STOP_AT), d.log_tail()
    model, x = model_and_data()
    expected = train(model, x, STOP_AT)
    other = daemon_factory("replacement", **{"shared.dir": str(d.shared)}).start()
    with Client(JOB, socket=other.socket) as c:
        assert c.latest() == STOP_AT
        got = c.load()
    assert all(torch.equal(got["model"][k], v) for k, v in expected.items())


@pytest.mark.parametrize("trainer", ["alive", "exited"])
def test_sigterm_drains_the_newest_step_kept_in_memory_only(daemon_factory: Any, trainer: str) -> None:
    """``[local] persist_every = 10``: steps 11-13 are in the daemon's shared memory only, in the trainer's
    arena (its trainer alive) or in the memory tier (its trainer gone). On SIGTERM step 13 is written to the
    SSD, drained, and a replacement node loads it."""
    nbytes = 256 << 10
    d = daemon_factory("node", **{"local.persist_every": 10, "shared.drain_every": 10,
                                  "shared.drain_on_stop_s": 20}).start()
    c = Client(JOB, socket=d.socket)
    try:
        for step in range(10, 14):
            c.save(step, state(step, nbytes)).wait("memory" if step % 10 else "shared", timeout=60)
        if trainer == "exited":
            c.close()
        assert not on_shared(d.shared, 13) and not layout.commit_path(d.local, JOB, 13).exists()
        code, _ = stop_by_sigterm(d)
    finally:
        with contextlib.suppress(Exception):  # the daemon is gone: the session cannot be closed politely
            c.close()
    assert code == 0
    assert on_shared(d.shared, 13) and not on_shared(d.shared, 12), d.log_tail()
    log = d.log.read_text()
    assert f"stopping: wrote {JOB} step 13 (kept in memory only) to local SSD: ranks 0" in log
    assert f"stopping: drained {JOB} step 13 to the shared tier" in log
    restore_elsewhere(daemon_factory, d.shared, 13, nbytes)
