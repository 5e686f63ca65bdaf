"""The Lightning ``CheckpointIO`` plug-in: checkpoints saved through the node's daemon, pointers in their place."""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

from ckptstage.client import Client, SaveHandle, errors
from ckptstage.lightning.pointers import (
    Pointer, PointerError, is_remote, list_pointers, local_path, read_pointer, try_read_pointer, write_pointer_file,
)
from ckptstage.protos import layout

log = logging.getLogger(__name__)


class CkptstageCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through the node's ckptstage daemon.

    ``job`` names the checkpoints (None: a plug-in that only loads);
    ``socket`` the daemon (default ``$CKPTSTAGE_SOCKET``, else the daemon's
    default path). ``pin`` (default True) pins every step a pointer names, so
    the daemon's retention rules never remove a checkpoint Lightning still
    keeps; with False, retention applies as to any step (``retention`` sets
    the job's overrides, e.g. ``{"keep_best_metric": ...}``) and a pointer may
    outlive its step. ``arena_bytes`` pre-allocates the shared memory at the
    first save. See the module docstring for how paths map to steps.
    """

    def __init__(self, job: str | None, socket: str | os.PathLike[str] | None = None, *, pin: bool = True,
                 retention: Mapping[str, Any] | None = None, arena_bytes: int | None = None,
                 connect_timeout: float = 30.0) -> None:
        if job is not None:
            try:
                layout.check_job(job)
            except layout.InvalidName as e:
                raise ValueError(str(e)) from None
        self.job = job
        self.socket = None if socket is None else str(socket)
        self.pin = pin
        self.retention = dict(retention) if retention is not None else None
        self.arena_bytes = arena_bytes
        self.connect_timeout = connect_timeout
        self._start()

    def _start(self) -> None:
        """The per-process state: clients, saves in flight, the background thread (none until needed)."""
        self._clients: dict[str, Client] = {}
        self._cond = threading.Condition()
        self._pending: dict[int, SaveHandle] = {}  # step -> its newest save not yet known committed
        self._busy: set[int] = set()               # steps being saved whose pointer is not written yet
        self._deleting: set[int] = set()           # steps the background thread is deleting now
        self._written = 0                          # pointers written: a deletion pass rescans if it moved
        self._candidates: set[int] = set()         # steps of self.job to delete once no pointer names them
        self._dirs: set[Path] = set()              # directories whose pointers keep steps alive
        self._tasks: queue.Queue[Callable[[], None] | None] | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None   # a save that failed to commit, raised at the next call
        self._keep_all = False                     # after such a failure nothing more is deleted

    # Lightning pickles the plug-in for ddp_spawn: each process starts with none of the above.
    def __getstate__(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("job", "socket", "pin", "retention", "arena_bytes", "connect_timeout")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start()

    # --- CheckpointIO ---------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Saves ``checkpoint`` as step ``checkpoint["global_step"]`` and writes the pointer at ``path``.

        Returns once the daemon holds the snapshot. Raises the error of an
        earlier save that failed to commit, if any (as ``AsyncCheckpointIO``).
        """
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        if is_remote(path) or _is_temporary(path):
            TorchCheckpointIO().save_checkpoint(checkpoint, path)
            return
        if self.job is None:
            raise ValueError(f"{type(self).__name__}(job=None) only loads; give it a job to save")
        self._raise_error()
        target = local_path(path)
        step = _step_of(checkpoint, target)
        client = self._client(self.job, saving=True)
        with self._cond:
            earlier = self._pending.get(step)
        if earlier is not None:
            # A step still being persisted cannot be replaced: the later save of the same global
            # step (last.ckpt after the top-k file) waits for the earlier one's local commit.
            try:
                earlier.wait("local")
            except errors.CkptStageError as e:
                log.warning("ckptstage: the earlier save of step %d failed (%s); saving it again", step, e)
        with self._cond:
            while step in self._deleting:
                self._cond.wait()
            self._busy.add(step)
        try:
            try:
                handle = client.save(step, checkpoint, overwrite=True)
            except TypeError as e:
                raise TypeError(f"cannot save the Lightning checkpoint {target} through ckptstage: {e}") from e
            handle.wait_snapshot()
            superseded = try_read_pointer(target)
            write_pointer_file(target, Pointer(self.job, step))
            with self._cond:
                self._pending[step] = handle
                self._candidates.add(step)
                self._dirs.update(_checkpoint_dirs(checkpoint), [target.parent])
                if superseded is not None and superseded.job == self.job and superseded.step != step:
                    self._candidates.add(superseded.step)
        finally:
            with self._cond:
                self._busy.discard(step)
                self._written += 1
        log.debug("ckptstage: %s -> job %s step %d (blocked %.3fs)", target, self.job, step, handle.blocked_s or 0)
        self._submit(lambda: self._committed(client, handle, target))
        if superseded is not None and superseded != Pointer(self.job, step):
            self._submit(self._collect)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint at ``path``: through its pointer from the daemon, else with ``torch.load``.

        ckptstage returns tensors on the CPU; ``map_location`` then moves
        them (a device or str; a dict keyed by ``"cpu"``; a callable is
        called as ``torch.load`` would for a CPU checkpoint, with the tensor's
        storage and ``"cpu"``). ``weights_only`` matters only for a
        ``torch.save`` file: a pointer's checkpoint is never unpickled.
        """
        if is_remote(path) or _is_temporary(path):
            return TorchCheckpointIO().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        pointer = read_pointer(p)
        if pointer is None:
            return TorchCheckpointIO().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        with self._cond:
            in_flight = self._pending.get(pointer.step) if pointer.job == self.job else None
        if in_flight is not None:
            in_flight.wait("local")  # saved by this process a moment ago: read it once it is on disk
        client = self._client(pointer.job)
        try:
            state = client.load(pointer.step)
        except errors.CheckpointNotFound as e:
            raise errors.CheckpointNotFound(
                f"{p} points to step {pointer.step} of ckptstage job {pointer.job!r}, which the daemon on "
                f"{self.socket or '$CKPTSTAGE_SOCKET / the default socket'} cannot load: it was deleted, never "
                f"committed, or is only on another node's local tier ({e})") from e
        if not isinstance(state, dict):
            raise errors.CkptStageError(f"{p} points to step {pointer.step} of job {pointer.job!r}, which holds a "
                                        f"{type(state).__name__}, not a Lightning checkpoint dict")
        if pointer.job == self.job:
            with self._cond:
                self._dirs.update(_checkpoint_dirs(state))  # a resumed run's pointers keep their steps
            client.prepare()  # the resumed run saves again: its arena is made now, not in its first save
        return _map_location(state, map_location)

    def remove_checkpoint(self, path: Any) -> None:
        """Removes the file at ``path``; its step is deleted once no pointer names it (in the background)."""
        if is_remote(path) or _is_temporary(path):
            TorchCheckpointIO().remove_checkpoint(path)
            return
        p = Path(path)
        if not os.path.lexists(p):
            return
        try:
            pointer = read_pointer(p) if p.is_file() else None
        except (OSError, PointerError):
            pointer = None
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
        if pointer is None:
            return
        if pointer.job != self.job:
            log.info("ckptstage: removed %s, a pointer to job %r step %d; this plug-in deletes only steps of "
                     "its own job %r", p, pointer.job, pointer.step, self.job)
            return
        with self._cond:
            self._dirs.add(p.parent)
            self._candidates.add(pointer.step)
        self._submit(self._collect)

    def teardown(self) -> None:
        """Waits for the local commit of every save (then pins, deletions), closes the clients.

        Raises the error of a save that failed to commit. A later save or
        load starts afresh (Lightning tears down after every fit/validate/test).
        """
        thread, tasks = self._thread, self._tasks
        if thread is not None and tasks is not None:
            tasks.put(None)
            thread.join()
        for client in self._clients.values():
            try:
                client.close()
            except errors.CkptStageError as e:
                log.warning("ckptstage: closing the client of job %s: %s", client.job, e)
        error = self._error
        self._start()
        if error is not None:
            raise error

    # --- internals ------------------------------------------------------------------

    def _client(self, job: str, saving: bool = False) -> Client:
        """One client per job in this process, created on first use: rank 0 of a one-rank checkpoint world."""
        client = self._clients.get(job)
        if client is None:
            # Only our own job gets our overrides (None: the job's rules stay as they are).
            client = Client(job, socket=self.socket, world_size=1,
                            retention=self.retention if job == self.job else None,
                            arena_bytes=self.arena_bytes if saving else None, connect_timeout=self.connect_timeout)
            self._clients[job] = client
        return client

    def _submit(self, task: Callable[[], None]) -> None:
        """Runs ``task`` on the background thread, after every task submitted before it."""
        if self._thread is None:
            self._tasks = queue.Queue()
            self._thread = threading.Thread(target=self._run, args=(self._tasks,), daemon=True,
                                            name="ckptstage-lightning")
            self._thread.start()
        assert self._tasks is not None
        self._tasks.put(task)

    def _run(self, tasks: queue.Queue[Callable[[], None] | None]) -> None:
        while (task := tasks.get()) is not None:
            try:
                task()
            except Exception:  # noqa: BLE001 - a bookkeeping failure must not stop the commits behind it
                log.exception("ckptstage: background task failed")

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _committed(self, client: Client, handle: SaveHandle, path: Path) -> None:
        """Background: waits for a save's local commit, then pins its step."""
        step = handle.step
        try:
            handle.wait("local")
        except Exception as e:  # noqa: BLE001 - handed to the trainer at its next save
            self._keep_all = True
            self._error = errors.SaveFailed(f"the checkpoint {path} (job {self.job!r} step {step}) was "
                                            f"not committed: {e}; nothing will be deleted from now on")
            log.error("ckptstage: %s", self._error)
            return
        finally:
            with self._cond:
                if self._pending.get(step) is handle:
                    del self._pending[step]
        if self.pin:
            try:
                client.pin(step)
            except errors.CkptStageError as e:
                log.warning("ckptstage: cannot pin job %s step %d: %s", self.job, step, e)

    def _collect(self) -> None:
        """Background: deletes the candidate steps that no pointer in the checkpoint directories names."""
        if self._keep_all or self.job is None:
            return
        while True:
            with self._cond:
                written, dirs = self._written, list(self._dirs)
            named = {p.step for d in dirs for p in list_pointers(d).values() if p.job == self.job}
            with self._cond:
                if self._written != written:
                    continue  # a pointer was written while listing: list again
                doomed = sorted(s for s in self._candidates - named
                                if s not in self._busy and s not in self._pending)
                self._deleting.update(doomed)
                self._candidates.difference_update(doomed)
            break
        if not doomed:
            return
        client = self._client(self.job)
        for step in doomed:
            try:
                self._delete(client, step)
            finally:
                with self._cond:
                    self._deleting.discard(step)
                    self._cond.notify_all()

    def _delete(self, client: Client, step: int) -> None:
        try:
            if self.pin:
                client.unpin(step)
            client.delete(step)
            log.info("ckptstage: deleted job %s step %d (no checkpoint file names it any more)", self.job, step)
        except errors.CheckpointNotFound:
            pass  # already gone (an operator's `ckptstage rm`, or retention with pin=False)
        except errors.StepPinned as e:
            log.info("ckptstage: keeping job %s step %d: %s", self.job, step, e)
        except errors.CkptStageError as e:
            log.warning("ckptstage: cannot delete job %s step %d: %s", self.job, step, e)


def load(path: str | os.PathLike[str], map_location: Any = None, socket: str | os.PathLike[str] | None = None,
         weights_only: bool | None = None) -> dict[str, Any]:
    """The checkpoint dict at ``path``, a pointer or a ``torch.save`` file (outside a Trainer).

    ``LightningModule.load_from_checkpoint`` reads files with ``torch.load``
    and so cannot read a pointer; build the module and load
    ``load(path)["state_dict"]`` instead.
    """
    io = CkptstageCheckpointIO(job=None, socket=socket)
    try:
        return io.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
    finally:
        io.teardown()


# --- helpers --------------------------------------------------------------------------


def _is_temporary(path: Any) -> bool:
    """Lightning's own hidden temporaries: ddp_spawn's hand-over of the weights (``.temp.ckpt``, a bare
    state_dict) and the tuner's ``.lr_find_*.ckpt`` / ``.scale_batch_size_*.ckpt``. They are written,
    read and removed at once: as files, never as steps (one would replace a real step of its global step)."""
    return Path(str(path)).name.startswith(".")


def _checkpoint_dirs(checkpoint: Mapping[str, Any]) -> list[Path]:
    """The directories of the checkpoint's ``ModelCheckpoint`` callbacks: their pointers keep steps alive."""
    callbacks = checkpoint.get("callbacks")
    if not isinstance(callbacks, Mapping):
        return []
    return [Path(v["dirpath"]) for v in callbacks.values()
            if isinstance(v, Mapping) and isinstance(v.get("dirpath"), str)]



def _step_of(checkpoint: Mapping[str, Any], path: Path) -> int:
    step = checkpoint.get("global_step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"the checkpoint for {path} has global_step={step!r}; ckptstage needs an int >= 0 "
                         "to name the step")
    return step


def _map_location(state: dict[str, Any], map_location: Any) -> dict[str, Any]:
    """Moves the loaded (CPU) tensors as ``torch.load(..., map_location)`` would have."""
    if map_location is None:
        return state
    if isinstance(map_location, Mapping):
        map_location = map_location.get("cpu")
        if map_location is None:
            return state
    if isinstance(map_location, (str, torch.device)):
        device = torch.device(map_location)
        return apply_to_collection(state, torch.Tensor, lambda t: t.to(device))  # type: ignore[no-any-return]
    if callable(map_location):
        def move(t: torch.Tensor) -> torch.Tensor:
            out = map_location(t.untyped_storage(), "cpu")
            device = getattr(out, "device", t.device)
            return t if device == t.device else t.to(device)

        return apply_to_collection(state, torch.Tensor, move)  # type: ignore[no-any-return]
    raise TypeError(f"map_location must be a device, str, dict or callable, not {type(map_location).__name__}")
