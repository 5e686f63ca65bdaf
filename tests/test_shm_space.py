"""Shared memory smaller than the arena budget.

A container's /dev/shm is often far smaller than ``[arena] max_bytes``. The
daemon caps the budget at start to what the file system holds (a warning
names both figures and the key; ``ckptstage status`` shows the cap), and a
save that finds no room there (something outside the daemon filled it) is
an ``ArenaFull`` that says how much there is and what to change, instead of
an internal error pointing to a traceback nobody logged.

The arenas live in a small tmpfs mounted for the test (``[arena] dir``):
root only, skipped where mounting is not permitted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ckptstage.client import ArenaFull, Client
from support import small_tmpfs

MiB = 1 << 20
SHM_BYTES = 24 * MiB


@pytest.fixture
def small_shm(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs of the test's own."""
    with small_tmpfs(tmp_path / "shm", SHM_BYTES) as where:
        yield where


def status_json(daemon: Any) -> dict[str, Any]:
    cli = Path(sys.executable).parent / "ckptstage"
    out = subprocess.run([str(cli), "--json", "status", "--socket", str(daemon.socket)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def test_a_budget_larger_than_the_shm_mount_is_capped_with_a_warning(daemon_factory: Any, small_shm: Path) -> None:
    d = daemon_factory(**{"arena.dir": str(small_shm), "arena.max_bytes": "512MiB"}).start()
    warnings = [line for line in d.log.read_text().splitlines() if "arena.max_bytes" in line and "WARNING" in line]
    assert len(warnings) == 1, d.log_tail()
    assert str(512 * MiB) in warnings[0] and str(SHM_BYTES) in warnings[0] and str(small_shm) in warnings[0]
    budget = status_json(d)["arena_budget_bytes"]
    assert 0 < budget <= SHM_BYTES, budget
    # A state larger than the mount still saves: it streams through the arena the mount holds.
    state = {"w": torch.arange(8 * MiB, dtype=torch.float32)}  # 32 MiB
    with Client("capped", socket=d.socket) as c:
        c.save(1, state).wait("local", timeout=60)
        assert torch.equal(c.load(1)["w"], state["w"])


def test_a_save_with_no_shared_memory_left_is_arena_full_naming_the_mount_and_the_key(
        daemon_factory: Any, small_shm: Path) -> None:
    d = daemon_factory(**{"arena.dir": str(small_shm), "arena.max_bytes": "512MiB"}).start()
    filler = small_shm / "someone-else"
    with open(filler, "wb") as f:  # another program takes the mount's room after the daemon started
        os.posix_fallocate(f.fileno(), 0, SHM_BYTES - 512 * 1024)
    with Client("no-room", socket=d.socket) as c:
        with pytest.raises(ArenaFull) as info:
            c.save(1, {"w": torch.ones(MiB)}).wait("local", timeout=60)
        message = str(info.value)
        assert str(small_shm) in message and "arena.max_bytes" in message and "bytes free of" in message, message
        assert "traceback" not in message
        filler.unlink()  # room again: the same client saves
        c.save(2, {"w": torch.ones(MiB)}).wait("local", timeout=60)
        assert c.latest() == 2
    assert "Traceback" not in d.log.read_text()
