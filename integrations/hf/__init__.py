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

from ckptstage.hf.callback import CkptstageCallback
from ckptstage.hf.rotation import steps_to_rotate

__all__ = ["CkptstageCallback", "steps_to_rotate"]
