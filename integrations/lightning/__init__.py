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

from ckptstage.lightning.checkpoint_io import CkptstageCheckpointIO, load
from ckptstage.lightning.pointers import (
    POINTER_FORMAT, Pointer, PointerError, list_pointers, read_pointer, write_pointer,
)
from ckptstage.lightning.preemption import PreemptionCheckpoint

__all__ = ["POINTER_FORMAT", "CkptstageCheckpointIO", "Pointer", "PointerError", "PreemptionCheckpoint",
           "list_pointers", "load", "read_pointer", "write_pointer"]
