"""Chunk packs on the object store: finding chunks in them, and the sweep's calls on them as a whole.

The layout is a file system's (docs/FORMAT.md, "Packs"), as objects:
``<store>/packs/<id>.pack`` and ``<store>/packs/<id>.idx``, the index
publishing the pack (:mod:`ckptstage.daemon.tiers.s3.packbatch` writes them).
What differs is how a pack leaves the store, since an object cannot be
renamed and a pack may hold a gigabyte:

* **condemned**: its index moves (copy, then delete) to
  ``<store>/packs/.condemned/<id>.idx``; the pack's bytes stay where they
  are (readers that found them before still read the right bytes);
* **put back**: the index moves back, if the pack is still there;
* **deleted**: the condemned index, then the pack.

A pack no index publishes is a writer's cut short (completed, its index
never written): a sweep condemns it once it is :data:`ABANDONED_S` old, by
writing an empty condemned index. A multipart upload of a pack left that
long by a daemon that died is aborted by the sweep's listing too; a daemon
that restarts aborts its own at once (:meth:`S3Packs.abort_own_uploads`).

A reuse touches the pack's index, not its bytes (:mod:`ckptstage.daemon.tiers.s3.touch`).
"""

from __future__ import annotations

import errno
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptstage.daemon.tiers.interface import Pack, Reader
from ckptstage.daemon.tiers.s3.keys import Keys
from ckptstage.daemon.tiers.s3.objects import Objects, abort
from ckptstage.daemon.tiers.s3.orphans import age_s
from ckptstage.daemon.tiers.s3.packbatch import S3PackBatch, owner_tag
from ckptstage.daemon.tiers.s3.touch import Touches
from ckptstage.protos import chunks, packs

ABANDONED_S = 6 * 3600  # a pack upload (or a pack no index publishes) this old is a dead writer's


class S3PackSource:
    """How a :class:`packs.StoreIndex` sees one store of the object store: a listing of the store (its packs'
    indexes, and the chunks it keeps as objects of their own), and each index read once."""

    def __init__(self, keys: Keys, objects: Objects, job: str) -> None:
        self._keys = keys
        self._objects = objects
        self._job = job
        self._prefix = keys.dir_key(keys.store(job))
        self._loose: dict[str, int] = {}  # chunk -> its object's size, as last listed

    def index_names(self) -> list[str] | None:
        names, loose = [], {}
        for obj in self._objects.listing(self._prefix):
            parts = obj.get("Key", "")[len(self._prefix):].split("/")
            if len(parts) == 2 and parts[0] == packs.PACKS_DIR:
                names.append(parts[1])
            elif len(parts) == 2 and chunks.is_chunk_name(parts[1]) and parts[0] == parts[1][:2]:
                loose[parts[1]] = int(obj.get("Size", 0))
        self._loose = loose
        return names

    def read_index(self, name: str) -> list[packs.Entry]:
        location = packs.packs_dir(self._keys.store(self._job)) / name
        return read_index(self._objects, self._keys, self._keys.key(location))

    def loose(self, name: str) -> packs.Place | None:
        size = self._loose.get(name)
        return None if size is None else packs.Place(self._keys.chunk_location(self._job, name), 0, size, whole=True)

    def gone(self, paths: set[Path]) -> set[Path]:
        """The packs whose index is no longer there: condemned (their bytes stay until deleted) or deleted. A
        writer that checks its chunks after publishing a part must see a condemned pack as gone, as it does
        on a file system, where the pack is renamed away."""
        return {path for path in paths if self._objects.head(self._keys.key(packs.index_beside(path))) is None}


class S3Packs:
    """The packs of the chunk stores under ``keys``' prefix, on ``objects``."""

    def __init__(self, keys: Keys, objects: Objects, touches: Touches,
                 new_batch: Callable[[str], S3PackBatch]) -> None:
        self._keys = keys
        self._objects = objects
        self._touches = touches
        self._new_batch = new_batch
        self._indexes: dict[str, packs.StoreIndex] = {}
        self._entries: dict[tuple[str, str], list[packs.Entry]] = {}  # (index key, ETag) -> entries: never change

    def index(self, job: str) -> packs.StoreIndex:
        """Where each chunk of the store is (one per store, kept)."""
        found = self._indexes.get(job)
        if found is None:
            found = self._indexes.setdefault(job, packs.StoreIndex(
                self._keys.store(job), S3PackSource(self._keys, self._objects, job)))
        return found

    def published(self, job: str) -> Callable[[Path, list[packs.Entry]], None]:
        """What a batch tells the store's index of each pack it published."""
        return lambda pack, entries: self.index(job).add(pack, entries)

    def _key(self, job: str, name: str) -> str:
        return self._keys.key(packs.packs_dir(self._keys.store(job)) / name)

    def _condemned_key(self, job: str, pack_id: str) -> str:
        return self._key(job, f"{chunks.CONDEMNED_DIR}/{pack_id}{packs.INDEX_SUFFIX}")

    def _read(self, key: str, etag: str) -> list[packs.Entry]:
        """An index's entries (read once per version); [] for one that cannot be trusted."""
        found = self._entries.get((key, etag))
        if found is None:
            try:
                found = read_index(self._objects, self._keys, key)
            except packs.PackError:
                found = []
            self._entries[(key, etag)] = found
        return found

    def abort_own_uploads(self) -> int:
        """Aborts the pack uploads this daemon left in any store of the tier (it restarts: none is its
        writers' now); returns how many."""
        mine = f"{owner_tag(self._keys.owner)}-"
        done = 0
        for upload in self._objects.uploads(self._keys.dir_key(self._keys.root)):
            where = self._keys.location(upload["Key"])
            if where.parent.name == packs.PACKS_DIR and where.name.startswith(mine):
                abort(self._objects.connection, upload["Key"], upload["UploadId"])
                done += 1
        return done

    # ------------------------------------------------------------------ the sweep's calls

    def list_packs(self, job: str) -> list[Pack]:
        """The packs in the store (not those condemned), each with when it was written or its index touched
        last; a pack upload a dead writer left is aborted on the way."""
        prefix = self._keys.dir_key(packs.packs_dir(self._keys.store(job)))
        listed: dict[str, dict[str, Any]] = {}
        for obj in self._objects.listing(prefix):
            listed[obj.get("Key", "")[len(prefix):]] = obj
        out = []
        for name, obj in sorted(listed.items()):
            pack_id = packs.pack_id_of(name)
            if pack_id is None or not name.endswith(packs.PACK_SUFFIX):
                continue
            if f"{chunks.CONDEMNED_DIR}/{pack_id}{packs.INDEX_SUFFIX}" in listed:
                continue
            index = listed.get(f"{pack_id}{packs.INDEX_SUFFIX}")
            try:
                entries = [] if index is None else self._read(prefix + f"{pack_id}{packs.INDEX_SUFFIX}",
                                                              str(index.get("ETag")))
            except FileNotFoundError:
                continue  # condemned meanwhile
            stamp = (index or obj)["LastModified"].timestamp()
            out.append(Pack.of(pack_id, entries, stamp))
        # Forget the indexes of packs no longer here (deleted, or moved): the cache holds what the store holds.
        self._entries = {k: v for k, v in self._entries.items()
                         if not k[0].startswith(prefix) or k[0][len(prefix):] in listed}
        for upload in self._objects.uploads(prefix):
            if time.time() - upload["Initiated"].timestamp() > ABANDONED_S:
                abort(self._objects.connection, upload["Key"], upload["UploadId"])
        return out

    def condemn_pack(self, job: str, pack_id: str, untouched_since: float) -> bool:
        index = self._key(job, f"{pack_id}{packs.INDEX_SUFFIX}")
        head = self._objects.head(index)
        try:
            if head is None:  # no index: a writer's cut short, once it is surely dead
                pack = self._objects.head(self._key(job, f"{pack_id}{packs.PACK_SUFFIX}"))
                if pack is None or age_s(pack) < max(ABANDONED_S, time.time() - untouched_since):
                    return False
                self._objects.put(self._condemned_key(job, pack_id), packs.encode_index([]))
                return True
            if not self._touches.idle(index, head, untouched_since):
                return False
            self._objects.copy(index, self._condemned_key(job, pack_id), int(head["ContentLength"]))
            self._objects.delete(index, str(head["ETag"]))
        except FileNotFoundError:
            return False  # another node's sweep took it first
        self.index(job).reset()
        return True

    def condemned_packs(self, job: str) -> list[Pack]:
        prefix = self._keys.dir_key(packs.packs_dir(self._keys.store(job)) / chunks.CONDEMNED_DIR)
        out = []
        for obj in self._objects.listing(prefix):
            name = obj.get("Key", "")[len(prefix):]
            pack_id = packs.pack_id_of(name)
            if pack_id is None or not name.endswith(packs.INDEX_SUFFIX):
                continue
            try:
                entries = self._read(obj["Key"], str(obj.get("ETag")))
            except FileNotFoundError:
                continue
            out.append(Pack.of(pack_id, entries, time.time()))
        return out

    def restore_pack(self, job: str, pack_id: str) -> None:
        """Puts a condemned pack's index back; FileNotFoundError when the pack (or its condemned index) is gone
        (a pack gone with its condemned index left behind: that index goes too)."""
        condemned = self._condemned_key(job, pack_id)
        head = self._objects.head(condemned)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no condemned pack {self._objects.where(condemned)}")
        if self._objects.head(self._key(job, f"{pack_id}{packs.PACK_SUFFIX}")) is None:
            self._objects.delete(condemned)
            raise FileNotFoundError(errno.ENOENT, f"pack {pack_id} of {job} is gone")
        self._objects.copy(condemned, self._key(job, f"{pack_id}{packs.INDEX_SUFFIX}"), int(head["ContentLength"]))
        self._objects.delete(condemned)
        self.index(job).reset()

    def delete_condemned_pack(self, job: str, pack_id: str) -> int:
        """Deletes a condemned pack (its index first); returns the bytes freed."""
        condemned = self._condemned_key(job, pack_id)
        if self._objects.head(condemned) is None:
            raise FileNotFoundError(errno.ENOENT, f"no condemned pack {self._objects.where(condemned)}")
        pack = self._key(job, f"{pack_id}{packs.PACK_SUFFIX}")
        head = self._objects.head(pack)
        self._objects.delete(condemned)
        if head is None:
            return 0
        self._objects.delete(pack, str(head["ETag"]))
        return int(head["ContentLength"])

    def quarantine_pack(self, location: Path, open_chunk: Callable[[packs.Place], Reader]) -> Path:
        """A pack one of whose chunks failed verification: every chunk that still hashes to its name is copied
        into a new pack (published first), then the pack and its index move to ``<store>/.corrupt/``
        (listed and expired like every quarantined copy). Returns where the pack went."""
        store = location.parent.parent
        pack_id = packs.pack_id_of(location.name)
        job = store.parent.name if store.name == chunks.CHUNKS_DIR else ""
        if pack_id is None or location.parent.name != packs.PACKS_DIR or self._keys.store(job) != store:
            raise ValueError(f"{self._keys.url_of(location)} is not a pack of a chunk store")
        index = self._key(job, f"{pack_id}{packs.INDEX_SUFFIX}")
        try:
            entries = read_index(self._objects, self._keys, index)
        except (FileNotFoundError, packs.PackError):
            entries = []  # nothing it holds can be trusted to be anywhere: it only goes aside
        batch = self._new_batch(job)
        try:
            for e in entries:  # a chunk that fails its name is left behind
                def write(view: memoryview, name: str = e.name) -> None:
                    batch.write(name, view, direct_io=False)

                place = packs.Place(location, e.offset, e.length, whole=False, size=e.size)
                with open_chunk(place) as f:
                    chunks.copy_checked(e.name, place.nbytes, f.readinto, write)
            batch.publish()
        finally:
            batch.discard()
        tag = f"{pack_id}-{uuid.uuid4().hex[:6]}"
        aside = store / chunks.CORRUPT_DIR
        target = aside / f"{tag}{packs.PACK_SUFFIX}"
        for key, moved in ((index, aside / f"{tag}{packs.INDEX_SUFFIX}"), (self._keys.key(location), target)):
            head = self._objects.head(key)
            if head is not None:
                self._objects.copy(key, self._keys.key(moved), int(head["ContentLength"]))
                self._objects.delete(key, str(head["ETag"]))
        self.index(job).reset()
        return target


def read_index(objects: Objects, keys: Keys, key: str) -> list[packs.Entry]:
    """The entries of the pack index at ``key``. FileNotFoundError: it is not there; :class:`packs.PackError`:
    it cannot be trusted (named by its location)."""
    return packs.decode_index(objects.get(key), keys.location(key))
