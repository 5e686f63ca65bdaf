"""Retention, applied: catalogue -> records -> the pure rules of retention.py -> deletions, logged and counted."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum

from ckptstage.daemon.catalog import chunkstore
from ckptstage.daemon.retention import planner as retention
from ckptstage.daemon.catalog.index import Catalog, Checkpoint, Part, TierName
from ckptstage.daemon.catalog.chunkstore import ChunkStore
from ckptstage.daemon.catalog.storedbytes import ChunkLists
from ckptstage.daemon.config import Config
from ckptstage.daemon.drain.queue import DrainQueue
from ckptstage.daemon.retention.floorwatch import FloorWatch
from ckptstage.daemon.retention.job_rules import JobRetention, JobRules
from ckptstage.daemon.logs import fields
from ckptstage.daemon.metrics import Metrics
from ckptstage.daemon.tiers.interface import Tier
from ckptstage.protos import chunks, layout

log = logging.getLogger(__name__)

SWEEP_SPACING = 0.25  # after a deleting pass, a store is swept again once this share of the grace has passed


@dataclass(frozen=True)
class Deleted:
    """What deleting a step removed."""

    parts: int
    nbytes: int
    tiers: tuple[TierName, ...]


class Removal(Enum):
    """What became of a part retention deleted."""

    REMOVED = "removed"  # this daemon removed it
    GONE = "gone"        # it was gone already: another node's daemon applied the same rule to its step
    KEPT = "kept"        # it stays: in use (a drain reading it), or the deletion failed (logged)


@dataclass(frozen=True)
class GcAction:
    job: str
    step: int
    tier: TierName
    reason: str
    nbytes: int


class Janitor:
    """Applies the tiers' rules to one job at a time.

    Passes come from several threads (commits, drains, timers, ``gc``) and are
    serialized per tier, never across tiers: a pass that waits on a slow or
    hung shared file system must not hold up the local passes that every
    commit runs.
    """

    def __init__(self, config: Config, catalog: Catalog, metrics: Metrics, drain: DrainQueue | None,
                 job_rules: JobRules, in_flight: Callable[[str, int, int], bool],
                 chunk_stores: dict[TierName, ChunkStore] | None = None, *,
                 tiers: Mapping[TierName, Tier], chunk_lists: ChunkLists | None = None) -> None:
        """``drain``: the queue of parts bound for the shared tier (no shared tier: None); ``tiers``: each disk
        tier's storage (no shared tier: no entry)."""
        self.config = config
        self.tiers = dict(tiers)
        self.catalog = catalog
        self.metrics = metrics
        self.drain = drain
        self.job_rules = job_rules
        self._in_flight = in_flight
        self.chunk_stores = chunk_stores or {}
        self.chunk_lists = chunk_lists or ChunkLists(self.tiers)  # each part's chunks, from its manifest once
        self._swept_at: dict[tuple[str, TierName], float] = {}  # monotonic time of each job's last sweep
        self._locks = {TierName.LOCAL: threading.Lock(), TierName.SHARED: threading.Lock()}
        self.floor = FloorWatch(config.local.min_free_bytes, str(config.local.dir),
                                lambda: self._free_bytes(TierName.LOCAL))

    def apply(self, job: str, dry_run: bool = False, trigger: str = "gc", local: bool = True,
              shared: bool = True) -> list[GcAction]:
        """Runs the tiers' rules for one job; deletes (unless dry_run) and returns what goes.

        ``trigger`` (commit, drain, timer, start, gc) labels the pass in metrics.
        ``shared=False`` plans the local tier only: a local commit changes
        nothing the shared rules look at, and the persister thread that runs
        that pass must never wait on the shared file system; ``local=False``
        is the shared-tier thread's pass.
        """
        actions: list[GcAction] = []
        # The shared tier first: what it deletes can change what the local rules decide (a step sealed
        # there, then deleted there, is drained), and a local pass must see that deletion whole. Run the
        # other way round, the pass after a job's last drain could find a shared step mid-deletion (its
        # record dropped, its part not yet) and keep the local copy until the timer came round.
        tiers = [t for t, on in ((TierName.SHARED, shared and self.drain is not None), (TierName.LOCAL, local))
                 if on]
        for tier in tiers:
            with self._locks[tier]:
                planned = self._plan(job, tier)
                if not dry_run:
                    here = [self._remove_stragglers(job, tier), *(self._delete(action) for action in planned)]
                    self._sweep(job, tier, deleted=any(here), trigger=trigger)
                    if tier == TierName.LOCAL:
                        self.floor.after_pass(len(planned))
            actions = planned + actions if tier == TierName.LOCAL else actions + planned  # reported local first
        if not dry_run and tiers:
            self.metrics.retention_passes.labels(trigger).inc()
        return actions

    def delete_step(self, job: str, step: int, busy_wait_s: float = 30.0) -> Deleted:
        """Deletes a step from the local tier, then from the shared tier (a user's request, not a rule).

        Per tier as retention deletes: out of the index first, parts, then the
        commit record, so a deletion cut short never reads as complete. A local
        part still being copied to the shared tier is waited for (up to
        ``busy_wait_s``) so that its copy cannot land after the deletion.
        Raises OSError naming what could not be deleted (the rest is gone).
        """
        parts = nbytes = 0
        tiers = []
        for tier in (TierName.LOCAL, TierName.SHARED):
            if tier == TierName.SHARED and self.drain is None:
                continue
            ckpt = self.catalog.get(job, step)
            if ckpt is None or not (ckpt.on_tier(tier) or tier in ckpt.records):
                continue
            with self._locks[tier]:
                self.catalog.drop_record(tier, job, step)
                kept = []
                for part in ckpt.on_tier(tier):
                    if self._delete_requested(part, tier, time.monotonic() + busy_wait_s):
                        parts, nbytes = parts + 1, nbytes + part.nbytes
                    else:
                        kept.append(part)
                if kept:
                    raise OSError(f"could not delete {', '.join(str(p.path) for p in kept)} (see the daemon's log); "
                                  f"{job} step {step} is no longer listed on the {tier.value} tier")
                if tier in ckpt.records:
                    self._delete_record(job, step, tier, retention.REQUESTED)
            tiers.append(tier)
        self._drop_staged(job, step)
        log.info("deleted %s step %d on request: %d parts, %d bytes, from %s", job, step, parts, nbytes,
                 " and ".join(t.value for t in tiers) or "nowhere", extra=fields(job=job, step=step, bytes=nbytes))
        return Deleted(parts, nbytes, tuple(tiers))

    def _drop_staged(self, job: str, step: int) -> None:
        """Removes a replacement of the deleted step still being assembled here (a save with overwrite
        waiting for its other ranks' parts): it must not take the place of a step that is gone."""
        for tier in (TierName.LOCAL, TierName.SHARED):
            if tier == TierName.SHARED and self.drain is None:
                continue
            storage = self.tiers[tier]
            if storage.discard_staged(job, step):
                log.info("deleted the replacement of %s step %d being assembled on the %s tier", job, step,
                         tier.value, extra=fields(job=job, step=step, tier=tier))
        if self.drain is not None:
            self.drain.forget_step(job, step)

    def _delete_requested(self, part: Part, tier: TierName, deadline: float) -> bool:
        """Deletes a part on a user's request; a local part being copied to the shared tier is waited for
        (until ``deadline``), also when a drain worker takes it between the wait and the deletion."""
        while True:
            while tier == TierName.LOCAL and self.drain is not None and self.drain.busy_with(part) and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
            if self._delete_part(part, tier, retention.REQUESTED) is not Removal.KEPT:
                return True
            if tier != TierName.LOCAL or self.drain is None or not self.drain.busy_with(part) or \
                    time.monotonic() >= deadline:
                return False

    def gc(self, dry_run: bool) -> list[GcAction]:
        return [a for job in self.catalog.jobs() for a in self.apply(job, dry_run, trigger="gc")]

    def _plan(self, job: str, tier: TierName) -> list[GcAction]:
        records = []
        d = self.drain
        ckpts = self.catalog.checkpoints(job)
        drained_parts: set[tuple[int, int]] = set()
        if tier == TierName.LOCAL and d is not None:
            # The drained marks first, the catalogue after: a part marked drained by then has its shared copy
            # (and, once sealed, the step's record) in what is read next. Read the other way round, a drain
            # finishing in between looks drained with neither in view, and the step's only commit went.
            drained_parts = {(c.step, p.rank) for c in ckpts for p in c.on_tier(tier)
                             if d.drained(job, c.step, p.rank)}
            ckpts = self.catalog.checkpoints(job)
        stored = self._stored_bytes(job, tier, ckpts)
        for c in ckpts:
            ranks = sorted(p.rank for p in c.on_tier(tier))
            if not ranks:
                continue
            if tier == TierName.LOCAL:
                # Drained: committed on the shared tier, even if the shared rules deleted it since.
                # A step the cadence keeps off the shared tier ([shared] drain_every) needs no shared copy.
                drained = d is None or not self.config.shared.drains(c.step) or \
                    all((c.step, r) in drained_parts for r in ranks)
                if drained and d is not None and c.complete_on(TierName.LOCAL) and \
                        not c.complete_on(TierName.SHARED) and \
                        all(TierName.SHARED in c.parts.get(r, {}) for r in range(c.world_size)):
                    drained = False  # every part is there but not yet its record: this is still the only commit
                records.append(retention.Record(c.step, stored.get(c.step, c.nbytes(tier)), drained=drained,
                                                pinned=c.pinned, complete=c.complete, metrics=c.metrics))
            else:
                records.append(retention.Record(c.step, stored.get(c.step, c.nbytes(tier)), pinned=c.pinned,
                                                complete=c.complete_on(tier), metrics=c.metrics))
        if tier == TierName.LOCAL:
            # The job's rules as its sessions here set them: the local pass never reads the shared tier.
            rules = _local_rules(self.config, self.job_rules.for_job(job, read_shared=False))
            plan = retention.plan_local(records, rules, self._free_bytes(TierName.LOCAL))
        else:
            plan = retention.plan_shared(records, _shared_rules(self.config),
                                         *_job_shared_rules(self.config, self.job_rules.for_job(job)))
        return [GcAction(job, s, tier, why, _nbytes(records, s)) for s, why in sorted(plan.delete.items())]

    def _stored_bytes(self, job: str, tier: TierName, ckpts: list[Checkpoint]) -> dict[int, int]:
        """What deleting each step of a job frees on ``tier`` when some of it is incremental (see
        :func:`chunkstore.stored_bytes`); empty when the job has no chunk store there (every part counts
        its own bytes)."""
        rows = self.chunk_lists.rows(job, tier, ckpts)
        self.chunk_lists.added(job, tier, ckpts)  # what the tier's metrics show, as of this pass
        return {} if rows is None else chunkstore.stored_bytes(rows)

    def _free_bytes(self, tier: TierName) -> int | None:
        try:
            usage = self.tiers[tier].usage()
        except OSError:
            return None
        return None if usage.unbounded else usage.free_bytes

    def _remove_stragglers(self, job: str, tier: TierName) -> bool:
        """Removes what no reader will ever use on ``tier``: parts of a complete step that its commit
        record does not name (an earlier attempt's, left by a crashed run), and records whose parts
        are all gone (a deletion cut short). True when this daemon removed any of it itself."""
        here = False
        for ckpt in self.catalog.checkpoints(job):
            if tier in ckpt.records and not ckpt.on_tier(tier):
                here |= self._delete_record(job, ckpt.step, tier, "its parts are gone")
            for part in ckpt.stragglers():
                if part.tier == tier:
                    here |= self._delete_part(part, tier, "straggler") is Removal.REMOVED
        return here

    def _sweep(self, job: str, tier: TierName, deleted: bool, trigger: str) -> None:
        """Removes the chunks that no part on ``tier`` refers to any more (incremental parts): of the job's
        store, and of the user's (:data:`chunks.USER_STORE`) where the tier has one.

        When :func:`sweep_due`: a sweep reads the whole job's listing (every part's manifest, every pack's
        index), on a tier that may be a shared file system under thousands of ranks."""
        store = self.chunk_stores.get(tier)
        if store is None:
            return
        for key in (job, chunks.USER_STORE):
            now = time.monotonic()
            last = self._swept_at.get((key, tier))
            since = None if last is None else now - last
            if not sweep_due(trigger, deleted, since, store.grace_s):
                continue
            elsewhere = store.since_swept(key)  # the tier's other nodes sweep it too: one sweep serves them all
            if elsewhere is not None and not sweep_due(trigger, deleted, elsewhere, store.grace_s):
                continue
            self._swept_at[(key, tier)] = now
            try:
                swept = store.sweep(key)  # nothing to do (and one look) where the store does not exist
            except OSError as e:
                log.error("retention could not sweep the chunks of %s on %s: %s", key, tier.value, e,
                          extra=fields(job=job, tier=tier, error=e))
                continue
            self.metrics.chunks_swept.labels(tier.value).inc(swept.removed)
            self.metrics.chunk_bytes_swept.labels(tier.value).inc(swept.freed)

    def _delete_record(self, job: str, step: int, tier: TierName, why: str) -> bool:
        """Deletes a step's commit record (after its parts: a half-deleted step never reads complete); True
        when this daemon removed it (not another node's, nor a failure)."""
        storage = self.tiers[tier]
        where = storage.step_location(job, step)
        self.catalog.drop_record(tier, job, step)
        try:
            storage.remove_commit_record(where)
        except FileNotFoundError:
            return False  # another node's daemon deleted it
        except OSError as e:
            log.error("retention could not delete %s: %s", where / layout.COMMIT_FILE, e,
                      extra=fields(job=job, step=step, tier=tier, error=e))
            return False
        log.info("retention: deleted the commit record of %s step %d on %s (%s)", job, step, tier.value, why,
                 extra=fields(job=job, step=step, tier=tier, reason=why))
        return True

    def _delete(self, action: GcAction) -> bool:
        """Deletes one step from one tier; True when this daemon carried the deletion out: it removed the
        step's record (one node does, of all those that planned it), or a step without one, a part of it."""
        ckpt = self.catalog.get(action.job, action.step)
        if ckpt is None:
            return False
        # Out of the index first, so that no reader takes the step for complete while its parts go; on disk
        # the record goes last, so that a deletion cut short never leaves a record naming absent parts valid.
        self.catalog.drop_record(action.tier, action.job, action.step)
        removals = [self._delete_part(part, action.tier, action.reason) for part in ckpt.on_tier(action.tier)]
        if action.tier not in ckpt.records:
            return Removal.REMOVED in removals
        return Removal.KEPT not in removals and \
            self._delete_record(action.job, action.step, action.tier, action.reason)

    def _delete_part(self, part: Part, tier: TierName, reason: str) -> Removal:
        """Deletes one part from ``tier`` (see :class:`Removal`)."""
        if self._in_flight(part.job, part.step, part.rank) and tier == TierName.SHARED:
            return Removal.KEPT
        # A part that reached the shared tier is no failure when it goes, even while the drainer still
        # holds it (its step's record could not be sealed because the shared tier's retention had
        # already removed the step as superseded there).
        drained = self.catalog.was_drained(part.job, part.step, part.rank)
        failure = None if reason == retention.REQUESTED or drained else \
            "deleted before it drained: the step is committed by another attempt"
        if self.drain is not None and tier == TierName.LOCAL and not self.drain.drop(part, failure):
            return Removal.KEPT  # being read by a drain worker right now; the next pass gets it
        try:
            self.tiers[tier].remove_part(part.path)
        except FileNotFoundError:
            # Gone already: another node's daemon applied the same rule to this step.
            self.catalog.remove(part)
            log.debug("retention: %s was already deleted", part.path, extra=_fields(part))
            return Removal.GONE
        except OSError as e:
            log.error("retention could not delete %s: %s", part.path, e, extra=_fields(part, error=e))
            return Removal.KEPT
        self.catalog.remove(part)
        self.metrics.evictions.labels(tier.value, retention.rule_name(reason)).inc()
        log.info("retention: deleted %s step %d rank %d from %s (%s, %d bytes; attempt %r)", part.job, part.step,
                 part.rank, tier.value, reason, part.nbytes, part.attempt, extra=_fields(part, reason=reason))
        return Removal.REMOVED


def sweep_due(trigger: str, deleted: bool, since: float | None, grace_s: float) -> bool:
    """Whether a retention pass sweeps a chunk store last swept ``since`` seconds ago (None: never since this
    daemon started; by this daemon, or by any node sharing the tier: :meth:`ChunkStore.since_swept`).

    At start and on request (``gc``), always. After a pass in which this daemon removed parts or records
    itself (``deleted``; on a shared tier every node plans the same deletion, one carries it out, the others
    find it done), at most once per :data:`SWEEP_SPACING` of the grace: a chunk whose last reference went is
    removed only once nobody touched it for the grace, so sweeping sooner frees little, and with a step a
    minute a sweep per deleting pass was a sweep per step. On the timer (what is left: a failed save's or
    drain's chunks, a deletion whose sweep was spaced out, a node that died before its sweep), at most once
    per grace. Never after a commit's or a drain's pass that removed nothing: no chunk lost its last
    reference, and every part's commit and drain asks for a pass.
    """
    if trigger in ("start", "gc"):
        return True
    if deleted:
        return since is None or since >= SWEEP_SPACING * grace_s
    return trigger == "timer" and (since is None or since >= grace_s)


def _local_rules(config: Config, job: JobRetention) -> retention.LocalRules:
    c = config.local
    keep_last = c.keep_last
    if job.local_keep_last:
        keep_last = max(keep_last, min(job.local_keep_last, config.retention.max_job_keep_last))
    return retention.LocalRules(keep_last=keep_last, max_bytes=c.max_bytes, min_free_bytes=c.min_free_bytes)


def _job_shared_rules(config: Config, job: JobRetention) -> list[retention.SharedRules]:
    """The job's own shared rules, kept in addition to the operator's (see :class:`JobRetention`)."""
    cap = config.retention.max_job_keep_last
    rules = retention.SharedRules(keep_last=min(job.shared_keep_last, cap) or None,
                                  keep_every=job.shared_keep_every or None, keep_best=job.keep_best(cap))
    # A rule set with no rules would keep everything: only pass one that has some.
    return [rules] if rules != retention.SharedRules() else []


def _shared_rules(config: Config) -> retention.SharedRules:
    c = config.shared
    return retention.SharedRules(keep_last=c.keep_last, keep_every=c.keep_every, keep_best=c.keep_best)


def _fields(part: Part, error: object = None, reason: str | None = None) -> dict[str, object]:
    return fields(job=part.job, step=part.step, rank=part.rank, tier=part.tier, bytes=part.nbytes, error=error,
                  reason=reason)


def _nbytes(records: list[retention.Record], step: int) -> int:
    return next((r.nbytes for r in records if r.step == step), 0)
