"""The node's checkpoint service: the one domain object the gRPC servicer calls.

It wires the stages together (sessions, the persister, the catalogue, the
drainer, retention) and keeps one method per RPC; the work of each lives in a
module of its own: :mod:`~ckptstage.daemon.node.sessiondesk` (sessions),
:mod:`~ckptstage.daemon.node.saving` (saves), :mod:`~ckptstage.daemon.node.booking`
(what follows a commit: index -> seal -> queue for draining -> settle ->
retention), :mod:`~ckptstage.daemon.node.lookup` (what readers ask),
:mod:`~ckptstage.daemon.node.steps` (pins, deletions, prefetches),
:mod:`~ckptstage.daemon.node.timers` (periodic passes) and
:mod:`~ckptstage.daemon.node.probe` (job summaries, scrape-time state).
Nothing here knows about gRPC.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ckptstage.daemon.catalog.chunkstore import ChunkStore
from ckptstage.daemon.catalog.commits import Commits
from ckptstage.daemon.catalog.index import Catalog, Checkpoint, TierName
from ckptstage.daemon.catalog.quarantine import Quarantine
from ckptstage.daemon.config import Config
from ckptstage.daemon.drain import drainer as drainer_mod
from ckptstage.daemon.drain import stopdrain
from ckptstage.daemon.drain.drainer import Drainer
from ckptstage.daemon.drain import indexcopy
from ckptstage.daemon.drain.indexcopy import IndexCopies
from ckptstage.daemon.drain.sharedsync import SharedSync
from ckptstage.daemon.errors import ShuttingDown
from ckptstage.daemon.events import Bus
from ckptstage.daemon.logs import fields
from ckptstage.daemon.metrics import Metrics
from ckptstage.daemon.node import listing, peering, probe
from ckptstage.daemon.node.booking import CommitBooking
from ckptstage.daemon.node.incomplete import IncompleteSteps
from ckptstage.daemon.node.jobs import JobSummary
from ckptstage.daemon.node.lookup import Lookup, committed_digest, newest_complete
from ckptstage.daemon.node.saves import SaveTable
from ckptstage.daemon.node.saving import BegunSave, SaveDesk
from ckptstage.daemon.node.sessiondesk import SessionDesk
from ckptstage.daemon.node.status import NodeStatus, StatusReader, TierReport
from ckptstage.daemon.node.steps import StepOps
from ckptstage.daemon.node.timers import Timers
from ckptstage.daemon.retention.coalesce import PassGate
from ckptstage.daemon.retention.janitor import Deleted, GcAction, Janitor
from ckptstage.daemon.retention.job_rules import JobRules
from ckptstage.daemon.save import arena as arena_mod
from ckptstage.daemon.save import persister as persister_mod
from ckptstage.daemon.save.memtier import MemoryTier
from ckptstage.daemon.save.persister import Persister
from ckptstage.daemon.save.sessions import Session, SessionInfo, SessionTable
from ckptstage.daemon.tiers.kinds import open_tiers
from ckptstage.daemon.tiers.loadgate import LoadGate
from ckptstage.daemon.tiers.probe import TierProbe
from ckptstage.protos import layout

log = logging.getLogger(__name__)

VERSION = "0.1.0"
STATE_DIR = ".state"  # under the local tier: pins; ignored by tier scans (not a job name)
# A session whose client has not attached after this long is closed (the client died after OpenSession).
ATTACH_TIMEOUT_S = 30.0


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
        self.started = time.monotonic()
        self.budget = arena_mod.Budget(config.arena.max_bytes, shm_dir=config.arena.dir)
        self.catalog = catalog = Catalog(config.local.dir / STATE_DIR / "pins.json")
        self.memory = MemoryTier(self.budget, config.memory.enabled, config.memory.keep_s,
                                 lambda job, step, rank: committed_digest(catalog, job, step, rank),
                                 lambda job: newest_complete(catalog, job))
        self.sessions = SessionTable()
        self.saves = SaveTable()
        self.owner = node_name(config.local.dir, config.node_name)
        # The storage of each disk tier: everything below the node reaches a tier through these.
        self.tiers = open_tiers(config, self.owner)
        local = self.tiers[TierName.LOCAL]
        shared = self.tiers.get(TierName.SHARED)
        self.job_rules = JobRules(config.local.dir / STATE_DIR / "job-retention.json", shared)
        self._stopping = threading.Event()
        self.tier_probes = {name: TierProbe(name.value, tier) for name, tier in self.tiers.items()}
        # Loads in flight on this node: drains, repacks and replicas sent to peers wait while there are any.
        self.loads = LoadGate(config.persist.yield_to_loads_s)
        self.chunk_stores = {name: ChunkStore(tier, config.persist.chunk_grace_s, self.loads.acquire)
                             for name, tier in self.tiers.items()}
        # What the persister and the drainer report (see _subscribe): their events, handled in order.
        self.events = Bus()
        self.persister = Persister(config.persist.workers, self.events, config.persist.nice)
        self.commits = Commits(catalog, local, shared, clock, poll_s=config.shared.step_poll_s)
        self.drainer: Drainer | None = None
        self.shared_sync: SharedSync | None = None
        if shared is not None:
            self.drainer = Drainer(config.shared, catalog, self.metrics, self.commits, self.events,
                                   chunk_stores=self.chunk_stores, nice=config.persist.nice, tiers=self.tiers,
                                   gate=self.loads)
            self.shared_sync = SharedSync(catalog, shared, max_age_s=config.shared.stale_after_s,
                                          wait_s=config.shared.stale_wait_s, interval_s=config.shared.watch_interval_s,
                                          watched=lambda: {s.info.job for s in self.sessions.all()})
        drain = self.drainer.queue if self.drainer is not None else None  # what retention and status read
        self.peers = peering.open_peers(config, local, config.local.dir / STATE_DIR, self.owner, catalog, self.budget,
                                        self.metrics, self.loads)
        # Kept copies, then replicas kept in memory, make way for sessions that need the room.
        self.budget.reclaim = peering.reclaimer(self.budget, self.memory, self.peers)
        self.fetcher = peering.open_fetcher(
            self.drainer, self.peers, catalog, self.metrics,
            lambda part, detail: self.report_corrupt(part.job, part.step, part.rank, part.tier, detail))
        self.quarantine = Quarantine(catalog, self.metrics, tiers=self.tiers,
                                     keep_s=config.retention.quarantine_keep_s,
                                     max_bytes=config.retention.quarantine_max_bytes)
        self.incomplete = IncompleteSteps(catalog, config.retention.incomplete_after_s, clock=clock,
                                          busy=lambda job, step: any(s.spec.job == job and s.spec.step == step
                                                                     for s in self.saves.in_flight()))
        self.janitor = Janitor(config, catalog, self.metrics, drain, self.job_rules, self.saves.busy,
                               self.chunk_stores, tiers=self.tiers)
        self.timers = Timers(config.retention.interval_s, catalog, self.apply_retention, self.memory, self.incomplete,
                             self._stopping, self.quarantine.expire)
        index_copies = IndexCopies(shared, config.local.dir / STATE_DIR / indexcopy.DIR, config.local.dir) \
            if shared is not None else None
        self.lookup = Lookup(config, catalog, self.commits, self.memory, self.quarantine, self.tiers, self.drainer,
                             self.shared_sync, self._stopping, index_copies, self.peers, self.janitor.chunk_lists)
        self.session_desk = SessionDesk(config, self.sessions, self.budget, self.memory, catalog, self.job_rules,
                                        self.persister, self.metrics, self._check_running, self.timers.shared_wake)
        self.save_desk = SaveDesk(config, self.sessions, self.saves, self.persister, catalog, self.commits,
                                  self.memory, local, self.chunk_stores[TierName.LOCAL], self.metrics, self.drainer,
                                  self._check_running, self._stopping, self.peers)
        self._passes = PassGate()
        self.booking = CommitBooking(self.saves, catalog, self.commits, self.memory, self.metrics, local,
                                     self.drainer, self._retention_after, clock, config.local.persist_every,
                                     self.peers.committed if self.peers is not None else None)
        self.steps = StepOps(catalog, self.lookup, self.saves, self.memory, self.janitor, self.quarantine,
                             self.commits, self.fetcher, self.peers.drop_replica if self.peers else None)
        self._status = StatusReader(self.tiers, catalog, self.sessions, self.budget, self.memory, drain,
                                    self.tier_probes, self.job_summaries, self.started, self._tier_warnings)
        self._subscribe()
        self.metrics.add_state(probe.state_probe(self.budget, self.sessions, catalog, self.tier_probes, self.drainer,
                                                 self.incomplete, self.memory, self.job_summaries, self.peers,
                                                 self.loads, self.quarantine, self.janitor.chunk_lists))

    def _subscribe(self) -> None:
        """What follows each event of the layers below, on the thread that published it (see
        :mod:`ckptstage.daemon.events`): a save's commit is booked before its waiters wake, a drain's retention
        runs before the drain counts as finished."""
        on = self.events.subscribe
        on(persister_mod.Progressed, lambda e: self.saves.owner(e.save).notify())
        on(persister_mod.Committed, lambda e: self.booking.committed(e.save))
        on(persister_mod.Failed, lambda e: self.booking.failed(e.save))
        on(drainer_mod.Drained, lambda e: self._retention_after(e.part.job, trigger="drain"))
        on(drainer_mod.CorruptCopy,
           lambda e: self.report_corrupt(e.part.job, e.part.step, e.part.rank, TierName.LOCAL, e.detail))
        on(drainer_mod.Indexed, lambda e: self._on_shared_indexed())

    # --- life cycle -------------------------------------------------------------

    def recover(self) -> None:
        """Invariant 3: clean temporaries, re-read what is committed, resume draining.

        Only the local tier is read here, so the daemon serves as soon as its
        own disk is indexed: the drainer cleans and indexes the shared tier on
        its own thread (a shared file system that hangs must not keep the node
        from taking saves), then resumes draining. Starts the periodic passes
        (:mod:`ckptstage.daemon.node.timers`) and the tier probes.
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
        for tier_probe in self.tier_probes.values():
            tier_probe.start()
        for job in self.catalog.jobs():
            self.apply_retention(job, trigger="start", shared=False)
        self.timers.start(self.sessions, self.close_session, self.metrics, self.attach_timeout_s)
        if self.drainer is not None:
            self.drainer.start()
            self.timers.start_shared(self.drainer, self.commits, self.job_rules, self.tiers[TierName.SHARED])
        if self.shared_sync is not None:
            self.shared_sync.start()
        if self.peers is not None:
            self.peers.start()

    def shutdown(self, timeout: float, drain_s: float = 0.0) -> None:
        """Stops taking saves, lets finished ones commit (bounded by ``timeout``), drains the newest step of
        each job the shared tier lacks, on SSD or kept in memory only (bounded by ``drain_s``: see
        :mod:`ckptstage.daemon.drain.stopdrain` and :mod:`ckptstage.daemon.save.memflush`), then stops the
        drainer."""
        self._stopping.set()
        self.loads.open_for_good()  # the drain below goes before any load
        self.commits.wake()  # step waits end (they check _stopping)
        self.timers.shared_wake.set()  # the shared-tier thread sleeps on it
        deadline = time.monotonic() + timeout
        flushed_s = 0.0  # of drain_s: writing memory-only steps to local SSD for the drain below
        if self.drainer is not None and drain_s > 0:
            flushed_s = self.save_desk.persist_memory_steps(deadline, drain_s)
        self.memory.shutdown()  # first: the sessions closed below free their arenas instead of handing them over
        for session in self.sessions.all():
            for save in session.close(wait_writer_s=0):
                self.persister.fail(save, "daemon shutting down before the client finished copying")
        for save in self.saves.in_flight():
            if not self.saves.wait_settled(save, max(0.0, deadline - time.monotonic())):
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
        if self.peers is not None:
            self.peers.stop()
        if self.shared_sync is not None:
            self.shared_sync.stop()
        for tier_probe in self.tier_probes.values():
            tier_probe.stop()
        self.quarantine.shutdown()
        self.timers.join(deadline)

    # --- sessions (node/sessiondesk.py) ----------------------------------------------

    def open_session(self, info: SessionInfo) -> Session:
        return self.session_desk.open(info)

    def close_session(self, session_id: str, reason: str) -> None:
        self.session_desk.close(session_id, reason)

    def reap_session(self, session_id: str) -> None:
        self.session_desk.reap(session_id)

    def peer_address(self) -> str:
        """This daemon's address for its jobs' other nodes ("": no peer tier)."""
        return self.peers.address if self.peers is not None else ""

    def join_peers(self, session_id: str, nodes: list[str]) -> list[str]:
        """The nodes a session's job runs on, as its clients gathered them; returns the others."""
        if self.peers is None:
            return []
        return self.peers.join(self.sessions.get(session_id).info.job, nodes)

    def attach(self, session_id: str) -> Session:
        return self.session_desk.attach(session_id)

    def take_lifeline(self, session_id: str, conn: socket.socket) -> bool:
        return self.session_desk.take_lifeline(session_id, conn)

    def ensure_arena(self, session_id: str, want: int) -> arena_mod.Arena:
        return self.session_desk.ensure_arena(session_id, want)

    def arena_mapped(self, session_id: str, generation: int) -> None:
        self.session_desk.arena_mapped(session_id, generation)

    # --- saves (node/saving.py) --------------------------------------------------------

    def begin_save(self, session_id: str, step: int, manifest_json: bytes, data_bytes: int,
                   metrics: dict[str, float], stream_base: int | None = None, overwrite: bool = False) -> BegunSave:
        return self.save_desk.begin(session_id, step, manifest_json, data_bytes, metrics, stream_base, overwrite)

    def progress(self, save_id: str, copied_upto: int, wait_released: int, timeout: float) -> int:
        return self.save_desk.progress(save_id, copied_upto, wait_released, timeout)

    def finish_save(self, save_id: str) -> int:
        return self.save_desk.finish(save_id)

    def abort_save(self, save_id: str, reason: str) -> None:
        self.save_desk.abort(save_id, reason)

    def wait_save(self, save_id: str, tier: TierName, timeout: float) -> bool:
        return self.save_desk.wait(save_id, tier, timeout)

    # --- what readers ask (node/lookup.py) -----------------------------------------------

    def list_checkpoints(self, job: str, memory: bool = False) -> listing.Listing:
        return self.lookup.list_checkpoints(job, memory)

    def locate_parts(self, job: str, step: int | None, rank: int, all_ranks: bool = False, memory: bool = False,
                     ranks: Sequence[int] = (), node_copy: bool = False, step_index: bool = False) -> listing.Located:
        return self.lookup.locate_parts(job, step, rank, all_ranks, memory, ranks, node_copy, step_index)

    def wait_step(self, job: str, step: int, tier: TierName | None, timeout: float) -> Checkpoint | None:
        return self.lookup.wait_step(job, step, tier, timeout)

    # --- what is done to a step (node/steps.py) ------------------------------------------

    def report_corrupt(self, job: str, step: int, rank: int, tier: TierName, detail: str) -> None:
        self.steps.report_corrupt(job, step, rank, tier, detail)

    def loading(self, lease: str, ttl_s: float, done: bool) -> None:
        """A reader on this node begins (renews) or ends a load: background copies wait meanwhile."""
        self.loads.announce(lease, ttl_s, done)

    def set_pin(self, job: str, step: int, pinned: bool) -> bool:
        return self.steps.set_pin(job, step, pinned)

    def delete_step(self, job: str, step: int, settle_wait_s: float = 30.0) -> Deleted:
        return self.steps.delete(job, step, settle_wait_s)

    def prefetch(self, job: str, step: int | None, ranks: Sequence[int] = ()) -> tuple[int, int]:
        return self.steps.prefetch(job, step, ranks)

    # --- status ----------------------------------------------------------------------------

    def status(self) -> NodeStatus:
        """The node's state, from memory only (see :mod:`ckptstage.daemon.node.status`)."""
        return self._status.read()

    def tier_status(self, tier: TierName) -> TierReport:
        return self._status.tier(tier)

    def job_summaries(self) -> list[JobSummary]:
        return probe.job_summaries(self.catalog, self.sessions, self.memory, self.drainer, self.peers)

    def _tier_warnings(self, tier: TierName) -> tuple[str, ...]:
        warning = self.janitor.floor.warning if tier == TierName.LOCAL else ""
        return (warning,) if warning else ()

    # --- retention and drain -----------------------------------------------------------

    def apply_retention(self, job: str, dry_run: bool = False, trigger: str = "gc",
                        local: bool = True, shared: bool = True) -> list[GcAction]:
        """Runs the retention rules for one job (see :meth:`Janitor.apply`)."""
        return self.janitor.apply(job, dry_run, trigger, local=local, shared=shared)

    def _retention_after(self, job: str, trigger: str, shared: bool = True) -> None:
        """The pass that follows a commit or a drain, coalesced (:mod:`ckptstage.daemon.retention.coalesce`)."""
        self._passes.run((job, shared), lambda: self.apply_retention(job, trigger=trigger, shared=shared))

    def gc(self, dry_run: bool) -> list[GcAction]:
        return self.janitor.gc(dry_run)

    def drain(self, job: str | None, wait: bool, timeout: float, newest: bool = False) -> tuple[int, int]:
        """Waits (with ``wait``, up to ``timeout``) for the job's (every job's) drain queue to empty;
        ``newest``: first drains each job's newest step only this node holds (see
        :mod:`ckptstage.daemon.drain.stopdrain`). Returns (parts still pending, parts failed)."""
        if job:
            layout.check_job(job)
        return stopdrain.on_request(self.catalog, self.drainer, job, wait, timeout, newest) if self.drainer else (0, 0)

    def _on_shared_indexed(self) -> None:
        """The drainer has indexed the shared tier (at start, or once it answered) and written the records a
        crash kept from being written: its rules may run, and what was moved aside there is listed."""
        self.quarantine.find_on(TierName.SHARED)
        for job in self.catalog.jobs():
            self.apply_retention(job, trigger="start", local=False)

    def _check_running(self) -> None:
        if self._stopping.is_set():
            raise ShuttingDown()
