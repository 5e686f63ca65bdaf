"""Retention, applied: catalogue -> records -> the pure rules of retention.py -> deletions, logged and counted."""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ckptstage.daemon import fsutil, retention
from ckptstage.daemon.catalog import Catalog, TierName
from ckptstage.daemon.config import Config
from ckptstage.daemon.drainer import Drainer
from ckptstage.daemon.job_rules import JobRetention, JobRules
from ckptstage.daemon.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GcAction:
    job: str
    step: int
    tier: TierName
    reason: str
    nbytes: int


class Janitor:
    """Applies both tiers' rules to one job at a time (serialized: passes come from several threads)."""

    def __init__(self, config: Config, catalog: Catalog, metrics: Metrics, owner: str, drainer: Drainer | None,
                 job_rules: JobRules, in_flight: Callable[[str, int, int], bool]) -> None:
        self.config = config
        self.catalog = catalog
        self.metrics = metrics
        self.owner = owner
        self.drainer = drainer
        self.job_rules = job_rules
        self._in_flight = in_flight
        self._lock = threading.Lock()

    def apply(self, job: str, dry_run: bool = False, trigger: str = "gc", shared: bool = True) -> list[GcAction]:
        """Runs both tiers' rules for one job; deletes (unless dry_run) and returns what goes.

        ``trigger`` (commit, drain, timer, start, gc) labels the pass in metrics.
        ``shared=False`` plans the local tier only: a local commit changes
        nothing the shared rules look at, and the persister thread that runs
        that pass must never wait on the shared file system.
        """
        with self._lock:
            actions = self._plan(job, shared)
            if not dry_run:
                self.metrics.retention_passes.labels(trigger).inc()
                for action in actions:
                    self._delete(action)
            return actions

    def gc(self, dry_run: bool) -> list[GcAction]:
        return [a for job in self.catalog.jobs() for a in self.apply(job, dry_run, trigger="gc")]

    def _plan(self, job: str, shared: bool = True) -> list[GcAction]:
        ckpts = self.catalog.checkpoints(job)
        local_records, shared_records = [], []
        d = self.drainer
        for c in ckpts:
            local_ranks = c.ranks_on(TierName.LOCAL)
            if local_ranks:
                # Drained: committed on the shared tier, even if the shared rules deleted it since.
                drained = d is None or all(d.drained(job, c.step, r) for r in local_ranks)
                local_records.append(retention.Record(c.step, c.nbytes(TierName.LOCAL), drained=drained,
                                                      pinned=c.pinned, complete=c.complete, metrics=c.metrics))
            if c.ranks_on(TierName.SHARED):
                shared_records.append(retention.Record(c.step, c.nbytes(TierName.SHARED), pinned=c.pinned,
                                                       complete=c.complete_on(TierName.SHARED),
                                                       metrics=c.metrics))
        actions = []
        free = _free_bytes(self.config.local.dir)
        job_rules = self.job_rules.for_job(job)
        local_plan = retention.plan_local(local_records, self._local_rules(job_rules), free)
        actions += [GcAction(job, s, TierName.LOCAL, why, _nbytes(local_records, s))
                    for s, why in sorted(local_plan.delete.items())]
        if self.drainer is not None and shared:
            shared_plan = retention.plan_shared(shared_records, self._shared_rules(),
                                                *self._job_shared_rules(job_rules))
            actions += [GcAction(job, s, TierName.SHARED, why, _nbytes(shared_records, s))
                        for s, why in sorted(shared_plan.delete.items())]
        return actions

    def _local_rules(self, job: JobRetention) -> retention.LocalRules:
        c = self.config.local
        keep_last = c.keep_last
        if job.local_keep_last:
            keep_last = max(keep_last, min(job.local_keep_last, self.config.retention.max_job_keep_last))
        return retention.LocalRules(keep_last=keep_last, max_bytes=c.max_bytes, min_free_bytes=c.min_free_bytes)

    def _job_shared_rules(self, job: JobRetention) -> list[retention.SharedRules]:
        """The job's own shared rules, kept in addition to the operator's (see :class:`JobRetention`)."""
        cap = self.config.retention.max_job_keep_last
        best = (retention.KeepBest(job.keep_best_metric, job.keep_best_mode,  # type: ignore[arg-type]
                                   min(job.keep_best_n or 1, cap)) if job.keep_best_metric else None)
        rules = retention.SharedRules(keep_last=min(job.shared_keep_last, cap) or None,
                                      keep_every=job.shared_keep_every or None, keep_best=best)
        # A rule set with no rules would keep everything: only pass one that has some.
        return [rules] if rules != retention.SharedRules() else []

    def _shared_rules(self) -> retention.SharedRules:
        c = self.config.shared
        best = (retention.KeepBest(c.keep_best.metric, c.keep_best.mode, c.keep_best.n)
                if c.keep_best is not None else None)
        return retention.SharedRules(keep_last=c.keep_last, keep_every=c.keep_every, keep_best=best)

    def _delete(self, action: GcAction) -> None:
        ckpt = self.catalog.get(action.job, action.step)
        if ckpt is None:
            return
        tier_dir = self.config.local.dir if action.tier == TierName.LOCAL else self.config.shared.dir
        assert tier_dir is not None
        for part in ckpt.on_tier(action.tier):
            if self._in_flight(part.job, part.step, part.rank) and action.tier == TierName.SHARED:
                continue
            if self.drainer is not None and action.tier == TierName.LOCAL and self.drainer.busy_with(part):
                continue  # being read by the drainer right now; the next pass gets it
            try:
                fsutil.remove_part(tier_dir, self.owner, part.path)
            except FileNotFoundError:
                # Gone already: another node's daemon applied the same rule to this step.
                self.catalog.remove(part)
                log.debug("retention: %s was already deleted", part.path)
                continue
            except OSError as e:
                log.error("retention could not delete %s: %s", part.path, e)
                continue
            self.catalog.remove(part)
            self.metrics.evictions.labels(action.tier.value, retention.rule_name(action.reason)).inc()
            log.info("retention: deleted %s step %d rank %d from %s (%s, %d bytes)", part.job, part.step,
                     part.rank, action.tier.value, action.reason, part.nbytes)

def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _nbytes(records: list[retention.Record], step: int) -> int:
    return next((r.nbytes for r in records if r.step == step), 0)
