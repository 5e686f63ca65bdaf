"""``Client``: what a trainer calls.

``save`` plans the file layout on the caller's thread (milliseconds; bad
input raises here) and queues the copy on the client's snapshot thread, so
training goes on while the state is copied into the daemon's arena. Two
completion points stay separate: ``wait_snapshot`` (the tensors may be
mutated again) and ``wait(tier)`` (durable on that tier).

The client is thin over its parts: the session with the daemon
(:mod:`~ckptstage.client.session`), the snapshot thread and its
:class:`SaveHandle` (:mod:`~ckptstage.client.saver`), and which copy a load
reads (:mod:`~ckptstage.client.loader`).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptstage.client import dist, errors, lifecycle, preemption, steps, stepwait, tree
from ckptstage.client.loader import Loader
from ckptstage.client.optimizers import innermost_optimizer, prepare_after_first_step
from ckptstage.client.saver import SaveHandle, Saver
from ckptstage.client.session import Session
from ckptstage.protos import layout
from ckptstage.protos.v1 import ckptstage_pb2 as pb

# A deletion waits for saves and drains of the step still in flight (the daemon bounds each wait to 30 s).
_DELETE_TIMEOUT_S = 120.0


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
        self._not_the_saver = dist.refuse_saves(world_size, given_rank)  # "only rank 0 saves" (see above)
        self._prepare_ahead = arena_bytes is None and not self._not_the_saver
        self._closed = False
        self._session = Session(socket, self.job, rank, world_size, self.attempt, retention,
                                saves=not self._not_the_saver, connect_timeout=connect_timeout)
        self._conn = self._session.conn
        self._loader = Loader(self._conn, self.job, rank, world_size)
        self._saver = Saver(self._session)
        lifecycle.track(self)
        try:
            self._peers = dist.exchange_peers(self._session, world_size)  # the job's other nodes ([peers])
            self._saver.reserve(arena_bytes or 0)
        except BaseException:
            self.close()  # else the session and its snapshot thread outlive the failed constructor
            raise

    @property
    def last_load_tier(self) -> str | None:
        """The tier the last :meth:`load` read this rank's part from (``None`` before the first)."""
        return self._loader.last_tier

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
        self._saver.prepare_deferred()
        try:
            layout.check_step(step)
        except layout.InvalidName as e:
            raise errors.InvalidRequest(str(e)) from None
        return self._saver.submit(step, flat, metrics, overwrite)

    def wait_snapshots(self) -> None:
        """Blocks until every save started so far has been copied out."""
        self._saver.wait_snapshots()

    def protect(self, optimizer: Any) -> Any:
        """Makes ``optimizer.step()`` wait for snapshots still copying; returns the hook handle.

        ``optimizer`` is a ``torch.optim.Optimizer`` or a wrapper that forwards
        ``step`` to one (Accelerate's ``AcceleratedOptimizer``, Lightning's
        ``LightningOptimizer``, ``ZeroRedundancyOptimizer``, a user's own):
        the hook goes on the optimizer that updates the tensors.
        """
        inner = innermost_optimizer(optimizer)
        handle = inner.register_step_pre_hook(lambda *_: self.wait_snapshots())
        if not self._prepare_ahead:
            return handle
        if self._session.expected:  # a trainer that saved this job here before: the same size again
            self.prepare()
            return handle
        prepare_after_first_step(inner, lambda nbytes: None if self._closed else self.prepare(nbytes))
        return handle

    def on_preemption(self, state_fn: Callable[[], tuple[int, Any]], signals: Sequence[int] = (signal.SIGTERM,),
                      *, timeout: float | None = 10.0, at_optimizer_step: bool = True) -> Any:
        """On one of ``signals``, one last snapshot of ``state_fn()`` (``(step, state)``) at the next safe point
        (before the next ``optimizer.step()``, at :meth:`Preemption.check`, or from a watchdog after ``timeout``
        seconds), then the process ends as it would have. Main thread only; a second call replaces the first;
        :meth:`close` restores the previous handlers. See :mod:`ckptstage.client.preemption`."""
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
            nbytes = self._session.expected
        elif isinstance(state, int):
            nbytes = state
        else:
            flat = tree.flatten_state(state)
            nbytes = self._saver.plans.plan(flat.tensors, flat.paths).data_bytes
        self._saver.prepare(nbytes)

    # --- reading --------------------------------------------------------------------

    def latest(self, group: Any = None) -> int | None:
        """The newest complete step (every rank's part of one attempt committed), or None.

        When ``torch.distributed`` is initialized this is collective over
        ``group`` (the default group when None): every rank answers the same,
        the newest step that every rank's daemon can load, from either tier.
        """
        if group is None and not dist.initialized():
            newest = steps.complete_steps(self._conn, self.job, 1)
            return newest[0] if newest else None
        common = set.intersection(*(set(s) for s in dist.gather(steps.complete_steps(self._conn, self.job), group)))
        return max(common, default=None)

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
        stepwait.wait_step(self._conn, self.job, self.rank, self.world_size, step, tier, timeout, collective,
                           self._saver.recent(step))

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
            return self._loader.load(step, into)
        finally:
            self._saver.prepare_deferred()

    def open_step(self, step: int | None = None) -> steps.OpenStep:
        """Every rank's part of ``step`` (newest complete when None), open for verified reads of any box.

        For tools that read a step their own way (the DCP reader, consolidation):
        ``opened.view`` is a :class:`~ckptstage.client.reshard.StepView`. Close it
        (or use ``with``).
        """
        return steps.open_step(self._conn, self.job, step, self.rank, self.world_size)

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
        preemption.release(self)  # its signal handlers, if any: the previous ones come back
        self._saver.stop()
        self._session.close()
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
        if self._saver.finish(self._exit_timeout):
            self.close()
            return
        self._closed = True
        self._saver.abandon()

    def _saving(self, step: int) -> SaveHandle | None:  # for a preemption's snapshot (preemption.Saving)
        return self._saver.reusable(step)

    def _check_open(self) -> None:
        if self._closed:
            raise errors.CkptStageError("this Client is closed")


def _info(c: pb.CheckpointInfo) -> CheckpointInfo:
    tiers = tuple(t for t, committed in (("local", c.committed_local), ("shared", c.committed_shared),
                                         ("memory", len(c.ranks_memory) == c.world_size),
                                         ("peer", c.committed_peer)) if committed)
    return CheckpointInfo(step=c.step, tiers=tiers, bytes=c.bytes, created=c.created, complete=c.complete,
                          world_size=c.world_size, pinned=c.pinned, drain_state=c.drain_state,
                          metrics=dict(c.metrics), attempt=c.attempt, ranks_missing=tuple(c.ranks_missing),
                          ranks_memory=tuple(c.ranks_memory))
