"""A client's session with its daemon: the connection, the arena saves copy into, and the lifeline.

The session is opened once per client and again when the daemon restarts
(the snapshot thread notices the session's event stream ending). Held open
for the life of the session, the event stream and the lifeline tell the
daemon when this process dies, so it frees the session and keeps the arena
for the memory tier.
"""

from __future__ import annotations

import logging
import os
import socket as socketlib
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import grpc

from ckptstage.client import errors, rpc
from ckptstage.client.rpc import Connection
from ckptstage.client.snapshot import ArenaMap
from ckptstage.protos import handoff
from ckptstage.protos.v1 import ckptstage_pb2 as pb

log = logging.getLogger(__name__)

# After losing its session, how long a save waits for a restarting daemon before it fails.
_REOPEN_WAIT_S = 10.0
# How long closing waits for a client thread to leave its gRPC call (it ends as soon as the call is cancelled).
THREAD_EXIT_S = 5.0

# Every open client's lifeline (see protos/handoff.py). A forked child (a DataLoader worker) never writes into
# an arena, so it lets go of its copies at once: the lifeline then closes when the trainer itself dies, not
# when the last of its workers does.
_LIFELINES: weakref.WeakSet[socketlib.socket] = weakref.WeakSet()


def _drop_lifelines_in_child() -> None:
    for sock in list(_LIFELINES):
        sock.close()  # this process's descriptor only: the parent's connection stays open


os.register_at_fork(after_in_child=_drop_lifelines_in_child)


class Session:
    """One rank's session with the daemon on ``socket`` and the arena it maps; opened by the constructor.

    ``saves``: whether this process saves at all (a rank told that only rank
    0 saves never takes an arena, so it never defers one for the memory tier).
    """

    def __init__(self, socket: str | os.PathLike[str] | None, job: str, rank: int, world_size: int, attempt: str,
                 retention: Mapping[str, Any] | None, saves: bool, connect_timeout: float) -> None:
        self.conn = Connection(socket)
        self.job, self.rank, self.world_size, self.attempt = job, rank, world_size, attempt
        self._retention = dict(retention) if retention is not None else None
        self._saves = saves
        self.arena: ArenaMap | None = None
        # The arena stream as this client last heard of it (see snapshot.Streamer):
        # where its previous save ended, and the position below which all is free.
        self.stream_end = 0
        self.released = 0
        self._lock = threading.Lock()
        self._released_hint = (0, 0)  # (arena generation, released) as the daemon last announced it
        self._lifeline: socketlib.socket | None = None
        self.open(connect_timeout)

    def open(self, connect_timeout: float = _REOPEN_WAIT_S) -> None:
        """Opens the session, waiting up to ``connect_timeout`` for a daemon that is (re)starting."""
        request = pb.OpenSessionRequest(
            job=self.job, rank=self.rank, world_size=self.world_size, pid=os.getpid(),
            hostname=socketlib.gethostname(), attempt=self.attempt)
        if self._retention is not None:  # else the job keeps the rules an earlier session set
            request.retention.CopyFrom(pb.RetentionOverrides(**self._retention))
        resp = rpc.call_when_up(self.conn, "OpenSession", request, connect_timeout)
        self.session_id = resp.session_id
        self.chunk = resp.chunk_bytes
        self.expected = int(resp.expected_bytes)
        # The daemon holds this rank's newest part in memory: an arena is created only after the restart
        # has loaded it (see Saver.prepare), so that taking the budget cannot evict the very copy it reads.
        self.memory_copy = bool(resp.memory_copy) and self._saves
        # This daemon's address for the job's other nodes ("": it keeps no replicas, [peers] is off).
        self.peer_address = resp.peer_address
        # Held open for the life of the session: if this process dies, the
        # daemon sees the stream break and frees the session.
        self._attach = self.conn.stub.Attach(pb.AttachRequest(session_id=self.session_id))
        try:
            first = next(self._attach)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, str(self.conn.socket)) from None
        if first.kind != pb.SessionEvent.READY:
            raise errors.DaemonUnavailable(f"daemon refused the session: {first.message}")
        with self._lock:
            self._released_hint = (0, 0)
        self._close_lifeline()
        try:
            self._lifeline = handoff.lifeline(handoff.socket_path(self.conn.socket), self.session_id)
            _LIFELINES.add(self._lifeline)
        except OSError as e:  # an older daemon: no memory tier for this session's arena, nothing else lost
            log.debug("ckptstage: no lifeline to the daemon's memory tier: %s", e)
        self._watcher = threading.Thread(target=self._watch, args=(self._attach, self.session_id), daemon=True,
                                         name=f"ckptstage-session-{self.rank}")
        self._watcher.start()

    def join_peers(self, nodes: list[str]) -> list[str]:
        """Tells the daemon the nodes the job runs on (every rank's daemon's peer address); returns the
        others, as the daemon will use them."""
        resp = self.conn.call("JoinPeers", pb.JoinPeersRequest(session_id=self.session_id, nodes=nodes))
        return list(resp.peers)

    def lost(self) -> bool:
        """Whether the session's event stream ended: the daemon died or restarted (or the session closed)."""
        return bool(self._attach.done())

    def reopen(self) -> int:
        """The session's stream ended: the daemon died or restarted. Starts over on its successor; returns the
        size of the arena the old session had (0: none), for the caller to prepare again.

        The old session and arena are gone with the old daemon; without a new
        session every later save of a long-running trainer would fail.
        """
        log.warning("ckptstage: lost the session with the daemon on %s; opening a new one", self.conn.socket)
        had = self.arena.size if self.arena is not None else 0
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self.open()
        return had

    def released_hint(self) -> tuple[int, int]:
        """(arena generation, released stream position) as the daemon last announced them."""
        with self._lock:
            return self._released_hint

    def ensure_arena(self, want: int) -> ArenaMap:
        """An arena of at least ``want`` bytes, mapped; a new one starts a new stream."""
        if self.arena is not None and self.arena.size >= want:
            return self.arena
        info = self.conn.call("EnsureArena", pb.EnsureArenaRequest(session_id=self.session_id, want_bytes=want))
        if self.arena is None or info.generation != self.arena.generation:
            old, self.arena = self.arena, ArenaMap(info)
            self.stream_end = self.released = 0  # a new arena starts a new stream
            self.conn.call("ArenaMapped", pb.ArenaMappedRequest(session_id=self.session_id,
                                                                generation=info.generation))
            if old is not None:
                old.close()
        return self.arena

    def prepare_arena(self, nbytes: int) -> None:
        """Sizes the arena ahead of the saves; on any trouble the next save asks again (and reports it).

        Never raises: this runs on the snapshot thread, which must live on to copy the saves.
        """
        try:
            if not self.lost():
                self.ensure_arena(nbytes)
        except errors.CkptStageError as e:
            log.debug("ckptstage: no arena of %d bytes prepared ahead (%s); the next save asks again", nbytes, e)
        except Exception as e:  # noqa: BLE001 - out of descriptors or memory, a vanished file: the save reports it
            log.warning("ckptstage: could not prepare an arena of %d bytes ahead (%s); the next save asks again",
                        nbytes, e)

    def close(self) -> None:
        """Ends the session (nothing of this process writes into the arena any more), then the connection."""
        self._close_lifeline()  # nothing of this process writes into the arena any more: the daemon may keep it
        try:
            self.conn.call("CloseSession", pb.CloseSessionRequest(session_id=self.session_id), timeout=10)
        except errors.CkptStageError:
            pass  # the daemon is gone; nothing is left to release there
        self._attach.cancel()
        self._watcher.join(THREAD_EXIT_S)  # out of its gRPC call before the interpreter may exit
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self.conn.close()

    def join_watcher(self, timeout: float) -> None:
        self._watcher.join(timeout)

    def _close_lifeline(self) -> None:
        lifeline, self._lifeline = self._lifeline, None
        if lifeline is not None:
            lifeline.close()

    def _watch(self, attach: Any, session_id: str) -> None:
        """Follows the session's event stream: the daemon announces arena space as it frees up."""
        try:
            for ev in attach:
                if ev.kind != pb.SessionEvent.RELEASED:
                    continue
                with self._lock:
                    if self.session_id == session_id:
                        self._released_hint = (ev.arena_generation, ev.released)
        except grpc.RpcError:
            pass  # the stream ended (close, daemon exit or restart); the snapshot thread sees it through lost()
