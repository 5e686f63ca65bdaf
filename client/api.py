"""``Client`` and ``SaveHandle``: what a trainer calls.

``save`` plans the file layout on the caller's thread (milliseconds; bad
input raises here) and queues the copy on the client's snapshot thread, so
training goes on while the state is copied into the daemon's arena. Two
completion points stay separate: ``wait_snapshot`` (the tensors may be
mutated again) and ``wait(tier)`` (durable on that tier).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket as socketlib
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import grpc
import torch

from ckptstage.client import dist, errors, lifecycle, reshard, rpc, shards, steps, tree
from ckptstage.client.fileplan import FilePlan, PlanCache, build_manifest
from ckptstage.client.memread import read_memory_part
from ckptstage.client.restore import read_part
from ckptstage.client.rpc import Connection
from ckptstage.client.snapshot import ArenaMap, CopyThreads, Streamer, ready_events
from ckptstage.protos import layout
from ckptstage.protos import handoff
from ckptstage.protos.handoff import NotInMemory
from ckptstage.protos.v1 import ckptstage_pb2 as pb

log = logging.getLogger(__name__)

_TIERS = {"local": pb.LOCAL, "shared": pb.SHARED, "memory": pb.MEMORY}
# After losing its session, how long a save waits for a restarting daemon before it fails.
_REOPEN_WAIT_S = 10.0

# Every open client's lifeline (see protos/handoff.py). A forked child (a DataLoader worker) never writes into
# an arena, so it lets go of its copies at once: the lifeline then closes when the trainer itself dies, not
# when the last of its workers does.
_LIFELINES: weakref.WeakSet[socketlib.socket] = weakref.WeakSet()


def _drop_lifelines_in_child() -> None:
    for sock in list(_LIFELINES):
        sock.close()  # this process's descriptor only: the parent's connection stays open


os.register_at_fork(after_in_child=_drop_lifelines_in_child)
# A deletion waits for saves and drains of the step still in flight (the daemon bounds each wait to 30 s).
_DELETE_TIMEOUT_S = 120.0
# How long closing waits for a client thread to leave its gRPC call (it ends as soon as the call is cancelled).
_THREAD_EXIT_S = 5.0
# A wait at exit longer than this is logged as a warning (the script should have waited for its saves).
_WAIT_NOTED_S = 1.0
# How long a reader whose copy failed verification asks whether the step was replaced meanwhile, before it
# takes the copy for corrupt (the daemon indexes a replacement's commit just after putting its parts in place).
_REPLACED_SETTLE_S = 1.0


@dataclass(frozen=True)
class CheckpointInfo:
    """One step of a job as the daemon knows it."""

    step: int
    tiers: tuple[str, ...]     # tiers holding the step's commit record (and so every rank's part); "memory"
                               # when the daemon keeps every rank's part in memory (the memory tier)
    bytes: int
    created: float             # unix seconds
    complete: bool             # every rank's part is committed somewhere: restorable
    world_size: int
    pinned: bool = False
    drain_state: str = ""
    metrics: Mapping[str, float] = field(default_factory=dict)
    attempt: str = ""                       # the run whose parts make up the step
    ranks_missing: tuple[int, ...] = ()     # of that attempt, with no part on any tier the daemon reads
    ranks_memory: tuple[int, ...] = ()      # whose part the daemon keeps in memory (the memory tier)


class SaveHandle:
    """A save in flight. ``wait_snapshot`` then ``wait("local")`` / ``wait("shared")``."""

    def __init__(self, client: Client, step: int) -> None:
        self.step = step
        self._client = client
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

        With a ``timeout`` it returns or raises :class:`TimeoutError` within
        about that long, also when the daemon does not answer at all (hung or
        stopped): the daemon is asked to answer before the call's own deadline.
        """
        code = _tier_code(tier)
        deadline = None if timeout is None else time.monotonic() + timeout
        self.wait_snapshot(timeout)
        assert self.save_id is not None
        while True:
            left = 25.0 if deadline is None else min(25.0, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"step {self.step} not committed on {tier} after {timeout}s")
            # The daemon answers "not yet" at timeout_s; the call's deadline, a little later, covers a
            # daemon that cannot answer at all.
            resp = self._client._conn.call("WaitSave", pb.WaitSaveRequest(
                save_id=self.save_id, tier=code, timeout_s=left), timeout=left + 0.5)
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


class Client:
    """A trainer rank's connection to its node's ``ckptstaged``.

    ``socket`` defaults to ``$CKPTSTAGE_SOCKET``, else the daemon's default
    path. ``rank`` and ``world_size`` default to the default process group's
    when ``torch.distributed`` is initialized, else 0 and 1. ``attempt``
    names this run of the job, the same on every rank (see
    :mod:`ckptstage.client.dist` for how it is agreed when not given: with a
    process group, the constructor is collective).

    The shared-memory arena a save copies into is best prepared before the
    first save needs it, in the background, by a process that will save:
    :meth:`protect` does it (for what this rank of the job last saved on this
    node, or else after the first ``optimizer.step()``), and so does
    :meth:`prepare`. A client that only loads takes no memory. ``arena_bytes``
    allocates it in the constructor instead (which waits for it);
    ``arena_bytes=0`` has ``protect()`` prepare nothing.

    ``retention`` sets the job's own retention overrides (see the README);
    ``None`` leaves whatever an earlier session of the job set, ``{}`` resets
    them to the operator's rules.

    ``world_size=1`` in every process of a larger group declares that only
    rank 0 saves (data parallelism, where every rank holds the same state):
    a step is complete with that one part, every process can load it, and a
    save from another rank of the group is refused.

    ``connect_timeout`` (seconds) is how long the constructor waits for a
    daemon that is not answering yet (a job prologue that starts it a moment
    before the trainer); then :class:`DaemonUnavailable` names the socket.

    A client still open when the interpreter exits (the script ended without
    ``close()``) first finishes its snapshots in flight, so every save it
    started reaches the daemon, which commits it; it waits at most
    ``exit_timeout`` seconds (``None``: ``$CKPTSTAGE_EXIT_TIMEOUT``, else 60)
    and logs a warning when it waited long or gave up (see
    :mod:`ckptstage.client.lifecycle`). A process killed by a signal gets
    only the saves the daemon already held.
    """

    def __init__(self, job: str, socket: str | os.PathLike[str] | None = None, rank: int | None = None,
                 world_size: int | None = None, arena_bytes: int | None = None,
                 retention: Mapping[str, Any] | None = None, attempt: str | None = None,
                 connect_timeout: float = 30.0, exit_timeout: float | None = None) -> None:
        try:
            self.job = layout.check_job(job)
            self._exit_timeout = lifecycle.exit_timeout(exit_timeout)
            given_rank = rank
            rank, world_size = dist.rank_and_world(rank, world_size)
            layout.check_rank(rank, world_size)
            self.attempt = dist.agree_attempt(attempt, world_size)
        except (layout.InvalidName, ValueError) as e:
            raise errors.InvalidRequest(str(e)) from None
        self.rank, self.world_size = rank, world_size
        # A process other than the group's rank 0 under "only rank 0 saves" must not save (see above).
        group_rank = dist.group_rank()
        self._not_the_saver = (f"this process is rank {group_rank} of its process group and the client was "
                               "created with world_size=1 (only rank 0 saves): save from rank 0 only"
                               if world_size == 1 and given_rank is None and group_rank else None)
        self._retention = dict(retention) if retention is not None else None
        self._conn = Connection(socket)
        self._arena: ArenaMap | None = None
        self._queue: queue.Queue[_Job | _Prepare | None] = queue.Queue()
        self._prepare_ahead = arena_bytes is None and not self._not_the_saver
        self._inflight: list[SaveHandle] = []
        self._recent: OrderedDict[int, SaveHandle] = OrderedDict()  # newest saves by step, for wait_step
        self._lock = threading.Lock()
        self._closed = False
        # The arena stream as this client last heard of it (see snapshot.Streamer):
        # where its previous save ended, and the position below which all is free.
        self._stream_end = 0
        self._released = 0
        self._released_hint = (0, 0)  # (arena generation, released) as the daemon last announced it
        self._plans = PlanCache()
        # Arena sizes asked for before the first load, when the daemon holds this rank's newest part in
        # memory: the arena is created only after that load (or at the first save), so that taking the
        # budget for it cannot evict the very copy the restart is about to read.
        self._deferred_prepare = 0
        self._memory_copy = False
        self.last_load_tier: str | None = None  # the tier the last load() read this rank's part from
        self._open_session(connect_timeout=connect_timeout)
        # The snapshot thread copies with one intra-op thread while the trainer computes (two
        # copy threads beside the trainer's would stall its parallel regions), and with the
        # trainer's own count once the trainer waits for it (see snapshot.CopyThreads).
        self._copy_threads = CopyThreads(torch.get_num_threads())
        self._worker = threading.Thread(target=self._run, name=f"ckptstage-snapshot-{rank}", daemon=True)
        self._worker.start()
        self._copy_threads.confirm_private()
        lifecycle.track(self)
        if arena_bytes and self._memory_copy:
            self._deferred_prepare = arena_bytes
        elif arena_bytes:
            try:
                self._ensure_arena(arena_bytes)
            except BaseException:
                self.close()  # else the session and its snapshot thread outlive the failed constructor
                raise

    # --- saving ---------------------------------------------------------------------

    def save(self, step: int, state: Any, metrics: Mapping[str, float] | None = None,
             overwrite: bool = False) -> SaveHandle:
        """Starts a checkpoint of ``state`` and returns at once.

        Do not mutate the state's tensors until ``wait_snapshot()`` returns
        (or use :meth:`protect`). Raises ``TypeError`` naming the key path of
        anything that cannot be saved.

        A step that is already committed is refused (:class:`AlreadyCommitted`)
        unless ``overwrite``: then the new checkpoint replaces it atomically on
        each tier (the old one stays loadable there until the new one is
        committed there; a crash in between leaves one of the two, whole).
        Every rank of the job must save the step with ``overwrite``.
        """
        self._check_open()
        return self.save_flat(step, tree.flatten_state(state), metrics, overwrite)

    def save_flat(self, step: int, flat: tree.Flat, metrics: Mapping[str, float] | None = None,
                  overwrite: bool = False) -> SaveHandle:
        """:meth:`save` of a state already taken apart (the DCP writer builds its fragments itself)."""
        self._check_open()
        if self._not_the_saver:
            raise errors.InvalidRequest(self._not_the_saver)
        self._prepare_deferred()
        try:
            layout.check_step(step)
        except layout.InvalidName as e:
            raise errors.InvalidRequest(str(e)) from None
        plan = self._plans.plan(flat.tensors, flat.paths)
        clean_metrics = _check_metrics(metrics)
        handle = SaveHandle(self, step)
        with self._lock:
            self._inflight = [h for h in self._inflight if not h.snapshot_done()] + [handle]
            self._recent[step] = handle
            while len(self._recent) > 64:
                self._recent.popitem(last=False)
        self._queue.put(_Job(handle, plan, flat.tree, flat.entry_extras(), flat.tensors, clean_metrics,
                             ready_events(flat.tensors), overwrite))
        return handle

    def wait_snapshots(self) -> None:
        """Blocks until every save started so far has been copied out."""
        with self._lock:
            pending = list(self._inflight)
        for h in pending:
            h._urgent.set()
        for h in pending:
            h._snapshot.wait()

    def protect(self, optimizer: Any) -> Any:
        """Makes ``optimizer.step()`` wait for snapshots still copying; returns the hook handle.

        ``optimizer`` is a ``torch.optim.Optimizer`` or a wrapper that forwards
        ``step`` to one (Accelerate's ``AcceleratedOptimizer``, Lightning's
        ``LightningOptimizer``, ``ZeroRedundancyOptimizer``, a user's own):
        the hook goes on the optimizer that updates the tensors.
        """
        inner = _innermost_optimizer(optimizer)
        handle = inner.register_step_pre_hook(lambda *_: self.wait_snapshots())
        if not self._prepare_ahead:
            return handle
        if self._expected:  # a trainer that saved this job here before: the same size again
            self.prepare()
            return handle
        # After the first step the optimizer holds its state: what a checkpoint of it costs is known.
        once: list[Any] = []

        def size_arena(*_: Any) -> None:
            once.pop().remove()
            if not self._closed:
                self.prepare(_optimizer_bytes(inner))

        once.append(inner.register_step_post_hook(size_arena))
        return handle

    def on_preemption(self, state_fn: Callable[[], tuple[int, Any]], signals: Sequence[int] = (signal.SIGTERM,),
                      *, timeout: float | None = 10.0, at_optimizer_step: bool = True) -> Any:
        """On one of ``signals``, one last snapshot of ``state_fn()`` (``(step, state)``) at the next safe point
        (before the next ``optimizer.step()``, at :meth:`Preemption.check`, or from a watchdog after ``timeout``
        seconds), then the process ends as it would have. Main thread only; a second call replaces the first;
        :meth:`close` restores the previous handlers. See :mod:`ckptstage.client.preemption`."""
        from ckptstage.client import preemption

        return preemption.install(self, state_fn, signals, timeout=timeout, at_optimizer_step=at_optimizer_step)

    def prepare(self, state: Any = None) -> None:
        """Prepares the arena for saves of a state like ``state`` (or of ``state`` bytes), in the background.

        With no argument: for what this rank of the job last saved on this
        node (nothing when it never did). Returns at once. Creating shared
        memory costs about a second per GiB on a small machine; done ahead,
        the first save blocks no longer than the others. The arena only
        grows, between saves; it is taken from the node's budget, so only a
        process that will save should prepare one.
        """
        self._check_open()
        if self._not_the_saver:
            return  # its saves are refused: memory for them would only be taken from the others
        if state is None:
            nbytes = self._expected
        elif isinstance(state, int):
            nbytes = state
        else:
            flat = tree.flatten_state(state)
            nbytes = self._plans.plan(flat.tensors, flat.paths).data_bytes
        if nbytes > 0 and self._memory_copy:
            self._deferred_prepare = max(self._deferred_prepare, nbytes)
        elif nbytes > 0:
            self._queue.put(_Prepare(nbytes))

    def _prepare_deferred(self) -> None:
        """The restart has loaded (or saves already): the arena put off until now is prepared."""
        self._memory_copy = False
        nbytes, self._deferred_prepare = self._deferred_prepare, 0
        if nbytes > 0:
            self._queue.put(_Prepare(nbytes))

    # --- reading --------------------------------------------------------------------

    def latest(self, group: Any = None) -> int | None:
        """The newest complete step (every rank's part of one attempt committed), or None.

        When ``torch.distributed`` is initialized this is collective over
        ``group`` (the default group when None): every rank answers the same,
        the newest step that every rank's daemon can load, from either tier.
        """
        if group is None and not dist.initialized():
            newest = self._complete_steps(1)
            return newest[0] if newest else None
        common = set.intersection(*(set(steps) for steps in dist.gather(self._complete_steps(), group)))
        return max(common, default=None)

    def _complete_steps(self, most: int = 256) -> list[int]:
        """This daemon's complete steps of the job, newest first (at most ``most``)."""
        if most == 1:
            try:
                resp = self._conn.call("Locate", pb.LocateRequest(job=self.job, latest=True, rank=0, memory=True))
            except errors.CheckpointNotFound:
                return []
            return [int(resp.step)]
        return sorted((c.step for c in self.list() if c.complete), reverse=True)[:most]

    def wait_step(self, step: int, tier: str = "local", timeout: float | None = None,
                  collective: bool | None = None) -> None:
        """Returns once every rank's part of ``step`` (one attempt) is committed on ``tier``.

        ``"shared"``: the step's commit record is on the shared tier (written
        by whichever node's drain finished last). ``"local"``: every part is
        on its node's local tier. Collective (``collective=None``: when a
        process group spans the job), every rank waits for its own part, then
        they agree; otherwise this node's daemon answers, and it can tell
        "local" only for a job whose ranks all run on this node (it waits for
        the step's local commit record). Raises :class:`SaveFailed` if a
        rank's part failed, :class:`TimeoutError` after ``timeout`` seconds.
        """
        _tier_code(tier)
        if collective is None:
            collective = dist.initialized() and torch.distributed.get_world_size() == self.world_size
        if tier == "local" and collective:
            handle = self._recent.get(step)
            failure = None
            try:
                if handle is not None:
                    handle.wait(tier, timeout)
                else:
                    self._wait_step(step, tier, timeout)
            except Exception as e:  # noqa: BLE001 - every rank must reach the gather, whatever went wrong here
                failure = f"rank {self.rank}: {type(e).__name__}: {e}"
            failures = [f for f in dist.gather(failure) if f]
            if failures:
                raise errors.SaveFailed(f"step {step} of {self.job!r} is not complete on {tier}: "
                                        + "; ".join(failures))
            return
        self._wait_step(step, tier, timeout)

    def _wait_step(self, step: int, tier: str, timeout: float | None) -> None:
        """Asks this node's daemon until the step's commit record is on ``tier``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 25.0 if deadline is None else min(25.0, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"step {step} of {self.job!r} not complete on {tier} after {timeout}s")
            resp = self._conn.call("WaitStep", pb.WaitStepRequest(job=self.job, step=step, tier=_tier_code(tier),
                                                                 timeout_s=left), timeout=left + 0.5)
            if resp.done:
                return

    def list(self) -> list[CheckpointInfo]:
        resp = self._conn.call("ListCheckpoints", pb.ListRequest(job=self.job, memory=True))
        return [_info(c) for c in resp.checkpoints]

    def load(self, step: int | None = None, into: Any = None) -> Any:
        """The state saved at ``step`` (newest complete when None), verified.

        A sharded state (DTensors) is read from every rank's part: each
        DTensor of ``into`` (any mesh, placements or world size) is filled in
        place from the byte ranges of the fragments that overlap its shard;
        without ``into``, sharded tensors come back whole. Plain tensors and
        values come from this rank's part at the same world size, from rank
        0's at another. ``into`` fills a state's tensors in place (e.g. CUDA
        tensors) instead of allocating; a key or a shape that disagrees with
        the checkpoint is an error naming it.

        A copy that fails verification is reported to the daemon (which
        re-reads it and quarantines it only if its own read fails too) and
        the next copy (the shared tier's) is read instead; if none verifies,
        :class:`CorruptCheckpoint` is raised. An error of this process's own
        (out of file descriptors or memory, an interrupted read) proves
        nothing about a copy: it is never reported, the next copy is tried,
        and if none can be read the error itself is raised. A copy that
        retention deletes while it is being read, or that a save with
        ``overwrite`` replaces (the daemon names another commit when asked
        again), is not corrupt: the step is read again.

        With ``into``, the bytes are read straight into its tensors and
        verified as they land: when the load raises, those tensors hold
        whatever was read before the failure (possibly the corrupt block), not
        their old values. Reload them (from another step) before using them.

        A trainer restarted on the node where it ran reads its part from the
        daemon's memory tier when the daemon kept it (:attr:`last_load_tier`
        says ``"memory"``): the tensors are then mapped from that copy,
        verified, without a read from disk.
        """
        try:
            return self._load(step, into)
        finally:
            self._prepare_deferred()

    def _load(self, step: int | None, into: Any) -> Any:
        target = tree.flatten_state(into) if into is not None else None
        tries = 3
        for attempt in range(1, tries + 1):
            located = steps.locate(self._conn, self.job, step, self.rank, all_ranks=False, memory=True)
            step = located.step  # pinned down: a retry reads the same step
            tree_rank = located.tree_rank(self.rank, self.world_size)
            if tree_rank != self.rank:
                located = steps.locate(self._conn, self.job, step, tree_rank, all_ranks=False, memory=True)
            if tree_rank not in located.parts:
                raise errors.CheckpointNotFound(f"{self.job} step {step}: the daemon did not say where rank "
                                                f"{tree_rank}'s part is")
            try:
                if (target is not None and target.sharded) or _is_sharded(located.parts[tree_rank]):
                    located = steps.locate(self._conn, self.job, step, self.rank)  # every part, now
                    with steps.OpenStep(self._conn, located) as opened:
                        return opened.view.load(tree_rank, target, union=located.world_size != self.world_size)
            except layout.ManifestError as e:
                if not layout.is_verification_failure(e):
                    raise  # this process's own trouble (see above): nothing is known about the copies
                if attempt < tries and self._replaced(step, located.commit, _settle(e)):
                    continue
                raise errors.CorruptCheckpoint(f"no copy of {self.job} step {step} verifies: {e}") from e
            except FileNotFoundError:
                if attempt == tries:
                    raise
                continue  # retention removed a copy while it was read: ask again
            memory = located.memory.get(tree_rank)
            if memory is not None:
                found, state = self._read_memory(memory, step, tree_rank, into)
                if found:
                    return state
            if not located.parts[tree_rank]:  # a step kept in memory only, and gone from there since
                if attempt == tries:
                    raise errors.CheckpointNotFound(f"{self.job} step {step} was kept in memory only, and the "
                                                    "daemon no longer holds it")
                continue
            state, moved = self._load_part(step, tree_rank, located.parts[tree_rank], into, located.commit,
                                           located.digests)
            if not moved:
                return state
        raise errors.CheckpointNotFound(f"{self.job} step {step} was removed or replaced each of the {tries} times "
                                        "it was read; load it again")

    def open_step(self, step: int | None = None) -> steps.OpenStep:
        """Every rank's part of ``step`` (newest complete when None), open for verified reads of any box.

        For tools that read a step their own way (the DCP reader, consolidation):
        ``opened.view`` is a :class:`~ckptstage.client.reshard.StepView`. Close it
        (or use ``with``).
        """
        return steps.open_step(self._conn, self.job, step, self.rank)

    def _replaced(self, step: int, commit: str, settle_s: float = 0.0) -> bool:
        """Whether ``step`` is another commit than ``commit`` when the daemon is asked again, asking for up
        to ``settle_s`` (see :func:`_settle`).

        A step that is gone is not replaced: the daemon may just have
        quarantined the copy this reader (or another) reported corrupt; a
        copy deleted under the reader shows as its files vanishing instead.
        """
        deadline = time.monotonic() + settle_s
        while True:
            try:
                if steps.locate(self._conn, self.job, step, self.rank, all_ranks=False).commit != commit:
                    return True
            except errors.CheckpointNotFound:
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def _read_memory(self, socket: Path, step: int, rank: int, into: Any) -> tuple[bool, Any]:
        """(True, state) from the memory tier's copy of the part; (False, None) when it cannot be had there
        (gone since Locate answered, or failed verification): the caller reads the disk copies."""
        try:
            _, state = read_memory_part(socket, self.job, step, rank, into)
        except (NotInMemory, OSError) as e:
            log.info("checkpoint %s step %d rank %d: not read from memory (%s); reading it from disk", self.job,
                     step, rank, e)
        except layout.ManifestError as e:
            if not layout.is_verification_failure(e):
                raise
            log.error("checkpoint %s step %d rank %d: the memory copy failed verification (%s); reading it "
                      "from disk", self.job, step, rank, e)
            try:
                self._conn.call("ReportCorrupt", pb.ReportCorruptRequest(
                    job=self.job, step=step, rank=rank, tier=pb.MEMORY, detail=str(e)))
            except errors.CkptStageError as report_error:  # the disk copies are read all the same
                log.warning("could not report the bad memory copy: %s", report_error)
        else:
            self.last_load_tier = "memory"
            return True, state
        return False, None

    def _load_part(self, step: int, rank: int, locations: Sequence[tuple[pb.Tier, Path]], into: Any,
                   commit: str = "", digests: Mapping[Path, str] | None = None) -> tuple[Any, bool]:
        """One rank's whole part, from its first copy that verifies; (state, whether a copy vanished or the
        step was replaced meanwhile: then the caller asks the daemon again)."""
        failures, moved = [], False
        own_errors: list[BaseException] = []
        for tier_code, part in locations:
            tier = pb.Tier.Name(tier_code).lower()
            ino = _inode(part)
            try:
                _, state = read_part(part, into, committed=(digests or {}).get(part, ""))
                self.last_load_tier = tier
                return state, False
            except (layout.ManifestError, OSError, MemoryError) as e:
                if not part.exists():
                    # Retention deleted (or the daemon quarantined) this copy after Locate
                    # answered: not corruption. Locate again if no other copy verifies.
                    moved = True
                    log.info("checkpoint %s step %d rank %d: %s copy removed while reading it", self.job,
                             step, rank, tier)
                    failures.append(f"{tier}: {part} was removed while reading it")
                    continue
                # The manifest and the data read from two versions of the part: a replacement swapped
                # the directory between the two reads (the daemon may not have indexed it yet).
                if layout.is_verification_failure(e) and (_inode(part) != ino or
                                                          commit and self._replaced(step, commit, _settle(e))):
                    log.info("checkpoint %s step %d was replaced while it was read; reading it again", self.job,
                             step)
                    return None, True
                failures.append(f"{tier}: {e}")
                if not layout.is_verification_failure(e):
                    own_errors.append(e)
                    log.warning("checkpoint %s step %d rank %d: cannot read the %s copy here: %s", self.job,
                                step, rank, tier, e)
                    continue
                log.error("checkpoint %s step %d rank %d: %s copy failed verification: %s", self.job,
                          step, rank, tier, e)
                self._conn.call("ReportCorrupt", pb.ReportCorruptRequest(
                    job=self.job, step=step, rank=rank, tier=tier_code, detail=str(e)))
        if moved:
            return None, True
        if own_errors and len(own_errors) == len(failures):
            raise own_errors[0]  # nothing is known to be wrong with the checkpoint, only with this process
        raise errors.CorruptCheckpoint(f"no copy of {self.job} step {step} rank {rank} verifies: "
                                       + "; ".join(failures))

    def pin(self, step: int) -> None:
        self._conn.call("SetPin", pb.PinRequest(job=self.job, step=step, pinned=True))

    def unpin(self, step: int) -> None:
        self._conn.call("SetPin", pb.PinRequest(job=self.job, step=step, pinned=False))

    def delete(self, step: int) -> None:
        """Removes ``step`` from this node's local tier and from the shared tier.

        Raises :class:`StepPinned` while it is pinned, :class:`CheckpointNotFound`
        when neither tier has it. A save of the step still in flight on this
        node is waited for first. Other nodes' local copies of a multi-node
        step are removed by calling this on each node (it is idempotent per
        node: a step already gone raises CheckpointNotFound).
        """
        try:
            layout.check_step(step)
        except layout.InvalidName as e:
            raise errors.InvalidRequest(str(e)) from None
        self._conn.call("DeleteStep", pb.DeleteStepRequest(job=self.job, step=step), timeout=_DELETE_TIMEOUT_S)

    # --- life cycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Finishes copying queued saves, then ends the session (the daemon keeps persisting)."""
        if self._closed:
            return
        self._closed = True
        from ckptstage.client import preemption  # its signal handlers, if any: the previous ones come back

        preemption.release(self)
        self._queue.put(None)
        self._worker.join()
        self._close_lifeline()  # nothing of this process writes into the arena any more: the daemon may keep it
        try:
            self._conn.call("CloseSession", pb.CloseSessionRequest(session_id=self._session_id), timeout=10)
        except errors.CkptStageError:
            pass  # the daemon is gone; nothing is left to release there
        self._attach.cancel()
        self._watcher.join(_THREAD_EXIT_S)  # out of its gRPC call before the interpreter may exit
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        self._conn.close()
        lifecycle.untrack(self)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close_at_exit(self) -> None:
        """At interpreter exit: the snapshots in flight finish (at most ``exit_timeout``), then :meth:`close`.

        Given up on, the connection is closed under them instead: that ends the
        calls the snapshot thread waits in, and the daemon drops the session.
        """
        if self._closed:
            return
        if self._finish_snapshots(self._exit_timeout):
            self.close()
            return
        self._closed = True
        self._queue.put(None)
        self._conn.close()
        self._worker.join(_THREAD_EXIT_S)
        self._watcher.join(_THREAD_EXIT_S)

    def _finish_snapshots(self, timeout: float) -> bool:
        """Waits up to ``timeout`` for every snapshot in flight, logging what it waited for; False if one is left."""
        with self._lock:
            pending = [h for h in self._inflight if not h.snapshot_done()]
        if not pending:
            return True
        started = time.monotonic()
        deadline = started + timeout
        log.info("ckptstage: finishing the snapshots of job %r steps %s before exit (up to %gs)", self.job,
                 [h.step for h in pending], timeout)
        for h in pending:
            h._snapshot.wait(max(0.0, deadline - time.monotonic()))
        waited = time.monotonic() - started
        left = [h.step for h in pending if not h.snapshot_done()]
        failed = [h for h in pending if h.snapshot_done() and h._error is not None]
        if left:
            log.warning("ckptstage: gave up after %.1fs (exit_timeout) on the snapshots of job %r steps %s: they are "
                        "not saved; wait for them (h.wait_snapshot()) or raise exit_timeout / $%s", waited, self.job,
                        left, lifecycle.EXIT_TIMEOUT_ENV)
        elif waited > _WAIT_NOTED_S:
            log.warning("ckptstage: waited %.1fs at exit for the snapshots of job %r steps %s (the script ended "
                        "without waiting for its saves); the daemon commits them", waited, self.job,
                        [h.step for h in pending])
        for h in failed:
            log.warning("ckptstage: the save of job %r step %d failed: %s", self.job, h.step, h._error)
        return not left

    # --- internals ----------------------------------------------------------------------

    def _open_session(self, connect_timeout: float = _REOPEN_WAIT_S) -> None:
        """Opens the session, waiting up to ``connect_timeout`` for a daemon that is (re)starting."""
        request = pb.OpenSessionRequest(
            job=self.job, rank=self.rank, world_size=self.world_size, pid=os.getpid(),
            hostname=socketlib.gethostname(), attempt=self.attempt)
        if self._retention is not None:  # else the job keeps the rules an earlier session set
            request.retention.CopyFrom(pb.RetentionOverrides(**self._retention))
        resp = rpc.call_when_up(self._conn, "OpenSession", request, connect_timeout)
        self._session_id = resp.session_id
        self._chunk = resp.chunk_bytes
        self._expected = int(resp.expected_bytes)
        self._memory_copy = bool(resp.memory_copy) and not self._not_the_saver
        # Held open for the life of the session: if this process dies, the
        # daemon sees the stream break and frees the session.
        self._attach = self._conn.stub.Attach(pb.AttachRequest(session_id=self._session_id))
        try:
            first = next(self._attach)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, str(self._conn.socket)) from None
        if first.kind != pb.SessionEvent.READY:
            raise errors.DaemonUnavailable(f"daemon refused the session: {first.message}")
        with self._lock:
            self._released_hint = (0, 0)
        self._close_lifeline()
        try:
            self._lifeline: socketlib.socket | None = handoff.lifeline(handoff.socket_path(self._conn.socket),
                                                                      self._session_id)
            _LIFELINES.add(self._lifeline)
        except OSError as e:  # an older daemon: no memory tier for this session's arena, nothing else lost
            log.debug("ckptstage: no lifeline to the daemon's memory tier: %s", e)
        self._watcher = threading.Thread(target=self._watch, args=(self._attach, self._session_id), daemon=True,
                                         name=f"ckptstage-session-{self.rank}")
        self._watcher.start()

    def _close_lifeline(self) -> None:
        lifeline, self._lifeline = getattr(self, "_lifeline", None), None
        if lifeline is not None:
            lifeline.close()

    def _watch(self, attach: Any, session_id: str) -> None:
        """Follows the session's event stream: the daemon announces arena space as it frees up."""
        try:
            for ev in attach:
                if ev.kind != pb.SessionEvent.RELEASED:
                    continue
                with self._lock:
                    if self._session_id == session_id:
                        self._released_hint = (ev.arena_generation, ev.released)
        except grpc.RpcError:
            pass  # the stream ended (close, daemon exit or restart); _copy sees it through done()

    def _reopen_session(self) -> None:
        """The session's stream ended: the daemon died or restarted. Start over on its successor.

        The old session and arena are gone with the old daemon; without a new
        session every later save of a long-running trainer would fail.
        """
        log.warning("ckptstage: lost the session with the daemon on %s; opening a new one", self._conn.socket)
        had = self._arena.size if self._arena is not None else 0
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        self._open_session()
        if had:  # a client that saved before saves again: its arena is prepared again, ahead of that save
            self._queue.put(_Prepare(had))

    def _prepare_now(self, nbytes: int) -> None:
        """Sizes the arena ahead of the saves; on any trouble the next save asks again (and reports it).

        Never raises: this runs on the snapshot thread, which must live on to copy the saves.
        """
        try:
            if not self._attach.done():
                self._ensure_arena(nbytes)
        except errors.CkptStageError as e:
            log.debug("ckptstage: no arena of %d bytes prepared ahead (%s); the next save asks again", nbytes, e)
        except Exception as e:  # noqa: BLE001 - out of descriptors or memory, a vanished file: the save reports it
            log.warning("ckptstage: could not prepare an arena of %d bytes ahead (%s); the next save asks again",
                        nbytes, e)

    def _ensure_arena(self, want: int) -> ArenaMap:
        if self._arena is not None and self._arena.size >= want:
            return self._arena
        info = self._conn.call("EnsureArena", pb.EnsureArenaRequest(session_id=self._session_id, want_bytes=want))
        if self._arena is None or info.generation != self._arena.generation:
            old, self._arena = self._arena, ArenaMap(info)
            self._stream_end = self._released = 0  # a new arena starts a new stream
            self._conn.call("ArenaMapped", pb.ArenaMappedRequest(session_id=self._session_id,
                                                                 generation=info.generation))
            if old is not None:
                old.close()
        return self._arena

    def _run(self) -> None:
        self._copy_threads.start_background()
        while True:
            job = self._queue.get()
            if job is None:
                return
            if isinstance(job, _Prepare):
                self._prepare_now(job.nbytes)
                continue
            try:
                self._copy(job)
                job.handle._finish(None)
            except BaseException as e:  # noqa: BLE001 - handed to the trainer through the handle
                job.handle._finish(e)
            finally:
                job.tensors.clear()  # drop references to the trainer's tensors

    def _copy(self, job: _Job) -> None:
        if self._attach.done():
            self._reopen_session()
        arena = self._ensure_arena(job.plan.data_bytes)
        if any(t.is_cuda for t in job.tensors):
            arena.register_cuda()
        base = -(-self._stream_end // self._chunk) * self._chunk
        n = job.plan.data_bytes
        if n <= arena.size and base % arena.size + n > arena.size:
            # Whole in one piece from the ring's start, rather than wrapped around its end: the image of the
            # file stays contiguous, which is what the memory tier keeps and a restart maps.
            base = -(-base // arena.size) * arena.size
        with self._lock:
            generation, announced = self._released_hint
        if generation == arena.generation:
            self._released = max(self._released, announced)
        # BeginSave goes out now and is answered while the copy runs: the copy
        # needs the answer only to stream (see snapshot.Streamer).
        sent = self._conn.start("BeginSave", pb.BeginSaveRequest(
            session_id=self._session_id, step=job.handle.step, manifest_json=self._manifest_json(job),
            data_bytes=job.plan.data_bytes, metrics=job.metrics, stream_base=base, overwrite=job.overwrite))
        begin = _Once(lambda: self._began(job, base, sent()))
        streamer = Streamer(self._conn, arena, base, self._chunk, self._released, begin, job.ready,
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
        finished = self._conn.call("FinishSave", pb.FinishSaveRequest(save_id=resp.save_id))
        self._released = max(streamer.released, finished.released)

    def _began(self, job: _Job, base: int, resp: pb.BeginSaveResponse) -> pb.BeginSaveResponse:
        if resp.stream_base != base:  # the daemon refuses a mismatch; this is belt and braces
            raise errors.CkptStageError(f"the daemon placed step {job.handle.step} at stream position "
                                        f"{resp.stream_base}, the client copied it to {base}")
        # Only now does the save hold its stream positions; one that was refused holds none.
        self._stream_end = resp.stream_base + job.plan.data_bytes
        self._released = max(self._released, resp.released)
        job.handle.save_id = resp.save_id
        return resp

    def _manifest_json(self, job: _Job) -> bytes:
        """Built on the snapshot thread: off the trainer's thread."""
        raw = layout.encode_manifest(build_manifest(job.plan, job.tree, self.job, job.handle.step, self.rank,
                                                    self.world_size, self.attempt, job.extras))
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
            self._conn.call("AbortSave", pb.AbortSaveRequest(save_id=save_id, reason=repr(error)), timeout=5)
        except errors.CkptStageError:
            pass

    def _check_open(self) -> None:
        if self._closed:
            raise errors.CkptStageError("this Client is closed")


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


# Attributes through which known wrappers reach the optimizer they forward ``step`` to.
_WRAPPED_OPTIMIZER_ATTRS = ("optimizer", "_optimizer", "optim", "_optim")


def _settle(error: BaseException) -> float:
    """How long to ask whether a step was replaced after a read failed with ``error``: a replacement (save with
    overwrite) puts its parts in place a moment before the daemon's index names its commit, so a reader in
    between finds a part that verifies but is not the commit it was told of; no other failure needs a wait."""
    return _REPLACED_SETTLE_S if isinstance(error, layout.ManifestNotCommitted) else 0.0


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """What this rank's checkpoint of ``optimizer`` and the parameters it updates holds in tensors (after a
    step): of a sharded tensor (DTensor), only this rank's shard."""
    seen: set[int] = set()
    total = 0
    tensors = [p for g in optimizer.param_groups for p in g["params"]] + \
        [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            local = t.to_local() if shards.is_dtensor(t) else t
            total += local.numel() * local.element_size()
    return total


def _innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer at the bottom of ``optimizer``'s wrappers: the one whose ``step`` updates the tensors.

    Wrappers keep the wrapped optimizer in an attribute and forward ``step``
    to it; some subclass ``torch.optim.Optimizer`` without initializing it
    (Accelerate's), so being an Optimizer does not end the walk: an object
    that wraps another optimizer is followed to it (``ZeroRedundancyOptimizer``
    to its local optimizer, whose ``step`` it calls).
    """
    seen = [type(optimizer).__qualname__]
    current = optimizer
    while len(seen) <= 8:
        inner = next((getattr(current, a) for a in _WRAPPED_OPTIMIZER_ATTRS
                      if isinstance(getattr(current, a, None), torch.optim.Optimizer)), None)
        if inner is None or inner is current:
            break
        current = inner
        seen.append(type(current).__qualname__)
    if not isinstance(current, torch.optim.Optimizer) or not hasattr(current, "_optimizer_step_pre_hooks"):
        raise TypeError(f"protect() needs a torch.optim.Optimizer or a wrapper of one; "
                        f"{' -> '.join(seen)} is neither (none of its attributes "
                        f"{', '.join(_WRAPPED_OPTIMIZER_ATTRS)} holds an optimizer): pass the optimizer it wraps")
    return current


def _tier_code(tier: str) -> pb.Tier:
    if tier not in _TIERS:
        raise ValueError(f"tier must be 'local', 'shared' or 'memory', not {tier!r}")
    return _TIERS[tier]


def _is_sharded(locations: Sequence[tuple[int, Path]]) -> bool:
    """Whether the part (its first copy whose manifest reads) holds DTensor fragments."""
    for _, part in locations:
        try:
            return reshard.has_sharded(layout.read_manifest(part))
        except layout.ManifestError:
            continue
    return False


def _check_metrics(metrics: Mapping[str, float] | None) -> dict[str, float]:
    out = {}
    for k, v in (metrics or {}).items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"metrics[{k!r}] must map a str to a number, got {type(v).__name__}")
        out[k] = float(v)
    return out


def _info(c: pb.CheckpointInfo) -> CheckpointInfo:
    tiers = tuple(t for t, committed in (("local", c.committed_local), ("shared", c.committed_shared),
                                         ("memory", len(c.ranks_memory) == c.world_size)) if committed)
    return CheckpointInfo(step=c.step, tiers=tiers, bytes=c.bytes, created=c.created, complete=c.complete,
                          world_size=c.world_size, pinned=c.pinned, drain_state=c.drain_state,
                          metrics=dict(c.metrics), attempt=c.attempt, ranks_missing=tuple(c.ranks_missing),
                          ranks_memory=tuple(c.ranks_memory))
