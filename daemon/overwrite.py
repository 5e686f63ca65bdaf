"""Replacing a committed step (``save(..., overwrite=True)``): the old step stays until the new one is whole.

A committed step is never written over in place. The replacement's parts
are committed on a tier into the daemon's own temporaries,

    <tier>/.tmp/<node>/replace/<job>/step-N/rank-R/...

and once every rank's part of the replacement is there, its commit record
is written into that directory and the directory is swapped with
``<tier>/<job>/step-N``: one ``renameat2(RENAME_EXCHANGE)`` where the file
system has it, else two renames (the old step out, the new one in). Then the
old step, now in the temporaries, is removed.

Crash safety follows from one rule applied on start, before temporaries are
removed (:func:`recover`): a staged step with a commit record becomes the
step only if ``<job>/step-N`` is absent (the crash fell between the two
renames); otherwise the step in place is the one that stays (the staged one
was never acknowledged as the step, or it is the old one swapped out). At
every point exactly one of the two is there after recovery.

Replacing needs the whole replacement on one daemon per tier: on the local
tier, every rank of the job saves through this daemon (a single-node job);
on the shared tier, this daemon drains every part of it (they are its local
parts). A step saved from several nodes cannot be replaced in place: delete
it, or save a new step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import shutil
import threading
import uuid
from pathlib import Path

from ckptstage.daemon import fsutil
from ckptstage.daemon.catalog import Catalog, Part, TierName
from ckptstage.daemon.logs import fields
from ckptstage.protos import layout

log = logging.getLogger(__name__)

_REPLACE_DIR = "replace"
_RENAME_EXCHANGE = 2  # linux/fs.h


def staged_step_dir(tier_dir: Path, owner: str, job: str, step: int) -> Path:
    """Where a replacement of (job, step) is assembled on a tier (inside this daemon's temporaries)."""
    return layout.tmp_root(tier_dir, owner) / _REPLACE_DIR / layout.check_job(job) / layout.step_dirname(step)


def staged_part_dir(tier_dir: Path, owner: str, job: str, step: int, rank: int) -> Path:
    return staged_step_dir(tier_dir, owner, job, step) / layout.rank_dirname(rank)


def is_staged(tier_dir: Path, owner: str, path: Path) -> bool:
    return path.is_relative_to(layout.tmp_root(tier_dir, owner) / _REPLACE_DIR)


def staged_parts(tier_dir: Path, owner: str, job: str, step: int, tier: TierName) -> list[Part]:
    """The replacement's parts committed so far on a tier (unreadable ones skipped)."""
    sdir = staged_step_dir(tier_dir, owner, job, step)
    if not sdir.is_dir():
        return []
    out = []
    for entry in sorted(sdir.iterdir()):
        rank = layout.parse_rank_dirname(entry.name)
        if rank is None or not (entry / layout.MANIFEST_FILE).is_file():
            continue
        try:
            out.append(Part.from_disk(layout.PartRef(job, step, rank, entry, fsutil.inode(entry)), tier))
        except (OSError, layout.ManifestError) as e:
            log.warning("ignoring the staged part %s: %s", entry, e,
                        extra=fields(job=job, step=step, rank=rank, tier=tier, error=e))
    return out


class Swapper:
    """Puts a whole staged replacement in place of a step on a tier, and tells the catalogue."""

    def __init__(self, catalog: Catalog, owner: str) -> None:
        self.catalog = catalog
        self.owner = owner
        self._lock = threading.Lock()  # one swap at a time: two threads may complete the same set

    def swap_in(self, tier: TierName, tier_dir: Path, record: layout.CommitRecord, parts: dict[int, Part]) -> list[Part]:
        """Writes ``record`` into the staged step, swaps it in, removes the old step; returns the new parts.

        ``parts`` are the staged parts ``record`` names (rank -> part).
        Returns [] when another thread swapped this replacement in already.
        """
        job, step = record.job, record.step
        staged = staged_step_dir(tier_dir, self.owner, job, step)
        final = layout.step_dir(tier_dir, job, step)
        with self._lock:
            if not staged.is_dir():
                return []
            fsutil.write_file_durable(staged / layout.COMMIT_FILE, layout.commit_record_bytes(record))
            fsutil.fsync_dir(staged)
            fsutil.makedirs_durable(final.parent, within=tier_dir)
            old = self._exchange(tier_dir, staged, final)
            moved = [Part(job, step, rank, part.world_size, tier, path, part.nbytes, part.created, part.metrics,
                          part.attempt, part.digest, fsutil.inode(path))
                     for rank, part in sorted(parts.items())
                     for path in [layout.part_dir(tier_dir, job, step, rank)]]
            self.catalog.replace_tier(tier, record, fsutil.inode(final / layout.COMMIT_FILE), moved)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        log.info("replaced %s step %d on the %s tier: %d ranks of attempt %r", job, step, tier.value,
                 record.world_size, record.attempt, extra=fields(job=job, step=step, tier=tier, attempt=record.attempt))
        return moved

    def _exchange(self, tier_dir: Path, staged: Path, final: Path) -> Path | None:
        """Swaps ``staged`` in at ``final``; returns where the old step now is (None: there was none)."""
        if not final.exists():
            os.rename(staged, final)
            fsutil.fsync_dir(final.parent)
            return None
        if _rename_exchange(staged, final):
            fsutil.fsync_dir(final.parent)
            fsutil.fsync_dir(staged.parent)
            trash = layout.tmp_root(tier_dir, self.owner) / f"del.{uuid.uuid4().hex[:12]}"
            os.rename(staged, trash)  # the old step, out of the replace area (recover() must not see it)
            return trash
        # No atomic exchange here (e.g. NFS): old out, new in. A crash between the two is what recover() undoes.
        trash = layout.tmp_root(tier_dir, self.owner) / f"del.{uuid.uuid4().hex[:12]}"
        os.rename(final, trash)
        os.rename(staged, final)
        fsutil.fsync_dir(final.parent)
        return trash


def recover(tier_dir: Path, owner: str) -> int:
    """Finishes replacements a crash cut short (see the module docstring); returns how many it put in place.

    Runs before the tier's temporaries are removed: whatever it does not
    move is removed with them.
    """
    root = layout.tmp_root(tier_dir, owner) / _REPLACE_DIR
    if not root.is_dir() or root.is_symlink():
        return 0
    done = 0
    for job_dir in root.iterdir():
        for sdir in job_dir.iterdir() if job_dir.is_dir() and not job_dir.is_symlink() else ():
            step = layout.parse_step_dirname(sdir.name)
            if step is None or not (sdir / layout.COMMIT_FILE).is_file():
                continue
            final = layout.step_dir(tier_dir, job_dir.name, step)
            if final.exists():
                continue
            try:
                layout.read_commit_record(sdir)
                fsutil.makedirs_durable(final.parent, within=tier_dir)
                os.rename(sdir, final)
                fsutil.fsync_dir(final.parent)
            except (OSError, layout.ManifestError) as e:
                log.error("cannot finish the replacement of %s step %d on %s: %s", job_dir.name, step, tier_dir, e,
                          extra=fields(job=job_dir.name, step=step, path=tier_dir, error=e))
                continue
            log.info("finished the replacement of %s step %d on %s that a crash interrupted", job_dir.name, step,
                     tier_dir, extra=fields(job=job_dir.name, step=step, path=tier_dir))
            done += 1
    return done


_libc: ctypes.CDLL | None = None


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically exchanges two paths (Linux ``renameat2``); False where the system or file system cannot."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = _libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, f"cannot exchange {a} and {b}: {os.strerror(err)}")
