"""Per-tier cadence: every save reaches local SSD (and the memory tier), only every Mth the shared tier.

Multi-level checkpointing: a frequent cheap level for process crashes, a
rare expensive one for losing the node. ``[shared] drain_every = M`` drains
steps whose number is a multiple of M; the others stay local, and local
retention deletes them without waiting for a shared copy they will never get.
"""

from __future__ import annotations

import pytest
import torch
from support import drain

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
        # keep_last = 2 on local: steps 1-3 went, none of them waited for a shared copy; 5 is newest.
        assert steps_on(d.local, "cad") == [4, 5]
        states = {i.step: i.drain_state for i in c.list()}
        assert states[5] == "local-only" and states[4] == "drained" and states[2] == "drained"
        with pytest.raises(CkptStageError, match="drain_every"):
            c.wait_step(5, "shared", timeout=5)
        assert c.load(5)["step"] == 5 and c.load(2)["step"] == 2
