"""The node's periodic work, each on a thread of its own: local retention, the shared tier's pass, the reaper.

Every ``[retention] interval_s`` the local rules of every job run (they never
touch the shared tier), kept memory copies expire, incomplete steps are
reported and copies quarantined long enough ago go; on another thread the
shared tier is re-read, job rules are published, its rules applied, what
dead daemons left there cleaned and its old quarantined copies removed, so a
hung shared file system stops only that thread. Sessions whose client never
attached are closed. A pass that fails is logged and the next one tries
again: a timer outlives any one bad pass.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ckptstage.daemon.catalog.commits import Commits
from ckptstage.daemon.catalog.index import Catalog, TierName
from ckptstage.daemon.drain.drainer import Drainer
from ckptstage.daemon.logs import fields
from ckptstage.daemon.metrics import Metrics
from ckptstage.daemon.node.incomplete import IncompleteSteps
from ckptstage.daemon.retention.job_rules import JobRules
from ckptstage.daemon.save.memtier import MemoryTier
from ckptstage.daemon.save.sessions import SessionTable
from ckptstage.daemon.tiers.interface import Tier

log = logging.getLogger(__name__)


class Timers:
    """Starts the node's periodic threads (:meth:`start`); they end once ``stopping`` is set."""

    def __init__(self, interval_s: float, catalog: Catalog, apply_retention: Callable[..., object],
                 memory: MemoryTier, incomplete: IncompleteSteps, stopping: threading.Event,
                 expire_quarantined: Callable[[TierName], object] = lambda tier: None) -> None:
        """``apply_retention(job, trigger=, local=, shared=)``: one job's rules (the janitor's);
        ``expire_quarantined(tier)``: removes what was moved aside there long enough ago."""
        self.interval_s = interval_s
        self._expire_quarantined = expire_quarantined
        self._catalog = catalog
        self._apply_retention = apply_retention
        self._memory = memory
        self._incomplete = incomplete
        self._stopping = stopping
        self.shared_wake = threading.Event()  # job rules changed: publish them now
        self.threads: list[threading.Thread] = []

    def start(self, sessions: SessionTable, reap: Callable[[str, str], None], metrics: Metrics,
              attach_timeout_s: float) -> None:
        """The local pass and the reaper of sessions whose client never attached (``reap(session, why)``)."""
        self._spawn("retention-local", self._local_pass)
        self._spawn("sessions-reaper", lambda: self._reap_unattached(sessions, reap, metrics, attach_timeout_s))

    def start_shared(self, drainer: Drainer, commits: Commits, job_rules: JobRules, shared: Tier) -> None:
        """The shared tier's pass, on its own thread."""
        self._spawn("retention-shared", lambda: self._shared_pass(drainer, commits, job_rules, shared))

    def join(self, deadline: float) -> None:
        """Waits for the threads until ``deadline`` (monotonic); one stuck on a hung shared tier is a daemon
        thread, not waited for beyond it. The caller has set ``stopping`` and ``shared_wake`` (the shared pass
        sleeps on the latter)."""
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self.threads.append(thread)

    def _local_pass(self) -> None:
        """Every ``[retention] interval_s``: the local rules of every job (never touches the shared tier)."""
        while not self._stopping.wait(self.interval_s):
            try:
                for job in self._catalog.jobs():
                    self._apply_retention(job, trigger="timer", shared=False)
                self._memory.expire()
                self._incomplete.report()
                self._expire_quarantined(TierName.LOCAL)
            except OSError as e:  # a disk's condition, not a bug: one line, and the next pass tries again
                log.warning("timed local retention pass failed: %s", e, extra=fields(tier=TierName.LOCAL, error=e))
            except Exception:  # the timer must outlive one bad pass
                log.exception("timed local retention pass failed")

    def _shared_pass(self, drainer: Drainer, commits: Commits, job_rules: JobRules, shared: Tier) -> None:
        """Every ``[retention] interval_s``: re-read the shared tier, publish job rules, apply the shared
        rules, clean what dead daemons left there; job rules are also published as soon as they change."""
        next_pass = time.monotonic() + self.interval_s
        while True:
            self.shared_wake.wait(max(0.0, next_pass - time.monotonic()))
            if self._stopping.is_set():
                return
            try:
                if self.shared_wake.is_set():
                    self.shared_wake.clear()
                    job_rules.publish()
                if time.monotonic() < next_pass:
                    continue
                next_pass = time.monotonic() + self.interval_s
                drainer.refresh()
                commits.seal_all(TierName.SHARED)
                job_rules.publish()
                for job in self._catalog.jobs():
                    self._apply_retention(job, trigger="timer", local=False)
                shared.clean_abandoned()  # what daemons gone for good left there
                self._expire_quarantined(TierName.SHARED)
            except OSError as e:  # the shared file system's condition, not a bug: the next pass tries again
                log.warning("timed shared retention pass failed: %s", e, extra=fields(tier=TierName.SHARED, error=e))
            except Exception:  # the timer must outlive one bad pass
                log.exception("timed shared retention pass failed")

    def _reap_unattached(self, sessions: SessionTable, reap: Callable[[str, str], None], metrics: Metrics,
                         attach_timeout_s: float) -> None:
        """Closes sessions whose client never opened its ``Attach`` stream (it died right after
        ``OpenSession``): else their arena budget and ``/dev/shm`` file would be held forever."""
        period = min(1.0, attach_timeout_s / 4)
        while not self._stopping.wait(period):
            for session in sessions.unattached(attach_timeout_s):
                metrics.sessions_reaped.inc()
                reap(session.id, f"the client never attached within {attach_timeout_s:g}s")
