"""The session RPCs: a client's session opened, attached, given its arena and lifeline, closed or reaped.

A session is one rank of one job on this node. Opening it sizes its first
arena from the rank's newest part, takes the job's retention overrides
(published to the other nodes by the shared pass), and tells the client
whether a new arena would evict its own copy in the memory tier. Closing it
fails the saves its client never finished (their temporaries go) before it
leaves the table, so whoever sees it gone sees it cleaned up.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
from collections.abc import Callable

from ckptstage.daemon.catalog.index import Catalog
from ckptstage.daemon.config import Config
from ckptstage.daemon.errors import InvalidRequest
from ckptstage.daemon.logs import fields
from ckptstage.daemon.metrics import Metrics
from ckptstage.daemon.retention.job_rules import JobRetention, JobRules
from ckptstage.daemon.save.arena import Arena, Budget
from ckptstage.daemon.save.memtier import MemoryTier
from ckptstage.daemon.save.persister import Persister
from ckptstage.daemon.save.sessions import Session, SessionInfo, SessionTable
from ckptstage.protos import layout

log = logging.getLogger(__name__)


class SessionDesk:
    """Opens and closes sessions in :class:`SessionTable`."""

    def __init__(self, config: Config, sessions: SessionTable, budget: Budget, memory: MemoryTier, catalog: Catalog,
                 job_rules: JobRules, persister: Persister, metrics: Metrics, check_running: Callable[[], None],
                 rules_changed: threading.Event) -> None:
        """``rules_changed``: set when a job's retention overrides change (the shared pass publishes them)."""
        self._config = config
        self._sessions = sessions
        self._budget = budget
        self._memory = memory
        self._catalog = catalog
        self._job_rules = job_rules
        self._persister = persister
        self._metrics = metrics
        self._check_running = check_running
        self._rules_changed = rules_changed

    def open(self, info: SessionInfo) -> Session:
        self._check_running()
        layout.check_job(info.job)
        layout.check_attempt(info.attempt)
        try:
            layout.check_rank(info.rank, info.world_size)
        except layout.InvalidName as e:
            raise InvalidRequest(str(e)) from e
        rules = JobRetention.parse(info.overrides) if info.overrides is not None else None
        expected = self._catalog.newest_part_bytes(info.job, info.rank, info.world_size)
        info = dataclasses.replace(info, expected_bytes=expected, memory_copy=self._memory.at_risk(
            info.job, info.rank, max(expected, self._config.arena.min_session_bytes)))
        session = Session(info, self._budget, self._config.persist.chunk_bytes, os.getpid(), self._memory.take)
        if rules is not None and self._job_rules.set(info.job, rules):
            self._rules_changed.set()  # the shared-tier thread publishes them for the other nodes
        self._sessions.add(session)
        self._metrics.sessions_opened.inc()
        log.info("session %s opened: job %s rank %d/%d attempt %r pid %d on %s", session.id, info.job, info.rank,
                 info.world_size, info.attempt, info.pid, info.hostname,
                 extra=fields(job=info.job, rank=info.rank, session=session.id, world_size=info.world_size,
                              attempt=info.attempt, pid=info.pid, hostname=info.hostname))
        return session

    def close(self, session_id: str, reason: str) -> None:
        """Closes a session: fails the saves its client never finished (removing their temporaries),
        then drops it from the table, so whoever sees it gone (``Status``) sees it cleaned up."""
        session = self._sessions.find(session_id)
        if session is None:
            return
        for save in session.close():
            self._persister.fail(save, f"session closed before the save finished ({reason})")
        if self._sessions.pop(session_id) is not None:
            log.info("session %s closed: %s", session_id, reason,
                     extra=fields(job=session.info.job, rank=session.info.rank, session=session_id, reason=reason))

    def reap(self, session_id: str) -> None:
        """The session's ``Attach`` stream ended without the client closing the session (it died, or
        its connection broke): the session goes, with the saves its client never finished."""
        session = self._sessions.find(session_id)
        if session is not None and not session.closed.is_set():
            self._metrics.sessions_reaped.inc()
            self.close(session_id, "client disconnected")

    def attach(self, session_id: str) -> Session:
        """The client opened the session's ``Attach`` stream: it is alive, and the session is not reaped."""
        session = self._sessions.get(session_id)
        session.attach()
        return session

    def take_lifeline(self, session_id: str, conn: socket.socket) -> bool:
        """A client's lifeline for its session arrived on the handoff socket (see protos/handoff.py)."""
        session = self._sessions.find(session_id)
        return session is not None and session.set_lifeline(conn)

    def ensure_arena(self, session_id: str, want: int) -> Arena:
        self._check_running()
        return self._sessions.get(session_id).ensure_arena(want, self._config.arena.min_session_bytes)

    def arena_mapped(self, session_id: str, generation: int) -> None:
        arena = self._sessions.get(session_id).arena
        if arena is not None and arena.generation == generation:
            arena.unlink()
