"""Writing to the object store: a part's objects under its claim, and a job's new chunks straight to theirs.

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
from typing import TYPE_CHECKING

from ckptstage.daemon.logs import fields
from ckptstage.daemon.tiers.s3.claims import WRITER_NOTE, Claim, quietly
from ckptstage.daemon.tiers.s3.io import UploadSink
from ckptstage.daemon.tiers.s3.objects import version
from ckptstage.daemon.tiers.interface import Manifest
from ckptstage.protos import chunks, layout

if TYPE_CHECKING:
    from ckptstage.daemon.tiers.s3.tier import S3Tier

log = logging.getLogger(__name__)


def plain_name(name: str) -> str:
    """``name`` as one segment of a key; ValueError for a name with a slash, an empty one, or a dot name."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"{name!r} is not a plain object name")
    return name


class S3PartWriter:
    """One part being written under its claim: its files uploaded to the part's keys (or staged, where a
    part is published there already), published by :meth:`commit`."""

    def __init__(self, tier: S3Tier, final: Path, staging: Path, replace: Callable[[Path], bool] | None) -> None:
        if not tier.owner:
            raise ValueError(f"{tier.url}: a tier opened without an owner only indexes; it writes no part")
        self._tier = tier
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
        tier = self._tier
        if self._claim is None:
            part = tier.dir_key(self.final)
            writer = self.staging.name.rpartition(".")[2]
            note = tier.key(self.staging / WRITER_NOTE)
            tier.objects.put(note, json.dumps({"owner": tier.owner, "writer": writer, "part": part,
                                               "started": time.time()}).encode())
            try:
                self._claim = tier.claims.take(part, writer)
            except OSError:
                quietly(tier.objects.delete, note)
                raise
            # A published part stays whole until commit asks ``replace``: the new files are staged meanwhile.
            self._staged = tier.objects.head(tier.key(self.final / layout.MANIFEST_FILE)) is not None
        tier.claims.check(self._claim)
        return self._claim

    def create_file(self, name: str, size: int, direct_io: bool, reserve: bool = True) -> UploadSink:
        """A new file of the part, uploaded as it is written (``direct_io`` and ``reserve`` mean nothing
        to an object store); it is completed only while this writer holds the claim."""
        tier = self._tier
        claim = self._hold()
        where = (self.staging if self._staged else self.final) / plain_name(name)
        sink = tier.upload_sink(tier.key(where), size, before_complete=lambda: tier.claims.check(claim))
        self._files[name] = sink
        return sink

    def commit(self, manifest: Manifest) -> Path:
        """Writes the manifest, the part's last object: the part exists from then on.

        Objects at the part's keys that are not this writer's files (a crashed
        writing's) go first. A part already there is replaced only if ``replace``
        allows it: its manifest goes first, then its objects, then the staged
        files are copied in, so readers see the old part, nothing, then the new one.
        """
        tier = self._tier
        claim = self._hold()
        for sink in self._files.values():
            sink.sync()  # already done by the caller; a no-op then
        tier.claims.verify(claim)
        manifest_key = tier.key(self.final / layout.MANIFEST_FILE)
        head = tier.objects.head(manifest_key)
        if head is not None and not self._staged:
            raise FileExistsError(errno.EEXIST, f"{tier.url_of(self.final)} was published meanwhile by a writer that "
                                                "did not hold its claim")
        if head is not None and not (self.replace is not None and self.replace(self.final)):
            raise FileExistsError(errno.EEXIST, f"{tier.url_of(self.final)} is already committed")
        if head is not None:
            tier.remove_published(self.final, str(head["ETag"]))
        ours = set() if self._staged else {sink.key for sink in self._files.values()}
        tier.objects.delete_many([k for k in tier.part_objects(tier.dir_key(self.final)) if k not in ours])
        if self._staged:
            for name, sink in self._files.items():
                tier.objects.copy(sink.key, tier.key(self.final / name), sink.size)
        raw = layout.manifest_file_bytes(manifest)
        etag = tier.objects.put(manifest_key, raw, if_absent=True)  # last: publishes the part
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
        tier = self._tier
        claim = self._claim
        try:
            for sink in self._files.values():
                sink.close()
            if claim is not None and not claim.lost and not self._staged:
                if tier.objects.head(tier.key(self.final / layout.MANIFEST_FILE)) is None:
                    tier.objects.delete_many(tier.part_objects(tier.dir_key(self.final)))
        except OSError as e:
            # The store fails: the claim and the note stay, and whoever writes the part next (this daemon
            # at once, another once the claim is stale) or this daemon's next start cleans up.
            log.warning("cannot remove what was written at %s: %s", tier.url_of(self.final), e,
                        extra=fields(tier="shared", error=e))
            if claim is not None:
                tier.claims.drop(claim, f"left behind: {e}", tier.dir_key(self.staging))
            return
        self._finish()

    def _finish(self) -> None:
        """Gives the claim back, then removes the temporaries, the note with them (kept where the claim
        could not be given back: the next start finds it through the note)."""
        tier = self._tier
        if self._claim is not None and not tier.claims.release(self._claim):
            return
        try:
            if self._staged:
                tier.objects.remove_tree(tier.dir_key(self.staging))
            else:  # the note is all there is
                tier.objects.delete(tier.key(self.staging / WRITER_NOTE))
        except OSError as e:  # the daemon's next start removes them
            log.warning("cannot remove the temporaries %s: %s", tier.url_of(self.staging), e,
                        extra=fields(tier="shared", error=e))


class S3ChunkBatch:
    """New chunks of a job's store, each uploaded straight to its key in the store by :meth:`write`.

    Staging them first and copying them in at :meth:`publish` would cost a
    second copy of every byte and twice the requests, and protect nothing: a
    chunk's name is the hash of its bytes, so a chunk never changes (one
    written where the same name already is has the same bytes), and a PUT is
    whole or absent. A chunk in the store before a manifest names it is
    harmless: no part relies on it yet, a writer that finds it reuses the
    right bytes, and a sweep leaves it for the grace period as it was written
    just now (this daemon's sweeps never take a chunk its writers lease). So
    every chunk is in the store once its :meth:`write` returned, and
    :meth:`discard` leaves what was written for a later save to reuse or a
    sweep to remove: another writer may rely on it already.
    """

    def __init__(self, tier: S3Tier, job: str) -> None:
        self._tier = tier
        self._job = job

    def write(self, name: str, data: memoryview, direct_io: bool) -> None:
        if not chunks.is_chunk_name(name):
            raise ValueError(f"{name!r} is not a chunk name")
        self._tier.objects.put(self._tier.key(self._tier.chunk_location(self._job, name)), bytes(data))

    def publish(self) -> None:
        """Nothing left to do: each chunk went into the store whole as it was written."""

    def discard(self) -> None:
        """Nothing to undo: chunks written stay for a later save or a sweep (see the class)."""
