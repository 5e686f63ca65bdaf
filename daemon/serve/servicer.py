"""The gRPC servicer: validate, call one :class:`Node` method, map errors to status codes.

It is served by ``grpc.aio`` (see :mod:`ckptstage.daemon.serve.server`): one event
loop answers every RPC, so an attached session (a rank holding its ``Attach``
stream for a whole run) costs no thread. Domain calls may touch disks or wait,
so they run in one of two bounded thread pools: ``quick`` for calls that answer
at once, ``waits`` for calls that block until something happens (``WaitSave``,
``Progress`` under back-pressure, ``Drain --wait``, arena allocation,
``Prefetch``). Ranks waiting for their commits therefore never hold up a new
client's ``OpenSession``, and ``Status`` runs on the loop itself, from memory,
so it answers while every pool is busy.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from ckptstage.daemon.catalog.index import TierName
from ckptstage.daemon.errors import (
    AlreadyExists,
    ArenaFull,
    CheckpointNotFound,
    InvalidRequest,
    SaveFailed,
    SaveNotFound,
    SessionNotFound,
    ShuttingDown,
    StepPinned,
)
from ckptstage.daemon.node.jobs import JobSummary
from ckptstage.daemon.node.listing import CheckpointEntry, Located, Location
from ckptstage.daemon.logs import fields
from ckptstage.daemon.node.node import VERSION, Node
from ckptstage.daemon.peers.health import JobPeers
from ckptstage.daemon.save.sessions import SessionInfo
from ckptstage.daemon.node.status import TierReport
from ckptstage.protos import layout
from ckptstage.protos.handoff import socket_path as handoff_socket
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
    (StepPinned, grpc.StatusCode.PERMISSION_DENIED),
    (ArenaFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (SaveFailed, grpc.StatusCode.ABORTED),
    (ShuttingDown, grpc.StatusCode.UNAVAILABLE),
]

_TIERS = {pb.LOCAL: TierName.LOCAL, pb.SHARED: TierName.SHARED, pb.MEMORY: TierName.MEMORY, pb.PEER: TierName.PEER}
_TIER_PB = {v: k for k, v in _TIERS.items()}
# Longest a blocking RPC holds a thread; clients loop for longer waits.
MAX_BLOCK_S = 30.0
# Threads for calls that answer at once, and for calls that wait (see the module docstring).
QUICK_THREADS = 16
WAIT_THREADS = 128

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
T = TypeVar("T")


def status_of(error: Exception, method: str) -> tuple[grpc.StatusCode, str]:
    """The status code and message a domain error reaches the client with."""
    for cls, code in _CODES:
        if isinstance(error, cls):
            return code, str(error)
    if isinstance(error, OSError):  # a disk's condition (full, gone, read-only), not a bug: one line
        log.warning("%s failed: %s", method, error, extra=fields(error=error, rpc=method))
        return grpc.StatusCode.INTERNAL, f"daemon I/O error: {error}"
    log.exception("%s failed", method, extra=fields(error=error, rpc=method))
    return grpc.StatusCode.INTERNAL, f"internal error in {method}: {error!r}"


def _mapped(method: F) -> F:
    """Turns domain errors into a gRPC status with the error's message."""

    @functools.wraps(method)
    async def wrapper(self: Servicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except (grpc.RpcError, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - every error reaches the client with a code
            await context.abort(*status_of(e, method.__name__))

    return wrapper  # type: ignore[return-value]


def _tier(value: pb.Tier) -> TierName:
    tier = _TIERS.get(value)
    if tier is None:
        raise InvalidRequest(f"unknown tier {value}: LOCAL, SHARED, MEMORY or PEER")
    return tier


def _timeout(requested: float, context: grpc.aio.ServicerContext) -> float:
    remaining = context.time_remaining()
    limit = MAX_BLOCK_S if remaining is None else max(0.0, min(MAX_BLOCK_S, remaining - 0.05))
    return limit if requested <= 0 else min(requested, limit)


class Servicer(pb_grpc.CheckpointerServicer):
    def __init__(self, node: Node, socket_path: str, metrics_url: str = "") -> None:
        self.node = node
        self.socket_path = socket_path
        self.metrics_url = metrics_url
        self._shutdown = False
        self._quick = ThreadPoolExecutor(QUICK_THREADS, thread_name_prefix="rpc")
        self._waits = ThreadPoolExecutor(WAIT_THREADS, thread_name_prefix="rpc-wait")
        self._streams: set[Callable[[], None]] = set()  # wakes every Attach stream (shutdown)

    def begin_shutdown(self) -> None:
        """Ends every ``Attach`` stream with SHUTTING_DOWN (callable from any thread)."""
        self._shutdown = True
        for poke in list(self._streams):
            poke()

    def close(self) -> None:
        self._quick.shutdown(wait=False, cancel_futures=True)
        self._waits.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs a domain call that answers at once on the quick pool."""
        return await asyncio.get_running_loop().run_in_executor(self._quick, fn, *args)

    async def _wait(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs a domain call that may block for a while on the waits pool."""
        return await asyncio.get_running_loop().run_in_executor(self._waits, fn, *args)

    # --- sessions -----------------------------------------------------------------

    @_mapped
    async def OpenSession(self, request: pb.OpenSessionRequest,
                          context: grpc.aio.ServicerContext) -> pb.OpenSessionResponse:
        o = request.retention
        # Every field of RetentionOverrides, by name; unset (zero/empty) ones mean "the operator's". No
        # message at all (a client that only reads, or did not say) leaves the job's rules as they are.
        overrides = {f.name: getattr(o, f.name) for f in o.DESCRIPTOR.fields if getattr(o, f.name)} \
            if request.HasField("retention") else None
        info = SessionInfo(request.job, request.rank, request.world_size or 1, request.pid, request.hostname,
                           overrides, request.attempt)
        session = await self._run(self.node.open_session, info)
        return pb.OpenSessionResponse(session_id=session.id, chunk_bytes=session.chunk_bytes,
                                      daemon_version=VERSION, expected_bytes=session.info.expected_bytes,
                                      memory_copy=session.info.memory_copy,
                                      peer_address=self.node.peer_address())

    @_mapped
    async def JoinPeers(self, request: pb.JoinPeersRequest,
                        context: grpc.aio.ServicerContext) -> pb.JoinPeersResponse:
        others = await self._run(self.node.join_peers, request.session_id, list(request.nodes))
        return pb.JoinPeersResponse(peers=others)

    async def Attach(self, request: pb.AttachRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.SessionEvent]:
        """The session's life line: READY, then RELEASED as arena space frees up, until either side ends it.

        Waits on an asyncio event that the session pokes from whichever thread
        changed it; a client that goes away cancels this task, and the
        ``finally`` reaps its session.
        """
        try:
            session = self.node.attach(request.session_id)
        except SessionNotFound as e:
            await context.abort(*status_of(e, "Attach"))
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()

        def poke() -> None:
            loop.call_soon_threadsafe(changed.set)

        session.subscribe(poke)
        self._streams.add(poke)
        try:
            yield pb.SessionEvent(kind=pb.SessionEvent.READY)
            # Tell the client as arena space frees up, so its next copy need not ask first.
            sent = session.released_mark()
            while not (session.closed.is_set() or self._shutdown):
                await changed.wait()
                changed.clear()
                mark = session.released_mark()
                if mark != sent and not (session.closed.is_set() or self._shutdown):
                    sent = mark
                    yield pb.SessionEvent(kind=pb.SessionEvent.RELEASED, arena_generation=mark[0],
                                          released=mark[1])
            if self._shutdown:
                yield pb.SessionEvent(kind=pb.SessionEvent.SHUTTING_DOWN, message="daemon shutting down")
        finally:
            session.unsubscribe(poke)
            self._streams.discard(poke)
            if not session.closed.is_set():
                # The client closed the stream, died, or we are done: free the session off the loop
                # (failing its unfinished saves removes their temporaries).
                self._quick.submit(self.node.reap_session, session.id)

    @_mapped
    async def EnsureArena(self, request: pb.EnsureArenaRequest, context: grpc.aio.ServicerContext) -> pb.ArenaInfo:
        # Allocating and pre-faulting gigabytes takes a while: the waits pool.
        arena = await self._wait(self.node.ensure_arena, request.session_id, request.want_bytes)
        return pb.ArenaInfo(path=str(arena.path), size_bytes=arena.size, generation=arena.generation)

    @_mapped
    async def ArenaMapped(self, request: pb.ArenaMappedRequest, context: grpc.aio.ServicerContext) -> pb.Empty:
        await self._run(self.node.arena_mapped, request.session_id, request.generation)
        return pb.Empty()

    @_mapped
    async def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext) -> pb.Empty:
        await self._run(self.node.close_session, request.session_id, "closed by the client")
        return pb.Empty()

    # --- saves ----------------------------------------------------------------------

    @_mapped
    async def BeginSave(self, request: pb.BeginSaveRequest,
                        context: grpc.aio.ServicerContext) -> pb.BeginSaveResponse:
        proposed = request.stream_base if request.HasField("stream_base") else None
        begun = await self._run(self.node.begin_save, request.session_id, request.step, request.manifest_json,
                                request.data_bytes, dict(request.metrics), proposed, request.overwrite)
        return pb.BeginSaveResponse(save_id=begun.id, stream_base=begun.stream_base, released=begun.released)

    @_mapped
    async def Progress(self, request: pb.ProgressRequest, context: grpc.aio.ServicerContext) -> pb.ProgressResponse:
        run = self._wait if request.wait_released else self._run
        released = await run(self.node.progress, request.save_id, request.copied_upto, request.wait_released,
                             _timeout(0, context))
        return pb.ProgressResponse(released=released)

    @_mapped
    async def FinishSave(self, request: pb.FinishSaveRequest,
                         context: grpc.aio.ServicerContext) -> pb.FinishSaveResponse:
        return pb.FinishSaveResponse(released=await self._run(self.node.finish_save, request.save_id))

    @_mapped
    async def AbortSave(self, request: pb.AbortSaveRequest, context: grpc.aio.ServicerContext) -> pb.Empty:
        await self._run(self.node.abort_save, request.save_id, request.reason or "no reason given")
        return pb.Empty()

    @_mapped
    async def WaitSave(self, request: pb.WaitSaveRequest, context: grpc.aio.ServicerContext) -> pb.WaitSaveResponse:
        tier = _tier(request.tier)
        done = await self._wait(self.node.wait_save, request.save_id, tier, _timeout(request.timeout_s, context))
        return pb.WaitSaveResponse(done=done)

    @_mapped
    async def WaitStep(self, request: pb.WaitStepRequest, context: grpc.aio.ServicerContext) -> pb.WaitStepResponse:
        tier = None if request.tier == pb.TIER_UNSPECIFIED else _tier(request.tier)
        timeout = _timeout(request.timeout_s, context)
        ckpt = await self._wait(self.node.wait_step, request.job, request.step, tier, timeout)
        if ckpt is None:
            return pb.WaitStepResponse(done=False)
        return pb.WaitStepResponse(done=True, attempt=ckpt.attempt, world_size=ckpt.world_size)

    # --- catalogue ----------------------------------------------------------------------

    @_mapped
    async def ListCheckpoints(self, request: pb.ListRequest, context: grpc.aio.ServicerContext) -> pb.ListResponse:
        found = await self._run(self.node.list_checkpoints, request.job, request.memory)
        return pb.ListResponse(checkpoints=[_checkpoint_info(c) for c in found.checkpoints], quarantined=[
            pb.QuarantinedCopy(step=q.step or 0, rank=q.rank or 0, tier=_TIER_PB[TierName(q.tier)], path=q.where,
                               detail=q.detail, chunk=q.chunk, bytes=q.nbytes, since=q.since)
            for q in found.quarantined])

    @_mapped
    async def Locate(self, request: pb.LocateRequest, context: grpc.aio.ServicerContext) -> pb.LocateResponse:
        found = await self._run(self.node.locate_parts, request.job, None if request.latest else request.step,
                                request.rank, request.all_ranks, request.memory, list(request.ranks),
                                request.node_copy, request.step_index)
        return _located(found, str(handoff_socket(self.socket_path)))

    @_mapped
    async def ReportCorrupt(self, request: pb.ReportCorruptRequest, context: grpc.aio.ServicerContext) -> pb.Empty:
        tier = _tier(request.tier)
        await self._run(self.node.report_corrupt, request.job, request.step, request.rank, tier, request.detail)
        return pb.Empty()

    @_mapped
    async def Loading(self, request: pb.LoadingRequest, context: grpc.aio.ServicerContext) -> pb.Empty:
        await self._run(self.node.loading, request.lease, request.ttl_s, request.done)
        return pb.Empty()

    @_mapped
    async def SetPin(self, request: pb.PinRequest, context: grpc.aio.ServicerContext) -> pb.PinResponse:
        changed = await self._run(self.node.set_pin, request.job, request.step, request.pinned)
        return pb.PinResponse(changed=changed, pinned=request.pinned)

    @_mapped
    async def DeleteStep(self, request: pb.DeleteStepRequest,
                         context: grpc.aio.ServicerContext) -> pb.DeleteStepResponse:
        deleted = await self._wait(self.node.delete_step, request.job, request.step)
        return pb.DeleteStepResponse(parts_deleted=deleted.parts, bytes_deleted=deleted.nbytes,
                                     tiers=[_TIER_PB[t] for t in deleted.tiers])

    @_mapped
    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.DrainResponse:
        timeout = _timeout(request.timeout_s, context)
        pending, failed = await self._wait(self.node.drain, request.job or None, request.wait, timeout,
                                           request.newest)
        return pb.DrainResponse(pending=pending, failed=failed)

    @_mapped
    async def CollectGarbage(self, request: pb.GcRequest, context: grpc.aio.ServicerContext) -> pb.GcResponse:
        actions = await self._wait(self.node.gc, request.dry_run)
        return pb.GcResponse(deleted=[pb.GcAction(job=a.job, step=a.step, tier=_TIER_PB[a.tier], reason=a.reason,
                                                  bytes=a.nbytes) for a in actions])

    @_mapped
    async def Prefetch(self, request: pb.PrefetchRequest, context: grpc.aio.ServicerContext) -> pb.PrefetchResponse:
        step, parts = await self._wait(self.node.prefetch, request.job, None if request.latest else request.step,
                                       list(request.ranks))
        return pb.PrefetchResponse(step=step, parts=parts)

    @_mapped
    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        # On the loop, from memory and the tier probes' last readings: answers even when
        # every pool is busy or the shared file system hangs.
        st = self.node.status()
        sessions = [pb.SessionStatus(session_id=s.id, job=s.job, rank=s.rank, pid=s.pid, arena_bytes=s.arena_bytes,
                                     saves_in_flight=s.saves_in_flight) for s in st.sessions]
        return pb.StatusResponse(
            version=VERSION, pid=st.pid, uptime_s=st.uptime_s, socket=self.socket_path,
            arena_budget_bytes=st.arena_budget_bytes, arena_used_bytes=st.arena_used_bytes, sessions=sessions,
            tiers=[_tier_status(t) for t in st.tiers], drain_queue=st.drain_queue, metrics_url=self.metrics_url,
            memory_parts=st.memory_parts, memory_bytes=st.memory_bytes, jobs=[_job_status(j) for j in st.jobs])

    @_mapped
    async def ListJobs(self, request: pb.ListJobsRequest, context: grpc.aio.ServicerContext) -> pb.ListJobsResponse:
        # From memory, like Status.
        return pb.ListJobsResponse(jobs=[_job_status(j) for j in self.node.job_summaries()])


def _checkpoint_info(c: CheckpointEntry) -> pb.CheckpointInfo:
    return pb.CheckpointInfo(
        job=c.job, step=c.step, world_size=c.world_size, ranks_local=c.ranks_local, ranks_shared=c.ranks_shared,
        bytes=c.nbytes, created=c.created, complete=c.complete, pinned=c.pinned, drain_state=c.drain_state,
        metrics=c.metrics, attempt=c.attempt, committed_local=c.committed_local, committed_shared=c.committed_shared,
        ranks_missing=c.ranks_missing, ranks_memory=c.ranks_memory, ranks_peer=c.ranks_peer,
        committed_peer=c.committed_peer, stored_local=c.stored.get(TierName.LOCAL, 0),
        stored_shared=c.stored.get(TierName.SHARED, 0))


def _located(found: Located, handoff: str) -> pb.LocateResponse:
    """The wire form of a Locate answer: a memory-tier copy is fetched through the daemon's handoff socket."""
    def where(locations: list[Location]) -> list[pb.PartLocation]:
        return [pb.PartLocation(tier=_TIER_PB[loc.tier], dir=handoff if loc.dir is None else loc.dir,
                                manifest_digest=loc.digest)
                for loc in locations]

    return pb.LocateResponse(step=found.step, world_size=found.world_size, locations=where(found.locations),
                             attempt=found.attempt, commit=found.commit,
                             parts=[pb.RankParts(rank=r, locations=where(locs)) for r, locs in found.parts.items()],
                             fetch_ranks=sorted(found.fetch), fetch_bytes=sum(found.fetch.values()),
                             step_index=found.index.path if found.index else "",
                             step_index_digest=found.index.digest if found.index else "")


def _tier_status(t: TierReport) -> pb.TierStatus:
    return pb.TierStatus(tier=_TIER_PB[t.tier], dir=t.dir, enabled=t.enabled, reachable=t.reachable,
                         used_bytes=t.used_bytes, free_bytes=t.free_bytes, checkpoints=t.parts, state=t.state,
                         last_error=t.last_error, last_error_time=t.last_error_time, unbounded=t.unbounded,
                         warnings=t.warnings)


def _job_status(j: JobSummary) -> pb.JobStatus:
    d = j.drain
    return pb.JobStatus(
        job=j.job, checkpoints=j.checkpoints, latest_step=j.latest_step or 0, has_latest=j.latest_step is not None,
        last_commit_time=max(j.last_commit_time.values(), default=0.0),
        local_bytes=j.bytes.get(TierName.LOCAL.value, 0), shared_bytes=j.bytes.get(TierName.SHARED.value, 0),
        sessions=j.sessions,
        drain=pb.DrainState(state=d.state, queued_parts=d.queued_parts, queued_bytes=d.queued_bytes,
                            last_error=d.last_error, last_error_time=d.last_error_time,
                            consecutive_failures=d.consecutive_failures),
        peers=_peer_state(j.peers) if j.peers is not None else None)


def _peer_state(p: JobPeers) -> pb.PeerState:
    return pb.PeerState(
        peers=[pb.PeerHealth(address=h.address, state=h.state, last_error=h.last_error, last_ok_time=h.last_ok)
               for h in p.peers],
        replicated_step=p.replicated_step or 0, has_replicated=p.replicated_step is not None, lag_s=p.lag_s,
        queued_parts=p.queued)
