"""Waiting until a step is complete on a tier: this node's daemon asked, or every rank agreeing under a group."""

from __future__ import annotations

import time

import torch

from ckptstage.client import dist, errors
from ckptstage.client.rpc import Connection
from ckptstage.client.saver import SaveHandle, tier_code
from ckptstage.protos.v1 import ckptstage_pb2 as pb


def wait_step(conn: Connection, job: str, rank: int, world_size: int, step: int, tier: str,
              timeout: float | None, collective: bool | None, handle: SaveHandle | None) -> None:
    """``Client.wait_step``; ``handle`` is this rank's own save of ``step``, when it made one."""
    tier_code(tier)
    if collective is None:
        collective = dist.initialized() and torch.distributed.get_world_size() == world_size
    if tier == "local" and collective:
        failure = None
        try:
            if handle is not None:
                handle.wait(tier, timeout)
            else:
                _ask_daemon(conn, job, step, tier, timeout)
        except Exception as e:  # noqa: BLE001 - every rank must reach the gather, whatever went wrong here
            failure = f"rank {rank}: {type(e).__name__}: {e}"
        failures = [f for f in dist.gather(failure) if f]
        if failures:
            raise errors.SaveFailed(f"step {step} of {job!r} is not complete on {tier}: " + "; ".join(failures))
        return
    _ask_daemon(conn, job, step, tier, timeout)


def _ask_daemon(conn: Connection, job: str, step: int, tier: str, timeout: float | None) -> None:
    """Asks this node's daemon until the step's commit record is on ``tier``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = 25.0 if deadline is None else min(25.0, deadline - time.monotonic())
        if left <= 0:
            raise TimeoutError(f"step {step} of {job!r} not complete on {tier} after {timeout}s")
        resp = conn.call("WaitStep", pb.WaitStepRequest(job=job, step=step, tier=tier_code(tier), timeout_s=left),
                         timeout=left + 0.5)
        if resp.done:
            return
