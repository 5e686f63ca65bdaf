"""The save RPCs: a save begun (its file created, or kept in memory only), its progress, finish, abort and waits.

``BeginSave`` checks the client's manifest before any file exists, decides
where the part goes (a new part, a replacement staged beside the committed
step, or the arena only with ``[local] persist_every``), and registers the
:class:`~ckptstage.daemon.save.persister.Save` with its session; the
persister then writes each chunk as the client reports it copied, and
:mod:`ckptstage.daemon.node.booking` books the commit. At the daemon's stop
the newest steps kept in memory only are written out here too
(:mod:`ckptstage.daemon.save.memflush`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from ckptstage.daemon.catalog.chunkstore import ChunkStore
from ckptstage.daemon.catalog.commits import Commits
from ckptstage.daemon.catalog.index import Catalog, TierName
from ckptstage.daemon.config import Config
from ckptstage.daemon.drain.drainer import Drainer
from ckptstage.daemon.errors import AlreadyExists, InvalidRequest, SaveFailed, SessionNotFound
from ckptstage.daemon.logs import fields
from ckptstage.daemon.metrics import Metrics
from ckptstage.daemon.node.saves import SaveTable
from ckptstage.daemon.save import memflush
from ckptstage.daemon.peers.tier import PeerTier
from ckptstage.daemon.save.manifest_check import parse_manifest
from ckptstage.daemon.save.memtier import MemoryTier
from ckptstage.daemon.save.persister import Persister, Save
from ckptstage.daemon.save.sessions import Session, SessionInfo, SessionTable
from ckptstage.daemon.tiers.interface import PartWriter, Tier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BegunSave:
    """What the client needs of a save it began: its id and where its bytes go in the arena stream."""

    id: str
    stream_base: int
    released: int  # the session's arena stream positions below this are free now


class SaveDesk:
    """Begins, follows and waits for saves; the table of them is :class:`SaveTable`."""

    def __init__(self, config: Config, sessions: SessionTable, saves: SaveTable, persister: Persister,
                 catalog: Catalog, commits: Commits, memory: MemoryTier, local: Tier, chunks: ChunkStore,
                 metrics: Metrics, drainer: Drainer | None, check_running: Callable[[], None],
                 stopping: threading.Event, peers: PeerTier | None = None) -> None:
        self._config = config
        self._sessions = sessions
        self._saves = saves
        self._persister = persister
        self._catalog = catalog
        self._commits = commits
        self._memory = memory
        self._local = local
        self._chunks = chunks
        self._metrics = metrics
        self._drainer = drainer
        self._check_running = check_running
        self._stopping = stopping
        self._peers = peers

    def begin(self, session_id: str, step: int, manifest_json: bytes, data_bytes: int, metrics: dict[str, float],
              stream_base: int | None = None, overwrite: bool = False) -> BegunSave:
        """Begins one rank's save of ``step`` (see the ``BeginSave`` RPC); the client then copies its bytes
        into the arena from the returned stream position and reports them with :meth:`progress`."""
        self._check_running()
        session = self._sessions.get(session_id)
        info = session.info
        if session.arena is None:
            raise InvalidRequest("no arena: call EnsureArena before BeginSave")
        spec = parse_manifest(manifest_json, info.job, step, info.rank, info.world_size, data_bytes, metrics)
        attempt = spec.manifest.get("attempt", "")
        if attempt != info.attempt:
            raise InvalidRequest(f"manifest attempt={attempt!r:.140} does not match the session's attempt "
                                 f"{info.attempt!r}")
        if self._saves.busy(info.job, step, info.rank):
            raise AlreadyExists(f"step {step} of job {info.job!r} rank {info.rank} is being saved; save a new step")
        local = self._local
        staged = self._commits.check_begin(info.job, step, info.rank, info.attempt, overwrite)
        if staged or (overwrite and self._catalog.has(info.job, step, info.rank)):
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
                                      replace=self._commits.replacer(TierName.LOCAL, info.job, step, info.attempt,
                                                                     overwrite))
        try:
            save = Save(uuid.uuid4().hex[:16], session.id, spec, session.arena,
                        base, session.chunk_bytes, writer,
                        direct_io=self._config.persist.direct_io,
                        store=self._chunks if self._config.persist.incremental else None,
                        user_store=self._config.persist.dedup == "user")
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
        self._saves.add(save, session)
        self._metrics.saves_started.inc()
        return BegunSave(save.id, save.stream_base, session.released())

    def progress(self, save_id: str, copied_upto: int, wait_released: int, timeout: float) -> int:
        save = self._saves.live(save_id)
        self._persister.progress(save, copied_upto)
        session = self._saves.owner(save)
        if wait_released:
            with session.cond:
                session.cond.wait_for(lambda: session.released() >= wait_released or save.error is not None
                                      or session.closed.is_set() or self._stopping.is_set(), timeout)
        if save.error is not None:
            raise SaveFailed(save.error)
        return session.released()

    def finish(self, save_id: str) -> int:
        """The client copied everything; returns the session's released stream position."""
        save = self._saves.live(save_id)
        self._persister.progress(save, save.spec.data_bytes, finished=True)
        return self._saves.owner(save).released()

    def abort(self, save_id: str, reason: str) -> None:
        save = self._saves.get(save_id)
        if isinstance(save, Save):
            self._persister.fail(save, f"aborted by the client: {reason}")

    def wait(self, save_id: str, tier: TierName, timeout: float) -> bool:
        """True once the save is committed on ``tier``; raises :class:`SaveFailed` if it cannot be."""
        found = self._saves.get(save_id)
        deadline = time.monotonic() + timeout
        if isinstance(found, Save):
            if not self._saves.wait_settled(found, timeout):
                return False
            found = self._saves.record(found)
        if found.error is not None:
            raise SaveFailed(found.error)
        if tier == TierName.MEMORY:
            return True  # committed: in the arena, and on disk too unless it is kept in memory only
        if found.memory_only:
            raise SaveFailed(f"{found.job} step {found.step} is kept in memory only: [local] persist_every = "
                             f"{self._config.local.persist_every} writes only steps that are multiples of it to "
                             "local SSD (wait for 'memory', or save a step that is one)")
        if tier == TierName.LOCAL:
            return True
        if tier == TierName.PEER:
            return self._wait_peer(found.job, found.step, found.rank, max(0.0, deadline - time.monotonic()))
        if self._drainer is None:
            raise SaveFailed("this daemon has no shared tier ([shared] dir is not set)")
        return self._drainer.wait_part(found.job, found.step, found.rank, max(0.0, deadline - time.monotonic()))

    def _wait_peer(self, job: str, step: int, rank: int, timeout: float) -> bool:
        if self._peers is None:
            raise SaveFailed("this daemon has no peer tier ([peers] listen is not set)")
        local = self._catalog.parts_of(job, step, rank).get(TierName.LOCAL)
        if local is None:
            raise SaveFailed(f"{job} step {step} rank {rank} is no longer on this node's local tier")
        return self._peers.wait(job, step, rank, local.digest, timeout)

    def persist_memory_steps(self, commit_deadline: float, within_s: float) -> float:
        """At the daemon's stop: lets saves whose bytes are all here commit (until ``commit_deadline``), then
        writes each job's newest step kept in memory only to local SSD, for at most ``within_s`` (see
        :mod:`ckptstage.daemon.save.memflush`); returns the seconds the writing took."""
        for save in self._saves.in_flight():
            if save.finished:
                self._saves.wait_settled(save, max(0.0, commit_deadline - time.monotonic()))
        began = time.monotonic()
        self._memory.wait_checked(within_s)  # a trainer that exited just now: its copy is still being checked
        images = [c.resident for c in self._memory.copies() if c.memory_only]
        images += [s.resident for s in self._sessions.all() if s.resident is not None]
        outcome = memflush.persist_newest(images, self._catalog, self._local, self._commits, began + within_s)
        memflush.log_outcome(outcome, "stopping")
        return time.monotonic() - began

    def _memory_only(self, session: Session, step: int, data_bytes: int, base: int, replacing: bool) -> bool:
        """Whether the save is kept in memory only (``[local] persist_every``): it must lie whole, unwrapped, in
        the arena (else it is written as usual), and a replacement of a committed step is always written."""
        arena = session.arena
        if replacing or self._config.local.persists(step) or not self._memory.enabled or arena is None:
            return False
        if base % arena.size + data_bytes > arena.size:
            log.info("%s step %d rank %d: %d bytes do not lie whole in the %d-byte arena; written to local SSD "
                     "although [local] persist_every = %d", session.info.job, step, session.info.rank, data_bytes,
                     arena.size, self._config.local.persist_every,
                     extra=fields(job=session.info.job, step=step, rank=session.info.rank, tier=TierName.LOCAL,
                                  bytes=data_bytes, arena_bytes=arena.size))
            return False
        return True

    def _check_replaceable_here(self, info: SessionInfo, step: int) -> None:
        """A committed step is replaced only by a job whose ranks all save through this daemon (see
        :mod:`ckptstage.daemon.catalog.overwrite`)."""
        here = {s.info.rank for s in self._sessions.all()
                if s.info.job == info.job and s.info.attempt == info.attempt and s.info.world_size == info.world_size}
        missing = sorted(set(range(info.world_size)) - here)
        if missing:
            raise InvalidRequest(f"step {step} of job {info.job!r} is committed and can be replaced (overwrite) only "
                                 f"when every rank saves through this node's daemon; ranks {missing[:20]} of "
                                 f"{info.world_size} have no session here. Delete the step on every node first, "
                                 "or save a new step")
