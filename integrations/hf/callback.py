"""``CkptstageCallback``: the Trainer's saves taken over at its save points and sent to the node's daemon."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import SaveStrategy
from transformers.utils import WEIGHTS_NAME

from ckptstage.client import CheckpointNotFound, Client, SaveHandle
from ckptstage.client.errors import StepPinned
from ckptstage.client.preemption import SignalLatch
from ckptstage.hf import resume
from ckptstage.hf.checkpoint import Pending, rng_states, trainer_checkpoint
from ckptstage.hf.processes import any_process, barrier, gather, process_index_and_count
from ckptstage.hf.resume import Restore
from ckptstage.hf.rotation import steps_to_rotate

log = logging.getLogger(__name__)


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
        self._pending: Pending | None = None
        self._last: SaveHandle | None = None   # the newest save of this process
        self._unpinned_best: tuple[int, SaveHandle] | None = None  # a new best to pin once committed
        self._restore: Restore | None = None
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
        self._restore = resume.write_directory(self.job, step, state)
        directory = self._restore.directory
        self.best_step = state.get("best_step")
        self._cleanup = weakref.finalize(self, shutil.rmtree, directory, True) if self._restore.owner else None
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
        restore.load_into(kwargs.get("optimizer"), kwargs.get("lr_scheduler"))
        barrier()  # every process has loaded the weights: the largest file can go now
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
        if self.preemption_signals and any_process(args, signalled):
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
            self._pending = Pending(state.global_step, {}, {})
        if self._pending is not None and self._pending.step == state.global_step:
            self._pending.rng = rng_states()
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

    def _save_pending(self, pending: Pending, args: TrainingArguments, state: TrainerState,
                      kwargs: Mapping[str, Any], history_end: int | None) -> None:
        rngs = gather(pending.rng)
        if not state.is_world_process_zero:
            return  # replicated state: the main process saves it (see the module docstring)
        new_best = state.best_global_step is not None and state.best_global_step == pending.step
        ckpt = trainer_checkpoint(pending, args, state, kwargs, history_end, rngs,
                                  pending.step if new_best else self.best_step)
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
        barrier()  # the main process's snapshot is with the daemon before any process ends
        if latch is not None:
            latch.finish()  # a process the signal did not reach ends as if it had (the first of the signals)

    # --- plumbing -----------------------------------------------------------------------

    def _get_client(self) -> Client:
        if self._client is None:
            # world_size=1: only the main process saves; every process may load (see the module docstring).
            saver = process_index_and_count()[0] == 0
            self._client = Client(self.job, socket=self.socket, world_size=1,
                                  arena_bytes=self.arena_bytes if saver else 0,
                                  connect_timeout=self.connect_timeout)
        return self._client

    def _discard_restore(self, collective: bool = False) -> None:
        restore, self._restore = self._restore, None
        if restore is None:
            return
        if collective:
            barrier()  # every process has read its RNG file
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
