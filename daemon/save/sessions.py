"""Client sessions: one per trainer rank, each with its arena and saves in flight."""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from ckptstage.daemon.save.arena import Arena, Budget, arena_name
from ckptstage.daemon.errors import ArenaFull, InvalidRequest, SessionNotFound, SharedMemoryFull
from ckptstage.daemon.logs import fields
from ckptstage.daemon.save.memtier import Resident
from ckptstage.daemon.save.persister import Save


log = logging.getLogger(__name__)

LIFELINE_WAIT_S = 2.0  # how long a closing session waits for its client's lifeline to close


@dataclass(frozen=True)
class SessionInfo:
    job: str
    rank: int
    world_size: int
    pid: int
    hostname: str
    overrides: dict[str, object] | None = None  # the job's retention overrides; None: leave them as they are
    attempt: str = ""  # the run this rank belongs to; "" is the anonymous attempt of older clients
    expected_bytes: int = 0  # what the rank's saves will likely need (its newest part here), for its arena
    # The memory tier holds the rank's newest part and an arena of expected_bytes would evict it: the client
    # prepares its arena only after it has loaded (OpenSessionResponse.memory_copy).
    memory_copy: bool = False


class Session:
    """A trainer rank's connection: its arena stream and the saves using it.

    Arena stream positions grow monotonically across saves; position ``p``
    lives at arena offset ``p % arena.size``. A save's bytes are released as
    the persister writes them; the client may overwrite a position only when
    everything below it has been released (back-pressure).

    Whoever waits for the session to change (the ``Attach`` stream, which
    announces freed arena space) either waits on ``cond`` or subscribes a
    callback; :meth:`notify` wakes both.
    """

    def __init__(self, info: SessionInfo, budget: Budget, chunk_bytes: int, daemon_pid: int,
                 handover: Callable[[Resident | None, Arena], bool] | None = None) -> None:
        """``handover(resident, arena)`` is offered the arena when the closed session lets go of it: True
        means it took the arena (and its share of the budget) over (the memory tier)."""
        self.id = uuid.uuid4().hex[:16]
        self.info = info
        self.opened = time.time()
        self.opened_monotonic = time.monotonic()
        self.chunk_bytes = chunk_bytes
        self.cond = threading.Condition()
        self.closed = threading.Event()
        self.attached = False  # its Attach stream is open: the client is alive
        self._listeners: set[Callable[[], None]] = set()
        self.saves: dict[str, Save] = {}  # not yet settled
        self.arena: Arena | None = None
        self._stream_end = 0
        self._generation = 0
        self._budget = budget
        self._daemon_pid = daemon_pid
        self._handover = handover
        # The newest committed save whose file image lies whole in the current arena (what the memory
        # tier keeps when the session closes); a later save may have overwritten it since: checked then.
        self.resident: Resident | None = None
        self._resident_base = 0  # its stream position
        # The client's lifeline (see protos/handoff.py): closed by the kernel only once no process of the
        # client's holds it, i.e. once nothing can write into the arena any more.
        self._lifeline: socket.socket | None = None
        self._wait_writer_s = LIFELINE_WAIT_S

    # --- liveness and change notification -----------------------------------------

    def attach(self) -> None:
        """Marks the session's ``Attach`` stream open: its client is alive (see :meth:`SessionTable.unattached`)."""
        with self.cond:
            if self.closed.is_set():
                raise SessionNotFound(self.id)
            self.attached = True

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Calls ``listener`` (cheap, thread-safe, e.g. ``loop.call_soon_threadsafe``) on every change."""
        with self.cond:
            self._listeners.add(listener)

    def unsubscribe(self, listener: Callable[[], None]) -> None:
        with self.cond:
            self._listeners.discard(listener)

    def notify(self) -> None:
        """Something changed (a chunk written, a save settled, the session closed): wake every waiter."""
        with self.cond:
            self._notify_locked()

    def _notify_locked(self) -> None:
        self.cond.notify_all()
        for listener in self._listeners:
            listener()

    # --- arena ----------------------------------------------------------------

    def ensure_arena(self, want: int, min_bytes: int) -> Arena:
        """Returns an arena for a save of ``want`` bytes, growing it when the budget allows.

        A save larger than the arena still works (it streams); growing only
        happens between saves, never under one in flight.
        """
        with self.cond:
            current = self.arena
            if current is not None and (current.size >= want or self.saves):
                return current
            try:
                size = self._budget.grant(max(want, min_bytes), self.chunk_bytes, (self.info.job, self.info.rank))
            except ArenaFull:
                if current is not None:
                    return current  # cannot grow now: the save streams through the arena it has
                raise
            if current is not None and size <= current.size:
                self._budget.release(size)
                return current
            try:
                arena = self._allocate(size)
            except SharedMemoryFull as e:
                self._budget.release(size)
                if current is not None:
                    return current  # the file system has no room to grow it: the save streams through this one
                raise SharedMemoryFull(e.wanted, e.free, e.fs_bytes, self._budget.total, self.chunk_bytes,
                                       e.where) from None
            except BaseException:
                self._budget.release(size)
                raise
            if arena.size < size:
                self._budget.release(size - arena.size)
            if current is not None:
                self._free(current)
            self.arena = arena
            # A new arena starts a new stream: align the next save to a chunk.
            self._stream_end = 0
            return arena

    def _allocate(self, size: int) -> Arena:
        """A new arena of ``size`` bytes, or of what the file system still holds (whole chunks; a save streams
        through a smaller arena) when something outside the budget took its room since the daemon started."""
        self._generation += 1
        name = arena_name(self._daemon_pid, self.id, self._generation)
        try:
            return Arena(name, size, self._generation, self._budget.shm_dir)
        except SharedMemoryFull as e:
            fits = e.free // self.chunk_bytes * self.chunk_bytes
            if not self.chunk_bytes <= fits < size:
                raise
            log.warning("session %s: %s holds no arena of %d bytes (%d free): granting %d", self.id, e.where, size,
                        e.free, fits, extra=fields(job=self.info.job, rank=self.info.rank, session=self.id))
            return Arena(name, fits, self._generation, self._budget.shm_dir)

    def stream_base_for_next_save(self, proposed: int | None = None) -> int:
        """Chunk-aligned start of the next save in the arena stream.

        ``proposed`` is where the client already started copying (it copies
        while BeginSave is in flight): accepted when chunk-aligned and not
        before the end of the previous save, so no two saves share a stream
        position; anything else is a client bug, refused before a byte of it
        is read.
        """
        with self.cond:
            c = self.chunk_bytes
            first_free = -(-self._stream_end // c) * c
            if proposed is None:
                return first_free
            if proposed % c or proposed < first_free:
                raise InvalidRequest(f"stream_base {proposed} is not a free, {c}-byte aligned arena stream "
                                     f"position: the session's next free one is {first_free}")
            return proposed

    def add_save(self, save: Save) -> None:
        """Registers a begun save; refused (SessionNotFound) once the session is closed.

        Checked under the lock :meth:`close` takes, so a save is either seen
        by ``close()`` (and failed, its temporary removed) or never added.
        """
        with self.cond:
            if self.closed.is_set():
                raise SessionNotFound(self.id)
            self.saves[save.id] = save
            self._stream_end = save.end

    def released(self) -> int:
        """Every stream position below this is free for the client to overwrite."""
        with self.cond:
            active = [s.released for s in self.saves.values()]
            return min(active) if active else self._stream_end

    def released_mark(self) -> tuple[int, int]:
        """(arena generation, released position): what the client is told as space frees up."""
        with self.cond:
            return (self.arena.generation if self.arena is not None else 0), self.released()

    def keep_resident(self, save: Save) -> None:
        """``save`` committed (on disk, or in memory only): its image in the arena is the session's newest."""
        assert save.committed_path is not None or save.memory_manifest is not None
        arena, spec = save.arena, save.spec
        offset, size = save.stream_base % arena.size, arena.size
        with self.cond:
            if arena is not self.arena or offset + spec.data_bytes > size:
                return  # the arena was replaced since, or the image wraps around the ring's end
            if self.resident is not None and self.resident.arena is arena and save.stream_base < self._resident_base:
                return  # an older save that committed late: the newer image stays
            self._resident_base = save.stream_base
            self.resident = Resident(spec.job, spec.step, spec.rank, spec.world_size,
                                     str(spec.manifest.get("attempt", "")), arena, offset, spec.data_bytes,
                                     save.committed_path, save.memory_manifest)

    def settle(self, save: Save) -> None:
        """Drops a committed or failed save; frees arenas nobody uses any more."""
        with self.cond:
            self.saves.pop(save.id, None)
            self._notify_locked()
            if self.closed.is_set() and not self.saves:
                if self.arena is not None:
                    self._let_go(self.arena)
                    self.arena = None
                self._drop_lifeline()

    def close(self, wait_writer_s: float = LIFELINE_WAIT_S) -> list[Save]:
        """Marks the session closed; returns saves the client never finished.

        Saves it did finish keep persisting from the arena (their bytes reached
        the daemon); the arena is freed once the last of them settles.
        ``wait_writer_s``: how long to wait for the client's lifeline to close
        before deciding that a writer may be left (0 at the daemon's shutdown).
        """
        with self.cond:
            self.closed.set()
            self._wait_writer_s = wait_writer_s
            unfinished = [s for s in self.saves.values() if not s.finished]
            if not self.saves:
                if self.arena is not None:
                    self._let_go(self.arena)
                    self.arena = None
                self._drop_lifeline()
            self._notify_locked()
            return unfinished

    def set_lifeline(self, conn: socket.socket) -> bool:
        """Takes the client's lifeline over; refused (False) once the session is closed or has one."""
        with self.cond:
            if self.closed.is_set() or self._lifeline is not None:
                return False
            self._lifeline = conn
            return True

    def _writer_gone(self) -> bool:
        """Whether no process can write into the arena any more: the client closed its lifeline after its last
        write, or died. A client that never opened one, or is alive (its session closed from outside, or its
        stream broke), may still write: its arena is not kept."""
        conn, self._lifeline = self._lifeline, None
        if conn is None:
            return False
        try:
            # At a client's death its descriptors close with the rest of it: allow for the stream's break
            # arriving first.
            readable, _, _ = select.select([conn], [], [], self._wait_writer_s)
            return bool(readable) and conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except OSError:
            return False
        finally:
            conn.close()

    def _drop_lifeline(self) -> None:
        conn, self._lifeline = self._lifeline, None
        if conn is not None:
            conn.close()

    def _let_go(self, arena: Arena) -> None:
        """The closed session is done with its arena: the memory tier may keep it, else it is freed."""
        if self._handover is not None and self.resident is not None:
            if not self._writer_gone():
                log.info("session %s: arena not kept in memory: its client may still write to it (it has not "
                         "closed its lifeline)", self.id,
                         extra=fields(job=self.info.job, rank=self.info.rank, session=self.id, tier="memory"))
            elif self._handover(self.resident, arena):
                return
        self._free(arena)

    def _free(self, arena: Arena) -> None:
        arena.close()
        self._budget.release(arena.size)


class SessionTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}

    def add(self, session: Session) -> None:
        with self._lock:
            self._sessions[session.id] = session

    def get(self, session_id: str) -> Session:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None or session.closed.is_set():
            raise SessionNotFound(session_id)
        return session

    def find(self, session_id: str) -> Session | None:
        """The session, closed or not (None once it has left the table)."""
        with self._lock:
            return self._sessions.get(session_id)

    def pop(self, session_id: str) -> Session | None:
        with self._lock:
            return self._sessions.pop(session_id, None)

    def all(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def unattached(self, older_than_s: float, now: float | None = None) -> list[Session]:
        """Sessions opened more than ``older_than_s`` ago whose client never attached (it died, or is broken)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return [s for s in self._sessions.values()
                    if not s.attached and now - s.opened_monotonic > older_than_s]
