"""Checkpoint pointer files: the small JSON file Lightning sees where a checkpoint would be, naming a ckptstage step.

Written atomically and read back by :class:`~ckptstage.lightning.CkptstageCheckpointIO`; usable on their
own to point Lightning at a step saved another way (:func:`write_pointer`).
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptstage.client import Client, errors
from ckptstage.protos import layout

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



def write_pointer_file(path: Path, pointer: Pointer) -> None:
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
    target = local_path(path)
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
    write_pointer_file(target, pointer)
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


def local_path(path: Any) -> Path:
    if is_remote(path):
        raise ValueError(f"ckptstage writes its checkpoint pointers to local (or mounted) paths, not {path}")
    return Path(str(path).removeprefix("file://")).absolute()


def try_read_pointer(path: Path) -> Pointer | None:
    try:
        return read_pointer(path) if path.is_file() else None
    except (OSError, PointerError):
        return None


def is_remote(path: Any) -> bool:
    return "://" in str(path) and not str(path).startswith("file://")
