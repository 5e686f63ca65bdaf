"""The file-system tier: :class:`ckptstage.daemon.tiers.interface.Tier` on a directory (local SSD, or a parallel file system).

The layout is docs/FORMAT.md's, byte for byte: clients read parts straight
from these files. Publishing is a rename of a temporary directory under
``.tmp/<owner>/`` (:class:`fsutil.PartWriter`), a commit record is created
exactly once with ``link()``, deletion renames into ``.tmp`` first, and no
path below the root ever goes through a symbolic link
(:func:`tierpath.check_contained`).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ckptstage.daemon import fsutil
from ckptstage.daemon.tiers import fspacks, fsquarantine
from ckptstage.daemon.tiers.compression import Compression
from ckptstage.daemon.tiers.fschunks import FsChunkCalls
from ckptstage.daemon.tiers.fsread import FileReader
from ckptstage.daemon.tiers.fsreplace import REPLACE_DIR, FsReplacing
from ckptstage.daemon.tiers.fswalk import subdirs
from ckptstage.daemon.tiers.interface import Manifest, QuarantinedCopy, Usage
from ckptstage.protos import chunks, layout, packs


class FsTier(FsChunkCalls):
    """One directory tree holding checkpoints, as the daemon ``owner`` uses it.

    ``owner`` names this daemon's temporaries (``.tmp/<owner>/``); a tier
    used only to index (list and read) needs none. ``compression``: whether
    new chunks are kept compressed (``[shared] compression``; the local tier's
    never are: :mod:`ckptstage.daemon.tiers.compression`).
    """

    def __init__(self, root: Path, owner: str = "", compression: str = "none") -> None:
        self._root = root
        self._owner = owner
        self._compression = Compression(compression)
        self._replacing = FsReplacing(root, owner)

    @property
    def root(self) -> Path:
        return self._root

    @property
    def compression(self) -> Compression:
        return self._compression

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

    # --- chunk stores (the calls on chunks and packs: fschunks.py) -----------------------

    def list_manifests(self, job: str) -> list[Path]:
        parts = [p.path for p in layout.scan_tier(self._root, job)]
        for owner in subdirs(self._root / layout.TMP_DIR):
            staged_job = owner / REPLACE_DIR / job
            parts += [r for s in subdirs(staged_job) for r in subdirs(s)]
        return parts

    def manifest_version(self, part: Path) -> tuple[int, ...]:
        st = os.stat(part / layout.MANIFEST_FILE)
        return st.st_ino, st.st_size, st.st_mtime_ns

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
            return fspacks.quarantine_pack(self._root, location.parent.parent, location, staging, self._compression)
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
