"""Lightning checkpoints through ckptstage: ``CkptstageCheckpointIO``.

One line in a training script::

    trainer = Trainer(plugins=[CkptstageCheckpointIO(job="resnet-run3")],
                      callbacks=[ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True)])
    trainer.fit(model, ckpt_path="last")

Paths and steps
---------------
Lightning names checkpoints by path; ckptstage by (job, step). The plug-in
saves a checkpoint as step ``checkpoint["global_step"]`` of its job, and
writes at the path Lightning asked for a *pointer*: a small JSON file
(``{"format": "ckptstage.lightning/1", "job": ..., "step": ...}``), written
atomically (temporary file, fsync, rename, fsync of the directory). So
everything Lightning does with files keeps working unchanged: ``last*.ckpt``
found by listing the directory and picked by modification time for
``ckpt_path="last"``, ``best_model_path``, version suffixes when a name is
taken, ``save_last="link"`` symlinks. ``load_checkpoint`` reads the pointer
and loads (job, step) from the daemon; a file that is not a pointer (a
``torch.save`` checkpoint) is loaded as ``TorchCheckpointIO`` would.
:func:`write_pointer` goes the other way: it makes a path Lightning can resume
from out of a step ckptstage holds.

Saving
------
``save_checkpoint`` returns once the daemon holds the snapshot
(``SaveHandle.wait_snapshot``): the trainer may change its tensors from then
on, and the checkpoint no longer depends on this process. The step is
persisted to local disk and drained to the shared tier behind it. Two paths
saved at one global step (``epoch=0-step=200.ckpt`` then ``last.ckpt``) name
one ckptstage step: the later save replaces it (``overwrite=True``), after
waiting for the earlier one to be committed locally.

Only rank 0 saves (Lightning's ``Strategy`` calls the plug-in on global rank 0
only): the client is created with ``world_size=1``, a one-rank checkpoint
world, so a step is complete with one part and every rank can load it.

Keeping and removing
--------------------
Lightning, not the daemon's retention rules, decides which checkpoints stay:
a step the plug-in saved is pinned on the daemon once committed (``pin=True``),
so ``keep_last`` can never remove a top-k checkpoint still named by a file.
A step is unpinned and deleted (``Client.delete``, both tiers) once no
pointer in the checkpoint directories names it any more: after
``remove_checkpoint``, and after a pointer is written over (``last.ckpt``
moving on) or removed by Lightning behind the plug-in's back (the
``save_last="link"`` symlink replacing a file). Deletions run on a
background thread, behind the commits of every save started before them:
a checkpoint is never deleted before its successor is durable. Only steps
of the plug-in's own job are ever deleted.

Preemption
----------
Lightning handles SIGTERM itself during ``fit`` (its signal connector): the
handler records it (calling a handler installed before, at once), the loop
ends the current training batch, agrees across ranks, and raises
``SIGTERMException`` (a ``SystemExit``) after every callback's
``on_exception``. It saves nothing (unless SLURM auto-requeue is on: then
its own SIGUSR1 handler saves through the plug-in). A ``CheckpointIO`` never
sees the trainer, so the save is a callback's: :class:`PreemptionCheckpoint`
saves the state at that safe point, through the plug-in, and the process
then ends as Lightning ends it::

    trainer = Trainer(plugins=[CkptstageCheckpointIO(job="run3")],
                      callbacks=[ModelCheckpoint(dirpath="ckpts", save_last=True),
                                 PreemptionCheckpoint("ckpts")])
    trainer.fit(model, ckpt_path="last")

``ckpt_path="last"`` (Lightning's default with this callback) picks the
newer of ``last.ckpt`` and ``preempted.ckpt``. Leave the callback out to
turn this off. Client code outside Lightning uses ``Client.on_preemption``.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning_utilities.core.apply_func import apply_to_collection

from ckptstage.client import Client, SaveHandle, errors
from ckptstage.protos import layout

__all__ = ["POINTER_FORMAT", "CkptstageCheckpointIO", "Pointer", "PointerError", "PreemptionCheckpoint",
           "list_pointers", "load", "read_pointer", "write_pointer"]

log = logging.getLogger(__name__)

POINTER_FORMAT = "ckptstage.lightning/1"
_MAX_POINTER_BYTES = 64 * 1024
_HINT = "a ckptstage checkpoint: load it with ckptstage.lightning (CkptstageCheckpointIO or load())"


class PointerError(ValueError):
    """A file that starts like a ckptstage pointer (JSON) but is not a valid one, or an empty file."""


@dataclass(frozen=True)
class Pointer:
    """What a pointer file names: step ``step`` of ckptstage job ``job``."""

    job: str
    step: int

    def to_json(self) -> bytes:
        return (json.dumps({"format": POINTER_FORMAT, "job": self.job, "step": self.step, "note": _HINT},
                           indent=1) + "\n").encode()


# --- pointer files --------------------------------------------------------------------


def read_pointer(path: str | os.PathLike[str]) -> Pointer | None:
    """The (job, step) a pointer file names; None if the file is not a pointer (e.g. a ``torch.save`` file).

    Raises :class:`PointerError` for an empty file and for one that starts
    like a pointer (a JSON object) but is not a valid one, naming the path
    and what is wrong; ``OSError`` if it cannot be read.
    """
    p = Path(path)
    with open(p, "rb") as f:
        head = f.read(_MAX_POINTER_BYTES + 1)
    if not head.strip():
        raise PointerError(f"{p} is empty: neither a ckptstage pointer nor a torch checkpoint")
    if not head.lstrip().startswith(b"{"):
        return None  # torch.save writes a zip (PK..) or a pickle (\x80..), never a JSON object
    if len(head) > _MAX_POINTER_BYTES:
        raise PointerError(f"{p} starts like a ckptstage pointer (JSON) but is over {_MAX_POINTER_BYTES} bytes")
    try:
        obj = json.loads(head.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PointerError(f"{p} is not a valid ckptstage checkpoint pointer: not JSON ({e})") from None
    if not isinstance(obj, dict) or obj.get("format") != POINTER_FORMAT:
        got = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
        raise PointerError(f"{p} is not a ckptstage checkpoint pointer: its format is {got!r}, "
                           f"expected {POINTER_FORMAT!r}")
    job, step = obj.get("job"), obj.get("step")
    try:
        if not isinstance(job, str) or not isinstance(step, int):
            raise layout.InvalidName(f"its job must be a name and its step a number, got {job!r} and {step!r}")
        return Pointer(layout.check_job(job), layout.check_step(step))
    except layout.InvalidName as e:
        raise PointerError(f"{p} is not a valid ckptstage checkpoint pointer: {e}") from None


def _write_pointer_file(path: Path, pointer: Pointer) -> None:
    """Writes ``pointer`` at ``path`` atomically: a reader sees the old file or the new one, never a torn one."""
    parent = path.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f".{path.name}.{uuid.uuid4().hex[:12]}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # the umask applies, as for any file
    try:
        try:
            os.write(fd, pointer.to_json())
            os.fsync(fd)  # the bytes are on disk before the name is
        finally:
            os.close(fd)
        os.replace(tmp, path)  # over a symlink, replaces the link, not its target
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    layout.fsync_dir(parent)  # the rename itself survives a crash


def write_pointer(path: str | os.PathLike[str], job: str, step: int | None = None,
                  socket: str | os.PathLike[str] | None = None) -> Pointer:
    """Makes ``path`` a checkpoint Lightning can load: a pointer to ``step`` of ``job`` (newest complete if None).

    The reverse of what the plug-in does on save, for a step saved another
    way (``Client.save``, another framework): ``write_pointer("ckpts/last.ckpt",
    "run3")`` then ``trainer.fit(model, ckpt_path="ckpts/last.ckpt")``. The
    state must be a Lightning checkpoint dict (``state_dict``, ``loops``,
    ``optimizer_states``, ...). Raises ``CheckpointNotFound`` if the daemon
    has no such complete step.
    """
    target = _local_path(path)
    with Client(job, socket=socket, rank=0, world_size=1) as client:
        complete = {c.step for c in client.list() if c.complete}
        if step is None:
            if not complete:
                raise errors.CheckpointNotFound(f"job {job!r} has no complete step to point {target} at")
            step = max(complete)
        elif step not in complete:
            raise errors.CheckpointNotFound(f"job {job!r} has no complete step {step} (complete steps: "
                                            f"{sorted(complete)[-10:]}); {target} not written")
    pointer = Pointer(layout.check_job(job), layout.check_step(step))
    _write_pointer_file(target, pointer)
    return pointer


def list_pointers(directory: str | os.PathLike[str]) -> dict[Path, Pointer]:
    """Every pointer file in ``directory`` (symlinks followed; not recursive), by path."""
    out: dict[Path, Pointer] = {}
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return out
    for entry in entries:
        if entry.name.startswith("."):
            continue  # our own temporaries, hidden files
        try:
            if not entry.is_file() or entry.stat().st_size > _MAX_POINTER_BYTES:
                continue
            pointer = read_pointer(entry.path)
        except (OSError, PointerError):
            continue  # vanished meanwhile, unreadable, a dangling link: names nothing
        if pointer is not None:
            out[Path(entry.path)] = pointer
    return out


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


# --- preemption -----------------------------------------------------------------------


class PreemptionCheckpoint(OnExceptionCheckpoint):
    """Saves ``dirpath/filename.ckpt`` when Lightning stops ``fit`` on SIGTERM (see "Preemption" above).

    Only on ``SIGTERMException``: Lightning raises it at the end of a training
    batch, where the state is whole. Any other exception may come from the
    middle of an optimizer step, so nothing is saved then (Lightning's own
    ``OnExceptionCheckpoint`` saves on every exception). Through
    :class:`CkptstageCheckpointIO` the save returns once the daemon holds the
    snapshot; the daemon commits it after the process ends.
    """

    def __init__(self, dirpath: str | os.PathLike[str], filename: str = "preempted") -> None:
        super().__init__(os.fspath(dirpath), filename)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            log.warning("ckptstage: SIGTERM: saving step %d as %s before Lightning stops", trainer.global_step,
                        self.ckpt_path)
            trainer.save_checkpoint(self.ckpt_path)


# --- the plug-in ----------------------------------------------------------------------


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
        if _is_remote(path) or _is_temporary(path):
            TorchCheckpointIO().save_checkpoint(checkpoint, path)
            return
        if self.job is None:
            raise ValueError(f"{type(self).__name__}(job=None) only loads; give it a job to save")
        self._raise_error()
        target = _local_path(path)
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
            superseded = _try_read_pointer(target)
            _write_pointer_file(target, Pointer(self.job, step))
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
        if _is_remote(path) or _is_temporary(path):
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
        if _is_remote(path) or _is_temporary(path):
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


# --- helpers --------------------------------------------------------------------------


def _is_remote(path: Any) -> bool:
    return "://" in str(path) and not str(path).startswith("file://")


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


def _local_path(path: Any) -> Path:
    if _is_remote(path):
        raise ValueError(f"ckptstage writes its checkpoint pointers to local (or mounted) paths, not {path}")
    return Path(str(path).removeprefix("file://")).absolute()


def _try_read_pointer(path: Path) -> Pointer | None:
    try:
        return read_pointer(path) if path.is_file() else None
    except (OSError, PointerError):
        return None


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
