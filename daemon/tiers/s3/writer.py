"""Writing a part to the object store: its objects under its claim, the manifest last.

**Publishing, all or nothing.** A part's files are uploaded straight to
their keys, large ones as multipart uploads with several pieces in flight
(:class:`ckptstage.daemon.tiers.s3.io.UploadSink`), and :meth:`S3PartWriter.commit`
writes ``manifest.json`` last: a part exists if and only if its manifest
object does (objects at a part's keys without one are nobody's part).
Nothing relies on a listing showing a write sooner than S3 promises: a
missing manifest reads as "not published".

A writer holds the part's claim while it writes
(:class:`ckptstage.daemon.tiers.s3.claims.Claims`), noted first in its daemon's
temporaries (``.tmp/<owner>/<job>.<step>.<rank>.<id>/.writer``). Where a
published part is there already (a part replaced in place), the new files
are uploaded to those temporaries and copied into place at commit, so the
old part stays whole until the writer's ``replace`` policy lets it go.
"""

from __future__ import annotations

import errno
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from ckptstage.daemon.logs import fields
from ckptstage.daemon.tiers.interface import Manifest
from ckptstage.daemon.tiers.s3.claims import Claim, Claims, part_objects, quietly
from ckptstage.daemon.tiers.s3.cleanup import Cleanup
from ckptstage.daemon.tiers.s3.io import Transfers, UploadSink
from ckptstage.daemon.tiers.s3.keys import WRITER_NOTE, Keys, plain_name
from ckptstage.daemon.tiers.s3.objects import Objects, version
from ckptstage.protos import layout

log = logging.getLogger(__name__)


class S3PartWriter:
    """One part being written under its claim: its files uploaded to the part's keys (or staged, where a
    part is published there already), published by :meth:`commit`."""

    def __init__(self, final: Path, staging: Path, replace: Callable[[Path], bool] | None, *, keys: Keys,
                 objects: Objects, claims: Claims, transfers: Transfers, cleanup: Cleanup) -> None:
        if not keys.owner:
            raise ValueError(f"{keys.url}: a tier opened without an owner only indexes; it writes no part")
        self._keys = keys
        self._objects = objects
        self._claims = claims
        self._transfers = transfers
        self._cleanup = cleanup
        self.final = final
        self.staging = staging  # this writer's temporaries: its note, and the files of a part replaced
        self.replace = replace
        self.manifest_digest = ""  # xxh3-64 of the committed manifest.json
        self.ino = 0               # the committed part's version
        self._files: dict[str, UploadSink] = {}
        self._claim: Claim | None = None
        self._staged = False  # a part was published at final when the claim was taken
        self._done = False

    def _hold(self) -> Claim:
        """The part's claim, taken on the first call (after noting it in the temporaries, for a clean-up
        after a crash); raises OSError when another writer holds it, or when this one lost it."""
        keys, objects = self._keys, self._objects
        if self._claim is None:
            part = keys.dir_key(self.final)
            writer = self.staging.name.rpartition(".")[2]
            note = keys.key(self.staging / WRITER_NOTE)
            objects.put(note, json.dumps({"owner": keys.owner, "writer": writer, "part": part,
                                          "started": time.time()}).encode())
            try:
                self._claim = self._claims.take(part, writer)
            except OSError:
                quietly(objects.delete, note)
                raise
            # A published part stays whole until commit asks ``replace``: the new files are staged meanwhile.
            self._staged = objects.head(keys.key(self.final / layout.MANIFEST_FILE)) is not None
        self._claims.check(self._claim)
        return self._claim

    def create_file(self, name: str, size: int, direct_io: bool, reserve: bool = True) -> UploadSink:
        """A new file of the part, uploaded as it is written (``direct_io`` and ``reserve`` mean nothing
        to an object store); it is completed only while this writer holds the claim."""
        claim = self._hold()
        where = (self.staging if self._staged else self.final) / plain_name(name)
        sink = self._transfers.upload_sink(self._keys.key(where), size,
                                           before_complete=lambda: self._claims.check(claim))
        self._files[name] = sink
        return sink

    def commit(self, manifest: Manifest) -> Path:
        """Writes the manifest, the part's last object: the part exists from then on.

        Objects at the part's keys that are not this writer's files (a crashed
        writing's) go first. A part already there is replaced only if ``replace``
        allows it: its manifest goes first, then its objects, then the staged
        files are copied in, so readers see the old part, nothing, then the new one.
        """
        keys, objects = self._keys, self._objects
        claim = self._hold()
        for sink in self._files.values():
            sink.sync()  # already done by the caller; a no-op then
        self._claims.verify(claim)
        manifest_key = keys.key(self.final / layout.MANIFEST_FILE)
        head = objects.head(manifest_key)
        if head is not None and not self._staged:
            raise FileExistsError(errno.EEXIST, f"{keys.url_of(self.final)} was published meanwhile by a writer that "
                                                "did not hold its claim")
        if head is not None and not (self.replace is not None and self.replace(self.final)):
            raise FileExistsError(errno.EEXIST, f"{keys.url_of(self.final)} is already committed")
        if head is not None:
            self._cleanup.remove_published(self.final, str(head["ETag"]))
        ours = set() if self._staged else {sink.key for sink in self._files.values()}
        objects.delete_many([k for k in part_objects(objects, keys.dir_key(self.final)) if k not in ours])
        if self._staged:
            for name, sink in self._files.items():
                objects.copy(sink.key, keys.key(self.final / name), sink.size)
        raw = layout.manifest_file_bytes(manifest)
        etag = objects.put(manifest_key, raw, if_absent=True)  # last: publishes the part
        self.manifest_digest = layout.chunk_digest(raw)
        self.ino = version(etag)
        self._done = True
        self._finish()
        return self.final

    def abort(self) -> None:
        """Drops what was written (a no-op once committed): uploads aborted, objects at the part's keys
        deleted while the claim is still this writer's and no part was published there."""
        if self._done:
            return
        self._done = True
        keys, objects = self._keys, self._objects
        claim = self._claim
        try:
            for sink in self._files.values():
                sink.close()
            if claim is not None and not claim.lost and not self._staged:
                if objects.head(keys.key(self.final / layout.MANIFEST_FILE)) is None:
                    objects.delete_many(part_objects(objects, keys.dir_key(self.final)))
        except OSError as e:
            # The store fails: the claim and the note stay, and whoever writes the part next (this daemon
            # at once, another once the claim is stale) or this daemon's next start cleans up.
            log.warning("cannot remove what was written at %s: %s", keys.url_of(self.final), e,
                        extra=fields(tier="shared", error=e))
            if claim is not None:
                self._claims.drop(claim, f"left behind: {e}", keys.dir_key(self.staging))
            return
        self._finish()

    def _finish(self) -> None:
        """Gives the claim back, then removes the temporaries, the note with them (kept where the claim
        could not be given back: the next start finds it through the note)."""
        keys = self._keys
        if self._claim is not None and not self._claims.release(self._claim):
            return
        try:
            if self._staged:
                self._objects.remove_tree(keys.dir_key(self.staging))
            else:  # the note is all there is
                self._objects.delete(keys.key(self.staging / WRITER_NOTE))
        except OSError as e:  # the daemon's next start removes them
            log.warning("cannot remove the temporaries %s: %s", keys.url_of(self.staging), e,
                        extra=fields(tier="shared", error=e))

