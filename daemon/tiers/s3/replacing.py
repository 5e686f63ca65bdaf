"""Replacing a committed step on the object store (a save with ``overwrite``): staged out of sight, then swapped in.

A replacement's parts are published in ``.tmp/<owner>/replace/<job>/step-N/rank-R/``.
:meth:`S3Replacing.swap_in` writes its commit record there first (sealed:
from then on a crash rolls it forward), then removes the step in place, its
record first (the step stops existing at once, never half there), then its
objects (manifests first), copies the staged objects in (manifests last),
and writes the record at the step. There is no atomic exchange of many
objects, so readers see the old step, then no step (no record) for the time
of the copies, then the new one. On an object store the step "is in place"
when its commit record is: a step whose record was removed is one a swap
was replacing (:meth:`S3Replacing.recover_staged`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ckptstage.daemon.logs import fields
from ckptstage.daemon.tiers.s3.claims import part_objects
from ckptstage.daemon.tiers.s3.cleanup import Cleanup
from ckptstage.daemon.tiers.s3.keys import CLAIM_FILE, REPLACE_DIR, Keys
from ckptstage.daemon.tiers.s3.listing import S3Index
from ckptstage.daemon.tiers.s3.objects import Objects, version
from ckptstage.protos import layout

log = logging.getLogger(__name__)


class S3Replacing:
    """The replacements of steps under ``keys``' prefix that this daemon assembles, on one bucket's
    ``objects``; ``index`` says which steps are in place, ``cleanup`` drops a replacement no longer wanted."""

    def __init__(self, keys: Keys, objects: Objects, index: S3Index, cleanup: Cleanup) -> None:
        self._keys = keys
        self._objects = objects
        self._index = index
        self._cleanup = cleanup

    def staged_location(self, job: str, step: int, rank: int) -> Path:
        return self._keys.staged_step(job, step) / layout.rank_dirname(rank)

    def list_staged(self, job: str, step: int) -> list[layout.PartRef]:
        staged = self._keys.staged_step(job, step)
        prefix = self._keys.dir_key(staged)
        found = []
        for obj in self._objects.listing(prefix):
            names = obj.get("Key", "")[len(prefix):].split("/")
            rank = layout.parse_rank_dirname(names[0])
            if rank is not None and names[1:] == [layout.MANIFEST_FILE]:
                found.append(layout.PartRef(job, step, rank, staged / names[0], version(obj["ETag"])))
        return sorted(found, key=lambda ref: ref.rank)

    def swap_in(self, record: layout.CommitRecord) -> bool:
        staged = self._keys.staged_step(record.job, record.step)
        if not self.list_staged(record.job, record.step):
            return False
        raw = layout.commit_record_bytes(record)
        self._objects.put(self._keys.key(staged / layout.COMMIT_FILE), raw)  # sealed
        self._move_in(staged, record.job, record.step, raw)
        return True

    def _move_in(self, staged: Path, job: str, step: int, record: bytes) -> None:
        """The staged step becomes the step: the one in place goes (record first), the staged objects are
        copied in (manifests last), then the record is written; the staging area goes last."""
        final = self._keys.step_location(job, step)
        try:
            self._objects.delete(self._keys.key(final / layout.COMMIT_FILE))
        except FileNotFoundError:
            pass
        self._remove_step_objects(final)
        source, dest = self._keys.dir_key(staged), self._keys.dir_key(final)
        staged_objects = [o for o in self._objects.listing(source)
                          if o.get("Key", "")[len(source):] != layout.COMMIT_FILE
                          and not o.get("Key", "").endswith("/" + CLAIM_FILE)]
        staged_objects.sort(key=lambda o: o["Key"].endswith("/" + layout.MANIFEST_FILE))  # data first, manifests last
        for obj in staged_objects:
            self._objects.copy(obj["Key"], dest + obj["Key"][len(source):], int(obj.get("Size", 0)))
        self._objects.put(self._keys.key(final / layout.COMMIT_FILE), record)
        self._objects.remove_tree(source)

    def _remove_step_objects(self, step: Path) -> None:
        """Every object of a step, each part's manifest before its files (claims stay: their writers')."""
        there = part_objects(self._objects, self._keys.dir_key(step))
        self._objects.delete_many([k for k in there if k.endswith("/" + layout.MANIFEST_FILE)])
        self._objects.delete_many([k for k in there if not k.endswith("/" + layout.MANIFEST_FILE)])

    def discard_staged(self, job: str, step: int) -> bool:
        return self._cleanup.discard_temporary(self._keys.staged_step(job, step))

    def recover_staged(self) -> int:
        root = self._keys.dir_key(self._keys.tmp() / REPLACE_DIR)
        done = 0
        url = self._keys.url
        for obj in list(self._objects.listing(root)):
            names = obj.get("Key", "")[len(root):].split("/")
            step = layout.parse_step_dirname(names[1]) if len(names) == 3 else None
            if step is None or names[2] != layout.COMMIT_FILE:
                continue
            job = names[0]
            staged = self._keys.staged_step(job, step)
            if self._index.has_commit_record(self._keys.step_location(job, step)):
                continue  # the old step stays (the swap never began), or the new one is in place already
            try:
                raw = self._objects.get(obj["Key"])
                layout.parse_commit_record(raw, staged / layout.COMMIT_FILE)
                self._move_in(staged, job, step, raw)
            except (OSError, layout.ManifestError) as e:
                log.error("cannot finish the replacement of %s step %d on %s: %s", job, step, url, e,
                          extra=fields(job=job, step=step, path=url, error=e))
                continue
            log.info("finished the replacement of %s step %d on %s that a crash interrupted", job, step, url,
                     extra=fields(job=job, step=step, path=url))
            done += 1
        return done
