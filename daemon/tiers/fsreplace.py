"""Replacing a committed step on the file-system tier: assembled in the temporaries, then exchanged with the step.

A replacement is assembled in ``.tmp/<owner>/replace/<job>/step-N/rank-R/``;
once whole, its commit record is written there and the directory is
exchanged with ``<job>/step-N``: one ``renameat2(RENAME_EXCHANGE)`` where the
file system has it, else two renames (the old step out, the new one in),
which is the crash window :meth:`FsReplacing.recover_staged` closes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import shutil
import uuid
from pathlib import Path

from ckptstage.daemon import fsutil
from ckptstage.daemon.logs import fields
from ckptstage.daemon.tiers.fswalk import subdirs, subdirs_or_none
from ckptstage.protos import layout

log = logging.getLogger(__name__)

REPLACE_DIR = "replace"  # .tmp/<owner>/replace/<job>/step-N/: replacements being assembled (overwrite.py)
_RENAME_EXCHANGE = 2  # linux/fs.h


class FsReplacing:
    """The replacements of steps of the tier at ``root`` that the daemon ``owner`` assembles."""

    def __init__(self, root: Path, owner: str) -> None:
        self._root = root
        self._owner = owner

    def staged_step(self, job: str, step: int) -> Path:
        """Where this daemon assembles the replacement of a step."""
        return layout.tmp_root(self._root, self._owner) / REPLACE_DIR / layout.check_job(job) / \
            layout.step_dirname(step)

    def staged_location(self, job: str, step: int, rank: int) -> Path:
        return self.staged_step(job, step) / layout.rank_dirname(rank)

    def list_staged(self, job: str, step: int) -> list[layout.PartRef]:
        found = []
        for entry in subdirs(self.staged_step(job, step)):
            rank = layout.parse_rank_dirname(entry.name)
            if rank is not None and (entry / layout.MANIFEST_FILE).is_file():
                found.append(layout.PartRef(job, step, rank, entry, fsutil.inode(entry)))
        return sorted(found, key=lambda ref: ref.rank)

    def swap_in(self, record: layout.CommitRecord) -> bool:
        staged = self.staged_step(record.job, record.step)
        final = layout.step_dir(self._root, record.job, record.step)
        if not staged.is_dir():
            return False
        fsutil.write_file_durable(staged / layout.COMMIT_FILE, layout.commit_record_bytes(record))
        fsutil.fsync_dir(staged)
        fsutil.makedirs_durable(final.parent, within=self._root)
        old = self._exchange(staged, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return True

    def _exchange(self, staged: Path, final: Path) -> Path | None:
        """Swaps ``staged`` in at ``final``; returns where the old step now is (None: there was none)."""
        if not final.exists():
            os.rename(staged, final)
            fsutil.fsync_dir(final.parent)
            return None
        trash = layout.tmp_root(self._root, self._owner) / f"del.{uuid.uuid4().hex[:12]}"
        if _rename_exchange(staged, final):
            fsutil.fsync_dir(final.parent)
            fsutil.fsync_dir(staged.parent)
            os.rename(staged, trash)  # the old step, out of the replace area (recover_staged() must not see it)
            return trash
        # No atomic exchange here (e.g. NFS): old out, new in. A crash between the two is what
        # recover_staged() undoes.
        os.rename(final, trash)
        os.rename(staged, final)
        fsutil.fsync_dir(final.parent)
        return trash

    def recover_staged(self) -> int:
        root = layout.tmp_root(self._root, self._owner) / REPLACE_DIR
        done = 0
        for job_dir in subdirs_or_none(root) if not root.is_symlink() else []:
            for sdir in subdirs_or_none(job_dir):
                step = layout.parse_step_dirname(sdir.name)
                if step is None or not (sdir / layout.COMMIT_FILE).is_file():
                    continue
                final = layout.step_dir(self._root, job_dir.name, step)
                if final.exists():
                    continue
                try:
                    layout.read_commit_record(sdir)
                    fsutil.makedirs_durable(final.parent, within=self._root)
                    os.rename(sdir, final)
                    fsutil.fsync_dir(final.parent)
                except (OSError, layout.ManifestError) as e:
                    log.error("cannot finish the replacement of %s step %d on %s: %s", job_dir.name, step,
                              self._root, e, extra=fields(job=job_dir.name, step=step, path=self._root, error=e))
                    continue
                log.info("finished the replacement of %s step %d on %s that a crash interrupted", job_dir.name,
                         step, self._root, extra=fields(job=job_dir.name, step=step, path=self._root))
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
