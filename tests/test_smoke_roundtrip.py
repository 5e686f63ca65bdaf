"""The quickest end-to-end check: one save through a real daemon, loaded back bit-exactly."""

from __future__ import annotations

import torch

from ckptstage.client import Client


def test_save_wait_load(daemon):
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 3}
    with Client("smoke", socket=daemon.socket) as c:
        h = c.save(3, state)
        h.wait("local", timeout=30)
        assert c.latest() == 3
        loaded = c.load()
    assert loaded["step"] == 3
    assert torch.equal(loaded["w"], state["w"])
