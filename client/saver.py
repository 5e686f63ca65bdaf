"""The snapshot thread: saves queued by the trainer copied into the session's arena, off the trainer's thread.

``Client.save`` plans the file layout on the caller's thread and hands the
save to this thread, which copies the tensors into the arena (streaming,
see :mod:`ckptstage.client.snapshot`) and tells the daemon; a
:class:`SaveHandle` follows each save to its two completion points. The
thread also sizes the arena ahead of the saves, so that creating shared
memory never blocks the trainer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from ckptstage.client import errors, lifecycle, tree
from ckptstage.client.fileplan import FilePlan, PlanCache, build_manifest
from ckptstage.client.rpc import Connection
from ckptstage.client.session import THREAD_EXIT_S, Session
from ckptstage.client.snapshot import CopyThreads, Streamer, ready_events
from ckptstage.protos import layout
from ckptstage.protos.v1 import ckptstage_pb2 as pb

log = logging.getLogger(__name__)

# A WaitSave without a timeout is asked this long at a time (the daemon answers "not yet" at its end).
WAIT_SLICE_S = 25.0

_TIERS = {"local": pb.LOCAL, "shared": pb.SHARED, "memory": pb.MEMORY, "peer": pb.PEER}
# A wait at exit longer than this is logged as a warning (the script should have waited for its saves).
_WAIT_NOTED_S = 1.0
# Saves remembered by step, for wait_step and for a preemption snapshot of a step already saved.
_RECENT = 64


def tier_code(tier: str) -> pb.Tier:
    if tier not in _TIERS:
        raise ValueError(f"tier must be 'local', 'shared', 'memory' or 'peer', not {tier!r}")
    return _TIERS[tier]


class SaveHandle:
    """A save in flight. ``wait_snapshot`` then ``wait("local")`` / ``wait("shared")``."""

    def __init__(self, conn: Connection, step: int) -> None:
        self.step = step
        self._conn = conn
        self._snapshot = threading.Event()
        self._copied = threading.Event()  # every byte is in the arena (FinishSave may still be on its way)
        self._urgent = threading.Event()  # someone waits for the snapshot: copy with every core
        self._error: BaseException | None = None
        self.save_id: str | None = None
        self.blocked_s: float | None = None  # save() call to snapshot done
        self._t0 = time.perf_counter()

    def snapshot_done(self) -> bool:
        return self._snapshot.is_set()

    def wait_snapshot(self, timeout: float | None = None) -> None:
        """Returns once the daemon holds the whole state: the tensors may be mutated again.

        From then on the checkpoint no longer depends on this process: if the
        trainer dies, the daemon still commits it.
        """
        self._urgent.set()
        if not self._snapshot.wait(timeout):
            raise TimeoutError(f"snapshot of step {self.step} not done after {timeout}s")
        if self._error is not None:
            raise self._error

    def wait_copied(self, timeout: float | None = None) -> None:
        """Returns once every byte of the state is in the daemon's shared memory: the tensors may be
        mutated again, but until :meth:`wait_snapshot` returns the checkpoint still needs this process
        (the daemon has not been told the copy is complete). For a caller that waits for the commit
        anyway, e.g. the DCP writer's stager, whose background save follows."""
        self._urgent.set()
        if not self._copied.wait(timeout):
            raise TimeoutError(f"copy of step {self.step} not done after {timeout}s")
        if self._error is not None:
            raise self._error

    def wait(self, tier: str = "local", timeout: float | None = None) -> None:
        """Returns once the checkpoint is committed on ``tier``; raises :class:`SaveFailed` if it cannot be.

        ``"memory"``: complete in the daemon's memory (every save; with ``[local] persist_every`` above 1
        the only tier of the steps it does not write to local SSD, whose ``wait("local")`` raises).
        ``"peer"``: the part's replicas are committed on the other nodes of the job that keep them
        (``[peers]``); raises when the daemon has no peer tier, the job runs on no other node, or a newer
        step of the job committed before this one was sent.

        With a ``timeout`` it returns or raises :class:`TimeoutError` within
        about that long, also when the daemon does not answer at all (hung or
        stopped): the daemon is asked to answer before the call's own deadline.
        """
        code = tier_code(tier)
        deadline = None if timeout is None else time.monotonic() + timeout
        self.wait_snapshot(timeout)
        assert self.save_id is not None
        while True:
            left = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"step {self.step} not committed on {tier} after {timeout}s")
            # The daemon answers "not yet" at timeout_s; the call's deadline, a little later, covers a
            # daemon that cannot answer at all.
            try:
                resp = self._conn.call("WaitSave", pb.WaitSaveRequest(
                    save_id=self.save_id, tier=code, timeout_s=left), timeout=left + 0.5)
            except errors.DaemonTimeout:
                if deadline is not None:
                    raise
                continue  # no timeout was given: a daemon too busy to answer in time is asked again
            if resp.done:
                return

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self.blocked_s = time.perf_counter() - self._t0
        self._copied.set()
        self._snapshot.set()


@dataclass
class _Job:
    handle: SaveHandle
    plan: FilePlan
    tree: Any  # the state's structure, as tree.flatten encoded it
    extras: list[dict[str, Any]]  # per tensor: fqn, and a DTensor fragment's place
    tensors: list[torch.Tensor]
    metrics: dict[str, float]
    ready: dict[torch.device, Any]  # CUDA events the copy waits for (see snapshot.ready_events)
    overwrite: bool = False


@dataclass
class _Prepare:
    """Size the arena for saves of ``nbytes``, ahead of them (on the snapshot thread, off the trainer's)."""

    nbytes: int


class Saver:
    """The snapshot thread of one client and the saves it has in flight; started by the constructor."""

    def __init__(self, session: Session) -> None:
        self._session = session
        self._queue: queue.Queue[_Job | _Prepare | None] = queue.Queue()
        self._inflight: list[SaveHandle] = []
        self._recent: OrderedDict[int, SaveHandle] = OrderedDict()  # newest saves by step
        self._lock = threading.Lock()
        self.plans = PlanCache()
        # Arena sizes asked for before the first load, when the daemon holds this rank's newest part in
        # memory (session.memory_copy): the arena is created only after that load (or at the first save).
        self._deferred_prepare = 0
        # The snapshot thread copies with one intra-op thread while the trainer computes (two
        # copy threads beside the trainer's would stall its parallel regions), and with the
        # trainer's own count once the trainer waits for it (see snapshot.CopyThreads).
        self._copy_threads = CopyThreads(torch.get_num_threads())
        self._worker = threading.Thread(target=self._run, name=f"ckptstage-snapshot-{session.rank}", daemon=True)
        self._worker.start()
        self._copy_threads.confirm_private()

    # --- what the trainer's thread calls ------------------------------------------------

    def submit(self, step: int, flat: tree.Flat, metrics: Mapping[str, float] | None, overwrite: bool) -> SaveHandle:
        """Plans the save here (bad input raises) and queues its copy."""
        plan = self.plans.plan(flat.tensors, flat.paths)
        clean_metrics = _check_metrics(metrics)
        handle = SaveHandle(self._session.conn, step)
        with self._lock:
            self._inflight = [h for h in self._inflight if not h.snapshot_done()] + [handle]
            self._recent[step] = handle
            while len(self._recent) > _RECENT:
                self._recent.popitem(last=False)
        self._queue.put(_Job(handle, plan, flat.tree, flat.entry_extras(), flat.tensors, clean_metrics,
                             ready_events(flat.tensors), overwrite))
        return handle

    def recent(self, step: int) -> SaveHandle | None:
        """This client's newest save of ``step``, if it is among the last few."""
        with self._lock:
            return self._recent.get(step)

    def reusable(self, step: int) -> SaveHandle | None:
        """This client's save of ``step`` still good (in flight, or snapshotted without error), if any."""
        handle = self.recent(step)
        return None if handle is None or (handle.snapshot_done() and handle._error is not None) else handle

    def reserve(self, nbytes: int) -> None:
        """An arena of ``nbytes`` now, on the caller's thread (``Client(arena_bytes=...)``); after the first load
        when the daemon holds this rank's newest part in memory (see :meth:`prepare`)."""
        if nbytes and self._session.memory_copy:
            self._deferred_prepare = nbytes
        elif nbytes:
            self._session.ensure_arena(nbytes)

    def prepare(self, nbytes: int) -> None:
        """An arena for saves of ``nbytes``, prepared in the background (or once the restart has loaded)."""
        if nbytes > 0 and self._session.memory_copy:
            self._deferred_prepare = max(self._deferred_prepare, nbytes)
        elif nbytes > 0:
            self._queue.put(_Prepare(nbytes))

    def prepare_deferred(self) -> None:
        """The restart has loaded (or saves already): the arena put off until now is prepared."""
        self._session.memory_copy = False
        nbytes, self._deferred_prepare = self._deferred_prepare, 0
        if nbytes > 0:
            self._queue.put(_Prepare(nbytes))

    def wait_snapshots(self) -> None:
        """Blocks until every save started so far has been copied out."""
        with self._lock:
            pending = list(self._inflight)
        for h in pending:
            h._urgent.set()
        for h in pending:
            h._snapshot.wait()

    # --- ending ---------------------------------------------------------------------------

    def stop(self) -> None:
        """Finishes copying the queued saves, then ends the thread."""
        self._queue.put(None)
        self._worker.join()

    def abandon(self) -> None:
        """Given up on at exit: the connection is closed under the thread, which ends the calls it waits in."""
        self._queue.put(None)
        self._session.conn.close()
        self._worker.join(THREAD_EXIT_S)
        self._session.join_watcher(THREAD_EXIT_S)

    def finish(self, timeout: float) -> bool:
        """Waits up to ``timeout`` for every snapshot in flight, logging what it waited for; False if one is left."""
        job = self._session.job
        with self._lock:
            pending = [h for h in self._inflight if not h.snapshot_done()]
        if not pending:
            return True
        started = time.monotonic()
        deadline = started + timeout
        log.info("ckptstage: finishing the snapshots of job %r steps %s before exit (up to %gs)", job,
                 [h.step for h in pending], timeout)
        for h in pending:
            h._snapshot.wait(max(0.0, deadline - time.monotonic()))
        waited = time.monotonic() - started
        left = [h.step for h in pending if not h.snapshot_done()]
        failed = [h for h in pending if h.snapshot_done() and h._error is not None]
        if left:
            log.warning("ckptstage: gave up after %.1fs (exit_timeout) on the snapshots of job %r steps %s: they are "
                        "not saved; wait for them (h.wait_snapshot()) or raise exit_timeout / $%s", waited, job,
                        left, lifecycle.EXIT_TIMEOUT_ENV)
        elif waited > _WAIT_NOTED_S:
            log.warning("ckptstage: waited %.1fs at exit for the snapshots of job %r steps %s (the script ended "
                        "without waiting for its saves); the daemon commits them", waited, job,
                        [h.step for h in pending])
        for h in failed:
            log.warning("ckptstage: the save of job %r step %d failed: %s", job, h.step, h._error)
        return not left

    # --- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        self._copy_threads.start_background()
        while True:
            job = self._queue.get()
            if job is None:
                return
            if isinstance(job, _Prepare):
                self._session.prepare_arena(job.nbytes)
                continue
            try:
                self._copy(job)
                job.handle._finish(None)
            except BaseException as e:  # noqa: BLE001 - handed to the trainer through the handle
                job.handle._finish(e)
            finally:
                job.tensors.clear()  # drop references to the trainer's tensors

    def _copy(self, job: _Job) -> None:
        s = self._session
        if s.lost():
            had = s.reopen()
            if had:  # a client that saved before saves again: its arena is prepared again, ahead of that save
                self._queue.put(_Prepare(had))
        arena = s.ensure_arena(job.plan.data_bytes)
        if any(t.is_cuda for t in job.tensors):
            arena.register_cuda()
        base = -(-s.stream_end // s.chunk) * s.chunk
        n = job.plan.data_bytes
        if n <= arena.size and base % arena.size + n > arena.size:
            # Whole in one piece from the ring's start, rather than wrapped around its end: the image of the
            # file stays contiguous, which is what the memory tier keeps and a restart maps.
            base = -(-base // arena.size) * arena.size
        generation, announced = s.released_hint()
        if generation == arena.generation:
            s.released = max(s.released, announced)
        # BeginSave goes out now and is answered while the copy runs: the copy
        # needs the answer only to stream (see snapshot.Streamer).
        sent = s.conn.start("BeginSave", pb.BeginSaveRequest(
            session_id=s.session_id, step=job.handle.step, manifest_json=self._manifest_json(job),
            data_bytes=job.plan.data_bytes, metrics=job.metrics, stream_base=base, overwrite=job.overwrite))
        begin = _Once(lambda: self._began(job, base, sent()))
        streamer = Streamer(s.conn, arena, base, s.chunk, s.released, begin, job.ready,
                            threads=self._copy_threads, urgent=job.handle._urgent)
        try:
            streamer.run(job.plan, job.tensors)
        except BaseException as e:
            self._abort(begin, e)
            raise
        job.handle._copied.set()
        resp = begin()
        # The snapshot is done only once the daemon has the whole save: from
        # then on the checkpoint no longer depends on this process (a trainer
        # that crashes right after wait_snapshot() still gets it committed).
        finished = s.conn.call("FinishSave", pb.FinishSaveRequest(save_id=resp.save_id))
        s.released = max(streamer.released, finished.released)

    def _began(self, job: _Job, base: int, resp: pb.BeginSaveResponse) -> pb.BeginSaveResponse:
        if resp.stream_base != base:  # the daemon refuses a mismatch; this is belt and braces
            raise errors.CkptStageError(f"the daemon placed step {job.handle.step} at stream position "
                                        f"{resp.stream_base}, the client copied it to {base}")
        # Only now does the save hold its stream positions; one that was refused holds none.
        s = self._session
        s.stream_end = resp.stream_base + job.plan.data_bytes
        s.released = max(s.released, resp.released)
        job.handle.save_id = resp.save_id
        return resp

    def _manifest_json(self, job: _Job) -> bytes:
        """Built on the snapshot thread: off the trainer's thread."""
        s = self._session
        raw = layout.encode_manifest(build_manifest(job.plan, job.tree, s.job, job.handle.step, s.rank,
                                                    s.world_size, s.attempt, job.extras))
        if len(raw) > layout.MAX_MANIFEST_BYTES:
            raise errors.InvalidRequest(f"step {job.handle.step}: the manifest (tensor layout and plain values) "
                                        f"is {len(raw)} bytes, over the limit of {layout.MAX_MANIFEST_BYTES}; "
                                        "move large plain values into tensors")
        return raw

    def _abort(self, begin: _Once[pb.BeginSaveResponse], error: BaseException) -> None:
        try:
            save_id = begin().save_id
        except BaseException:  # noqa: BLE001 - the daemon never took the save: nothing to abort
            return
        try:
            self._session.conn.call("AbortSave", pb.AbortSaveRequest(save_id=save_id, reason=repr(error)),
                                    timeout=5)
        except errors.CkptStageError:
            pass


_T = TypeVar("_T")


class _Once(Generic[_T]):
    """Calls ``fn`` on first use and remembers its result or its exception (for BeginSave)."""

    def __init__(self, fn: Callable[[], _T]) -> None:
        self._fn = fn
        self._result: _T | None = None
        self._error: BaseException | None = None
        self._called = False

    def __call__(self) -> _T:
        if not self._called:
            self._called = True
            try:
                self._result = self._fn()
            except BaseException as e:
                self._error = e
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]


def _check_metrics(metrics: Mapping[str, float] | None) -> dict[str, float]:
    out = {}
    for k, v in (metrics or {}).items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"metrics[{k!r}] must map a str to a number, got {type(v).__name__}")
        out[k] = float(v)
    return out
