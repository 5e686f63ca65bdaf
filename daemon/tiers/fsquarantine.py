"""Copies moved aside as corrupt on a file-system tier: moving them, listing them, removing them.

A part goes to ``<job>/step-N/.corrupt-rank-RRRRR-<random>/`` beside where
it was, a chunk to ``<job>/chunks/.corrupt/<name>-<random>``: out of every
listing and out of the chunk store, kept for forensics until retention
removes it (:mod:`ckptstage.daemon.catalog.quarantine`). When a copy was
moved aside is its inode's change time, which the rename sets.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from pathlib import Path

from ckptstage.daemon.tierpath import check_contained
from ckptstage.daemon.tiers.fswalk import subdirs_or_none
from ckptstage.daemon.tiers.interface import QuarantinedCopy
from ckptstage.protos import chunks, layout, packs


def quarantine_part(part: Path) -> Path:
    target = part.parent / f"{layout.CORRUPT_PREFIX}{part.name}-{uuid.uuid4().hex[:6]}"
    os.rename(part, target)
    return target


def quarantine_chunk(location: Path) -> Path | None:
    target = chunks.corrupt_location(location)
    if target is None:
        return None
    target.parent.mkdir(exist_ok=True)
    os.rename(location, target)
    return target


def list_quarantined(root: Path) -> list[QuarantinedCopy]:
    found = []
    for job_dir in subdirs_or_none(root):
        for step_dir in subdirs_or_none(job_dir):
            step = layout.parse_step_dirname(step_dir.name)
            for entry in subdirs_or_none(step_dir, prefix=layout.CORRUPT_PREFIX) if step is not None else ():
                rank = layout.parse_corrupt_dirname(entry.name)
                if rank is not None:
                    found += _copy(job_dir.name, step, rank, entry)
        try:
            names = os.listdir(job_dir / chunks.CHUNKS_DIR / chunks.CORRUPT_DIR)
        except OSError:
            continue
        for name in names:
            chunk = chunks.corrupt_chunk_name(name) or (name if packs.is_pack_file(name) else None)
            if chunk is not None:
                found += _copy(job_dir.name, None, None, job_dir / chunks.CHUNKS_DIR / chunks.CORRUPT_DIR / name,
                               chunk)
    return found


def delete_quarantined(root: Path, location: Path) -> int:
    """Removes a copy :func:`list_quarantined` lists, and the step directory it leaves empty; returns the
    bytes it held. Refuses (ValueError) any other path."""
    part = layout.parse_corrupt_dirname(location.name) is not None and \
        layout.parse_step_dirname(location.parent.name) is not None
    chunk = (chunks.corrupt_chunk_name(location.name) is not None or packs.is_pack_file(location.name)) and \
        location.parent.name == chunks.CORRUPT_DIR and location.parent.parent.name == chunks.CHUNKS_DIR
    if not (part or chunk):
        raise ValueError(f"{location} is not a copy moved aside as corrupt")
    check_contained(root, location)
    nbytes = _size(location)
    if part:
        shutil.rmtree(location)
        try:
            location.parent.rmdir()  # the step's directory, when its parts and record went before
        except OSError:
            pass
    else:
        location.unlink()
        if packs.is_pack_file(location.name):  # its index went aside with it
            packs.index_beside(location).unlink(missing_ok=True)
    return nbytes


def _copy(job: str, step: int | None, rank: int | None, entry: Path, chunk: str = "") -> list[QuarantinedCopy]:
    """The copy at ``entry`` as listed (none when it went meanwhile)."""
    try:
        since = os.lstat(entry).st_ctime
        nbytes = _size(entry)
    except FileNotFoundError:
        return []
    return [QuarantinedCopy(job, step, rank, entry, nbytes, since, chunk)]


def _size(path: Path) -> int:
    st = os.lstat(path)
    if not os.path.isdir(path):
        return st.st_size
    total = 0
    for parent, _, names in os.walk(path, onerror=_raise):
        for name in names:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except FileNotFoundError:
                pass
    return total


def _raise(e: OSError) -> None:
    if e.errno != errno.ENOENT:
        raise e
