"""A node going away keeps its checkpoints: the newest step of each job drained before the daemon exits.

A node drained for maintenance, a spot node given notice, a job signalled
before its time limit: the daemon gets SIGTERM (or, on Kubernetes, a
``preStop`` hook runs ``ckptstage drain --wait``), and every step that is only
on this node's SSD goes with the node. With ``[shared] drain_every`` > 1 that
is most steps, and the job would resume from its last cadence step, or from
further back if the drain queue was behind.

So, once in-flight saves have committed, :func:`drain_newest` picks for each
job the newest step whose parts this node holds whole (every rank this node
saves for the job; a one-node job: the step is complete here) and that the
shared tier lacks, queues its parts ahead of older ones (the drainer takes
each job's newest step first) even off the cadence, and waits until the
step's commit record is on the shared tier or the time is up. What it could
not drain is logged by name.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ckptstage.daemon.catalog.index import Catalog, Checkpoint, TierName
from ckptstage.daemon.drain.drainer import Drainer
from ckptstage.daemon.errors import SaveFailed
from ckptstage.daemon.logs import fields

log = logging.getLogger(__name__)

_POLL_S = 0.05


@dataclass(frozen=True)
class Outcome:
    """What :func:`drain_newest` did: the steps now complete on the shared tier, and those it could not
    drain, as (job, step) pairs, and for each of the latter why."""

    drained: list[tuple[str, int]]
    missed: list[tuple[str, int, str]]


def newest_undrained(catalog: Catalog, job: str | None = None) -> list[Checkpoint]:
    """Per job (``job``'s only, when given), the newest step this node holds whole on its local tier,
    where the shared tier lacks it; the most recent first."""
    found = []
    for job in [job] if job else catalog.jobs():
        ckpts = [c for c in catalog.checkpoints(job) if c.ranks_on(TierName.LOCAL)]
        here = set().union(*(c.ranks_on(TierName.LOCAL) for c in ckpts)) if ckpts else set()
        whole = [c for c in ckpts if c.complete_on(TierName.LOCAL) or set(c.ranks_on(TierName.LOCAL)) >= here]
        if whole:
            newest = max(whole, key=lambda c: c.step)
            if not newest.complete_on(TierName.SHARED):
                found.append(newest)
    return sorted(found, key=lambda c: max(p.created for p in c.on_tier(TierName.LOCAL)), reverse=True)


def drain_newest(catalog: Catalog, drainer: Drainer, timeout: float, job: str | None = None) -> Outcome:
    """Drains each job's (``job``'s) newest whole local step to the shared tier, waiting at most ``timeout``
    seconds (0: queues them and returns)."""
    deadline = time.monotonic() + timeout
    targets = newest_undrained(catalog, job)
    for ckpt in targets:
        for part in ckpt.on_tier(TierName.LOCAL):
            drainer.enqueue(part, off_cadence=True)
    drained: list[tuple[str, int]] = []
    missed: list[tuple[str, int, str]] = []
    for ckpt in targets:
        why = _wait_step(catalog, drainer, ckpt, deadline)
        if why:
            missed.append((ckpt.job, ckpt.step, why))
        else:
            drained.append((ckpt.job, ckpt.step))
    return Outcome(drained, missed)


def _wait_step(catalog: Catalog, drainer: Drainer, ckpt: Checkpoint, deadline: float) -> str:
    """Until the step's record is on the shared tier; "" then, else why not."""
    for part in ckpt.on_tier(TierName.LOCAL):
        try:
            if not drainer.wait_part(part.job, part.step, part.rank, max(0.0, deadline - time.monotonic())):
                return f"rank {part.rank} not drained in time"
        except SaveFailed as e:
            return str(e)
    while True:  # the record: written by whichever node's drain brought the step's last part
        now = catalog.get(ckpt.job, ckpt.step)
        if now is not None and now.complete_on(TierName.SHARED):
            return ""
        if time.monotonic() >= deadline:
            return "its parts are on the shared tier, not yet every rank's (other nodes' ranks still draining)"
        time.sleep(_POLL_S)


def on_request(catalog: Catalog, drainer: Drainer, job: str | None, wait: bool, timeout: float,
               newest: bool) -> tuple[int, int]:
    """``ckptstage drain``: with ``newest``, :func:`drain_newest` first; then, with ``wait``, waits up to
    ``timeout`` (in all) for the job's (every job's) queue to empty. Returns (parts pending, parts failed)."""
    budget = timeout if wait else 0.0
    deadline = time.monotonic() + budget
    if newest:
        outcome = drain_newest(catalog, drainer, budget, job)
        if wait:
            log_outcome(outcome, timeout, "drain requested")
    return drainer.wait_idle(job or None, max(0.0, deadline - time.monotonic()))


def log_outcome(outcome: Outcome, timeout: float, why: str) -> None:
    """One line per step: INFO for a step drained, WARNING naming each one that was not."""
    for job, step in outcome.drained:
        log.info("%s: drained %s step %d to the shared tier", why, job, step,
                 extra=fields(job=job, step=step, tier=TierName.SHARED))
    for job, step, reason in outcome.missed:
        log.warning("%s: %s step %d is not on the shared tier after %.0fs: %s; unless a copy under way ends "
                    "first, it is on this node only",
                    why, job, step, timeout, reason, extra=fields(job=job, step=step, tier=TierName.SHARED,
                                                                 error=reason))
