"""What ``resume()`` hands the Trainer: a directory with the files it restores from, and the states it loads later.

The Trainer resumes from a directory (``trainer_state.json``, the weights, each process's RNG file); the
optimizer, scheduler and scaler states wait in :class:`Restore` until the Trainer has built what they load into.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.trainer import TRAINER_STATE_NAME
from transformers.utils import WEIGHTS_NAME

from ckptstage.hf.processes import barrier, process_index_and_count

log = logging.getLogger(__name__)

# Where resume() writes the directory the Trainer reads, when it has room: memory, not a disk.
_SHM = Path("/dev/shm")


@dataclass
class Restore:
    """A step ``resume()`` loaded, waiting for the Trainer to create what it restores into."""

    step: int
    directory: Path
    owner: bool                   # this process wrote the directory's shared files and removes them
    optimizer: Any = None
    scheduler: Any = None
    scaler: Any = None

    def load_into(self, optimizer: Any, scheduler: Any) -> None:
        """Loads the saved optimizer, scheduler and scaler states into the Trainer's, then lets go of them."""
        if self.optimizer is not None and optimizer is not None:
            optimizer.load_state_dict(self.optimizer)
        if self.scheduler is not None and scheduler is not None:
            scheduler.load_state_dict(self.scheduler)
        scaler = getattr(optimizer, "scaler", None)
        if self.scaler is not None and scaler is not None:
            scaler.load_state_dict(self.scaler)
        self.optimizer = self.scheduler = self.scaler = None


def write_directory(job: str, step: int, state: dict[str, Any]) -> Restore:
    """The directory the Trainer resumes ``step`` of ``job`` from, written from the loaded ``state`` (collective)."""
    directory, owner = resume_directory(job, step, _weights_bytes(state["model"]))
    rank, world = process_index_and_count()
    if owner:
        (directory / TRAINER_STATE_NAME).write_bytes(_as_bytes(state["trainer_state"]))
        torch.save(state["model"], directory / WEIGHTS_NAME)
    rngs = state.get("rng") or []
    if rank < len(rngs):
        torch.save(rngs[rank], directory / ("rng_state.pth" if world == 1 else f"rng_state_{rank}.pth"))
    elif rngs:
        log.warning("ckptstage: step %d holds RNG states of %d processes, this is process %d: its random "
                    "numbers will not continue the saved run's", step, len(rngs), rank)
    barrier()  # every process's files are written before any Trainer reads the directory
    return Restore(step, directory, owner, state.get("optimizer"), state.get("scheduler"), state.get("scaler"))


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


def _weights_bytes(model_state: Mapping[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in model_state.values() if isinstance(t, torch.Tensor))


def resume_directory(job: str, step: int, weights_bytes: int) -> tuple[Path, bool]:
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

