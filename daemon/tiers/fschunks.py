"""The chunk-store calls of a file-system tier (:class:`~ckptstage.daemon.tiers.interface.ChunkStorage`): a job's
store is ``<tier>/<job>/chunks``, its chunks in packs (:mod:`ckptstage.daemon.tiers.fspacks`) or, written
before packs, each in a file of its own (docs/FORMAT.md).
"""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Iterable
from pathlib import Path

from ckptstage.daemon import fsutil
from ckptstage.daemon.tiers import fspacks
from ckptstage.daemon.tiers.fspacks import FsPackBatch
from ckptstage.daemon.tiers.compression import Compression, DecodedReader
from ckptstage.daemon.tiers.fsread import FileReader, open_place
from ckptstage.daemon.tiers.fswalk import subdirs
from ckptstage.daemon.tiers.interface import PartWriter
from ckptstage.protos import chunks, layout, packs


class FsChunkCalls(fspacks.PackCalls):
    """The chunk stores of the tier rooted at ``_root``, whose temporaries are ``.tmp/<_owner>/``; new chunks are
    kept compressed where ``_compression`` chooses (:mod:`ckptstage.daemon.tiers.compression`)."""

    _root: Path
    _owner: str
    _compression: Compression

    def _store(self, job: str) -> Path:
        return chunks.store_dir(self._root, job)

    def has_chunk_store(self, job: str) -> bool:
        return self._store(job).is_dir()

    def compressed_sizes(self, job: str) -> dict[str, int]:
        return packs.store_index(self._store(job)).compressed()

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

    def swept_at(self, job: str) -> float | None:
        try:
            return os.stat(self._store(job) / chunks.SWEPT_FILE).st_mtime
        except FileNotFoundError:
            return None

    def note_swept(self, job: str) -> None:
        path = self._store(job) / chunks.SWEPT_FILE
        try:
            os.utime(path)
        except FileNotFoundError:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644))

    def touch_chunk(self, job: str, name: str) -> bool:
        return name in self.touch_chunks(job, [name])

    def touch_chunks(self, job: str, names: Iterable[str]) -> set[str]:
        """Without listing the store for a chunk it does not know (a save asks this of each of its chunks): one
        another node packed since the last listing is then written again, which is harmless. A pack's
        modification time stands for every chunk in it: each pack is touched once."""
        def touch(place: packs.Place) -> bool:
            try:
                os.utime(place.path)
            except FileNotFoundError:
                return False
            return True

        return packs.touch_each(packs.store_index(self._store(job)), names, touch)

    def chunk_size(self, job: str, name: str) -> int:
        return self._find(job, name).nbytes

    def open_chunk(self, job: str, name: str) -> FileReader | DecodedReader:
        """A reader of the chunk's bytes (decoded, where it is kept compressed). A pack a repack emptied and a
        sweep removed between the lookup and the open is looked up again (the chunk is in the new pack)."""
        return packs.use_chunk(packs.store_index(self._store(job)), name, open_place, str(self._store(job)))

    def chunk_runs(self, job: str, names: Iterable[str], max_bytes: int) -> list[packs.Run]:
        """Reads that fetch every chunk among ``names``: neighbours in one pack in one read
        (:func:`packs.runs`). FileNotFoundError names a chunk the store lacks."""
        found = packs.store_index(self._store(job)).find_all(names)
        lost = [name for name, place in found.items() if place is None]
        if lost:
            raise FileNotFoundError(errno.ENOENT, f"no chunk {lost[0]} in {self._store(job)}",
                                    str(chunks.chunk_path(self._store(job), lost[0])))
        return packs.runs([(name, place) for name, place in found.items() if place is not None], max_bytes)

    def open_chunk_run(self, job: str, run: packs.Run) -> FileReader | DecodedReader:
        if run.coded:
            return open_place(run.place)
        return FileReader(run.path, sequential=True, place=None if run.whole else run.place)

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
        return FsPackBatch(self._root, self._store(job), staging, self._compression)

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
