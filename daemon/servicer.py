"""The gRPC servicer: validate, call one :class:`Node` method, map errors to status codes."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from ckptstage.daemon.catalog import Checkpoint, TierName
from ckptstage.daemon.errors import (
    AlreadyExists,
    ArenaFull,
    CheckpointNotFound,
    InvalidRequest,
    SaveFailed,
    SaveNotFound,
    SessionNotFound,
    ShuttingDown,
)
from ckptstage.daemon.node import VERSION, Node
from ckptstage.daemon.sessions import SessionInfo
from ckptstage.protos import layout
from ckptstage.protos.v1 import ckptstage_pb2 as pb
from ckptstage.protos.v1 import ckptstage_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (layout.InvalidName, grpc.StatusCode.INVALID_ARGUMENT),
    # Not NOT_FOUND: that code means "no such checkpoint" to clients.
    (SessionNotFound, grpc.StatusCode.FAILED_PRECONDITION),
    (SaveNotFound, grpc.StatusCode.FAILED_PRECONDITION),
    (CheckpointNotFound, grpc.StatusCode.NOT_FOUND),
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (ArenaFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (SaveFailed, grpc.StatusCode.ABORTED),
    (ShuttingDown, grpc.StatusCode.UNAVAILABLE),
]

_TIERS = {pb.LOCAL: TierName.LOCAL, pb.SHARED: TierName.SHARED}
_TIER_PB = {v: k for k, v in _TIERS.items()}
# Longest a blocking RPC holds a server thread; clients loop for longer waits.
MAX_BLOCK_S = 30.0

F = TypeVar("F", bound=Callable[..., Any])


def _mapped(method: F) -> F:
    """Turns domain errors into a gRPC status with the error's message."""

    @functools.wraps(method)
    def wrapper(self: Servicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except grpc.RpcError:
            raise
        except Exception as e:  # noqa: BLE001 - every error reaches the client with a code
            for cls, code in _CODES:
                if isinstance(e, cls):
                    context.abort(code, str(e))
            if isinstance(e, OSError):
                log.exception("%s failed", method.__name__)
                context.abort(grpc.StatusCode.INTERNAL, f"daemon I/O error: {e}")
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method.__name__}: {e!r}")

    return wrapper  # type: ignore[return-value]


def _tier(value: int) -> TierName:
    if value not in _TIERS:
        raise InvalidRequest(f"unknown tier {value}: LOCAL or SHARED")
    return _TIERS[value]


def _timeout(requested: float, context: grpc.ServicerContext) -> float:
    remaining = context.time_remaining()
    limit = MAX_BLOCK_S if remaining is None else max(0.0, min(MAX_BLOCK_S, remaining - 0.05))
    return limit if requested <= 0 else min(requested, limit)


class Servicer(pb_grpc.CheckpointerServicer):
    def __init__(self, node: Node, socket_path: str, metrics_url: str = "") -> None:
        self.node = node
        self.socket_path = socket_path
        self.metrics_url = metrics_url
        self._shutdown = threading.Event()

    def begin_shutdown(self) -> None:
        self._shutdown.set()

    # --- sessions -----------------------------------------------------------------

    @_mapped
    def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.ServicerContext) -> pb.OpenSessionResponse:
        o = request.retention
        # Every field of RetentionOverrides, by name; unset (zero/empty) ones mean "the operator's".
        overrides = {f.name: getattr(o, f.name) for f in o.DESCRIPTOR.fields if getattr(o, f.name)}
        info = SessionInfo(request.job, request.rank, request.world_size or 1, request.pid, request.hostname,
                           overrides)
        session = self.node.open_session(info)
        return pb.OpenSessionResponse(session_id=session.id, chunk_bytes=session.chunk_bytes,
                                      daemon_version=VERSION)

    def Attach(self, request: pb.AttachRequest, context: grpc.ServicerContext) -> Iterator[pb.SessionEvent]:
        try:
            session = self.node.sessions.get(request.session_id)
        except SessionNotFound as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        gone = threading.Event()
        reaped = threading.Lock()

        def reap() -> None:
            """Frees a session whose client went away without closing it (e.g. killed). Runs once."""
            if reaped.acquire(blocking=False) and not session.closed.is_set():
                self.node.metrics.sessions_reaped.inc()
                self.node.close_session(session.id, "client disconnected")

        def on_gone() -> None:  # fires when the stream ends: the client closed it, died, or we are done
            gone.set()
            with session.cond:
                session.cond.notify_all()
            reap()  # here too: a generator suspended at a yield nobody takes would never get to it

        def ended() -> bool:
            return gone.is_set() or session.closed.is_set() or self._shutdown.is_set()

        context.add_callback(on_gone)
        try:
            yield pb.SessionEvent(kind=pb.SessionEvent.READY)
            # Tell the client as arena space frees up, so its next copy need not ask first.
            sent = session.released_mark()
            while not ended():
                with session.cond:  # notified as the persister writes chunks and as saves settle
                    session.cond.wait_for(lambda last=sent: ended() or session.released_mark() != last, 0.5)
                    mark = session.released_mark()
                if mark != sent and not ended():
                    sent = mark
                    yield pb.SessionEvent(kind=pb.SessionEvent.RELEASED, arena_generation=mark[0], released=mark[1])
            if self._shutdown.is_set() and not gone.is_set():
                yield pb.SessionEvent(kind=pb.SessionEvent.SHUTTING_DOWN, message="daemon shutting down")
        finally:
            reap()

    @_mapped
    def EnsureArena(self, request: pb.EnsureArenaRequest, context: grpc.ServicerContext) -> pb.ArenaInfo:
        arena = self.node.ensure_arena(request.session_id, request.want_bytes)
        return pb.ArenaInfo(path=str(arena.path), size_bytes=arena.size, generation=arena.generation)

    @_mapped
    def ArenaMapped(self, request: pb.ArenaMappedRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.node.arena_mapped(request.session_id, request.generation)
        return pb.Empty()

    @_mapped
    def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.node.close_session(request.session_id, "closed by the client")
        return pb.Empty()

    # --- saves ----------------------------------------------------------------------

    @_mapped
    def BeginSave(self, request: pb.BeginSaveRequest, context: grpc.ServicerContext) -> pb.BeginSaveResponse:
        proposed = request.stream_base if request.HasField("stream_base") else None
        save = self.node.begin_save(request.session_id, request.step, request.manifest_json, request.data_bytes,
                                    dict(request.metrics), proposed)
        released = self.node.sessions.get(request.session_id).released()
        return pb.BeginSaveResponse(save_id=save.id, stream_base=save.stream_base, released=released)

    @_mapped
    def Progress(self, request: pb.ProgressRequest, context: grpc.ServicerContext) -> pb.ProgressResponse:
        released = self.node.progress(request.save_id, request.copied_upto, request.wait_released,
                                      _timeout(0, context))
        return pb.ProgressResponse(released=released)

    @_mapped
    def FinishSave(self, request: pb.FinishSaveRequest, context: grpc.ServicerContext) -> pb.FinishSaveResponse:
        return pb.FinishSaveResponse(released=self.node.finish_save(request.save_id))

    @_mapped
    def AbortSave(self, request: pb.AbortSaveRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.node.abort_save(request.save_id, request.reason or "no reason given")
        return pb.Empty()

    @_mapped
    def WaitSave(self, request: pb.WaitSaveRequest, context: grpc.ServicerContext) -> pb.WaitSaveResponse:
        done = self.node.wait_save(request.save_id, _tier(request.tier), _timeout(request.timeout_s, context))
        return pb.WaitSaveResponse(done=done)

    # --- catalogue ----------------------------------------------------------------------

    @_mapped
    def ListCheckpoints(self, request: pb.ListRequest, context: grpc.ServicerContext) -> pb.ListResponse:
        return pb.ListResponse(checkpoints=[self._info(c) for c in self.node.checkpoints(request.job)])

    @_mapped
    def Locate(self, request: pb.LocateRequest, context: grpc.ServicerContext) -> pb.LocateResponse:
        ckpt, parts = self.node.locate(request.job, None if request.latest else request.step, request.rank)
        return pb.LocateResponse(step=ckpt.step, world_size=ckpt.world_size, locations=[
            pb.PartLocation(tier=_TIER_PB[p.tier], dir=str(p.path)) for p in parts])

    @_mapped
    def ReportCorrupt(self, request: pb.ReportCorruptRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.node.report_corrupt(request.job, request.step, request.rank, _tier(request.tier), request.detail)
        return pb.Empty()

    @_mapped
    def SetPin(self, request: pb.PinRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.node.set_pin(request.job, request.step, request.pinned)
        return pb.Empty()

    @_mapped
    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext) -> pb.DrainResponse:
        pending, failed = self.node.drain(request.job or None, request.wait, _timeout(request.timeout_s, context))
        return pb.DrainResponse(pending=pending, failed=failed)

    @_mapped
    def CollectGarbage(self, request: pb.GcRequest, context: grpc.ServicerContext) -> pb.GcResponse:
        actions = self.node.gc(request.dry_run)
        return pb.GcResponse(deleted=[pb.GcAction(job=a.job, step=a.step, tier=_TIER_PB[a.tier], reason=a.reason,
                                                  bytes=a.nbytes) for a in actions])

    @_mapped
    def Prefetch(self, request: pb.PrefetchRequest, context: grpc.ServicerContext) -> pb.PrefetchResponse:
        step, parts = self.node.prefetch(request.job, None if request.latest else request.step)
        return pb.PrefetchResponse(step=step, parts=parts)

    @_mapped
    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        node = self.node
        sessions = [pb.SessionStatus(session_id=s.id, job=s.info.job, rank=s.info.rank, pid=s.info.pid,
                                     arena_bytes=s.arena.size if s.arena else 0, saves_in_flight=len(s.saves))
                    for s in node.sessions.all()]
        return pb.StatusResponse(
            version=VERSION, pid=os.getpid(), uptime_s=time.monotonic() - node.started, socket=self.socket_path,
            arena_budget_bytes=node.budget.total, arena_used_bytes=node.budget.used, sessions=sessions,
            tiers=[self._tier_status(t) for t in (TierName.LOCAL, TierName.SHARED)],
            drain_queue=node.drainer.pending()[0] if node.drainer else 0, metrics_url=self.metrics_url)

    # --- helpers ------------------------------------------------------------------------

    def _info(self, c: Checkpoint) -> pb.CheckpointInfo:
        return pb.CheckpointInfo(
            job=c.job, step=c.step, world_size=c.world_size, ranks_local=c.ranks_on(TierName.LOCAL),
            ranks_shared=c.ranks_on(TierName.SHARED), bytes=c.nbytes(), created=c.created, complete=c.complete,
            pinned=c.pinned, drain_state=self.node.drain_state(c), metrics=c.metrics)

    def _tier_status(self, tier: TierName) -> pb.TierStatus:
        cfg = self.node.config
        path = cfg.local.dir if tier == TierName.LOCAL else cfg.shared.dir
        parts = list(self.node.catalog.all_parts(tier))
        status = pb.TierStatus(tier=_TIER_PB[tier], dir=str(path or ""), enabled=path is not None,
                               used_bytes=sum(p.nbytes for p in parts), checkpoints=len(parts))
        if path is not None:
            try:
                status.free_bytes = shutil.disk_usage(path).free
                status.reachable = True
            except OSError:
                status.reachable = False
        return status
