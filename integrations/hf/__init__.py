"""``transformers.Trainer`` checkpoints through ckptstage: ``CkptstageCallback``.

Three lines in a training script::

    ckpt = CkptstageCallback(job="bert-ft-run3")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[ckpt])
    trainer.train(resume_from_checkpoint=ckpt.resume())

``resume()`` returns None when the job has no checkpoint yet (``train`` then
starts from scratch), so the same line serves the first launch and every
restart.

Saving
------
Wherever the Trainer would write ``output_dir/checkpoint-N`` (``save_strategy``
"steps" or "epoch"), the callback hands the same state to the node's daemon
with ``Client.save`` and waits only until the daemon holds the snapshot:
the model's ``state_dict()``, the optimizer's, the LR scheduler's, the AMP
grad scaler's, every process's RNG states (python, numpy, torch CPU, CUDA)
and the ``TrainerState`` as ``trainer_state.json`` would hold it. The Trainer
writes no directory of its own.

A callback cannot run code at the Trainer's save point, so the callback
clears ``control.should_save`` before the Trainer reads it and takes the
save at the first event after that point. The order of events in the
Trainer's loop (``_run_epoch`` and ``_maybe_log_save_evaluate``)::

    on_step_begin                       (C)
      forward, backward, optimizer.step, scheduler.step, global_step += 1
    on_step_end                         (A) DefaultFlowCallback has set should_save
    log:      on_log                    (B)
    evaluate: on_log, on_evaluate       (B) the eval loop has drawn from torch's RNG
              ReduceLROnPlateau.step; best_metric, best_global_step updated
    if should_save: _save_checkpoint    the Trainer's save point (skipped: A cleared the flag)
    the next step's batches are fetched
    on_step_begin                       (C)
    ...
    on_epoch_end                        (C) the epoch's last step; (A) for save_strategy="epoch"
    the same log / evaluate / save point
    on_epoch_begin, or on_log (final summary) then on_train_end       (C)

(A) at ``on_step_end`` / ``on_epoch_end`` (and ``on_log`` / ``on_evaluate``,
for a save another callback asks for there) a requested save is noted and
``should_save`` cleared. (B) at every event up to the save point the RNG
states are read again, so the last reading is the one the Trainer's
``rng_state.pth`` would hold. (C) the next ``on_step_begin``,
``on_epoch_begin``, ``on_epoch_end`` or ``on_train_end`` takes the save:
between the save point and (C) nothing touches the model, the optimizer,
the scheduler or the ``TrainerState``, and the scheduler's plateau step and
the best-metric update, which follow ``on_evaluate``, are in it; but
fetching the next batches may draw random numbers (a collator that masks
tokens), which is why the RNG states are those read at (B). At
``on_train_end`` the summary entry ``train()`` logged after the save point
is left out of the saved log history. The test suite checks the result
against the ``checkpoint-N`` directory the Trainer writes on its own, value
for value.

Rotation and the best checkpoint
--------------------------------
``save_total_limit`` is honoured as the Trainer honours it: after each save
the oldest steps of the job are deleted from the daemon (``Client.delete``),
keeping the newest and the best. One difference, for safety: until the new
step is committed, the newest committed step is kept too (the Trainer
rotates only after its write finished), so a run may hold one step over the
limit until its next save; at ``on_train_end`` the limit is exact. The best
step is the Trainer's: ``state.best_global_step`` once that step is saved.
With ``load_best_model_at_end`` it is pinned (``Client.pin``, once committed;
the previous best is unpinned), and at ``on_train_end`` its weights are
loaded into the model from the daemon (the Trainer's own loader would look
for a directory). The pin outlives the run; ``ckptstage unpin JOB STEP``
releases it.

Resuming
--------
The Trainer derives the epoch, the batches to skip and the moment to restore
the RNG states from a checkpoint directory, and that logic is subtle (it
restores the RNG states only after fetching the first batch of a resumed
epoch). Rather than re-implement it, ``resume()`` loads the step from the
daemon and writes a small directory for the Trainer's own resume (on
/dev/shm when it has room): ``trainer_state.json``, the RNG file(s), and the
model's weights (``pytorch_model.bin``: the Trainer insists on finding them,
and loads them before it wraps the model). The optimizer, scheduler and
scaler states, two thirds of an Adam checkpoint, are not serialised again:
the callback loads them in place at ``on_train_begin``, where the Trainer
has just created them (and refuses to go on if ``train`` was not given the
directory: the optimizer would silently start over). The directory goes
once the Trainer has read it: the weights at ``on_train_begin``, the rest
at the first step. Losses after the resume are bit-identical to an
uninterrupted run's.

``resume()`` takes the newest step that is committed; a save the daemon is
still persisting when the new process asks is not waited for.

Preemption
----------
The Trainer does nothing on SIGTERM: a node given notice (a spot instance,
a drain, SLURM before its time limit) kills it and the steps since the last
save are lost. The callback catches ``preemption_signals`` (default SIGTERM;
``()`` turns it off): the handler only records the signal, and at the end of
the step being trained (``on_step_end``) a save is asked for, taken like any
other at (C) and waited for until the daemon holds it; then the process ends
as the signal would have ended it without ckptstage: the handler installed
before ``train()`` runs, or the signal's default action kills the process
(exit status -15 for SIGTERM), or, when it was ignored, training goes on.
Under DDP the processes agree at each step end (one all-reduce of a flag),
so they save the same step, and a process the signal did not reach ends as
if it had. A step longer than the notice loses the step, not the run: the
previous save stays the newest.

Distributed data parallel (DDP under accelerate)
------------------------------------------------
Model and optimizer are replicated, so only the main process saves, through
``Client(job, world_size=1)`` (a step is complete with its one part); every
process gives its RNG states to it (a gather at each save). Every process
loads: ``resume()`` must be called on every process (it agrees on the step
collectively); the directory is shared by the processes of a node. DeepSpeed
and FSDP inside the Trainer are refused (their states are sharded).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import secrets
import shutil
import signal
import tempfile
import weakref
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import SaveStrategy
from transformers.utils import WEIGHTS_NAME

from ckptstage.client import CheckpointNotFound, Client, SaveHandle
from ckptstage.client.errors import StepPinned
from ckptstage.client.preemption import SignalLatch

__all__ = ["CkptstageCallback", "steps_to_rotate"]

log = logging.getLogger(__name__)

# Where resume() writes the directory the Trainer reads, when it has room: memory, not a disk.
_SHM = Path("/dev/shm")


def steps_to_rotate(steps: Collection[int], limit: int | None, protected: Collection[int]) -> list[int]:
    """The steps ``save_total_limit`` removes, oldest first: as the Trainer rotates its directories.

    At most ``limit`` steps are kept (no rotation when ``limit`` is None or
    below 1), never removing a ``protected`` one (the newest, the best), so
    more are kept when the protected ones alone exceed the limit.
    """
    if not limit or limit < 1:
        return []
    ordered = sorted(set(steps))
    keep = max(limit, len(set(protected) & set(ordered)))
    remove: list[int] = []
    left = len(ordered)
    for step in ordered:
        if left <= keep:
            break
        if step not in protected:
            remove.append(step)
            left -= 1
    return remove


@dataclass
class _Pending:
    """A save the Trainer asked for at ``step``, to be taken at the next event (see the module docstring)."""

    step: int
    rng: dict[str, Any]           # this process's RNG states, as read at the last event before the save point
    control: dict[str, Any]       # TrainerControl.state() as the Trainer would have saved it


@dataclass
class _Restore:
    """A step ``resume()`` loaded, waiting for the Trainer to create what it restores into."""

    step: int
    directory: Path
    owner: bool                   # this process wrote the directory's shared files and removes them
    optimizer: Any = None
    scheduler: Any = None
    scaler: Any = None


class CkptstageCallback(TrainerCallback):
    """Saves the Trainer's checkpoints to the node's ``ckptstaged`` and resumes from them.

    ``job`` names the run (the checkpoints' directory on each tier);
    ``socket`` is the daemon's (``$CKPTSTAGE_SOCKET`` or its default path
    when None); ``connect_timeout`` is how long to wait for a daemon that is
    still starting. The shared memory a save copies into is prepared in
    the background after the first training step, sized for the model and
    optimizer then (or for the job's last checkpoint on a resume), so that
    the first save blocks no longer than the others; ``arena_bytes``
    allocates it when the client connects (``on_train_begin``) instead. See the module docstring for what is saved,
    when, and how ``resume()`` works.

    ``preemption_signals`` (default SIGTERM): on one of them the step being
    trained is saved at its end, then the process ends as the signal would
    have ended it (see "Preemption" in the module docstring); ``()`` turns
    this off.
    """

    def __init__(self, job: str, socket: str | os.PathLike[str] | None = None, *,
                 arena_bytes: int | None = None, connect_timeout: float = 30.0,
                 preemption_signals: Sequence[int] = (signal.SIGTERM,)) -> None:
        self.job = job
        self.preemption_signals = tuple(preemption_signals)
        self._latch: SignalLatch | None = None
        self._stopping = False                 # a signal came: the save at the step's end is the last
        self.socket = socket
        self.arena_bytes = arena_bytes
        self.connect_timeout = connect_timeout
        self.best_step: int | None = None      # the best checkpoint's step (see "Rotation" above)
        self._client: Client | None = None
        self._pending: _Pending | None = None
        self._last: SaveHandle | None = None   # the newest save of this process
        self._unpinned_best: tuple[int, SaveHandle] | None = None  # a new best to pin once committed
        self._restore: _Restore | None = None
        self._cleanup: weakref.finalize | None = None
        self._eval_metrics: tuple[int, dict[str, float]] = (-1, {})
        self._warned_trainer_saved = False

    # --- resuming ---------------------------------------------------------------------

    def resume(self, step: int | None = None, *, required: bool = False) -> str | None:
        """Prepares ``trainer.train(resume_from_checkpoint=...)`` from the job's ``step`` (newest when None).

        Returns the directory to pass to ``train``, or None when the job has
        no complete checkpoint (``train`` then starts from scratch) unless
        ``required``: then :class:`CheckpointNotFound` says so, as it does for
        a ``step`` the job does not have. Call it on every process of a
        distributed run, after the Trainer is built (with this callback) and
        right before ``train``.
        """
        client = self._get_client()
        if step is None:
            step = client.latest()
            if step is None:
                if required:
                    raise CheckpointNotFound(f"job {self.job!r} has no complete checkpoint to resume from "
                                             "on this node's daemon or its shared tier")
                log.info("ckptstage: job %r has no checkpoint yet; training starts from scratch", self.job)
                return None
        state = client.load(step)
        self._discard_restore()
        directory, owner = _resume_directory(self.job, step, _weights_bytes(state["model"]))
        rank, world = _process_index_and_count()
        if owner:
            (directory / TRAINER_STATE_NAME).write_bytes(_as_bytes(state["trainer_state"]))
            torch.save(state["model"], directory / WEIGHTS_NAME)
        rngs = state.get("rng") or []
        if rank < len(rngs):
            torch.save(rngs[rank], directory / ("rng_state.pth" if world == 1 else f"rng_state_{rank}.pth"))
        elif rngs:
            log.warning("ckptstage: step %d holds RNG states of %d processes, this is process %d: its random "
                        "numbers will not continue the saved run's", step, len(rngs), rank)
        _barrier()  # every process's files are written before any Trainer reads the directory
        self._restore = _Restore(step, directory, owner, state.get("optimizer"), state.get("scheduler"),
                                 state.get("scaler"))
        self.best_step = state.get("best_step")
        self._cleanup = weakref.finalize(self, shutil.rmtree, directory, True) if owner else None
        log.info("ckptstage: resuming job %r from step %d (files for the Trainer in %s)", self.job, step, directory)
        return str(directory)

    # --- Trainer events -----------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        _check_supported(args)
        if state.is_world_process_zero:
            self._get_client()  # the saving process: a daemon that cannot be reached fails the run now
        self._watch_signals()
        self._pending, self._last, self._unpinned_best = None, None, None
        self._prepared = False
        restore = self._restore
        if restore is None:
            self.best_step = None
            return
        if self.best_step is not None and args.load_best_model_at_end and state.is_world_process_zero:
            # The run that saved it may have died before pinning it (a pin waits for the commit).
            try:
                self._get_client().pin(self.best_step)
            except CheckpointNotFound:
                log.warning("ckptstage: the best step %d of %r is gone; the best is tracked anew",
                            self.best_step, self.job)
                self.best_step = None
        if state.global_step != restore.step:
            raise RuntimeError(f"ckptstage: resume() prepared step {restore.step} of job {self.job!r}, but the "
                               f"Trainer starts at step {state.global_step}: pass what resume() returned to "
                               "trainer.train(resume_from_checkpoint=...)")
        optimizer, scheduler = kwargs.get("optimizer"), kwargs.get("lr_scheduler")
        if restore.optimizer is not None and optimizer is not None:
            optimizer.load_state_dict(restore.optimizer)
        if restore.scheduler is not None and scheduler is not None:
            scheduler.load_state_dict(restore.scheduler)
        scaler = getattr(optimizer, "scaler", None)
        if restore.scaler is not None and scaler is not None:
            scaler.load_state_dict(restore.scaler)
        restore.optimizer = restore.scheduler = restore.scaler = None
        _barrier()  # every process has loaded the weights: the largest file can go now
        if restore.owner:
            (restore.directory / WEIGHTS_NAME).unlink(missing_ok=True)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        self._take_pending(args, state, kwargs)
        if self._restore is not None:  # the Trainer has restored its RNG states from the directory by now
            self._discard_restore(collective=True)

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self._take_pending(args, state, kwargs)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if not self._prepared and state.is_world_process_zero:
            # The optimizer holds its state from the first step on: the arena is sized for a save now,
            # in the background, so that the first save blocks no longer than the others.
            self._prepared = True
            model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
            if self.arena_bytes is None and model is not None:
                self._get_client().prepare({"model": model.state_dict(),
                                            "optimizer": optimizer.state_dict() if optimizer is not None else None})
        signalled = self._latch is not None and self._latch.received is not None
        if self.preemption_signals and _any_process(args, signalled):
            self._stopping = True
            control.should_save = True  # taken over just below, as any save
        self._intercept(state, control)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._take_pending(args, state, kwargs)  # the epoch's last step's save, past its save point
        self._intercept(state, control)          # save_strategy="epoch"

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               **kwargs: Any) -> None:
        self._intercept(state, control)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    metrics: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self._eval_metrics = (state.global_step, {k: float(v) for k, v in (metrics or {}).items()
                                                  if isinstance(v, (int, float)) and not isinstance(v, bool)})
        self._intercept(state, control)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        if not self._warned_trainer_saved:
            self._warned_trainer_saved = True
            log.warning("ckptstage: the Trainer wrote checkpoint-%d itself: a callback after CkptstageCallback "
                        "asked for that save; put CkptstageCallback last in callbacks=[...]", state.global_step)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        # train() logged its summary after the last save point: it is not part of that checkpoint.
        self._take_pending(args, state, kwargs, history_end=-1)
        if state.is_world_process_zero and self._last is not None:
            self._last.wait("local")  # the final rotation counts it as committed
            self._settle_best_pin()
            self._rotate(args, self._last.step)
            if args.save_total_limit == 1 and self.best_step is not None:
                # As the Trainer's end of training: with a limit of 1 only the best step stays.
                for step in sorted({c.step for c in self._get_client().list()} - {self.best_step}):
                    self._delete(step)
        if args.load_best_model_at_end and self.best_step is not None and kwargs.get("model") is not None:
            best = self._get_client().load(self.best_step)["model"]
            kwargs["model"].load_state_dict(best)
            log.info("ckptstage: loaded the best model, step %d (%s %s)", self.best_step,
                     args.metric_for_best_model, state.best_metric)
        self._discard_restore(collective=True)
        self._unwatch_signals()

    def close(self) -> None:
        """Ends this process's session with the daemon (saves already snapshotted still commit)."""
        self._unwatch_signals()
        self._discard_restore()
        if self._client is not None:
            self._client.close()
            self._client = None

    # --- saving -------------------------------------------------------------------------

    def _intercept(self, state: TrainerState, control: TrainerControl) -> None:
        """(A) and (B) of the module docstring: takes over a save request; reads the RNG states again."""
        if control.should_save:
            control.should_save = False
            self._pending = _Pending(state.global_step, {}, {})
        if self._pending is not None and self._pending.step == state.global_step:
            self._pending.rng = _rng_states()
            control_state = control.state()
            control_state["args"]["should_save"] = True  # what the Trainer's own save records
            self._pending.control = control_state

    def _take_pending(self, args: TrainingArguments, state: TrainerState, kwargs: Mapping[str, Any],
                      history_end: int | None = None) -> None:
        """(C): takes the save noted at (A), if any."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            self._save_pending(pending, args, state, kwargs, history_end)
        finally:
            if self._stopping:
                self._end_for_preemption(pending.step)

    def _save_pending(self, pending: _Pending, args: TrainingArguments, state: TrainerState,
                      kwargs: Mapping[str, Any], history_end: int | None) -> None:
        rngs = _gather(pending.rng)
        if not state.is_world_process_zero:
            return  # replicated state: the main process saves it (see the module docstring)
        model, optimizer, scheduler = kwargs.get("model"), kwargs.get("optimizer"), kwargs.get("lr_scheduler")
        if model is None:
            raise RuntimeError("ckptstage: the Trainer passed no model to its callbacks; nothing to save")
        new_best = state.best_global_step is not None and state.best_global_step == pending.step
        ckpt: dict[str, Any] = {
            "model": model.state_dict(),
            "trainer_state": _trainer_state_bytes(state, pending.control, history_end),
            "best_step": pending.step if new_best else self.best_step,
        }
        if not args.save_only_model:
            ckpt["optimizer"] = optimizer.state_dict() if optimizer is not None else None
            ckpt["scheduler"] = scheduler.state_dict() if scheduler is not None else None
            scaler = getattr(optimizer, "scaler", None)
            ckpt["scaler"] = scaler.state_dict() if scaler is not None else None
            ckpt["rng"] = rngs
        step_of_metrics, metrics = self._eval_metrics
        client = self._get_client()
        self._settle_best_pin()
        handle = client.save(pending.step, ckpt, metrics if step_of_metrics == pending.step else None,
                             overwrite=True)
        handle.wait_snapshot()
        self._last = handle
        if new_best and pending.step != self.best_step:
            if args.load_best_model_at_end:
                if self.best_step is not None:
                    client.unpin(self.best_step)
                self._unpinned_best = (pending.step, handle)  # pinned once committed (a pin needs the step)
            self.best_step = pending.step
        self._rotate(args, pending.step)

    def _settle_best_pin(self) -> None:
        """Pins the best step saved earlier, now committed (a previous save has, by the next one)."""
        if self._unpinned_best is None:
            return
        step, handle = self._unpinned_best
        handle.wait("local")
        self._get_client().pin(step)
        self._unpinned_best = None

    def _rotate(self, args: TrainingArguments, newest: int) -> None:
        if not args.save_total_limit or args.save_total_limit < 1:
            return
        infos = self._get_client().list()
        committed = [c.step for c in infos if c.complete]
        protected = {newest} | ({max(committed)} if committed else set())
        if self.best_step is not None:
            protected.add(self.best_step)
        for step in steps_to_rotate({c.step for c in infos} | {newest}, args.save_total_limit, protected):
            self._delete(step)

    def _delete(self, step: int) -> None:
        try:
            self._get_client().delete(step)
        except StepPinned:
            log.info("ckptstage: step %d of %r is pinned; save_total_limit leaves it", step, self.job)
        except CheckpointNotFound:
            pass  # already gone (the daemon's own retention, or another node's deletion)

    # --- preemption ---------------------------------------------------------------------

    def _watch_signals(self) -> None:
        self._unwatch_signals()
        self._stopping = False
        if not self.preemption_signals:
            return
        try:
            self._latch = SignalLatch(self.preemption_signals)
        except RuntimeError as e:  # not the main thread: the Trainer runs without the last save
            log.warning("ckptstage: no save on preemption: %s", e)

    def _unwatch_signals(self) -> None:
        latch, self._latch = self._latch, None
        if latch is not None:
            latch.close()

    def _end_for_preemption(self, step: int) -> None:
        """After the save of the step a signal interrupted: every process ends as the signal says."""
        self._stopping = False
        latch = self._latch
        log.warning("ckptstage: preempted: step %d is with the daemon; ending as the signal says", step)
        _barrier()  # the main process's snapshot is with the daemon before any process ends
        if latch is not None:
            latch.finish()  # a process the signal did not reach ends as if it had (the first of the signals)

    # --- plumbing -----------------------------------------------------------------------

    def _get_client(self) -> Client:
        if self._client is None:
            # world_size=1: only the main process saves; every process may load (see the module docstring).
            saver = _process_index_and_count()[0] == 0
            self._client = Client(self.job, socket=self.socket, world_size=1,
                                  arena_bytes=self.arena_bytes if saver else 0,
                                  connect_timeout=self.connect_timeout)
        return self._client

    def _discard_restore(self, collective: bool = False) -> None:
        restore, self._restore = self._restore, None
        if restore is None:
            return
        if collective:
            _barrier()  # every process has read its RNG file
        if self._cleanup is not None:
            self._cleanup()
            self._cleanup = None


def _check_supported(args: TrainingArguments) -> None:
    if args.save_strategy == SaveStrategy.BEST:
        raise ValueError("ckptstage: save_strategy='best' decides to save after the last callback event "
                         "before the save: use save_strategy='steps' or 'epoch' with load_best_model_at_end=True")
    if args.deepspeed or args.fsdp:
        raise ValueError("ckptstage: DeepSpeed and FSDP shard the model and optimizer inside the Trainer; "
                         "CkptstageCallback saves replicated state only (single process or DDP)")


def _rng_states() -> dict[str, Any]:
    """This process's RNG states, as the Trainer's ``rng_state.pth`` holds them."""
    states: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                              "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        states["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
    return states


def _trainer_state_bytes(state: TrainerState, control: Mapping[str, Any], history_end: int | None) -> torch.Tensor:
    """``trainer_state.json`` as the Trainer writes it at a save, as a byte tensor (it grows with the log)."""
    fields = dataclasses.asdict(state)
    if history_end is not None:
        fields["log_history"] = fields["log_history"][:history_end]
    fields["best_model_checkpoint"] = None  # no directory: the best step is ckptstage's ("best_step")
    callbacks = dict(fields.get("stateful_callbacks") or {})
    if "TrainerControl" in callbacks:
        callbacks["TrainerControl"] = dict(control)
    fields["stateful_callbacks"] = callbacks
    text = json.dumps(fields, indent=2, sort_keys=True) + "\n"
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


def _weights_bytes(model_state: Mapping[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in model_state.values() if isinstance(t, torch.Tensor))


def _process_index_and_count() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _any_process(args: TrainingArguments, flag: bool) -> bool:
    """Whether ``flag`` is set on any process (collective under torch.distributed: one small all-reduce)."""
    if _process_index_and_count()[1] == 1:
        return flag
    t = torch.tensor([int(flag)], device=args.device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _gather(obj: Any) -> list[Any]:
    """Every process's ``obj``, by process index (collective under torch.distributed)."""
    _, world = _process_index_and_count()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    torch.distributed.all_gather_object(out, obj)
    return out


def _resume_directory(job: str, step: int, weights_bytes: int) -> tuple[Path, bool]:
    """The directory the Trainer resumes from, one per node; (it, whether this process writes its shared files).

    On /dev/shm when it has room for the weights (memory, removed once read),
    else the system's temporary directory. The main process picks it (a new
    name each time: a directory left by a killed run is never reused); on
    each node the first process to claim it writes the files that every
    process there reads.
    """
    want = weights_bytes + (64 << 20)
    base = _SHM if _SHM.is_dir() and os.access(_SHM, os.W_OK) and shutil.disk_usage(_SHM).free > want \
        else Path(tempfile.gettempdir())
    path = [str(base / f"ckptstage-resume-{job}-{step}-{secrets.token_hex(4)}")]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(path, src=0)
    directory = Path(path[0])
    directory.mkdir(mode=0o700, exist_ok=True)
    try:
        os.close(os.open(directory / ".writer", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return directory, True
    except FileExistsError:
        return directory, False

