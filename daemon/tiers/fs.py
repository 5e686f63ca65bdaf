"""The file-system tier: :class:`ckptstage.daemon.tiers.interface.Tier` on a directory (local SSD, or a parallel file system).

The layout is docs/FORMAT.md's, byte for byte: clients read parts straight
from these files. Publishing is a rename of a temporary directory under
``.tmp/<owner>/`` (:class:`fsutil.PartWriter`), a commit record is created
exactly once with ``link()``, deletion renames into ``.tmp`` first, and no
path below the root ever goes through a symbolic link
(:func:`tierpath.check_contained`).
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

from ckptstage.daemon import fsutil
from ckptstage.daemon.tiers import fspacks, fsquarantine
from ckptstage.daemon.tiers.fspacks import FsPackBatch
from ckptstage.daemon.tiers.fsreplace import REPLACE_DIR, FsReplacing
from ckptstage.daemon.tiers.fswalk import subdirs, subdirs_or_none
from ckptstage.daemon.tiers.interface import Manifest, PartWriter, QuarantinedCopy, Usage
from ckptstage.protos import chunks, layout, packs



class FsTier(fspacks.PackCalls):
    """One directory tree holding checkpoints, as the daemon ``owner`` uses it.

    ``owner`` names this daemon's temporaries (``.tmp/<owner>/``); a tier
    used only to index (list and read) needs none.
    """

    def __init__(self, root: Path, owner: str = "") -> None:
        self._root = root
        self._owner = owner
        self._replacing = FsReplacing(root, owner)

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

    def list_steps(self, job: str, step: int | None = None, known: Mapping[Path, int] | None = None,
                   trust: bool = False) -> Iterator[layout.StepRef]:
        return layout.scan_steps(self._root, job, step, known, trust)

    def list_step(self, job: str, step: int) -> layout.StepRef | None:
        return next(layout.scan_steps(self._root, job, step, trust=True), None)

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

    def claim_seal(self, step: Path) -> bool:
        return fsutil.link_exactly_once(self._root, self._owner, step / layout.SEAL_CLAIM_FILE, self._owner.encode())

    def write_step_index(self, step: Path, data: bytes) -> None:
        fsutil.write_atomic(step / layout.STEP_INDEX_FILE, data, within=self._root)

    def read_step_index(self, step: Path) -> bytes | None:
        path = step / layout.STEP_INDEX_FILE
        fsutil.check_contained(self._root, path)
        try:
            return layout.read_step_index_file(path)
        except FileNotFoundError:
            return None

    def release_seal(self, step: Path) -> None:
        fsutil.check_contained(self._root, step / layout.SEAL_CLAIM_FILE)
        (step / layout.SEAL_CLAIM_FILE).unlink(missing_ok=True)

    def remove_commit_record(self, step: Path) -> None:
        fsutil.remove_file(self._root, self._owner, step / layout.COMMIT_FILE)
        (step / layout.STEP_INDEX_FILE).unlink(missing_ok=True)
        self.release_seal(step)  # one a sealer that died left
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

    def _find(self, job: str, name: str) -> packs.Place:
        """Where a chunk of the job's store is: its own file, or a range of a pack (FileNotFoundError: neither)."""
        place = packs.store_index(self._store(job)).find(name)
        if place is None:
            raise FileNotFoundError(errno.ENOENT, f"no chunk {name} in {self._store(job)}")
        return place

    def chunk_location(self, job: str, name: str) -> Path:
        """The file holding the chunk (a pack, or its own file; where its own file would be when it is
        nowhere)."""
        place = packs.store_index(self._store(job)).find(name)
        return place.path if place is not None else chunks.chunk_path(self._store(job), name)

    def touch_chunk(self, job: str, name: str) -> bool:
        """Without listing the store for a chunk it does not know (a save asks this of each of its chunks): one
        another node packed since the last listing is then written again, which is harmless."""
        place = packs.store_index(self._store(job)).find(name, refreshed=True)
        try:
            if place is None:
                return False
            os.utime(place.path)  # a pack: every chunk in it counts as relied on
            return True
        except FileNotFoundError:
            return False

    def chunk_size(self, job: str, name: str) -> int:
        return self._find(job, name).length

    def open_chunk(self, job: str, name: str) -> FileReader:
        """A reader of the chunk's bytes. A pack a repack emptied and a sweep removed between the lookup and the
        open is looked up again (the chunk is in the new pack)."""
        place = self._find(job, name)
        try:
            return FileReader(place.path, sequential=False, place=place)
        except FileNotFoundError:
            if place.whole:
                raise
            packs.store_index(self._store(job)).reset()
            place = self._find(job, name)
            return FileReader(place.path, sequential=False, place=place)

    def missing_chunks(self, job: str, names: Iterable[str]) -> list[str]:
        return chunks.missing(self._store(job), names)

    def new_chunks(self, job: str, part: PartWriter | None = None) -> FsPackBatch:
        if part is not None:
            assert isinstance(part, fsutil.PartWriter), "a part of this tier stages the batch"
            staging = part.path(".new")  # inside the part's temporary: an abort removes it with the rest
        else:
            staging = layout.tmp_root(self._root, self._owner) / f"chunks.{uuid.uuid4().hex[:12]}"
            fsutil.makedirs_durable(staging.parent, within=self._root)
        staging.mkdir()
        return FsPackBatch(self._root, self._store(job), staging)

    def list_manifests(self, job: str) -> list[Path]:
        parts = [p.path for p in layout.scan_tier(self._root, job)]
        for owner in subdirs(self._root / layout.TMP_DIR):
            staged_job = owner / REPLACE_DIR / job
            parts += [r for s in subdirs(staged_job) for r in subdirs(s)]
        return parts

    def manifest_version(self, part: Path) -> tuple[int, ...]:
        st = os.stat(part / layout.MANIFEST_FILE)
        return st.st_ino, st.st_size, st.st_mtime_ns

    def list_chunks(self, job: str) -> list[str]:
        out = []
        for sub in subdirs(self._store(job)):  # fan-out directories; not .condemned nor .corrupt
            if sub.name == packs.PACKS_DIR:
                continue
            with os.scandir(sub) as it:
                out += [e.name for e in it if chunks.is_chunk_name(e.name)]
        index = packs.store_index(self._store(job))
        index.refresh()
        return sorted(set(out) | set(index.packed()))

    def condemn_chunk(self, job: str, name: str, untouched_since: float) -> bool:
        path = chunks.chunk_path(self._store(job), name)  # a chunk's own file (a pack is never condemned here)
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
        final = chunks.chunk_path(self._store(job), name)
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

    # --- copies moved aside as corrupt (see fsquarantine.py) -----------------------------

    def quarantine_part(self, part: Path) -> Path:
        return fsquarantine.quarantine_part(part)

    def quarantine_chunk(self, location: Path) -> Path | None:
        """A chunk's own file moves aside; a pack (the file a failed read named) is rewritten without the chunks
        that fail their digest, then moves aside (:func:`fspacks.quarantine_pack`)."""
        if location.name.endswith(packs.PACK_SUFFIX) and location.parent.name == packs.PACKS_DIR:
            fsutil.check_contained(self._root, location)
            staging = layout.tmp_root(self._root, self._owner) / f"chunks.{uuid.uuid4().hex[:12]}"
            fsutil.makedirs_durable(staging.parent, within=self._root)
            staging.mkdir()
            return fspacks.quarantine_pack(self._root, location.parent.parent, location, staging)
        return fsquarantine.quarantine_chunk(location)

    def list_quarantined(self) -> list[QuarantinedCopy]:
        return fsquarantine.list_quarantined(self._root)

    def delete_quarantined(self, location: Path) -> int:
        return fsquarantine.delete_quarantined(self._root, location)

    # --- replacing a step (see fsreplace.py) --------------------------------------------

    def staged_location(self, job: str, step: int, rank: int) -> Path:
        return self._replacing.staged_location(job, step, rank)

    def list_staged(self, job: str, step: int) -> list[layout.PartRef]:
        return self._replacing.list_staged(job, step)

    def swap_in(self, record: layout.CommitRecord) -> bool:
        return self._replacing.swap_in(record)

    def discard_staged(self, job: str, step: int) -> bool:
        return self.discard_temporary(self._replacing.staged_step(job, step))

    def recover_staged(self) -> int:
        return self._replacing.recover_staged()


class FileReader:
    """A file read from its start with unbuffered reads (:class:`ckptstage.daemon.tiers.interface.Reader`); with
    ``place``, only the ``length`` bytes from ``offset`` (a chunk in a pack), as if they were the file."""

    def __init__(self, path: Path, sequential: bool, place: packs.Place | None = None) -> None:
        self._file = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        try:
            self.size = os.fstat(self._file.fileno()).st_size
            self._left = self.size
            if place is not None and not place.whole:
                if place.offset + place.length > self.size:
                    raise FileNotFoundError(errno.ENOENT, f"{path} ends before its chunk at {place.offset} "
                                                          f"({place.length} bytes)")
                self._file.seek(place.offset)
                self.size = self._left = place.length
            if sequential:
                os.posix_fadvise(self._file.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except BaseException:
            self._file.close()
            raise

    def readinto(self, buf: memoryview) -> int | None:
        n = self._file.readinto(buf[:self._left]) or 0
        self._left -= n
        return n

    def read(self, n: int) -> bytes:
        data = self._file.read(min(n, self._left)) or b""
        self._left -= len(data)
        return data

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
