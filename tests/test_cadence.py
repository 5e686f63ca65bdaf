"""Per-tier cadence: every save to memory, every Nth to local SSD, every Mth to the shared tier.

Multi-level checkpointing: a frequent cheap level for process crashes, a
rare expensive one for losing the node. ``[local] persist_every = N`` writes
steps whose number is a multiple of N to local SSD and keeps the others in
memory only (a restart on the node loads the newest from there);
``[shared] drain_every = M`` drains multiples of M, and local retention
deletes the others without waiting for a shared copy they will never get.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from support import drain, wait_until

from ckptstage.client import Client
from ckptstage.client.errors import CkptStageError

SETTINGS = {"shared.drain_every": 2, "local.keep_last": 2, "arena.min_session_bytes": "1MiB"}


def state(step: int) -> dict[str, object]:
    return {"w": torch.full((1000,), float(step)), "step": step}


def steps_on(tier_dir, job: str) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in (tier_dir / job).glob("step-*")
                  if (p / "commit.json").exists())


def test_only_every_mth_step_is_drained_and_the_rest_retire_locally(daemon_factory):
    d = daemon_factory(**SETTINGS).start()
    with Client("cad", socket=d.socket) as c:
        for step in range(1, 6):
            h = c.save(step, state(step))
            h.wait("local", timeout=30)
            if step % 2 == 0:
                h.wait("shared", timeout=60)
            else:
                with pytest.raises(CkptStageError, match=r"does not go to the shared tier.*drain_every = 2"):
                    h.wait("shared", timeout=5)
        drain(d)
        assert steps_on(d.shared, "cad") == [2, 4]
        # keep_last = 2 on local: steps 1-3 went, none of them waited for a shared copy; 5 is newest. (The pass
        # that deletes step 3 follows step 5's commit, which wait("local") does not wait for.)
        wait_until(lambda: steps_on(d.local, "cad") == [4, 5], timeout=30, what="steps 1-3 gone from local")
        states = {i.step: i.drain_state for i in c.list()}
        assert states[5] == "local-only" and states[4] == "drained" and states[2] == "drained"
        with pytest.raises(CkptStageError, match="drain_every"):
            c.wait_step(5, "shared", timeout=5)
        assert c.load(5)["step"] == 5 and c.load(2)["step"] == 2


MEMORY_TRAINER = r"""
import sys, time
import torch
from ckptstage.client import Client

socket, job, last = sys.argv[1], sys.argv[2], int(sys.argv[3])
c = Client(job, socket=socket)
for step in range(1, last + 1):
    c.save(step, {"w": torch.full((1 << 18,), float(step)), "step": step}).wait("memory", timeout=60)
print("SAVED", flush=True)
time.sleep(3600)
"""


def test_steps_between_persisted_ones_live_in_memory_and_a_restart_loads_the_newest(daemon_factory):
    d = daemon_factory(**{"local.persist_every": 5, "shared.drain_every": 5, "arena.min_session_bytes": "1MiB",
                          "persist.chunk_bytes": "1MiB"}).start()
    proc = subprocess.Popen([sys.executable, "-c", MEMORY_TRAINER, str(d.socket), "mem", "7"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"SAVED", proc.stderr
    finally:
        proc.kill()
        proc.wait(30)
    drain(d)
    assert steps_on(d.local, "mem") == [5] and steps_on(d.shared, "mem") == [5]  # 1-4, 6, 7: memory only
    with Client("mem", socket=d.socket) as c:
        assert wait_until(lambda: c.latest() == 7, 20, "step 7 kept in memory: the newest, whole")
        infos = {i.step: i for i in c.list()}
        assert infos[7].tiers == ("memory",) and infos[7].drain_state == "memory-only"
        assert set(infos[5].tiers) >= {"local", "shared"}
        assert c.load()["step"] == 7 and c.last_load_tier == "memory"
        assert torch.equal(c.load(7)["w"], torch.full((1 << 18,), 7.0))
    d.stop()  # the memory tier lives in the daemon only: what it held is gone, the disk's newest remains
    d.start()
    with Client("mem", socket=d.socket) as c:
        assert c.latest() == 5 and c.load()["step"] == 5 and c.last_load_tier == "local"


def test_waits_and_deletes_of_a_step_kept_in_memory_only_say_so(daemon_factory):
    d = daemon_factory(**{"local.persist_every": 5, "shared.drain_every": 5,
                          "arena.min_session_bytes": "1MiB"}).start()
    with Client("mw", socket=d.socket) as c:
        h = c.save(3, state(3))
        h.wait("memory", timeout=30)
        with pytest.raises(CkptStageError, match=r"step 3 is kept in memory only.*persist_every = 5"):
            h.wait("local", timeout=5)
        with pytest.raises(CkptStageError, match="persist_every = 5"):
            c.wait_step(3, "local", timeout=5)
        c.save(5, state(5)).wait("shared", timeout=60)  # a multiple: written and drained as usual
    with Client("mw", socket=d.socket) as c:  # the session closed: step 5 is its newest, kept, on disk too
        assert c.latest() == 5
        c.save(6, state(6)).wait("memory", timeout=30)
    with Client("mw", socket=d.socket) as c:
        wait_until(lambda: c.latest() == 6, 20, "step 6 kept in memory")
        c.delete(6)
        assert c.latest() == 5 and 6 not in [i.step for i in c.list()]
        assert c.load()["step"] == 5
