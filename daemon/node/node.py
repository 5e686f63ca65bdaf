"""The node's checkpoint service: the one domain object the gRPC servicer calls.

It wires sessions, the persister, the catalogue, the drainer and retention
together and owns the order of events: commit locally -> index -> drain ->
apply retention. Nothing here knows about gRPC.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ckptstage.daemon.save import arena as arena_mod
from ckptstage.daemon.catalog.index import Catalog, Checkpoint, Part, TierName
from ckptstage.daemon.catalog.chunkstore import ChunkStore
from ckptstage.daemon.catalog import overwrite as overwrite_mod
from ckptstage.daemon.catalog.commits import Commits, complete_attempt
from ckptstage.daemon.config import Config
from ckptstage.daemon.drain import drainer as drainer_mod
from ckptstage.daemon.drain.drainer import Drainer
from ckptstage.daemon.drain.fetcher import Fetcher
from ckptstage.daemon.drain.health import NO_DRAIN
from ckptstage.daemon.errors import (
    AlreadyExists,
    CheckpointNotFound,
    InvalidRequest,
    SaveFailed,
    SaveNotFound,
    SessionNotFound,
    ShuttingDown,
    StepPinned,
)
from ckptstage.daemon.node.incomplete import IncompleteSteps, why_incomplete
from ckptstage.daemon.retention.janitor import Deleted, GcAction, Janitor
from ckptstage.daemon.drain import stopdrain
from ckptstage.daemon.node import listing
from ckptstage.daemon.save import memflush
from ckptstage.daemon.node import jobs as jobs_mod
from ckptstage.daemon.node.jobs import JobSummary
from ckptstage.daemon.retention.job_rules import JobRetention, JobRules
from ckptstage.daemon.logs import fields
from ckptstage.daemon.save.manifest_check import parse_manifest
from ckptstage.daemon.save.memtier import MemoryTier
from ckptstage.daemon.metrics import Metrics, StateProbe
from ckptstage.daemon.save import persister as persister_mod
from ckptstage.daemon.events import Bus
from ckptstage.daemon.save.persister import Persister, Save
from ckptstage.daemon.catalog.quarantine import Quarantine
from ckptstage.daemon.save.sessions import Session, SessionInfo, SessionTable
from ckptstage.daemon.drain.sharedsync import SharedSync
from ckptstage.daemon.node.status import NodeStatus, StatusReader, TierReport
from ckptstage.daemon.tiers.interface import PartWriter
from ckptstage.daemon.tiers.probe import TierProbe
from ckptstage.daemon.tiers.kinds import open_tiers
from ckptstage.protos import layout

log = logging.getLogger(__name__)

VERSION = "0.1.0"
STATE_DIR = ".state"  # under the local tier: pins; ignored by tier scans (not a job name)
# Settled saves remembered for late WaitSave/FinishSave calls: a few hundred bytes each, this many at most.
MAX_SETTLED_SAVES = 1024
# A session whose client has not attached after this long is closed (the client died after OpenSession).
ATTACH_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class SettledSave:
    """What the node keeps of a save once it committed or failed (its manifest and buffers are let go)."""

    id: str
    job: str
    step: int
    rank: int
    error: str | None
    memory_only: bool = False


@dataclass(frozen=True)
class BegunSave:
    """What the client needs of a save it began: its id and where its bytes go in the arena stream."""

    id: str
    stream_base: int
    released: int  # the session's arena stream positions below this are free now


def node_name(local_dir: Path | None = None, node: str | None = None) -> str:
    """This daemon's name for its temporaries on shared tiers: ``<node>-<8 hex of the local dir>``.

    ``node`` is the configured ``node_name`` (``$CKPTSTAGE_NODE_NAME``), else
    the host name. Every daemon cleans its own ``.tmp/<name>/`` on start, so
    no two live daemons may share a name: two users' daemons on one host (or
    two test daemons) differ by their local tier, and a restarted daemon
    keeps its name, so it finds what its predecessor left (on Kubernetes only
    with the node's name: a replaced pod gets a new host name).
    """
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in node or socket.gethostname())
    name = (name.lstrip("._-") or "node")[:100]
    if local_dir is None:
        return name
    return f"{name}-{hashlib.sha256(os.fsencode(local_dir)).hexdigest()[:8]}"


class Node:
    """Everything one ``ckptstaged`` does, minus the wire."""

    def __init__(self, config: Config, metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.time, attach_timeout_s: float = ATTACH_TIMEOUT_S) -> None:
        self.config = config
        self.attach_timeout_s = attach_timeout_s
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.started = time.monotonic()
        self.budget = arena_mod.Budget(config.arena.max_bytes, shm_dir=config.arena.dir)
        self.memory = MemoryTier(self.budget, config.memory.enabled, config.memory.keep_s, self._committed_digest,
                                 self._newest_complete)
        self.budget.reclaim = self.memory.reclaim  # kept copies make way for sessions that need the room
        self.sessions = SessionTable()
        self.owner = node_name(config.local.dir, config.node_name)
        # The storage of each disk tier: everything below the node reaches a tier through these.
        self.tiers = open_tiers(config, self.owner)
        local = self.tiers[TierName.LOCAL]
        shared = self.tiers.get(TierName.SHARED)
        self.catalog = Catalog(config.local.dir / STATE_DIR / "pins.json")
        self.job_rules = JobRules(config.local.dir / STATE_DIR / "job-retention.json", shared)
        self._threads: list[threading.Thread] = []
        self._saves: dict[str, Save] = {}  # in flight
        self._settled: OrderedDict[str, SettledSave] = OrderedDict()  # bounded: MAX_SETTLED_SAVES
        self._owners: dict[str, Session] = {}  # save id -> its session, even after the session closed
        self._saves_lock = threading.Lock()
        # Notified as a save settles (commits or fails): what waits for saves (WaitSave, deletions,
        # shutdown) sleeps on it instead of polling.
        self._settled_cond = threading.Condition(self._saves_lock)
        self._stopping = threading.Event()
        self._shared_wake = threading.Event()  # job rules changed: publish them now
        self.tier_probes = {name: TierProbe(name.value, tier) for name, tier in self.tiers.items()}
        grace = config.persist.chunk_grace_s
        self.chunk_stores = {name: ChunkStore(tier, grace) for name, tier in self.tiers.items()}
        # What the persister and the drainer report (see _subscribe): their events, handled in order.
        self.events = Bus()
        self.persister = Persister(config.persist.workers, self.events, config.persist.nice)
        self.commits = Commits(self.catalog, local, shared, clock)
        self.drainer: Drainer | None = None
        self.shared_sync: SharedSync | None = None
        if shared is not None:
            self.drainer = Drainer(config.shared, self.catalog, self.metrics, self.commits, self.events,
                                   chunk_stores=self.chunk_stores, nice=config.persist.nice, tiers=self.tiers)
            self.shared_sync = SharedSync(self.catalog, shared,
                                          watched=lambda: {s.info.job for s in self.sessions.all()})
        drain = self.drainer.queue if self.drainer is not None else None  # what retention and status read
        self.fetcher: Fetcher | None = None
        if (drainer := self.drainer) is not None:
            self.fetcher = Fetcher(lambda part: self.catalog.add(drainer.fetch(part)),
                                   lambda part, detail: self.report_corrupt(part.job, part.step, part.rank, part.tier,
                                                                            detail))
        self.quarantine = Quarantine(self.catalog, self.metrics, tiers=self.tiers)
        self.incomplete = IncompleteSteps(self.catalog, config.retention.incomplete_after_s,
                                          busy=lambda job, step: any(s.spec.job == job and s.spec.step == step
                                                                     for s in self._live_saves()), clock=clock)
        self.janitor = Janitor(config, self.catalog, self.metrics, drain, self.job_rules,
                               self._in_flight, self.chunk_stores, tiers=self.tiers)
        self._pins_lock = threading.Lock()  # a pin's check and change, one caller at a time
        self._status = StatusReader(self.tiers, self.catalog, self.sessions, self.budget, self.memory, drain,
                                    self.tier_probes, self.job_summaries, self.started, self._tier_warnings)
        self._subscribe()
        self.metrics.add_state(self._probe())

    def _subscribe(self) -> None:
        """What follows each event of the layers below, on the thread that published it (see
        :mod:`ckptstage.daemon.events`): a save's commit is booked before its waiters wake, a drain's retention
        runs before the drain counts as finished."""
        on = self.events.subscribe
        on(persister_mod.Progressed, lambda e: self._owner(e.save).notify())
        on(persister_mod.Committed, lambda e: self._on_commit(e.save))
        on(persister_mod.Failed, lambda e: self._on_failure(e.save))
        on(drainer_mod.Drained, lambda e: self.apply_retention(e.part.job, trigger="drain"))
        on(drainer_mod.CorruptCopy,
           lambda e: self.report_corrupt(e.part.job, e.part.step, e.part.rank, TierName.LOCAL, e.detail))
        on(drainer_mod.Indexed, lambda e: self._on_shared_indexed())

    # --- life cycle -------------------------------------------------------------

    def recover(self) -> None:
        """Invariant 3: clean temporaries, re-read what is committed, resume draining.

        Only the local tier is read here, so the daemon serves as soon as its
        own disk is indexed: the drainer cleans and indexes the shared tier on
        its own thread (a shared file system that hangs must not keep the node
        from taking saves), then resumes draining. Starts the threads stopped by
        :meth:`shutdown`: local retention every ``[retention] interval_s``, the
        shared tier's refresh and retention on the same cadence, the tier
        probes, and the reaper of sessions that never attached.
        """
        local = self.tiers[TierName.LOCAL]
        local.prepare()
        local.recover_staged()  # before the temporaries go
        removed = local.clean_temporaries()
        stale = arena_mod.sweep_stale(self.budget.shm_dir)
        self.budget.fit_to_dir()  # what the file system holds, once the stale arenas are gone
        n_local = self.catalog.load_tier(TierName.LOCAL, local)
        self.quarantine.load_tier(TierName.LOCAL)
        self.catalog.prune_drained()
        # A crash between a step's last local part and its commit record: the record is written now.
        self.commits.seal_all(TierName.LOCAL)
        self.job_rules.load()
        log.info("local tier %s: %d committed parts, %d temporaries removed, %d stale arenas removed",
                 local.root, n_local, removed, stale,
                 extra=fields(tier=TierName.LOCAL, parts=n_local, temporaries_removed=removed, stale_arenas=stale))
        for probe in self.tier_probes.values():
            probe.start()
        for job in self.catalog.jobs():
            self.apply_retention(job, trigger="start", shared=False)
        self._spawn("retention-local", self._local_timer)
        self._spawn("sessions-reaper", self._reap_unattached)
        if self.drainer is not None:
            self.drainer.start()
            self._spawn("retention-shared", self._shared_timer)
        if self.shared_sync is not None:
            self.shared_sync.start()

    def shutdown(self, timeout: float, drain_s: float = 0.0) -> None:
        """Stops taking saves, lets finished ones commit (bounded by ``timeout``), drains the newest step of
        each job the shared tier lacks, on SSD or kept in memory only (bounded by ``drain_s``: see
        :mod:`ckptstage.daemon.drain.stopdrain` and :mod:`ckptstage.daemon.save.memflush`), then stops the drainer."""
        self._stopping.set()
        self.commits.wake()  # step waits end (they check _stopping)
        self._shared_wake.set()  # the shared-tier thread sleeps on it
        deadline = time.monotonic() + timeout
        flushed_s = 0.0  # of drain_s: writing memory-only steps to local SSD for the drain below
        if self.drainer is not None and drain_s > 0:
            flushed_s = self._persist_memory_steps(deadline, drain_s)
        self.memory.shutdown()  # first: the sessions closed below free their arenas instead of handing them over
        for session in self.sessions.all():
            for save in session.close(wait_writer_s=0):
                self.persister.fail(save, "daemon shutting down before the client finished copying")
        for save in self._live_saves():
            if not self._wait_settled(save, max(0.0, deadline - time.monotonic())):
                self.persister.fail(save, "daemon shutdown timed out before the save committed")
        self.persister.shutdown(wait=True)
        if self.drainer is not None and drain_s > 0:
            outcome = stopdrain.drain_newest(self.catalog, self.drainer, max(0.0, drain_s - flushed_s))
            stopdrain.log_outcome(outcome, drain_s, "stopping")
            deadline = max(deadline, time.monotonic() + 1.0)  # the drainer's threads still get to stop
        if self.drainer is not None:
            self.drainer.stop(max(0.0, deadline - time.monotonic()))  # copies under way stop: fetches too
        if self.fetcher is not None:
            self.fetcher.close()
        if self.shared_sync is not None:
            self.shared_sync.stop()
        for probe in self.tier_probes.values():
            probe.stop()
        self.quarantine.shutdown()
        for thread in self._threads:  # a thread stuck on a hung shared tier is a daemon thread: not waited for
            thread.join(max(0.0, deadline - time.monotonic()))

    def _persist_memory_steps(self, commit_deadline: float, within_s: float) -> float:
        """Lets saves whose bytes are all here commit (until ``commit_deadline``), then writes each job's newest
        step kept in memory only to local SSD, for at most ``within_s`` (see :mod:`ckptstage.daemon.save.memflush`);
        returns the seconds the writing took."""
        for save in self._live_saves():
            if save.finished:
                self._wait_settled(save, max(0.0, commit_deadline - time.monotonic()))
        began = time.monotonic()
        images = [c.resident for c in self.memory.copies() if c.memory_only]
        images += [s.resident for s in self.sessions.all() if s.resident is not None]
        outcome = memflush.persist_newest(images, self.catalog, self.tiers[TierName.LOCAL], self.commits,
                                          began + within_s)
        memflush.log_outcome(outcome, "stopping")
        return time.monotonic() - began

    # --- sessions -----------------------------------------------------------------

    def open_session(self, info: SessionInfo) -> Session:
        self._check_running()
        layout.check_job(info.job)
        layout.check_attempt(info.attempt)
        try:
            layout.check_rank(info.rank, info.world_size)
        except layout.InvalidName as e:
            raise InvalidRequest(str(e)) from e
        rules = JobRetention.parse(info.overrides) if info.overrides is not None else None
        expected = self.catalog.newest_part_bytes(info.job, info.rank, info.world_size)
        info = dataclasses.replace(info, expected_bytes=expected, memory_copy=self.memory.at_risk(
            info.job, info.rank, max(expected, self.config.arena.min_session_bytes)))
        session = Session(info, self.budget, self.config.persist.chunk_bytes, os.getpid(), self.memory.take)
        if rules is not None and self.job_rules.set(info.job, rules):
            self._shared_wake.set()  # the shared-tier thread publishes them for the other nodes
        self.sessions.add(session)
        self.metrics.sessions_opened.inc()
        log.info("session %s opened: job %s rank %d/%d attempt %r pid %d on %s", session.id, info.job, info.rank,
                 info.world_size, info.attempt, info.pid, info.hostname,
                 extra=fields(job=info.job, rank=info.rank, session=session.id, world_size=info.world_size,
                              attempt=info.attempt, pid=info.pid, hostname=info.hostname))
        return session

    def close_session(self, session_id: str, reason: str) -> None:
        """Closes a session: fails the saves its client never finished (removing their temporaries),
        then drops it from the table, so whoever sees it gone (``Status``) sees it cleaned up."""
        session = self.sessions.find(session_id)
        if session is None:
            return
        for save in session.close():
            self.persister.fail(save, f"session closed before the save finished ({reason})")
        if self.sessions.pop(session_id) is not None:
            log.info("session %s closed: %s", session_id, reason,
                     extra=fields(job=session.info.job, rank=session.info.rank, session=session_id, reason=reason))

    def reap_session(self, session_id: str) -> None:
        """The session's ``Attach`` stream ended without the client closing the session (it died, or
        its connection broke): the session goes, with the saves its client never finished."""
        session = self.sessions.find(session_id)
        if session is not None and not session.closed.is_set():
            self.metrics.sessions_reaped.inc()
            self.close_session(session_id, "client disconnected")

    def attach(self, session_id: str) -> Session:
        """The client opened the session's ``Attach`` stream: it is alive, and the session is not reaped."""
        session = self.sessions.get(session_id)
        session.attach()
        return session

    def take_lifeline(self, session_id: str, conn: socket.socket) -> bool:
        """A client's lifeline for its session arrived on the handoff socket (see protos/handoff.py)."""
        session = self.sessions.find(session_id)
        return session is not None and session.set_lifeline(conn)

    def ensure_arena(self, session_id: str, want: int) -> arena_mod.Arena:
        self._check_running()
        return self.sessions.get(session_id).ensure_arena(want, self.config.arena.min_session_bytes)

    def arena_mapped(self, session_id: str, generation: int) -> None:
        arena = self.sessions.get(session_id).arena
        if arena is not None and arena.generation == generation:
            arena.unlink()

    # --- saves --------------------------------------------------------------------

    def begin_save(self, session_id: str, step: int, manifest_json: bytes, data_bytes: int,
                   metrics: dict[str, float], stream_base: int | None = None, overwrite: bool = False) -> BegunSave:
        """Begins one rank's save of ``step`` (see the ``BeginSave`` RPC); the client then copies its bytes
        into the arena from the returned stream position and reports them with :meth:`progress`."""
        self._check_running()
        session = self.sessions.get(session_id)
        info = session.info
        if session.arena is None:
            raise InvalidRequest("no arena: call EnsureArena before BeginSave")
        spec = parse_manifest(manifest_json, info.job, step, info.rank, info.world_size, data_bytes, metrics)
        attempt = spec.manifest.get("attempt", "")
        if attempt != info.attempt:
            raise InvalidRequest(f"manifest attempt={attempt!r:.140} does not match the session's attempt "
                                 f"{info.attempt!r}")
        if self._in_flight(info.job, step, info.rank):
            raise AlreadyExists(f"step {step} of job {info.job!r} rank {info.rank} is being saved; save a new step")
        local = self.tiers[TierName.LOCAL]
        staged = self.commits.check_begin(info.job, step, info.rank, info.attempt, overwrite)
        if staged or (overwrite and self.catalog.has(info.job, step, info.rank)):
            # Replacing what is saved already (whole, or this rank's part in place): every rank must save
            # through this daemon, so that it alone decides what each tier's step is made of.
            self._check_replaceable_here(info, step)
        base = session.stream_base_for_next_save(stream_base)  # may refuse: before any file is created
        writer: PartWriter | None = None
        if self._memory_only(session, step, data_bytes, base, overwrite or staged):
            pass  # kept in the arena only: no file
        elif staged:
            writer = local.begin_part(info.job, step, info.rank, replace=lambda _: True,
                                      final=local.staged_location(info.job, step, info.rank))
        else:
            writer = local.begin_part(info.job, step, info.rank,
                                      replace=self.commits.replacer(TierName.LOCAL, info.job, step, info.attempt,
                                                                    overwrite))
        try:
            save = Save(uuid.uuid4().hex[:16], session.id, spec, session.arena,
                        base, session.chunk_bytes, writer,
                        direct_io=self.config.persist.direct_io,
                        store=self.chunk_stores[TierName.LOCAL] if self.config.persist.incremental else None)
        except (OSError, OverflowError, ValueError) as e:
            if writer is not None:
                writer.abort()
            raise SaveFailed(f"cannot create the data file for step {step} on {local.root}: {e}") from e
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        try:
            session.add_save(save)
        except SessionNotFound:
            save.discard()  # closed meanwhile (client gone, or the daemon is shutting down)
            self._check_running()
            raise
        with self._saves_lock:
            self._saves[save.id] = save
            self._owners[save.id] = session
        self.metrics.saves_started.inc()
        return BegunSave(save.id, save.stream_base, session.released())

    def _memory_only(self, session: Session, step: int, data_bytes: int, base: int, replacing: bool) -> bool:
        """Whether the save is kept in memory only (``[local] persist_every``): it must lie whole, unwrapped, in
        the arena (else it is written as usual), and a replacement of a committed step is always written."""
        arena = session.arena
        if replacing or self.config.local.persists(step) or not self.memory.enabled or arena is None:
            return False
        if base % arena.size + data_bytes > arena.size:
            log.info("%s step %d rank %d: %d bytes do not lie whole in the %d-byte arena; written to local SSD "
                     "although [local] persist_every = %d", session.info.job, step, session.info.rank, data_bytes,
                     arena.size, self.config.local.persist_every,
                     extra=fields(job=session.info.job, step=step, rank=session.info.rank, tier=TierName.LOCAL,
                                  bytes=data_bytes, arena_bytes=arena.size))
            return False
        return True

    def progress(self, save_id: str, copied_upto: int, wait_released: int, timeout: float) -> int:
        save = self._live_save(save_id)
        self.persister.progress(save, copied_upto)
        session = self._owner(save)
        if wait_released:
            with session.cond:
                session.cond.wait_for(lambda: session.released() >= wait_released or save.error is not None
                                      or session.closed.is_set() or self._stopping.is_set(), timeout)
        if save.error is not None:
            raise SaveFailed(save.error)
        return session.released()

    def finish_save(self, save_id: str) -> int:
        """The client copied everything; returns the session's released stream position."""
        save = self._live_save(save_id)
        self.persister.progress(save, save.spec.data_bytes, finished=True)
        return self._owner(save).released()

    def abort_save(self, save_id: str, reason: str) -> None:
        save = self._save(save_id)
        if isinstance(save, Save):
            self.persister.fail(save, f"aborted by the client: {reason}")

    def wait_save(self, save_id: str, tier: TierName, timeout: float) -> bool:
        """True once the save is committed on ``tier``; raises :class:`SaveFailed` if it cannot be."""
        save = self._save(save_id)
        deadline = time.monotonic() + timeout
        if isinstance(save, Save):
            if not self._wait_settled(save, timeout):
                return False
            save = self._settled_record(save)
        if save.error is not None:
            raise SaveFailed(save.error)
        if tier == TierName.MEMORY:
            return True  # committed: in the arena, and on disk too unless it is kept in memory only
        if save.memory_only:
            raise SaveFailed(f"{save.job} step {save.step} is kept in memory only: [local] persist_every = "
                             f"{self.config.local.persist_every} writes only steps that are multiples of it to "
                             "local SSD (wait for 'memory', or save a step that is one)")
        if tier == TierName.LOCAL:
            return True
        if self.drainer is None:
            raise SaveFailed("this daemon has no shared tier ([shared] dir is not set)")
        return self.drainer.wait_part(save.job, save.step, save.rank, max(0.0, deadline - time.monotonic()))

    # --- catalogue ------------------------------------------------------------------

    def checkpoints(self, job: str) -> list[Checkpoint]:
        layout.check_job(job)
        self._fresh(job)
        # A record whose parts are all gone (a deletion under way) names nothing to list.
        return [c for c in self.catalog.checkpoints(job) if c.parts]

    def drain_state(self, ckpt: Checkpoint) -> str:
        if self.drainer is None:
            return "disabled"
        return self.drainer.checkpoint_state(ckpt)

    def list_checkpoints(self, job: str, memory: bool = False) -> listing.Listing:
        """A job's steps, oldest first, with their drain state and the ranks the memory tier holds; with
        ``memory`` also the steps only the memory tier holds. And the copies of the job quarantined."""
        entries = [listing.entry(c, self.drain_state(c), self.memory.ranks(c.job, c.step, c.world_size))
                   for c in self.checkpoints(job)]
        if memory:
            entries = sorted(entries + [listing.memory_entry(m) for m in self.memory.memory_steps(job)],
                             key=lambda e: e.step)
        return listing.Listing(entries, self.quarantine.moved(job))

    def locate_parts(self, job: str, step: int | None, rank: int, all_ranks: bool = False,
                     memory: bool = False) -> listing.Located:
        """Where a reader finds ``rank``'s part of the complete ``step`` (the newest when None), best copy
        first; with ``all_ranks`` every rank's too. ``memory``: the reader can read the memory tier, so a step
        kept in memory only (newer than any on disk, or the one asked for) is answered from there, and a
        part the memory tier holds is listed first."""
        if memory:
            kept = self.memory.step_for(job, step)
            if kept is not None:
                return listing.memory_located(kept, rank, all_ranks)
        ckpt, _ = self.locate(job, step, rank, all_ranks)
        return listing.located(ckpt, rank, all_ranks,
                               lambda r: memory and self.memory.has(ckpt.job, ckpt.step, r), self.tiers)

    def locate(self, job: str, step: int | None, rank: int, all_ranks: bool = False) -> tuple[Checkpoint, list[Part]]:
        """The complete step (the newest when ``step`` is None) and ``rank``'s copies of the committed
        attempt's part, best first. With ``all_ranks`` a rank outside the step's world size gets no
        copies instead of an error (a reader of another world size reads several parts)."""
        layout.check_job(job)
        self._fresh(job)
        ckpt = self.catalog.latest_complete(job) if step is None else self.catalog.get(job, step)
        if ckpt is None or not ckpt.complete:
            raise CheckpointNotFound(job, step, "" if ckpt is None else why_incomplete(ckpt))
        parts = ckpt.committed(rank)
        if not parts and not all_ranks:
            raise CheckpointNotFound(job, ckpt.step, f"no part for rank {rank} (world size {ckpt.world_size})")
        return ckpt, parts

    def _newest_complete(self, job: str) -> int | None:
        ckpt = self.catalog.latest_complete(job)
        return ckpt.step if ckpt is not None else None

    def _committed_digest(self, job: str, step: int, rank: int) -> str | None:
        ckpt = self.catalog.get(job, step)
        parts = ckpt.committed(rank) if ckpt is not None and ckpt.complete else []
        return parts[0].digest if parts else None

    def wait_step(self, job: str, step: int, tier: TierName | None, timeout: float) -> Checkpoint | None:
        """The step once its commit record is on ``tier`` (None: any) with all its parts; None at the timeout."""
        layout.check_job(job)
        layout.check_step(step)
        if tier == TierName.SHARED and self.drainer is None:
            raise InvalidRequest("this daemon has no shared tier ([shared] dir is not set)")
        if tier == TierName.MEMORY:
            raise InvalidRequest("a step is not waited for in the memory tier: wait for each save "
                                 "(SaveHandle.wait('memory'))")
        if tier is not None and not self.config.local.persists(step) and self.catalog.get(job, step) is None:
            raise InvalidRequest(f"step {step} is kept in memory only: [local] persist_every = "
                                 f"{self.config.local.persist_every} writes only steps that are multiples of it")
        if tier == TierName.SHARED and not self.config.shared.drains(step):
            ckpt = self.catalog.get(job, step)
            if ckpt is None or not ckpt.complete_on(TierName.SHARED):
                assert self.drainer is not None
                raise InvalidRequest(self.drainer.not_drained(step))
        sync = self.shared_sync
        refresh = (lambda j, s, wait: sync.fresh(j, s, max_age_s=0.25, wait_s=wait)) if sync is not None else None
        return self.commits.wait_step(job, step, tier, timeout, refresh, stop=self._stopping)

    def report_corrupt(self, job: str, step: int, rank: int, tier: TierName, detail: str) -> None:
        """A reader found a copy that fails verification: the daemon re-reads it and hides it only if its
        own read fails too (see :mod:`ckptstage.daemon.catalog.quarantine`). Returns at once.

        A memory copy is verified when kept, so one that fails a reader's check is memory gone bad: it is
        dropped, and the disk copies remain.
        """
        layout.check_job(job)
        if tier == TierName.MEMORY:
            log.error("memory copy of %s step %d rank %d failed a reader's verification: %s", job, step, rank,
                      detail, extra=fields(job=job, step=step, rank=rank, tier=TierName.MEMORY, error=detail))
            self.memory.drop_job(job, step)
            return
        ckpt = self.catalog.get(job, step)
        part = ckpt.parts.get(rank, {}).get(tier) if ckpt else None
        if part is not None:
            self.quarantine.report(part, detail[:1000])

    def set_pin(self, job: str, step: int, pinned: bool) -> bool:
        """Pins or unpins a step; False when it already was (nothing changed)."""
        layout.check_job(job)
        layout.check_step(step)
        known = self._indexed(job, step)
        with self._pins_lock:
            # A pin left on a step that is gone may still be lifted; any other unknown step is an error
            # (a typo'd step must not look done to a script).
            if not known and (pinned or not self.catalog.is_pinned(job, step)):
                raise CheckpointNotFound(job, step)
            if self.catalog.is_pinned(job, step) == pinned:
                return False
            self.catalog.set_pin(job, step, pinned)
        log.info("%s %s step %d", "pinned" if pinned else "unpinned", job, step,
                 extra=fields(job=job, step=step, pinned=pinned))
        return True

    # --- status --------------------------------------------------------------------

    def status(self) -> NodeStatus:
        """The node's state, from memory only (see :mod:`ckptstage.daemon.node.status`)."""
        return self._status.read()

    def _tier_warnings(self, tier: TierName) -> tuple[str, ...]:
        warning = self.janitor.floor.warning if tier == TierName.LOCAL else ""
        return (warning,) if warning else ()

    def tier_status(self, tier: TierName) -> TierReport:
        """One tier's part of :meth:`status`."""
        return self._status.tier(tier)

    def job_summaries(self) -> list[JobSummary]:
        """Every job this node knows of (catalogued, with a session, or kept in memory), sorted by name."""
        sessions = [s.info.job for s in self.sessions.all() if not s.closed.is_set()]
        memory = self.memory.copies()
        names = sorted(set(self.catalog.jobs()) | set(sessions) | {c.resident.job for c in memory})
        health = self.drainer.health_of(names) if self.drainer is not None else {}
        return [jobs_mod.summarize(job, self.catalog.checkpoints(job), [c for c in memory if c.resident.job == job],
                                   self.memory.memory_steps(job), sessions.count(job),
                                   health.get(job, NO_DRAIN))
                for job in names]

    def delete_step(self, job: str, step: int, settle_wait_s: float = 30.0) -> Deleted:
        """Deletes a step from the local tier and the shared tier; refuses a pinned one.

        Saves of the step still in flight here are waited for (up to
        ``settle_wait_s``), so that none commits a part after the deletion.
        """
        layout.check_job(job)
        layout.check_step(step)
        if not self._indexed(job, step):
            copies, nbytes = self.memory.drop_job(job, step)  # a step kept in memory only
            if copies:
                return Deleted(copies, nbytes, (TierName.MEMORY,))
            raise CheckpointNotFound(job, step)
        if self.catalog.is_pinned(job, step):
            raise StepPinned(job, step)
        deadline = time.monotonic() + settle_wait_s
        for save in self._live_saves():
            if save.spec.job == job and save.spec.step == step and \
                    not self._wait_settled(save, max(0.0, deadline - time.monotonic())):
                raise InvalidRequest(f"step {step} of job {job!r} is still being saved; delete it once the save "
                                     "is committed (SaveHandle.wait)")
        self.memory.drop_job(job, step)
        return self.janitor.delete_step(job, step)

    def _indexed(self, job: str, step: int) -> bool:
        """Whether the catalog has ``step`` of ``job``, once a step only the shared tier has is indexed."""
        if self.catalog.get(job, step) is None and self.shared_sync is not None:
            self.shared_sync.fresh(job, step, max_age_s=0.0)
        return self.catalog.get(job, step) is not None

    def prefetch(self, job: str, step: int | None, ranks: Sequence[int] = ()) -> tuple[int, int]:
        """Copies a checkpoint's shared-only parts (``ranks``' only, when given) onto the local tier; returns
        (step, parts copied). See :mod:`ckptstage.daemon.drain.fetcher`.

        The copies are verified against the shared manifests as they are
        read; a shared copy that fails is reported corrupt and the prefetch
        fails. Local retention still applies to what was fetched: prefetch
        the newest checkpoint (the one a restart reads), or pin an older one.
        """
        if self.fetcher is None:
            raise InvalidRequest("this daemon has no shared tier to prefetch from")
        ckpt, _ = self.locate(job, step, 0, all_ranks=True)
        for rank in ranks:
            if not 0 <= rank < ckpt.world_size:
                raise InvalidRequest(f"rank {rank} is not a rank of {job} step {ckpt.step} "
                                     f"(world size {ckpt.world_size})")
        wanted = sorted(set(ranks)) if ranks else range(ckpt.world_size)
        todo = [copies[TierName.SHARED] for rank in wanted
                for copies in [{p.tier: p for p in ckpt.committed(rank)}]
                if TierName.LOCAL not in copies and TierName.SHARED in copies]
        copied = self.fetcher.fetch(todo) if todo else 0
        self.commits.seal_local(job, ckpt.step)  # when every part is here now, the step exists locally too
        if todo:
            log.info("prefetched %s step %d: %d parts copied to the local tier", job, ckpt.step, copied,
                     extra=fields(job=job, step=ckpt.step, tier=TierName.LOCAL, parts=copied))
        return ckpt.step, copied

    # --- retention and drain -----------------------------------------------------------

    def apply_retention(self, job: str, dry_run: bool = False, trigger: str = "gc",
                        local: bool = True, shared: bool = True) -> list[GcAction]:
        """Runs the retention rules for one job (see :meth:`Janitor.apply`)."""
        return self.janitor.apply(job, dry_run, trigger, local=local, shared=shared)

    def gc(self, dry_run: bool) -> list[GcAction]:
        return self.janitor.gc(dry_run)

    def drain(self, job: str | None, wait: bool, timeout: float, newest: bool = False) -> tuple[int, int]:
        """Waits (with ``wait``, up to ``timeout``) for the job's (every job's) drain queue to empty;
        ``newest``: first drains each job's newest step only this node holds (see
        :mod:`ckptstage.daemon.drain.stopdrain`). Returns (parts still pending, parts failed)."""
        if self.drainer is None:
            return 0, 0
        if job:
            layout.check_job(job)
        budget = timeout if wait else 0.0
        deadline = time.monotonic() + budget
        if newest:
            outcome = stopdrain.drain_newest(self.catalog, self.drainer, budget, job)
            if wait:
                stopdrain.log_outcome(outcome, timeout, "drain requested")
        return self.drainer.wait_idle(job or None, max(0.0, deadline - time.monotonic()))

    # --- internals ---------------------------------------------------------------------

    def _check_replaceable_here(self, info: SessionInfo, step: int) -> None:
        """A committed step is replaced only by a job whose ranks all save through this daemon (see
        :mod:`ckptstage.daemon.catalog.overwrite`)."""
        here = {s.info.rank for s in self.sessions.all()
                if s.info.job == info.job and s.info.attempt == info.attempt and s.info.world_size == info.world_size}
        missing = sorted(set(range(info.world_size)) - here)
        if missing:
            raise InvalidRequest(f"step {step} of job {info.job!r} is committed and can be replaced (overwrite) only "
                                 f"when every rank saves through this node's daemon; ranks {missing[:20]} of "
                                 f"{info.world_size} have no session here. Delete the step on every node first, "
                                 "or save a new step")

    def _on_staged_commit(self, save: Save) -> None:
        """A part of a replacement is committed in the staging area: swap the step in once every rank's is."""
        spec = save.spec
        attempt = layout.manifest_attempt(spec.manifest)
        staged = [p for p in overwrite_mod.staged_parts(self.tiers[TierName.LOCAL], TierName.LOCAL, spec.job,
                                                        spec.step) if p.attempt == attempt]
        found = complete_attempt(staged)
        if found is not None:
            _, world, parts = found
            record = self.commits.replacement_record(spec.job, spec.step, attempt, world, parts)
            for part in self.commits.swap_in(TierName.LOCAL, record, parts):
                if self.drainer is not None:
                    self.drainer.forget(part.job, part.step, part.rank)
                    self.drainer.enqueue(part)

    def _on_commit(self, save: Save) -> None:
        """The persister committed a save: index it, queue it for draining, settle it, apply retention."""
        try:
            self._book_commit(save)
        except Exception as e:
            # Logged here: the persister's pool would keep the exception in a future no one reads.
            log.exception("cannot book the commit of %s step %d rank %d: %s", save.spec.job, save.spec.step,
                          save.spec.rank, e, extra=fields(job=save.spec.job, step=save.spec.step,
                                                          rank=save.spec.rank, tier=TierName.LOCAL, error=e))
            if self._unsettled(save) and save.error is None:  # not indexed, not queued: it must not look done
                save.error = f"step {save.spec.step} was written but could not be indexed: {e}"
        finally:
            if self._unsettled(save):  # the commit path broke before it settled the save: its waiters must wake
                self._settle(save)

    def _unsettled(self, save: Save) -> bool:
        with self._saves_lock:
            return save.id in self._saves

    def _book_commit(self, save: Save) -> None:
        if save.memory_only:
            self._on_memory_commit(save)
            return
        assert save.committed_path is not None
        if save.chunks is not None:
            self.metrics.chunks_reused.labels("local").inc(save.chunks.reused_bytes)
        spec = save.spec
        if save.committed_path == self.tiers[TierName.LOCAL].staged_location(spec.job, spec.step, spec.rank):
            self.metrics.saves_committed.labels("local").inc()
            self.metrics.bytes_persisted.labels("local").inc(save.spec.data_bytes)
            self.memory.drop_job(save.spec.job, save.spec.step)  # the step is being replaced
            try:
                self._on_staged_commit(save)
            except OSError as e:
                save.error = f"cannot put the replacement of step {save.spec.step} in place: {e}"
                log.error("%s %s", save.spec.job, save.error,
                          extra=fields(job=save.spec.job, step=save.spec.step, rank=save.spec.rank,
                                       tier=TierName.LOCAL, error=e))
            self._settle(save)
            self.apply_retention(save.spec.job, trigger="commit", shared=False)
            return
        writer = save.writer
        assert writer is not None  # a save that reached its commit wrote a part
        part = Part(spec.job, spec.step, spec.rank, spec.world_size, TierName.LOCAL, save.committed_path,
                    spec.data_bytes, self.clock(), dict(spec.metrics), layout.manifest_attempt(spec.manifest),
                    writer.manifest_digest, writer.ino)
        replaced = self.catalog.parts_of(spec.job, spec.step, spec.rank).get(TierName.LOCAL)
        self.catalog.add(part)
        if replaced is not None and self.drainer is not None:
            self.drainer.forget(spec.job, spec.step, spec.rank)  # an earlier attempt's part was replaced
        self.metrics.saves_committed.labels("local").inc()
        self.metrics.bytes_persisted.labels("local").inc(spec.data_bytes)
        elapsed = time.monotonic() - save.started
        self.metrics.persist_seconds.observe(elapsed)
        log.info("committed %s step %d rank %d on local: %d bytes in %.2fs", spec.job, spec.step, spec.rank,
                 spec.data_bytes, elapsed, extra=fields(job=spec.job, step=spec.step, rank=spec.rank,
                                                        tier=TierName.LOCAL, bytes=spec.data_bytes, duration_s=elapsed))
        try:
            # Before the save settles: the last rank's wait("local") returns with the step committed here.
            self.commits.seal_local(spec.job, spec.step)
        except OSError as e:
            log.error("cannot write the local commit record of %s step %d: %s (written on restart)", spec.job,
                      spec.step, e, extra=fields(job=spec.job, step=spec.step, tier=TierName.LOCAL, error=e))
        if self.drainer is not None:
            # Queued before the save settles, so that a wait("shared") finds it queued.
            self.drainer.enqueue(part)
        self._owner(save).keep_resident(save)
        self.memory.superseded(spec.job, spec.rank, spec.step)
        self._settle(save)
        self.apply_retention(spec.job, trigger="commit", shared=False)

    def _on_memory_commit(self, save: Save) -> None:
        """A save kept in memory only is complete in the arena: the session's newest image, for a restart."""
        spec = save.spec
        self.metrics.saves_committed.labels("memory").inc()
        log.info("kept %s step %d rank %d in memory only: %d bytes ([local] persist_every = %d)", spec.job,
                 spec.step, spec.rank, spec.data_bytes, self.config.local.persist_every,
                 extra=fields(job=spec.job, step=spec.step, rank=spec.rank, tier=TierName.MEMORY,
                              bytes=spec.data_bytes))
        self._owner(save).keep_resident(save)
        self.memory.superseded(spec.job, spec.rank, spec.step)
        self._settle(save)

    def _on_failure(self, save: Save) -> None:
        self.metrics.saves_failed.inc()
        self._settle(save)

    def _settle(self, save: Save) -> None:
        """A save committed or failed: its session lets go of it, the node keeps a small record."""
        owner = self._owner(save)
        with self._saves_lock:
            if self._saves.pop(save.id, None) is not None:
                spec = save.spec
                self._settled[save.id] = SettledSave(save.id, spec.job, spec.step, spec.rank, save.error,
                                                     save.memory_only)
                while len(self._settled) > MAX_SETTLED_SAVES:
                    old, _ = self._settled.popitem(last=False)
                    self._owners.pop(old, None)
            self._settled_cond.notify_all()
        owner.settle(save)

    def _wait_settled(self, save: Save, timeout: float) -> bool:
        """Blocks until ``save`` failed or committed with its whole commit path run (indexed, queued for
        draining, local retention applied); False at the timeout. Woken by :meth:`_settle`, no polling."""
        deadline = time.monotonic() + timeout
        with self._settled_cond:
            if not self._settled_cond.wait_for(lambda: save.id not in self._saves or save.error is not None,
                                               timeout):
                return False
        if save.error is not None:
            return True
        # Settled and committed: the persister marks it done as soon as the node's commit path returns.
        return save.local_done.wait(max(0.0, deadline - time.monotonic()))

    def _owner(self, save: Save) -> Session:
        with self._saves_lock:
            return self._owners[save.id]

    def _save(self, save_id: str) -> Save | SettledSave:
        with self._saves_lock:
            save = self._saves.get(save_id) or self._settled.get(save_id)
        if save is None:
            raise SaveNotFound(save_id)
        return save

    def _live_save(self, save_id: str) -> Save:
        """A save still in flight; one that settled answers with its outcome."""
        save = self._save(save_id)
        if isinstance(save, SettledSave):
            if save.error is not None:
                raise SaveFailed(save.error)
            raise InvalidRequest(f"save {save_id} ({save.job} step {save.step} rank {save.rank}) is already "
                                 "committed")
        return save

    def _settled_record(self, save: Save) -> SettledSave:
        with self._saves_lock:
            record = self._settled.get(save.id)
        spec = save.spec
        return record or SettledSave(save.id, spec.job, spec.step, spec.rank, save.error, save.memory_only)

    def _live_saves(self) -> list[Save]:
        with self._saves_lock:
            return [s for s in self._saves.values() if not s.settled]

    def _in_flight(self, job: str, step: int, rank: int) -> bool:
        return any(s.spec.job == job and s.spec.step == step and s.spec.rank == rank for s in self._live_saves())

    def _fresh(self, job: str) -> None:
        """The index of ``job`` on the shared tier at most ~1 s old, or as fresh as a bounded wait gets it."""
        if self.shared_sync is not None:
            self.shared_sync.fresh(job)

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _local_timer(self) -> None:
        """Every ``[retention] interval_s``: the local rules of every job (never touches the shared tier)."""
        while not self._stopping.wait(self.config.retention.interval_s):
            try:
                for job in self.catalog.jobs():
                    self.apply_retention(job, trigger="timer", shared=False)
                self.memory.expire()
                self.incomplete.report()
            except OSError as e:  # a disk's condition, not a bug: one line, and the next pass tries again
                log.warning("timed local retention pass failed: %s", e, extra=fields(tier=TierName.LOCAL, error=e))
            except Exception:  # the timer must outlive one bad pass
                log.exception("timed local retention pass failed")

    def _shared_timer(self) -> None:
        """Every ``[retention] interval_s``, on its own thread: re-read the shared tier, publish job
        rules, apply the shared rules, clean what dead daemons left there. A hung shared file system stops
        only this thread."""
        interval = self.config.retention.interval_s
        next_pass = time.monotonic() + interval
        while True:
            self._shared_wake.wait(max(0.0, next_pass - time.monotonic()))
            if self._stopping.is_set():
                return
            try:
                if self._shared_wake.is_set():
                    self._shared_wake.clear()
                    self.job_rules.publish()
                if time.monotonic() < next_pass:
                    continue
                next_pass = time.monotonic() + interval
                assert self.drainer is not None
                self.drainer.refresh()
                self.commits.seal_all(TierName.SHARED)
                self.job_rules.publish()
                for job in self.catalog.jobs():
                    self.apply_retention(job, trigger="timer", local=False)
                self.tiers[TierName.SHARED].clean_abandoned()  # what daemons gone for good left there
            except OSError as e:  # the shared file system's condition, not a bug: the next pass tries again
                log.warning("timed shared retention pass failed: %s", e, extra=fields(tier=TierName.SHARED, error=e))
            except Exception:  # the timer must outlive one bad pass
                log.exception("timed shared retention pass failed")

    def _on_shared_indexed(self) -> None:
        """The drainer has indexed the shared tier (at start, or once it answered) and written the records a
        crash kept from being written: its rules may run."""
        for job in self.catalog.jobs():
            self.apply_retention(job, trigger="start", local=False)

    def _reap_unattached(self) -> None:
        """Closes sessions whose client never opened its ``Attach`` stream (it died right after
        ``OpenSession``): else their arena budget and ``/dev/shm`` file would be held forever."""
        period = min(1.0, self.attach_timeout_s / 4)
        while not self._stopping.wait(period):
            for session in self.sessions.unattached(self.attach_timeout_s):
                self.metrics.sessions_reaped.inc()
                self.close_session(session.id, f"the client never attached within {self.attach_timeout_s:g}s")

    def _check_running(self) -> None:
        if self._stopping.is_set():
            raise ShuttingDown()

    def _probe(self) -> StateProbe:
        def tier_used(tier: str) -> int:
            return sum(p.nbytes for p in self.catalog.all_parts(TierName(tier)))

        def tier_free(tier: str) -> int | None:
            return self.tier_probes[TierName(tier)].reading().free_bytes

        def tier_size(tier: str) -> int | None:
            return self.tier_probes[TierName(tier)].reading().total_bytes

        d = self.drainer
        return StateProbe(
            arena_used=lambda: self.budget.used, arena_total=lambda: self.budget.total,
            sessions=lambda: len(self.sessions.all()), tiers=lambda: [t.value for t in self.tier_probes],
            tier_used=tier_used, tier_free=tier_free, tier_size=tier_size,
            drain_queue=(lambda: d.pending()) if d else (lambda: (0, 0)),
            drain_lag_s=(lambda: d.lag_s()) if d else (lambda: 0.0),
            shared_reachable=(lambda: d.reachable) if d else (lambda: None),
            incomplete_steps=lambda: len(self.incomplete.stuck()),
            memory_copies=lambda: len(self.memory.copies()), memory_bytes=lambda: self.memory.bytes_kept,
            jobs=self.job_summaries)
