"""Removing published parts, and cleaning what this daemon left in its own temporaries on the object store.

**Deleting.** A part's manifest goes first (the part vanishes at once),
then its files; a removal is recorded in the temporaries first, so that one
cut short (a crash, or the store failing half way) is finished when the
step's record is removed (:meth:`Cleanup.finish_removals`: a record goes
after every object of its parts) or when the daemon starts
(:meth:`Cleanup.clean_temporaries`, which also aborts this daemon's multipart
uploads and cleans the parts its writers left half written, through their
notes). What a daemon that never comes back left, any other daemon cleans
once it has been untouched long enough (:mod:`ckptstage.daemon.tiers.s3.orphans`).
"""

from __future__ import annotations

import errno
import json
import uuid
from pathlib import Path

from ckptstage.daemon.tiers.s3.claims import Claims, discard_unpublished, part_objects
from ckptstage.daemon.tiers.s3.keys import REMOVING, WRITER_NOTE, Keys
from ckptstage.daemon.tiers.s3.objects import Objects
from ckptstage.protos import layout


class Cleanup:
    """Removals, and this daemon's temporaries (``keys.owner``'s), on one bucket's ``objects``."""

    def __init__(self, objects: Objects, claims: Claims, keys: Keys) -> None:
        self._objects = objects
        self._claims = claims
        self._keys = keys

    def remove_published(self, part: Path, etag: str) -> None:
        """Removes the part whose manifest has ``etag``: the manifest first, then its files (its claim
        stays: its writer's), noted in the temporaries meanwhile (a tier without an owner notes nothing)."""
        keys = self._keys
        note = keys.removal_note(uuid.uuid4().hex[:12]) if keys.owner else None
        if note is not None:
            self._objects.put(note, json.dumps({"part": keys.dir_key(part)}).encode())
        self._objects.delete(keys.key(part / layout.MANIFEST_FILE), etag)
        self._objects.delete_many(part_objects(self._objects, keys.dir_key(part)))
        if note is not None:
            self._objects.delete(note)

    def finish_removals(self, step: Path) -> None:
        """Finishes the removals of the step's parts that this daemon left cut short (the store failed
        half way), before the step's record goes."""
        if self._keys.owner:
            for obj in list(self._objects.listing(self._keys.removals())):
                self._finish_removal(obj["Key"], under=self._keys.dir_key(step))

    def clean_temporaries(self) -> int:
        """Finishes removals cut short, cleans the parts this daemon's writers left half written under
        their claims, aborts its multipart uploads and deletes its staged objects; returns how many
        entries of ``.tmp/<owner>/`` that was."""
        objects = self._objects
        tmp = self._keys.dir_key(self._keys.tmp())
        entries: set[str] = set()
        for obj in list(objects.listing(self._keys.removals())):
            self._finish_removal(obj["Key"])
            entries.add(REMOVING)
        for note in [o["Key"] for o in objects.listing(tmp) if o.get("Key", "").endswith("/" + WRITER_NOTE)]:
            self._finish_writer(note)
        for key in objects.abort_uploads(tmp):
            entries.add(key[len(tmp):].split("/")[0])
        keys = [o["Key"] for o in objects.listing(tmp) if "Key" in o]
        entries.update(k[len(tmp):].split("/")[0] for k in keys)
        objects.delete_many(keys)
        return len(entries)

    def discard_temporary(self, location: Path) -> bool:
        """Removes a tree inside this daemon's temporaries, and the uploads under it; False when absent."""
        keys = self._keys
        prefix = keys.dir_key(location)
        if not prefix.startswith(keys.dir_key(keys.tmp())):
            raise OSError(errno.EXDEV, f"{keys.url_of(location)} is not among the temporaries of {keys.owner} on "
                                       f"{keys.url}")
        uploads = self._objects.abort_uploads(prefix)
        return self._objects.remove_tree(prefix) > 0 or bool(uploads)

    def _finish_writer(self, note: str) -> None:
        """A writer of this daemon that a crash stopped: while the part's claim is still that writer's, its
        uploads are aborted and its objects deleted (unless it published the part), then the claim goes."""
        try:
            info = json.loads(self._objects.get(note))
            part, writer = str(info["part"]), str(info["writer"])
        except FileNotFoundError:
            return
        except (ValueError, KeyError, TypeError):
            return  # not a note of this version: it claimed nothing
        if not part.startswith(self._keys.dir_key(self._keys.root)):
            return
        claim = self._claims.recover(part, writer)
        if claim is None:
            return  # it never took the claim, or another writer broke it since: what is there is not ours
        self._objects.abort_uploads(part)
        discard_unpublished(self._objects, part)
        self._claims.release(claim)

    def _finish_removal(self, note: str, under: str = "") -> None:
        """A removal cut short (of a part under ``under``, if given): the part's remaining objects go,
        unless a part was published there since."""
        try:
            prefix = str(json.loads(self._objects.get(note))["part"])
        except FileNotFoundError:
            return  # finished meanwhile
        except (ValueError, KeyError, TypeError):
            prefix = ""  # not one of ours to finish
        if not prefix.startswith(under):
            return
        if prefix:
            discard_unpublished(self._objects, prefix)
        self._objects.delete(note)
