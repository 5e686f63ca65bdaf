"""The node's saves: those in flight, with the session each belongs to, and a bounded memory of settled ones.

A save is registered when it begins and settles exactly once, committed or
failed (:meth:`SaveTable.settle`); what waits for saves (``WaitSave``,
deletions, the daemon's shutdown) sleeps on that save's own event instead of
polling (one condition for all would wake every waiter of a node at each
rank's commit: hundreds of threads, hundreds of times a step). A settled save leaves a small :class:`SettledSave` behind, so that a
late ``WaitSave`` or ``FinishSave`` still gets its outcome.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from ckptstage.daemon.errors import InvalidRequest, SaveFailed, SaveNotFound
from ckptstage.daemon.save.persister import Save
from ckptstage.daemon.save.sessions import Session

# Settled saves remembered for late WaitSave/FinishSave calls: a few hundred bytes each, this many at most.
MAX_SETTLED_SAVES = 1024


@dataclass(frozen=True)
class SettledSave:
    """What the node keeps of a save once it committed or failed (its manifest and buffers are let go)."""

    id: str
    job: str
    step: int
    rank: int
    error: str | None
    memory_only: bool = False

    @classmethod
    def of(cls, save: Save) -> SettledSave:
        spec = save.spec
        return cls(save.id, spec.job, spec.step, spec.rank, save.error, save.memory_only)


class SaveTable:
    """Saves by id: in flight, or settled (the newest :data:`MAX_SETTLED_SAVES`)."""

    def __init__(self) -> None:
        self._saves: dict[str, Save] = {}  # in flight
        self._settled: OrderedDict[str, SettledSave] = OrderedDict()
        self._owners: dict[str, Session] = {}  # save id -> its session, even after the session closed
        self._lock = threading.Lock()
        self._settling: dict[str, threading.Event] = {}  # save id -> set when it settles (in flight only)

    def add(self, save: Save, session: Session) -> None:
        with self._lock:
            self._saves[save.id] = save
            self._owners[save.id] = session
            self._settling[save.id] = threading.Event()

    def owner(self, save: Save) -> Session:
        with self._lock:
            return self._owners[save.id]

    def get(self, save_id: str) -> Save | SettledSave:
        """The save in flight, or the record of a settled one; raises :class:`SaveNotFound`."""
        with self._lock:
            save = self._saves.get(save_id) or self._settled.get(save_id)
        if save is None:
            raise SaveNotFound(save_id)
        return save

    def live(self, save_id: str) -> Save:
        """A save still in flight; one that settled answers with its outcome."""
        save = self.get(save_id)
        if isinstance(save, SettledSave):
            if save.error is not None:
                raise SaveFailed(save.error)
            raise InvalidRequest(f"save {save_id} ({save.job} step {save.step} rank {save.rank}) is already "
                                 "committed")
        return save

    def record(self, save: Save) -> SettledSave:
        """The settled record of ``save`` (made now when it has left the table's memory)."""
        with self._lock:
            record = self._settled.get(save.id)
        return record or SettledSave.of(save)

    def in_flight(self) -> list[Save]:
        """Saves neither committed nor failed yet."""
        with self._lock:
            return [s for s in self._saves.values() if not s.settled]

    def busy(self, job: str, step: int, rank: int) -> bool:
        """Whether a save of (job, step, rank) is in flight."""
        return any(s.spec.job == job and s.spec.step == step and s.spec.rank == rank for s in self.in_flight())

    def unsettled(self, save: Save) -> bool:
        """Whether ``save`` has not been settled through :meth:`settle` yet."""
        with self._lock:
            return save.id in self._saves

    def settle(self, save: Save) -> None:
        """A save committed or failed: its session lets go of it, the table keeps a small record."""
        owner = self.owner(save)
        with self._lock:
            if self._saves.pop(save.id, None) is not None:
                self._settled[save.id] = SettledSave.of(save)
                while len(self._settled) > MAX_SETTLED_SAVES:
                    old, _ = self._settled.popitem(last=False)
                    self._owners.pop(old, None)
            settling = self._settling.pop(save.id, None)
        if settling is not None:
            settling.set()
        owner.settle(save)

    def wait_settled(self, save: Save, timeout: float) -> bool:
        """Blocks until ``save`` failed or committed with its commit path run (indexed, its step's commit record
        written when it is the last rank's, queued for draining); the local retention pass that follows a
        commit is not waited for. False at the timeout. Woken by :meth:`settle`, no polling."""
        deadline = time.monotonic() + timeout
        with self._lock:
            settling = self._settling.get(save.id)
        if settling is not None and save.error is None and not settling.wait(timeout):
            return False
        if save.error is not None:
            return True
        # Settled and committed: the persister marks it done as soon as the node's commit path returns.
        return save.local_done.wait(max(0.0, deadline - time.monotonic()))
