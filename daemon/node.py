"""The node's checkpoint service: the one domain object the gRPC servicer calls.

It wires sessions, the persister, the catalogue, the drainer and retention
together and owns the order of events: commit locally -> index -> drain ->
apply retention. Nothing here knows about gRPC.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ckptstage.daemon import arena as arena_mod
from ckptstage.daemon import fsutil, retention
from ckptstage.daemon.catalog import Catalog, Checkpoint, Part, TierName
from ckptstage.daemon.config import Config
from ckptstage.daemon.drainer import CorruptSource, Drainer
from ckptstage.daemon.errors import (
    AlreadyExists,
    CheckpointNotFound,
    InvalidRequest,
    SaveFailed,
    SaveNotFound,
    ShuttingDown,
)
from ckptstage.daemon.metrics import Metrics, StateProbe
from ckptstage.daemon.persister import Persister, Save, parse_manifest
from ckptstage.daemon.sessions import Session, SessionInfo, SessionTable
from ckptstage.protos import layout

log = logging.getLogger(__name__)

VERSION = "0.1.0"
STATE_DIR = ".state"  # under the local tier: pins; ignored by tier scans (not a job name)
# A job's retention overrides, published beside its checkpoints on the shared tier
# (<shared>/<job>/retention.json, ignored by tier scans) for the other nodes' daemons.
JOB_RULES_FILE = "retention.json"


@dataclass(frozen=True)
class GcAction:
    job: str
    step: int
    tier: TierName
    reason: str
    nbytes: int


def node_name(local_dir: Path | None = None) -> str:
    """This daemon's name for its temporaries on shared tiers: ``<host>-<8 hex of the local dir>``.

    Every daemon cleans its own ``.tmp/<name>/`` on start, so no two live
    daemons may share a name: two users' daemons on one host (or two test
    daemons) differ by their local tier, and a restarted daemon keeps its
    name, so it finds what its predecessor left.
    """
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in socket.gethostname())
    name = (name.lstrip("._-") or "node")[:100]
    if local_dir is None:
        return name
    return f"{name}-{hashlib.sha256(os.fsencode(local_dir)).hexdigest()[:8]}"


@dataclass(frozen=True)
class JobRetention:
    """A job's own retention wishes, sent when its client opens a session (0 / "" = none).

    Policy: a job's rules are *added* to the operator's, so a job can keep
    more than the operator's rules would, never less, and never delete
    anything the operator's rules keep. Concretely:

    * ``local_keep_last`` and ``shared_keep_last`` raise the tier's
      ``keep_last`` up to ``[retention] max_job_keep_last`` (a value below the
      operator's has no effect: it would delete more);
    * ``shared_keep_every`` also keeps every step divisible by it, besides
      the operator's ``keep_every``;
    * ``keep_best_*`` also keeps the job's best ``n`` (``n`` capped at
      ``max_job_keep_last``) by its metric, besides the operator's ``keep_best``.

    Space watermarks (``local.max_bytes``, ``local.min_free_bytes``) stay the
    operator's alone: they protect the node, and still evict drained
    checkpoints a job asked to keep. Pins already let any job keep any step;
    the cap bounds only what rules keep by count.

    The latest session of a job sets its rules (an empty set resets them).
    They outlive the session and restarts (``.state/job-retention.json``),
    and are published on the shared tier beside the job's checkpoints, so
    that every node's daemon, which all apply the shared rules to every job
    they index there, applies the job's rules too.
    """

    local_keep_last: int = 0
    shared_keep_last: int = 0
    shared_keep_every: int = 0
    keep_best_metric: str = ""
    keep_best_mode: str = ""
    keep_best_n: int = 0

    @classmethod
    def parse(cls, overrides: Mapping[str, object]) -> JobRetention:
        """Validates a session's overrides; raises :class:`InvalidRequest` naming the bad one."""
        known = {f: t for f, t in cls.__annotations__.items()}
        values: dict[str, Any] = {}
        for key, value in overrides.items():
            if key not in known:
                raise InvalidRequest(f"unknown retention override {key!r} (known: {', '.join(sorted(known))})")
            if known[key] == "str":
                if not isinstance(value, str):
                    raise InvalidRequest(f"retention override {key} must be a string, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidRequest(f"retention override {key} must be an integer >= 0, got {value!r}")
            values[key] = value
        rules = cls(**values)
        if rules.keep_best_metric and rules.keep_best_mode not in ("min", "max"):
            raise InvalidRequest(f"retention override keep_best_mode must be 'min' or 'max' with "
                                 f"keep_best_metric, got {rules.keep_best_mode!r}")
        if not rules.keep_best_metric and (rules.keep_best_mode or rules.keep_best_n):
            raise InvalidRequest("retention overrides keep_best_mode / keep_best_n need keep_best_metric")
        return rules

    @property
    def empty(self) -> bool:
        return self == JobRetention()


class Node:
    """Everything one ``ckptstaged`` does, minus the wire."""

    def __init__(self, config: Config, metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.started = time.monotonic()
        self.budget = arena_mod.Budget(config.arena.max_bytes)
        self.sessions = SessionTable()
        self.owner = node_name(config.local.dir)
        self.catalog = Catalog(config.local.dir / STATE_DIR / "pins.json")
        self._job_rules_file = config.local.dir / STATE_DIR / "job-retention.json"
        self._job_rules: dict[str, JobRetention] = {}
        self._job_rules_lock = threading.Lock()
        self._unpublished: set[str] = set()  # jobs whose rules the shared tier does not have yet
        self._timer: threading.Thread | None = None
        self._saves: dict[str, Save] = {}
        self._owners: dict[str, Session] = {}  # save id -> its session, even after the session closed
        self._saves_lock = threading.Lock()
        self._stopping = threading.Event()
        self._retention_lock = threading.Lock()
        self.persister = Persister(config.persist.workers, self._on_commit, self._on_failure, self._on_progress)
        self.drainer: Drainer | None = None
        if config.shared.enabled:
            assert config.shared.dir is not None
            self.drainer = Drainer(config.shared, config.local.dir, self.owner, self.catalog, self.metrics,
                                   on_drained=lambda part: self.apply_retention(part.job, trigger="drain"),
                                   on_corrupt=lambda part, why: self.report_corrupt(
                                       part.job, part.step, part.rank, TierName.LOCAL, why))
        self.metrics.add_state(self._probe())

    # --- life cycle -------------------------------------------------------------

    def recover(self) -> None:
        """Invariant 3: clean temporaries, re-read what is committed, resume draining.

        Then runs retention once and starts the retention timer
        (``[retention] interval_s``), stopped by :meth:`shutdown`.
        """
        fsutil.makedirs_durable(self.config.local.dir)
        removed = fsutil.clean_temporaries(self.config.local.dir, self.owner)
        stale = arena_mod.sweep_stale()
        n_local = self.catalog.load_tier(TierName.LOCAL, self.config.local.dir)
        self.catalog.prune_drained()
        self._load_job_rules()
        log.info("local tier %s: %d committed parts, %d temporaries removed, %d stale arenas removed",
                 self.config.local.dir, n_local, removed, stale)
        if self.drainer is not None:
            self.drainer.recover()
            self.drainer.start()
        for job in self.catalog.jobs():
            self.apply_retention(job, trigger="start")
        self._timer = threading.Thread(target=self._retention_timer, name="retention", daemon=True)
        self._timer.start()

    def shutdown(self, timeout: float) -> None:
        """Stops taking saves, lets finished ones commit (bounded), then stops the drainer."""
        self._stopping.set()
        deadline = time.monotonic() + timeout
        for session in self.sessions.all():
            for save in session.close():
                self.persister.fail(save, "daemon shutting down before the client finished copying")
        for save in self._live_saves():
            if not save.local_done.wait(max(0.0, deadline - time.monotonic())):
                self.persister.fail(save, "daemon shutdown timed out before the save committed")
        self.persister.shutdown(wait=True)
        if self.drainer is not None:
            self.drainer.stop(max(0.0, deadline - time.monotonic()))
        if self._timer is not None:
            self._timer.join(max(0.0, deadline - time.monotonic()))

    # --- sessions -----------------------------------------------------------------

    def open_session(self, info: SessionInfo) -> Session:
        self._check_running()
        layout.check_job(info.job)
        try:
            layout.check_rank(info.rank, info.world_size)
        except layout.InvalidName as e:
            raise InvalidRequest(str(e)) from e
        rules = JobRetention.parse(info.overrides)
        session = Session(info, self.budget, self.config.persist.chunk_bytes, os.getpid())
        self._set_job_rules(info.job, rules)
        self.sessions.add(session)
        self.metrics.sessions_opened.inc()
        log.info("session %s opened: job %s rank %d/%d pid %d on %s", session.id, info.job, info.rank,
                 info.world_size, info.pid, info.hostname)
        return session

    def close_session(self, session_id: str, reason: str) -> None:
        session = self.sessions.pop(session_id)
        if session is None:
            return
        for save in session.close():
            self.persister.fail(save, f"session closed before the save finished ({reason})")
        log.info("session %s closed: %s", session_id, reason)

    def ensure_arena(self, session_id: str, want: int) -> arena_mod.Arena:
        self._check_running()
        return self.sessions.get(session_id).ensure_arena(want, self.config.arena.min_session_bytes)

    def arena_mapped(self, session_id: str, generation: int) -> None:
        arena = self.sessions.get(session_id).arena
        if arena is not None and arena.generation == generation:
            arena.unlink()

    # --- saves --------------------------------------------------------------------

    def begin_save(self, session_id: str, step: int, manifest_json: bytes, data_bytes: int,
                   metrics: dict[str, float]) -> Save:
        self._check_running()
        session = self.sessions.get(session_id)
        info = session.info
        if session.arena is None:
            raise InvalidRequest("no arena: call EnsureArena before BeginSave")
        spec = parse_manifest(manifest_json, info.job, step, info.rank, info.world_size, data_bytes, metrics)
        if self.catalog.has(info.job, step, info.rank) or self._in_flight(info.job, step, info.rank):
            raise AlreadyExists(f"step {step} of job {info.job!r} rank {info.rank} is already committed "
                                "or being saved; save a new step (or delete that one first)")
        writer = fsutil.PartWriter(self.config.local.dir, self.owner, info.job, step, info.rank)
        try:
            save = Save(uuid.uuid4().hex[:16], session.id, spec, session.arena,
                        session.stream_base_for_next_save(), session.chunk_bytes, writer,
                        direct_io=self.config.persist.direct_io)
        except OSError as e:
            writer.abort()
            raise SaveFailed(f"cannot create the data file for step {step} on {self.config.local.dir}: {e}") from e
        session.add_save(save)
        with self._saves_lock:
            self._saves[save.id] = save
            self._owners[save.id] = session
        self.metrics.saves_started.inc()
        return save

    def progress(self, save_id: str, copied_upto: int, wait_released: int, timeout: float) -> int:
        save = self._save(save_id)
        self.persister.progress(save, copied_upto)
        session = self._owner(save)
        if wait_released:
            with session.cond:
                session.cond.wait_for(lambda: session.released() >= wait_released or save.error is not None
                                      or session.closed.is_set() or self._stopping.is_set(), timeout)
        if save.error is not None:
            raise SaveFailed(save.error)
        return session.released()

    def finish_save(self, save_id: str) -> None:
        save = self._save(save_id)
        self.persister.progress(save, save.spec.data_bytes, finished=True)

    def abort_save(self, save_id: str, reason: str) -> None:
        self.persister.fail(self._save(save_id), f"aborted by the client: {reason}")

    def wait_save(self, save_id: str, tier: TierName, timeout: float) -> bool:
        """True once the save is committed on ``tier``; raises :class:`SaveFailed` if it cannot be."""
        save = self._save(save_id)
        deadline = time.monotonic() + timeout
        while not save.settled:
            if not save.local_done.wait(min(0.5, max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    return False
        if save.error is not None:
            raise SaveFailed(save.error)
        if tier == TierName.LOCAL:
            return True
        if self.drainer is None:
            raise SaveFailed("this daemon has no shared tier ([shared] dir is not set)")
        spec = save.spec
        return self.drainer.wait_part(spec.job, spec.step, spec.rank, max(0.0, deadline - time.monotonic()))

    # --- catalogue ------------------------------------------------------------------

    def checkpoints(self, job: str) -> list[Checkpoint]:
        return self.catalog.checkpoints(layout.check_job(job))

    def drain_state(self, ckpt: Checkpoint) -> str:
        if self.drainer is None:
            return "disabled"
        return self.drainer.checkpoint_state(ckpt)

    def locate(self, job: str, step: int | None, rank: int) -> tuple[Checkpoint, list[Part]]:
        layout.check_job(job)
        ckpt = self.catalog.latest_complete(job) if step is None else self.catalog.get(job, step)
        if ckpt is None or (step is not None and not ckpt.complete):
            raise CheckpointNotFound(job, step, "" if ckpt is None else
                                     f"ranks {sorted(set(range(ckpt.world_size)) - set(ckpt.parts))} missing")
        tiers = ckpt.parts.get(rank)
        if not tiers:
            raise CheckpointNotFound(job, ckpt.step, f"no part for rank {rank} (world size {ckpt.world_size})")
        ordered = [tiers[t] for t in (TierName.LOCAL, TierName.SHARED) if t in tiers]
        return ckpt, ordered

    def report_corrupt(self, job: str, step: int, rank: int, tier: TierName, detail: str) -> None:
        """A reader found a copy that fails verification: drop it from the index, keep it for forensics."""
        self.metrics.corrupt.labels(tier.value).inc()
        log.error("corrupt %s copy of %s step %d rank %d: %s", tier.value, job, step, rank, detail)
        ckpt = self.catalog.get(job, step)
        part = ckpt.parts.get(rank, {}).get(tier) if ckpt else None
        if part is None:
            return
        self.catalog.remove(part)
        quarantine = part.path.parent / f".corrupt-{part.path.name}-{uuid.uuid4().hex[:6]}"
        try:
            os.rename(part.path, quarantine)
        except OSError as e:
            log.error("cannot quarantine %s: %s", part.path, e)

    def set_pin(self, job: str, step: int, pinned: bool) -> None:
        layout.check_job(job)
        if pinned and self.catalog.get(job, step) is None:
            raise CheckpointNotFound(job, step)
        self.catalog.set_pin(job, step, pinned)

    def prefetch(self, job: str, step: int | None) -> tuple[int, int]:
        """Copies a checkpoint's shared-only parts back onto the local tier; returns (step, parts copied).

        The copies are verified against the shared manifests as they are
        read; a shared copy that fails is reported corrupt and the prefetch
        fails. Local retention still applies to what was fetched: prefetch
        the newest checkpoint (the one a restart reads), or pin an older one.
        """
        if self.drainer is None:
            raise InvalidRequest("this daemon has no shared tier to prefetch from")
        ckpt, _ = self.locate(job, step, 0)
        copied = 0
        for rank, tiers in sorted(ckpt.parts.items()):
            if TierName.LOCAL not in tiers and TierName.SHARED in tiers:
                shared = tiers[TierName.SHARED]
                try:
                    self.catalog.add(self.drainer.fetch(shared))
                except CorruptSource as e:
                    self.report_corrupt(job, ckpt.step, rank, TierName.SHARED, str(e))
                    raise SaveFailed(f"cannot prefetch {job} step {ckpt.step} rank {rank}: {e}") from e
                copied += 1
        log.info("prefetched %s step %d: %d parts copied to the local tier", job, ckpt.step, copied)
        return ckpt.step, copied

    # --- retention and drain -----------------------------------------------------------

    def apply_retention(self, job: str, dry_run: bool = False, trigger: str = "gc",
                        shared: bool = True) -> list[GcAction]:
        """Runs both tiers' rules for one job; deletes (unless dry_run) and returns what goes.

        ``trigger`` (commit, drain, timer, start, gc) labels the pass in metrics.
        ``shared=False`` plans the local tier only: a local commit changes
        nothing the shared rules look at, and the persister thread that runs
        that pass must never wait on the shared file system.
        """
        with self._retention_lock:
            actions = self._plan_retention(job, shared)
            if not dry_run:
                self.metrics.retention_passes.labels(trigger).inc()
                for action in actions:
                    self._delete(action)
            return actions

    def gc(self, dry_run: bool) -> list[GcAction]:
        return [a for job in self.catalog.jobs() for a in self.apply_retention(job, dry_run, trigger="gc")]

    def drain(self, job: str | None, wait: bool, timeout: float) -> tuple[int, int]:
        if self.drainer is None:
            return 0, 0
        if job:
            layout.check_job(job)
        return self.drainer.wait_idle(job or None, timeout if wait else 0.0)

    # --- internals ---------------------------------------------------------------------

    def _plan_retention(self, job: str, shared: bool = True) -> list[GcAction]:
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
        job_rules = self._rules_for(job)
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

    def _on_commit(self, save: Save) -> None:
        assert save.committed_path is not None
        spec = save.spec
        part = Part(spec.job, spec.step, spec.rank, spec.world_size, TierName.LOCAL, save.committed_path,
                    spec.data_bytes, self.clock(), dict(spec.metrics))
        self.catalog.add(part)
        self.metrics.saves_committed.labels("local").inc()
        self.metrics.bytes_persisted.labels("local").inc(spec.data_bytes)
        elapsed = time.monotonic() - save.started
        self.metrics.persist_seconds.observe(elapsed)
        log.info("committed %s step %d rank %d on local: %d bytes in %.2fs", spec.job, spec.step, spec.rank,
                 spec.data_bytes, elapsed)
        if self.drainer is not None:
            # Queued before the save settles, so that a wait("shared") finds it queued.
            self.drainer.enqueue(part)
        self._settle(save)
        self.apply_retention(spec.job, trigger="commit", shared=False)

    def _on_failure(self, save: Save) -> None:
        self.metrics.saves_failed.inc()
        self._settle(save)

    def _on_progress(self, save: Save) -> None:
        session = self._owner(save)
        with session.cond:
            session.cond.notify_all()

    def _settle(self, save: Save) -> None:
        self._owner(save).settle(save)

    def _owner(self, save: Save) -> Session:
        with self._saves_lock:
            return self._owners[save.id]

    def _save(self, save_id: str) -> Save:
        with self._saves_lock:
            save = self._saves.get(save_id)
            self._forget_old_saves()
        if save is None:
            raise SaveNotFound(save_id)
        return save

    def _forget_old_saves(self, keep_s: float = 3600.0) -> None:
        now = time.monotonic()
        for sid in [sid for sid, s in self._saves.items() if s.settled and now - s.started > keep_s]:
            del self._saves[sid]
            del self._owners[sid]

    def _live_saves(self) -> list[Save]:
        with self._saves_lock:
            return [s for s in self._saves.values() if not s.settled]

    def _in_flight(self, job: str, step: int, rank: int) -> bool:
        return any(s.spec.job == job and s.spec.step == step and s.spec.rank == rank for s in self._live_saves())

    def _retention_timer(self) -> None:
        """Every ``[retention] interval_s``: re-read the shared tier, then apply every job's rules."""
        while not self._stopping.wait(self.config.retention.interval_s):
            try:
                if self.drainer is not None:
                    self.drainer.refresh()
                    self._publish_job_rules()
                for job in self.catalog.jobs():
                    self.apply_retention(job, trigger="timer")
            except Exception:  # the timer must outlive one bad pass
                log.exception("timed retention pass failed")

    def _set_job_rules(self, job: str, rules: JobRetention) -> None:
        """The job's latest session sets its rules; they outlive the session (and restarts)."""
        with self._job_rules_lock:  # the ranks of a job open their sessions at once
            if self._job_rules.get(job) == rules:
                return  # an empty set is recorded too: it resets what an earlier session asked for
            self._job_rules = {**self._job_rules, job: rules}  # readers use the dict without the lock
            log.info("job %s retention overrides: %s", job,
                     {k: v for k, v in asdict(rules).items() if v} or "none (the operator's rules)")
            snapshot = {j: asdict(r) for j, r in sorted(self._job_rules.items())}
            try:
                fsutil.write_json_atomic(self._job_rules_file, snapshot)
            except OSError as e:
                log.warning("cannot persist job retention overrides to %s: %s", self._job_rules_file, e)
            self._unpublished.add(job)
        if self.config.shared.dir is not None:
            # Not on the caller's (an RPC's) thread: the shared file system may be slow or hung.
            threading.Thread(target=self._publish_job_rules, name="publish-rules", daemon=True).start()

    def _publish_job_rules(self) -> None:
        """Writes the rules of jobs whose sessions opened here to the shared tier (retried by the timer)."""
        if self.config.shared.dir is None:
            return
        with self._job_rules_lock:
            todo = {job: self._job_rules[job] for job in self._unpublished if job in self._job_rules}
        for job, rules in todo.items():
            job_dir = self.config.shared.dir / job
            try:
                fsutil.makedirs_durable(job_dir)
                fsutil.write_json_atomic(job_dir / JOB_RULES_FILE, asdict(rules))
            except OSError as e:
                log.warning("cannot publish job %s retention overrides on the shared tier: %s (will retry)", job, e)
                continue
            with self._job_rules_lock:
                if self._job_rules.get(job) == rules:
                    self._unpublished.discard(job)

    def _rules_for(self, job: str) -> JobRetention:
        """The job's rules: from its sessions here, else as another node published them, else none."""
        rules = self._job_rules.get(job)
        if rules is None and self.config.shared.dir is not None:
            path = self.config.shared.dir / job / JOB_RULES_FILE
            try:
                rules = JobRetention.parse(fsutil.read_json(path, {}))
            except (OSError, ValueError, AttributeError) as e:
                log.warning("ignoring %s: %s", path, e)
        return rules or JobRetention()

    def _load_job_rules(self) -> None:
        try:
            saved = fsutil.read_json(self._job_rules_file, {})
            self._job_rules = {str(job): JobRetention.parse(rules) for job, rules in saved.items()}
        except (OSError, ValueError, AttributeError) as e:
            log.error("ignoring job retention overrides in %s: %s", self._job_rules_file, e)

    def _check_running(self) -> None:
        if self._stopping.is_set():
            raise ShuttingDown()

    def _probe(self) -> StateProbe:
        def tier_dirs() -> dict[str, Path]:
            dirs = {"local": self.config.local.dir}
            if self.config.shared.dir is not None:
                dirs["shared"] = self.config.shared.dir
            return dirs

        def tier_used(tier: str) -> int:
            return sum(p.nbytes for p in self.catalog.all_parts(TierName(tier)))

        d = self.drainer
        return StateProbe(
            arena_used=lambda: self.budget.used, arena_total=lambda: self.budget.total,
            sessions=lambda: len(self.sessions.all()), tier_dirs=tier_dirs, tier_used=tier_used,
            drain_queue=(lambda: d.pending()) if d else (lambda: (0, 0)),
            drain_lag_s=(lambda: d.lag_s()) if d else (lambda: 0.0),
            shared_reachable=(lambda: d.reachable) if d else (lambda: None))


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _nbytes(records: list[retention.Record], step: int) -> int:
    return next((r.nbytes for r in records if r.step == step), 0)

