"""The file-system tier: :class:`ckptstage.daemon.tiers.interface.Tier` on a directory (local SSD, or a parallel file system).

The layout is docs/FORMAT.md's, byte for byte: clients read parts straight
from these files. Publishing is a rename of a temporary directory under
``.tmp/<owner>/`` (:class:`fsutil.PartWriter`), a commit record is created
exactly once with ``link()``, deletion renames into ``.tmp`` first, and no
path below the root ever goes through a symbolic link
(:func:`tierpath.check_contained`).
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
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

from ckptstage.daemon import fsutil
from ckptstage.daemon.logs import fields
from ckptstage.daemon.tiers.interface import Manifest, PartWriter, QuarantinedCopy, Usage
from ckptstage.protos import chunks, layout

log = logging.getLogger(__name__)

SYNC_THREADS = 8  # fsyncs in flight at once when a batch of chunks is made durable
_REPLACE_DIR = "replace"  # .tmp/<owner>/replace/<job>/step-N/: replacements being assembled (overwrite.py)
_RENAME_EXCHANGE = 2  # linux/fs.h


class FsTier:
    """One directory tree holding checkpoints, as the daemon ``owner`` uses it.

    ``owner`` names this daemon's temporaries (``.tmp/<owner>/``); a tier
    used only to index (list and read) needs none.
    """

    def __init__(self, root: Path, owner: str = "") -> None:
        self._root = root
        self._owner = owner

    @property
    def root(self) -> Path:
        return self._root

    @property
    def location(self) -> str:
        return str(self._root)

    def name_of(self, location: Path) -> str:
        return str(location)

    @property
    def owner(self) -> str:
        return self._owner

    def __repr__(self) -> str:
        return f"FsTier({str(self._root)!r})"

    # --- the index ---------------------------------------------------------------------

    def list_jobs(self) -> list[str]:
        return layout.scan_jobs(self._root)

    def list_steps(self, job: str, step: int | None = None) -> Iterator[layout.StepRef]:
        return layout.scan_steps(self._root, job, step)

    def part_location(self, job: str, step: int, rank: int) -> Path:
        return layout.part_dir(self._root, job, step, rank)

    def step_location(self, job: str, step: int) -> Path:
        return layout.step_dir(self._root, job, step)

    def has_part(self, part: Path) -> bool:
        return part.exists()

    def part_version(self, part: Path) -> int:
        return fsutil.inode(part)

    def read_manifest(self, part: Path) -> tuple[Manifest, str]:
        return layout.read_manifest_and_digest(part)

    def has_commit_record(self, step: Path) -> bool:
        return (step / layout.COMMIT_FILE).exists()

    def read_commit_record(self, step: Path) -> layout.CommitRecord | None:
        return layout.read_commit_record(step)

    def record_version(self, step: Path) -> int:
        return fsutil.inode(step / layout.COMMIT_FILE)

    # --- parts and records --------------------------------------------------------------

    def begin_part(self, job: str, step: int, rank: int, replace: Callable[[Path], bool] | None = None,
                   final: Path | None = None) -> fsutil.PartWriter:
        return fsutil.PartWriter(self._root, self._owner, job, step, rank, replace=replace, final=final)

    def open_file(self, part: Path, name: str) -> FileReader:
        return FileReader(part / name, sequential=True)

    def verify_part(self, part: Path) -> None:
        chunks.verify_part(part)

    def readable_path(self, part: Path) -> Path | None:
        return part

    def remove_part(self, part: Path) -> None:
        fsutil.remove_part(self._root, self._owner, part)

    def create_commit_record(self, step: Path, record: layout.CommitRecord) -> bool:
        return fsutil.link_exactly_once(self._root, self._owner, step / layout.COMMIT_FILE,
                                        layout.commit_record_bytes(record))

    def remove_commit_record(self, step: Path) -> None:
        fsutil.remove_file(self._root, self._owner, step / layout.COMMIT_FILE)
        try:
            step.rmdir()  # the step directory, when its parts went first
        except OSError:
            pass

    def read_job_json(self, job: str, name: str, default: Any) -> Any:
        return fsutil.read_json(self._root / layout.check_job(job) / name, default)

    def write_job_json(self, job: str, name: str, obj: Any) -> None:
        job_dir = self._root / layout.check_job(job)
        fsutil.check_contained(self._root, job_dir / name)
        fsutil.makedirs_durable(job_dir)
        fsutil.write_json_atomic(job_dir / name, obj)

    # --- chunk stores -------------------------------------------------------------------

    def _store(self, job: str) -> Path:
        return chunks.store_dir(self._root, job)

    def has_chunk_store(self, job: str) -> bool:
        return self._store(job).is_dir()

    def chunk_location(self, job: str, name: str) -> Path:
        return chunks.chunk_path(self._store(job), name)

    def touch_chunk(self, job: str, name: str) -> bool:
        try:
            os.utime(self.chunk_location(job, name))
            return True
        except FileNotFoundError:
            return False

    def chunk_size(self, job: str, name: str) -> int:
        return os.stat(self.chunk_location(job, name)).st_size

    def open_chunk(self, job: str, name: str) -> FileReader:
        return FileReader(self.chunk_location(job, name), sequential=False)

    def missing_chunks(self, job: str, names: Iterable[str]) -> list[str]:
        return chunks.missing(self._store(job), names)

    def new_chunks(self, job: str, part: PartWriter | None = None) -> FsChunkBatch:
        if part is not None:
            assert isinstance(part, fsutil.PartWriter), "a part of this tier stages the batch"
            staging = part.path(".new")  # inside the part's temporary: an abort removes it with the rest
        else:
            staging = layout.tmp_root(self._root, self._owner) / f"chunks.{uuid.uuid4().hex[:12]}"
            fsutil.makedirs_durable(staging.parent, within=self._root)
        staging.mkdir()
        return FsChunkBatch(self, job, staging)

    def list_manifests(self, job: str) -> list[Path]:
        parts = [p.path for p in layout.scan_tier(self._root, job)]
        for owner in _subdirs(self._root / layout.TMP_DIR):
            staged_job = owner / _REPLACE_DIR / job
            parts += [r for s in _subdirs(staged_job) for r in _subdirs(s)]
        return parts

    def manifest_version(self, part: Path) -> tuple[int, ...]:
        st = os.stat(part / layout.MANIFEST_FILE)
        return st.st_ino, st.st_size, st.st_mtime_ns

    def list_chunks(self, job: str) -> list[str]:
        out = []
        for sub in _subdirs(self._store(job)):  # fan-out directories; not .condemned nor .corrupt
            with os.scandir(sub) as it:
                out += [e.name for e in it if chunks.is_chunk_name(e.name)]
        return out

    def condemn_chunk(self, job: str, name: str, untouched_since: float) -> bool:
        path = self.chunk_location(job, name)
        condemned = self._store(job) / chunks.CONDEMNED_DIR
        try:
            if os.stat(path).st_mtime >= untouched_since:
                return False  # written or relied on within the grace period
            condemned.mkdir(exist_ok=True)
            os.rename(path, condemned / name)
        except FileNotFoundError:
            return False  # another node's sweep took it first
        return True

    def condemned_chunks(self, job: str) -> list[str]:
        try:
            with os.scandir(self._store(job) / chunks.CONDEMNED_DIR) as it:
                return [e.name for e in it if chunks.is_chunk_name(e.name)]
        except FileNotFoundError:
            return []

    def restore_chunk(self, job: str, name: str) -> None:
        final = self.chunk_location(job, name)
        final.parent.mkdir(exist_ok=True)
        os.rename(self._store(job) / chunks.CONDEMNED_DIR / name, final)  # a copy written meanwhile has the same bytes

    def delete_condemned_chunk(self, job: str, name: str) -> int:
        path = self._store(job) / chunks.CONDEMNED_DIR / name
        size = path.stat().st_size
        path.unlink()
        return size

    # --- housekeeping -------------------------------------------------------------------

    def prepare(self) -> None:
        fsutil.makedirs_durable(self._root)

    def clean_temporaries(self) -> int:
        return fsutil.clean_temporaries(self._root, self._owner)

    def discard_temporary(self, location: Path) -> bool:
        fsutil.check_contained(self._root, location)  # never through a link planted in the temporaries
        if not location.exists():
            return False
        shutil.rmtree(location, ignore_errors=True)
        return True

    def clean_abandoned(self) -> int:
        """Nothing: each daemon cleans its own temporaries when it starts again (see :meth:`clean_temporaries`);
        one that never comes back leaves its ``.tmp/<owner>/`` for the operator."""
        return 0

    def usage(self) -> Usage:
        st = os.statvfs(self._root)
        return Usage(free_bytes=st.f_bavail * st.f_frsize, total_bytes=st.f_blocks * st.f_frsize)

    def quarantine_part(self, part: Path) -> Path:
        target = part.parent / f"{layout.CORRUPT_PREFIX}{part.name}-{uuid.uuid4().hex[:6]}"
        os.rename(part, target)
        return target

    def quarantine_chunk(self, location: Path) -> Path | None:
        target = chunks.corrupt_location(location)
        if target is None:
            return None
        target.parent.mkdir(exist_ok=True)
        os.rename(location, target)
        return target

    def list_quarantined(self) -> list[QuarantinedCopy]:
        found = []
        for job_dir in _subdirs_or_none(self._root):
            for step_dir in _subdirs_or_none(job_dir):
                for entry in _subdirs_or_none(step_dir, prefix=layout.CORRUPT_PREFIX):
                    step = layout.parse_step_dirname(step_dir.name)
                    rank = layout.parse_rank_dirname(entry.name[len(layout.CORRUPT_PREFIX):].rsplit("-", 1)[0])
                    if step is not None and rank is not None:
                        found.append(QuarantinedCopy(job_dir.name, step, rank, entry))
        return found


    # --- replacing a step ---------------------------------------------------------------
    #
    # A replacement is assembled in .tmp/<owner>/replace/<job>/step-N/rank-R/; once whole, its commit record
    # is written there and the directory is exchanged with <job>/step-N: one renameat2(RENAME_EXCHANGE)
    # where the file system has it, else two renames (the old step out, the new one in), which is the crash
    # window recover_staged() closes.

    def _staged_step(self, job: str, step: int) -> Path:
        return layout.tmp_root(self._root, self._owner) / _REPLACE_DIR / layout.check_job(job) / \
            layout.step_dirname(step)

    def staged_location(self, job: str, step: int, rank: int) -> Path:
        return self._staged_step(job, step) / layout.rank_dirname(rank)

    def list_staged(self, job: str, step: int) -> list[layout.PartRef]:
        found = []
        for entry in _subdirs(self._staged_step(job, step)):
            rank = layout.parse_rank_dirname(entry.name)
            if rank is not None and (entry / layout.MANIFEST_FILE).is_file():
                found.append(layout.PartRef(job, step, rank, entry, fsutil.inode(entry)))
        return sorted(found, key=lambda ref: ref.rank)

    def swap_in(self, record: layout.CommitRecord) -> bool:
        staged = self._staged_step(record.job, record.step)
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

    def discard_staged(self, job: str, step: int) -> bool:
        return self.discard_temporary(self._staged_step(job, step))

    def recover_staged(self) -> int:
        root = layout.tmp_root(self._root, self._owner) / _REPLACE_DIR
        done = 0
        for job_dir in _subdirs_or_none(root) if not root.is_symlink() else []:
            for sdir in _subdirs_or_none(job_dir):
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


class FileReader:
    """A file read from its start with unbuffered reads (:class:`ckptstage.daemon.tiers.interface.Reader`)."""

    def __init__(self, path: Path, sequential: bool) -> None:
        self._file = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        try:
            self.size = os.fstat(self._file.fileno()).st_size
            if sequential:
                os.posix_fadvise(self._file.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except BaseException:
            self._file.close()
            raise

    def readinto(self, buf: memoryview) -> int | None:
        return self._file.readinto(buf)

    def read(self, n: int) -> bytes:
        return self._file.read(n) or b""

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class FsChunkBatch:
    """New chunks written under a staging directory in the tier's temporaries, then moved into the store."""

    def __init__(self, tier: FsTier, job: str, staging: Path) -> None:
        self._tier = tier
        self._job = job
        self._staging = staging
        self._lock = threading.Lock()
        self._written: dict[str, Path] = {}

    def write(self, name: str, data: memoryview, direct_io: bool) -> None:
        """Writes one new chunk's file (not fsynced: :meth:`publish` syncs the batch together)."""
        path = self._staging / name
        out = fsutil.DataFile(path, len(data), direct_io, reserve=False)
        try:
            out.write(data, 0)
        finally:
            out.close()
        with self._lock:
            self._written[name] = path

    def publish(self) -> None:
        """Moves the chunks into the store, durably, and removes the emptied staging directory.

        The files are fsynced, renamed into place, and the store directories
        they went to fsynced, each step on :data:`SYNC_THREADS` threads at once
        (fsyncs issued together share the file system's journal commits:
        one by one, a few hundred chunks cost a few hundred of them). A chunk
        of the same name already there (another save's, just now) has the
        same bytes: the rename replaces it, atomically.
        """
        with self._lock:
            written, self._written = self._written, {}
        if written:
            root, job = self._tier.root, self._job
            _each(fsutil.fsync_file, written.values())
            parents = {self._tier.chunk_location(job, n).parent for n in written}
            for d in parents:
                if not d.is_dir():
                    fsutil.makedirs_durable(d, within=root)
            for name, path in written.items():
                final = self._tier.chunk_location(job, name)
                fsutil.check_contained(root, final)
                os.rename(path, final)
            _each(layout.fsync_dir, parents)
        self._staging.rmdir()

    def discard(self) -> None:
        shutil.rmtree(self._staging, ignore_errors=True)


def _each(fn: Callable[[Path], None], paths: Iterable[Path]) -> None:
    """``fn`` on every path, :data:`SYNC_THREADS` at once (fsync releases the GIL); the first error is raised."""
    paths = list(paths)
    if len(paths) <= 1:
        for p in paths:
            fn(p)
        return
    with ThreadPoolExecutor(min(SYNC_THREADS, len(paths)), thread_name_prefix="chunk-sync") as pool:
        for f in [pool.submit(fn, p) for p in paths]:
            f.result()


def _subdirs(path: Path, prefix: str = "") -> list[Path]:
    """The subdirectories (never links) of ``path`` named ``prefix...``; dot-names only when ``prefix`` is one.
    None when ``path`` is gone; any other error is raised."""
    try:
        with os.scandir(path) as it:
            return [Path(e.path) for e in it if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)
                    and (prefix or not e.name.startswith("."))]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _subdirs_or_none(path: Path, prefix: str = "") -> list[Path]:
    """:func:`_subdirs`, and none when ``path`` cannot be read (a walk that skips what it cannot see)."""
    try:
        return _subdirs(path, prefix)
    except OSError:
        return []
