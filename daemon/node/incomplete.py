"""Steps that stay incomplete: some ranks' parts are committed, the others never come.

The usual cause is a job whose ranks do not all save (data parallelism,
where only rank 0 saves) but whose clients declare the whole world size:
no step ever completes, so nothing is restorable and retention keeps
everything. The daemon says so instead of leaving the user to guess: a
warning once per step in its log, the missing ranks in ``ckptstage ls``, and
``ckptstage_incomplete_steps``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ckptstage.daemon.catalog.index import Catalog, Checkpoint
from ckptstage.daemon.logs import fields

log = logging.getLogger(__name__)

# Warnings remembered per (job, step); past this the oldest are forgotten (and may be logged again).
_MAX_WARNED = 10_000


def why_incomplete(ckpt: Checkpoint) -> str:
    """Why a step is not complete, for a person: no record, or the ranks of its attempt that are missing."""
    missing = ckpt.ranks_missing()
    if missing:
        return (f"not complete: ranks {missing[:20]}{'...' if len(missing) > 20 else ''} of attempt "
                f"{ckpt.attempt!r} (world size {ckpt.world_size}) have no committed part")
    if ckpt.records:
        return "not complete: its commit record names parts this daemon cannot read"
    return f"not complete: no commit record yet (attempt {ckpt.attempt!r})"


class IncompleteSteps:
    """Finds steps incomplete for longer than ``after_s`` since their first part, and reports each once.

    ``busy(job, step)`` says whether a save of the step is still in flight on
    this node (such a step is late, not stuck).
    """

    def __init__(self, catalog: Catalog, after_s: float, busy: Callable[[str, int], bool],
                 clock: Callable[[], float] = time.time) -> None:
        self.catalog = catalog
        self.after_s = after_s
        self.busy = busy
        self.clock = clock
        self._warned: dict[tuple[str, int], None] = {}  # insertion-ordered set
        self._lock = threading.Lock()

    def stuck(self) -> list[Checkpoint]:
        """Every step with parts, not complete, whose first part is older than ``after_s``."""
        cutoff = self.clock() - self.after_s
        return [c for job in self.catalog.jobs() for c in self.catalog.checkpoints(job)
                if not c.complete and c.parts and c.created <= cutoff and not self.busy(job, c.step)]

    def report(self) -> int:
        """Logs each newly stuck step once; returns how many steps are stuck now."""
        stuck = self.stuck()
        for ckpt in stuck:
            key = (ckpt.job, ckpt.step)
            with self._lock:
                if key in self._warned:
                    continue
                self._warned[key] = None
                while len(self._warned) > _MAX_WARNED:
                    self._warned.pop(next(iter(self._warned)))
            log.warning("%s step %d is still %s after %.0fs. If only some ranks save (e.g. rank 0 under data "
                        "parallelism), create the Client with world_size=1 in every process; if ranks died, "
                        "this step will never be restorable (retention removes it once a newer one completes)",
                        ckpt.job, ckpt.step, why_incomplete(ckpt), self.clock() - ckpt.created,
                        extra=fields(job=ckpt.job, step=ckpt.step, reason=why_incomplete(ckpt)))
        return len(stuck)
