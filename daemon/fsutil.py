"""Durable file-system primitives: fsync of directories and the part commit.

Every committed part goes through :class:`PartWriter`, so invariant 1
(nothing torn is ever visible) is implemented in exactly one place.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from ckptstage.protos import layout


def fsync_dir(path: Path) -> None:
    """Makes a directory's entries (creations, renames, unlinks) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durable(path: Path) -> None:
    """``mkdir -p`` that fsyncs the parent of every directory it creates."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        fsync_dir(d.parent)


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """``pwrite`` until every byte is written (a write may be short)."""
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def write_file_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class PartWriter:
    """Writes one part under ``<tier>/.tmp`` and publishes it with one rename.

    Order (invariant 1): data files written and fsynced by the caller, then
    :meth:`commit` writes the manifest last, fsyncs it and the temporary
    directory, renames the directory into place and fsyncs the new parent.
    A crash anywhere before the rename leaves only a temporary, which the
    daemon removes on start.
    """

    def __init__(self, tier_dir: Path, owner: str, job: str, step: int, rank: int) -> None:
        self.final = layout.part_dir(tier_dir, job, step, rank)
        tmp_root = layout.tmp_root(tier_dir, owner)
        makedirs_durable(tmp_root)
        self.tmp = tmp_root / f"{job}.{step}.{rank}.{uuid.uuid4().hex[:12]}"
        self.tmp.mkdir()
        self._done = False

    def path(self, name: str) -> Path:
        return self.tmp / name

    def commit(self, manifest: dict[str, Any]) -> Path:
        if self.final.exists():
            raise FileExistsError(f"{self.final} is already committed")
        write_file_durable(self.tmp / layout.MANIFEST_FILE, layout.encode_manifest(manifest))
        fsync_dir(self.tmp)
        makedirs_durable(self.final.parent)
        os.rename(self.tmp, self.final)
        fsync_dir(self.final.parent)
        self._done = True
        return self.final

    def abort(self) -> None:
        if not self._done:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self._done = True


def remove_part(tier_dir: Path, owner: str, part: Path) -> None:
    """Deletes a committed part so that it vanishes at once, never half-deleted.

    The part is renamed into ``.tmp`` first (one atomic step that readers
    see), then removed; an emptied step directory is removed too.
    """
    trash = layout.tmp_root(tier_dir, owner) / f"del.{uuid.uuid4().hex[:12]}"
    makedirs_durable(trash.parent)
    os.rename(part, trash)
    try:
        fsync_dir(part.parent)
    except FileNotFoundError:
        pass  # another node's daemon removed the emptied step directory: nothing left to make durable
    shutil.rmtree(trash, ignore_errors=True)
    try:
        part.parent.rmdir()  # the step directory, when this was its last part
    except OSError:
        pass


def clean_temporaries(tier_dir: Path, owner: str) -> int:
    """Removes what a crash of this node's daemon left on a tier; returns how many entries."""
    root = layout.tmp_root(tier_dir, owner)
    if not root.is_dir():
        return 0
    count = 0
    for entry in root.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        count += 1
    return count


def read_json(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        return default


def write_json_atomic(path: Path, obj: Any) -> None:
    """Replaces a small JSON file atomically (write temp, fsync, rename, fsync dir)."""
    makedirs_durable(path.parent)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    write_file_durable(tmp, json.dumps(obj, sort_keys=True).encode())
    os.rename(tmp, path)
    fsync_dir(path.parent)
