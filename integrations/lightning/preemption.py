"""Lightning's SIGTERM stop as a checkpoint: the callback that saves the state at that safe point."""

from __future__ import annotations

import logging
import os
from typing import Any

from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)


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
