"""The chunk stores of incremental parts on the object store: one per job (and one per user), chunks in packs.

New chunks go into packs (:mod:`ckptstage.daemon.tiers.s3.packbatch`), found
through their indexes (:mod:`ckptstage.daemon.tiers.s3.packs`); a store
written before packs keeps each chunk as an object named by its bytes,
which stay readable and are swept as before. A chunk reused is touched
(:mod:`ckptstage.daemon.tiers.s3.touch`): its pack's index, or its own
object. A sweep's rules (leases, the grace period) are
:class:`ckptstage.daemon.catalog.chunkstore.ChunkStore`'s: this module only
stores, finds, lists and moves chunks.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable
from pathlib import Path

from ckptstage.daemon.tiers.interface import PartWriter
from ckptstage.daemon.tiers.compression import Compression, DecodedReader
from ckptstage.daemon.tiers.s3.compression import SIZE_META, open_object, read_decoded
from ckptstage.daemon.tiers.s3.io import ObjectReader, Transfers
from ckptstage.daemon.tiers.s3.keys import Keys
from ckptstage.daemon.tiers.s3.objects import Objects
from ckptstage.daemon.tiers.s3.packbatch import S3PackBatch
from ckptstage.daemon.tiers.s3.packs import S3Packs
from ckptstage.daemon.tiers.s3.touch import Touches
from ckptstage.protos import chunks, packs


class S3Chunks:
    """The chunk stores of the jobs under ``keys``' prefix, on one bucket's ``objects``; chunks are read
    through ``transfers``, and packed in uploads of ``piece_bytes`` pieces."""

    def __init__(self, keys: Keys, objects: Objects, transfers: Transfers, compression: Compression,
                 piece_bytes: int) -> None:
        self._keys = keys
        self._objects = objects
        self._transfers = transfers
        self.compression = compression
        self._piece_bytes = piece_bytes
        self._touches = Touches(objects, keys.url)
        self.packs = S3Packs(keys, objects, self._touches, self.new_chunks)

    def has_chunk_store(self, job: str) -> bool:
        return self._objects.any_under(self._keys.dir_key(self._keys.store(job)))

    def swept_at(self, job: str) -> float | None:
        head = self._objects.head(self._swept_key(job))
        return None if head is None else head["LastModified"].timestamp()

    def note_swept(self, job: str) -> None:
        self._objects.put(self._swept_key(job), b"")

    def _swept_key(self, job: str) -> str:
        return self._keys.key(self._keys.store(job) / chunks.SWEPT_FILE)

    # ------------------------------------------------------------------ finding and reading

    def _find(self, job: str, name: str) -> packs.Place:
        place = self.packs.index(job).find(name)
        if place is None:
            raise FileNotFoundError(errno.ENOENT, f"no chunk {name} in {self._keys.url_of(self._keys.store(job))}")
        return place

    def chunk_location(self, job: str, name: str) -> Path:
        """The object holding the chunk (a pack, or its own); where its own would be when it is nowhere."""
        place = self.packs.index(job).find(name)
        return place.path if place is not None else self._keys.chunk_location(job, name)

    def touch_chunks(self, job: str, names: Iterable[str]) -> set[str]:
        """Touches each pack holding one of ``names`` once (its index), and each chunk kept on its own; returns
        the names the store holds. A chunk another node packed since the store was last listed is not looked
        for: it is written again, which is harmless."""
        return packs.touch_each(self.packs.index(job), names, lambda place: self._touches.touch(
            self._keys.key(place.path if place.whole else packs.index_beside(place.path))))

    def chunk_size(self, job: str, name: str) -> int:
        place = self._find(job, name)
        if not place.whole:
            return place.nbytes
        key = self._keys.key(place.path)
        head = self._objects.head(key)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no chunk {self._objects.where(key)}")
        return int((head.get("Metadata") or {}).get(SIZE_META, head["ContentLength"]))

    def open_chunk(self, job: str, name: str) -> ObjectReader | DecodedReader:
        """The chunk's bytes, read by ranges, or when it is kept compressed, whole and decoded. A pack a
        repack emptied and a sweep removed between the lookup and the open is looked up again."""
        return packs.use_chunk(self.packs.index(job), name, self.open_place,
                               self._keys.url_of(self._keys.store(job)))

    def open_place(self, place: packs.Place) -> ObjectReader | DecodedReader:
        """A reader of what a chunk at ``place`` holds (decoded, where it is kept compressed)."""
        key = self._keys.key(place.path)
        if place.whole:
            return open_object(self._transfers, key)
        reader = self._transfers.reader(key, window=(place.offset, place.length))
        return read_decoded(reader) if place.size else reader

    def chunk_runs(self, job: str, names: Iterable[str], max_bytes: int) -> list[packs.Run]:
        """Neighbours of one pack in one ranged read (:func:`packs.runs`); a chunk kept compressed, or on its
        own, in a read of its own. FileNotFoundError names a chunk the store lacks."""
        found = self.packs.index(job).find_all(names)
        lost = [name for name, place in found.items() if place is None]
        if lost:
            raise FileNotFoundError(errno.ENOENT, f"no chunk {lost[0]} in {self._keys.url_of(self._keys.store(job))}",
                                    str(self._keys.chunk_location(job, lost[0])))
        return packs.runs([(name, place) for name, place in found.items() if place is not None], max_bytes)

    def open_chunk_run(self, job: str, run: packs.Run) -> ObjectReader | DecodedReader:
        if run.whole:
            return open_object(self._transfers, self._keys.key(run.path))
        if run.coded:
            return self.open_place(run.place)
        return self._transfers.reader(self._keys.key(run.path), window=(run.offset, run.length))

    def missing_chunks(self, job: str, names: Iterable[str]) -> list[str]:
        return [n for n, place in self.packs.index(job).find_all(names).items() if place is None]

    def new_chunks(self, job: str, part: PartWriter | None = None) -> S3PackBatch:
        """A batch of new chunks packed straight into the store (nothing is staged: an upload is invisible
        until it is completed, and its index publishes a pack)."""
        return S3PackBatch(self._keys, self._objects, job, self.compression, self._piece_bytes,
                           self.packs.published(job))

    def list_chunks(self, job: str) -> list[str]:
        index = self.packs.index(job)
        index.refresh()
        found = set(index.packed())
        for obj in self._objects.listing(self._keys.dir_key(self._keys.store(job))):  # and those on their own
            fan, _, name = obj.get("Key", "").rpartition("/")
            if chunks.is_chunk_name(name) and fan.endswith(f"/{name[:2]}"):  # not .condemned nor .corrupt
                found.add(name)
        return sorted(found)

    # ------------------------------------------------------------------ chunks kept on their own: the sweep

    def condemn_chunk(self, job: str, name: str, untouched_since: float) -> bool:
        key = self._keys.chunk_key(job, name)
        head = self._objects.head(key)
        try:
            if head is None or not self._touches.idle(key, head, untouched_since):
                return False
            self._objects.copy(key, self._keys.condemned(job, name), int(head["ContentLength"]))
            self._objects.delete(key, str(head["ETag"]))
        except FileNotFoundError:
            return False  # another node's sweep took it first
        self.packs.index(job).reset()
        return True

    def condemned_chunks(self, job: str) -> list[str]:
        prefix = self._keys.dir_key(self._keys.store(job) / chunks.CONDEMNED_DIR)
        return [name for obj in self._objects.listing(prefix)
                if chunks.is_chunk_name(name := obj.get("Key", "")[len(prefix):])]

    def restore_chunk(self, job: str, name: str) -> None:
        condemned = self._keys.condemned(job, name)
        head = self._objects.head(condemned)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no condemned chunk {self._objects.where(condemned)}")
        self._objects.copy(condemned, self._keys.chunk_key(job, name), int(head["ContentLength"]))
        self._objects.delete(condemned)

    def delete_condemned_chunk(self, job: str, name: str) -> int:
        condemned = self._keys.condemned(job, name)
        head = self._objects.head(condemned)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no condemned chunk {self._objects.where(condemned)}")
        self._objects.delete(condemned, str(head["ETag"]))
        return int(head["ContentLength"])

    def quarantine_chunk(self, location: Path) -> Path | None:
        """A chunk's own object moves to ``<store>/.corrupt/``; a pack is quarantined whole
        (:meth:`S3Packs.quarantine_pack`: its intact chunks repacked first)."""
        if location.parent.name == packs.PACKS_DIR:
            return self.packs.quarantine_pack(location, self.open_place)
        target = chunks.corrupt_location(location)
        if target is None:
            return None
        key = self._keys.key(location)
        head = self._objects.head(key)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no chunk {self._objects.where(key)}")
        self._objects.copy(key, self._keys.key(target), int(head["ContentLength"]))
        self._objects.delete(key, str(head["ETag"]))
        return target
