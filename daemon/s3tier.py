"""The object-store tier: :class:`ckptstage.daemon.tier.Tier` on an S3-compatible bucket.

Objects mirror docs/FORMAT.md's layout under the URL's prefix, so that a
person or another tool reads them as the file-system tier's files::

    <prefix>/<job>/step-000000000120/rank-00000/data.safetensors
    <prefix>/<job>/step-000000000120/rank-00000/manifest.json
    <prefix>/<job>/step-000000000120/commit.json
    <prefix>/<job>/chunks/9f/9f2c...          <prefix>/<job>/retention.json
    <prefix>/.tmp/<owner>/...                 this daemon's temporaries

**Locations.** The interface names places by ``Path``. Here a location is a
pseudo-path: :data:`PSEUDO_ROOT` / bucket / prefix / the key below the prefix
(``/s3:/bucket/prefix/job/step-000000000120/rank-00000``), which
:meth:`S3Tier.key` turns back into the key. No file-system call may be made
on one: nothing exists under ``/s3:``, and the tier's operations are the only
way to its objects. Clients cannot open objects as files either:
:meth:`S3Tier.readable_path` is None, and a restore goes through the daemon,
which fetches the part to the local tier first.

**Publishing, all or nothing.** A part's files are uploaded straight to
their keys, large ones as multipart uploads with several pieces in flight
(:class:`ckptstage.daemon.s3io.UploadSink`), and :meth:`S3PartWriter.commit`
writes ``manifest.json`` last: a part exists if and only if its manifest
object does (objects at a part's keys without one are nobody's part), and a
step exists only through its ``commit.json``, created with a conditional PUT
(``If-None-Match: *``) so that exactly one of racing daemons creates it.
Nothing relies on a listing showing a write sooner than S3 promises: a
missing manifest or record reads as "not published".

**Claims.** Writing at the final keys is safe only if two daemons never
write the same part at once: a writer first creates the part's claim,
``<part>/.claim`` (a conditional PUT naming the daemon and the writing), and
keeps it while it writes (:class:`Claims`). A writer that finds another's
claim gives up for now (EBUSY: the drain retries), unless the claim is
abandoned: its daemon's own from before a restart, or another's left
unchanged (not renewed) for ``claim_stale_s``. Where a published part is
there already (a part replaced in place), the new files are uploaded to this
daemon's temporaries (``.tmp/<owner>/<job>.<step>.<rank>.<id>/``) and copied
into place at commit, so the old part stays whole until the writer's
``replace`` policy lets it go. Every writer notes its claim in the
temporaries first, so that :meth:`S3Tier.clean_temporaries` finds what a
crash left at a part's keys (its uploads and objects, under its claim).

**Deleting.** A part's manifest goes first (the part vanishes at once),
then its files; a removal is recorded in the temporaries first, so that one
cut short (a crash, or the store failing half way) is finished when the
step's record is removed (:meth:`S3Tier.remove_commit_record`: a record goes
after every object of its parts) or when the daemon starts
(:meth:`S3Tier.clean_temporaries`, which also aborts this daemon's multipart
uploads left by a crash).

**Versions** are the ETag of the manifest (or record) object, as an integer:
an object written again with other bytes has another one. Written again with
the same bytes it keeps it, and then nothing a reader indexed differs.

**Room.** An object store has no free space to speak of: :meth:`S3Tier.usage`
says it is unbounded (no total, no free room), after one request that shows
the store answers. What the tier holds is the catalogue's
count (``ckptstage_tier_used_bytes``); listing the prefix to count it again
would take longer than the tier probe allows on a large bucket, and the probe
would report a healthy store as hung.

**Replacing a step** (a save with ``overwrite``): the replacement is staged
in the temporaries and swapped in as described above :meth:`S3Tier.swap_in`;
there is no atomic exchange of many objects, so readers see the old step,
then no step (no record) for the time of the copies, then the new one.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import boto3.s3.transfer
import xxhash

from ckptstage.daemon.logs import fields
from ckptstage.daemon.s3client import MAX_CONNECTIONS, Connection, check, connect, errors, is_conflict
from ckptstage.daemon.s3io import MIN_PIECE_BYTES, ObjectReader, UploadSink, abort
from ckptstage.daemon.tier import Manifest, PartWriter, QuarantinedCopy, Usage
from ckptstage.protos import chunks, layout

log = logging.getLogger(__name__)

PSEUDO_ROOT = Path("/s3:")  # locations on an object store: never a directory of this node
PIECE_BYTES = 64 << 20       # a multipart upload's piece (S3 allows 5 MiB to 5 GiB)
IN_FLIGHT = 8                # pieces of one object uploading at once ([shared] multipart_concurrency)
THREADS = 16                 # uploads (and, apart, ranged reads) in flight, across the tier
MAX_THREADS = MAX_CONNECTIONS // 2  # both pools together hold at most the client's connections
VERIFY_PIECE_BYTES = 64 << 20  # read at once (as several ranged GETs) by verify_part
MAX_COPY_BYTES = 5 << 30     # the largest object one CopyObject copies; larger ones go piece by piece
_MANY = 256                  # more chunk names than this: list the store instead of asking for each
_WRITER_MARK = ".writer"     # .tmp/<owner>/<job>.<step>.<rank>.<id>/.writer: a writer's note (its part, its claim)
CLAIM_FILE = ".claim"        # <part>/.claim: who writes the part's objects now (see Claims)
CLAIM_STALE_S = 120.0        # another daemon's claim left unchanged this long is abandoned (renewed every 1/4)
_REMOVING = "removing"       # .tmp/<owner>/removing/<id>.json: a removal under way (its prefix)
_REPLACE_DIR = "replace"     # .tmp/<owner>/replace/<job>/step-N/: replacements being assembled


def version(etag: str) -> int:
    """An object's version from its ETag: a non-zero integer that changes with the object's bytes."""
    return xxhash.xxh3_64_intdigest(etag.strip('"').encode()) or 1


class S3Tier:
    """One bucket and prefix holding checkpoints, as the daemon ``owner`` uses it.

    ``owner`` names this daemon's temporaries (``.tmp/<owner>/``); a tier used
    only to index needs none. ``piece_bytes`` and ``in_flight`` shape uploads
    (:class:`ckptstage.daemon.s3io.UploadSink`); ``threads`` run them, and
    the ranged reads (each kind its own pool); ``claim_stale_s`` is when
    another daemon's claim counts as abandoned (:class:`Claims`).
    """

    def __init__(self, conn: Connection, owner: str = "", piece_bytes: int = PIECE_BYTES,
                 in_flight: int = IN_FLIGHT, threads: int = THREADS, claim_stale_s: float = CLAIM_STALE_S) -> None:
        if piece_bytes < MIN_PIECE_BYTES:
            raise ValueError(f"a multipart upload's pieces are at least {MIN_PIECE_BYTES} bytes, not {piece_bytes}")
        self.connection = conn
        self._owner = owner
        self._prefix = conn.location.prefix
        self._root = PSEUDO_ROOT / conn.bucket / self._prefix if self._prefix else PSEUDO_ROOT / conn.bucket
        self._piece_bytes = piece_bytes
        self._in_flight = in_flight
        self._threads = threads
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._pools_lock = threading.Lock()
        self.claims = Claims(self, claim_stale_s)

    @classmethod
    def from_config(cls, config: Any, owner: str) -> S3Tier:
        """The tier ``[shared] url`` names (``config``: a :class:`ckptstage.daemon.config.SharedConfig`):
        pieces of ``multipart_bytes``, ``multipart_concurrency`` of them per file at once, and threads for
        that many per part drained at once."""
        threads = min(MAX_THREADS, max(THREADS, config.multipart_concurrency * config.max_concurrent))
        return cls(connect(config), owner, piece_bytes=config.multipart_bytes,
                   in_flight=config.multipart_concurrency, threads=threads)

    @property
    def root(self) -> Path:
        return self._root

    @property
    def owner(self) -> str:
        return self._owner

    @property
    def url(self) -> str:
        return self.connection.location.url

    @property
    def location(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"S3Tier({self.url!r} at {self.connection.endpoint})"

    def check(self) -> None:
        """Whether the bucket is there and the credentials may use it; raises an OSError naming the
        bucket, the endpoint and the credentials' source (see :func:`ckptstage.daemon.s3client.check`)."""
        check(self.connection)

    # --- keys ---------------------------------------------------------------------------

    def key(self, location: Path | PurePosixPath) -> str:
        """The object key of a location of this tier; raises OSError (EXDEV) for one elsewhere."""
        try:
            rel = PurePosixPath(location).relative_to(PurePosixPath(self._root))
        except ValueError:
            raise OSError(errno.EXDEV, f"{location} is not a location of the tier {self.url}") from None
        text = "" if str(rel) == "." else rel.as_posix()
        return f"{self._prefix}/{text}".strip("/") if self._prefix else text

    def _location(self, key: str) -> Path:
        return self._root / key[len(self._prefix):].lstrip("/") if self._prefix else self._root / key

    def _dir_key(self, location: Path) -> str:
        """The key prefix of everything below a location (ends with a slash)."""
        key = self.key(location)
        return f"{key}/" if key else ""

    def _tmp(self) -> Path:
        return layout.tmp_root(self._root, self._owner)

    def _pool(self, name: str) -> ThreadPoolExecutor:
        with self._pools_lock:
            pool = self._pools.get(name)
            if pool is None:
                pool = self._pools[name] = ThreadPoolExecutor(self._threads, thread_name_prefix=f"s3-{name}")
            return pool

    # --- requests -----------------------------------------------------------------------

    def _head(self, key: str) -> dict[str, Any] | None:
        """The object's metadata; None when it is not there."""
        try:
            with errors("looking up", self.connection, key):
                return dict(self.connection.client.head_object(Bucket=self.connection.bucket, Key=key))
        except FileNotFoundError:
            return None

    def _get(self, key: str) -> bytes:
        """A small object's bytes; FileNotFoundError when it is not there."""
        with errors("reading", self.connection, key):
            return bytes(self.connection.client.get_object(Bucket=self.connection.bucket, Key=key)["Body"].read())

    def _put(self, key: str, data: bytes, if_absent: bool = False, if_match: str | None = None) -> str:
        """Writes a small object whole; returns its ETag. ``if_absent``: FileExistsError when one is there;
        ``if_match``: FileExistsError (or FileNotFoundError) unless the object there has that ETag."""
        extra = {"IfNoneMatch": "*"} if if_absent else {"IfMatch": if_match} if if_match else {}
        for attempt in range(5):
            try:
                with errors("writing", self.connection, key):
                    got = self.connection.client.put_object(Bucket=self.connection.bucket, Key=key, Body=data,
                                                            **extra)
                return str(got["ETag"])
            except OSError as e:
                if not (if_absent and is_conflict(e)) or attempt == 4:
                    raise
                time.sleep(0.05 * 2 ** attempt)  # another conditional write of the key is under way
        raise AssertionError("unreachable")

    def _delete(self, key: str, etag: str | None = None) -> None:
        """Deletes one object (only while it has ``etag``, when given); FileNotFoundError when it is gone
        (or was written again meanwhile)."""
        extra = {"IfMatch": etag} if etag else {}
        try:
            with errors("deleting", self.connection, key):
                self.connection.client.delete_object(Bucket=self.connection.bucket, Key=key, **extra)
        except FileExistsError as e:  # the condition failed: the object is not the one we meant
            raise FileNotFoundError(errno.ENOENT, str(e)) from e

    def _delete_many(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        for i in range(0, len(keys), 1000):  # the most one request deletes
            batch = keys[i:i + 1000]
            with errors("deleting objects under", self.connection, batch[0]):
                got = self.connection.client.delete_objects(
                    Bucket=self.connection.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            failed = [e for e in got.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if failed:
                raise OSError(errno.EIO, f"deleting {self.connection.where(failed[0].get('Key'))}: "
                                         f"{failed[0].get('Code')} {failed[0].get('Message')}")

    def _copy(self, source: str, dest: str, size: int | None = None) -> None:
        """A server-side copy of one object; FileNotFoundError when the source is not there."""
        conn = self.connection
        with errors(f"copying s3://{conn.bucket}/{source} to", conn, dest):
            if size is not None and size <= MAX_COPY_BYTES:
                conn.client.copy_object(Bucket=conn.bucket, Key=dest, CopySource={"Bucket": conn.bucket,
                                                                                   "Key": source})
            else:  # piece by piece (needed above 5 GiB), several at once
                conn.client.copy({"Bucket": conn.bucket, "Key": source}, conn.bucket, dest,
                                 Config=boto3.s3.transfer.TransferConfig(
                                     multipart_threshold=MAX_COPY_BYTES, multipart_chunksize=self._piece_bytes,
                                     max_concurrency=self._in_flight))

    def _list(self, prefix: str, delimiter: str = "") -> Iterator[dict[str, Any]]:
        """Every object under ``prefix`` (and, with ``delimiter``, each common prefix as ``{"Prefix": ...}``)."""
        conn = self.connection
        kwargs: dict[str, Any] = {"Bucket": conn.bucket, "Prefix": prefix}
        if delimiter:
            kwargs["Delimiter"] = delimiter
        with errors("listing", conn, prefix):
            for page in conn.client.get_paginator("list_objects_v2").paginate(**kwargs):
                yield from page.get("CommonPrefixes", [])
                yield from page.get("Contents", [])

    def _any(self, prefix: str) -> bool:
        conn = self.connection
        with errors("listing", conn, prefix):
            got = conn.client.list_objects_v2(Bucket=conn.bucket, Prefix=prefix, MaxKeys=1)
        return bool(got.get("Contents"))

    def _remove_tree(self, prefix: str) -> int:
        """Deletes every object under ``prefix``; returns how many there were."""
        keys = [o["Key"] for o in self._list(prefix) if "Key" in o]
        self._delete_many(keys)
        return len(keys)

    def _part_objects(self, prefix: str) -> list[str]:
        """The keys under a part's ``prefix``, but its claim (only its writer, or a clean-up of that
        writer's, removes that)."""
        return [o["Key"] for o in self._list(prefix) if "Key" in o and not o["Key"].endswith("/" + CLAIM_FILE)]

    # --- the index ---------------------------------------------------------------------

    def list_jobs(self) -> list[str]:
        found = []
        for entry in self._list(self._dir_key(self._root), "/"):
            name = entry.get("Prefix", "").rstrip("/").rpartition("/")[2]
            try:
                found.append(layout.check_job(name))
            except layout.InvalidName:
                continue  # .tmp, and names the format does not make
        return sorted(found)

    def list_steps(self, job: str, step: int | None = None) -> Iterator[layout.StepRef]:
        """One listing of the job's steps (``<job>/step-``, chunks excluded), read for manifests and records."""
        job_key = self._dir_key(self._root / layout.check_job(job))
        prefix = job_key + (f"{layout.step_dirname(step)}/" if step is not None else "step-")
        parts: dict[int, list[layout.PartRef]] = {}
        records: dict[int, int] = {}
        for obj in self._list(prefix):
            names = obj.get("Key", "")[len(job_key):].split("/")
            s = layout.parse_step_dirname(names[0])
            if s is None:
                continue
            if names[1:] == [layout.COMMIT_FILE]:
                records[s] = version(obj["ETag"])
            elif len(names) == 3 and names[2] == layout.MANIFEST_FILE:
                r = layout.parse_rank_dirname(names[1])
                if r is not None:
                    parts.setdefault(s, []).append(layout.PartRef(job, s, r, self.part_location(job, s, r),
                                                                  version(obj["ETag"])))
        for s in sorted(parts.keys() | records.keys()):
            yield layout.StepRef(job, s, self.step_location(job, s),
                                 tuple(sorted(parts.get(s, []), key=lambda p: p.rank)), records.get(s))

    def part_location(self, job: str, step: int, rank: int) -> Path:
        return layout.part_dir(self._root, job, step, rank)

    def step_location(self, job: str, step: int) -> Path:
        return layout.step_dir(self._root, job, step)

    def has_part(self, part: Path) -> bool:
        return self.part_version(part) != 0

    def part_version(self, part: Path) -> int:
        head = self._head(self.key(part / layout.MANIFEST_FILE))
        return version(head["ETag"]) if head else 0

    def read_manifest(self, part: Path) -> tuple[Manifest, str]:
        path = part / layout.MANIFEST_FILE
        try:
            raw = self._get(self.key(path))
        except OSError as e:
            raise layout.ManifestError(f"{path}: unreadable manifest: {e}") from e
        return layout.parse_manifest_file(raw, path), layout.chunk_digest(raw)

    def has_commit_record(self, step: Path) -> bool:
        return self.record_version(step) != 0

    def read_commit_record(self, step: Path) -> layout.CommitRecord | None:
        path = step / layout.COMMIT_FILE
        try:
            raw = self._get(self.key(path))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise layout.ManifestError(f"{path}: unreadable commit record: {e}") from e
        return layout.parse_commit_record(raw, path)

    def record_version(self, step: Path) -> int:
        head = self._head(self.key(step / layout.COMMIT_FILE))
        return version(head["ETag"]) if head else 0

    # --- parts and records --------------------------------------------------------------

    def begin_part(self, job: str, step: int, rank: int, replace: Callable[[Path], bool] | None = None,
                   final: Path | None = None) -> S3PartWriter:
        staging = self._tmp() / f"{layout.check_job(job)}.{step}.{rank}.{uuid.uuid4().hex[:12]}"
        return S3PartWriter(self, final or self.part_location(job, step, rank), staging, replace)

    def open_file(self, part: Path, name: str) -> ObjectReader:
        return ObjectReader(self.connection, self.key(part / name), self._pool("read"))

    def verify_part(self, part: Path) -> None:
        """Reads every byte of the part (its objects, or its chunks) by ranges and checks it against the
        manifest: sizes, then each block's digest, as :func:`ckptstage.protos.chunks.verify_part` does."""
        manifest = self.read_manifest(part)[0]
        piece = memoryview(bytearray(VERIFY_PIECE_BYTES))
        for name, entry in layout.manifest_files(manifest).items():
            verifier = layout.BlockVerifier(entry, part / name)
            for ext in chunks.extents(part, manifest, name):
                verifier.path = ext.path  # a bad block is named by the object its last bytes came from
                try:
                    reader = ObjectReader(self.connection, self.key(ext.path), self._pool("read"))
                except FileNotFoundError as e:
                    raise layout.ChecksumMismatch(ext.path, f"missing: {e}") from e
                except OSError as e:
                    raise layout.ManifestError(f"{ext.path}: unreadable: {e}") from e
                if reader.size != ext.hi - ext.base:
                    raise layout.ChecksumMismatch(ext.path, f"size {reader.size} != {ext.hi - ext.base} in the "
                                                            "manifest")
                reader.seek(ext.lo - ext.base)
                left = ext.hi - ext.lo
                while left:
                    try:
                        n = reader.readinto(piece[:min(len(piece), left)]) or 0
                    except OSError as e:
                        raise layout.ManifestError(f"{ext.path}: unreadable: {e}") from e
                    if not n:
                        raise layout.ChecksumMismatch(ext.path, "shorter than the manifest says")
                    verifier.feed(piece[:n])
                    left -= n
            chunks.check_block_count(part / name, entry, verifier)

    def readable_path(self, part: Path) -> Path | None:
        return None  # objects are not files: the daemon fetches the part to the local tier for readers

    def remove_part(self, part: Path) -> None:
        """The manifest first (the part is gone at once), then its files; recorded in the temporaries
        first, so that a removal cut short is finished on start."""
        manifest = self.key(part / layout.MANIFEST_FILE)
        head = self._head(manifest)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no part at {part}")
        self._remove_published(part, str(head["ETag"]))

    def _remove_published(self, part: Path, etag: str) -> None:
        note = self.key(self._tmp() / _REMOVING / f"{uuid.uuid4().hex[:12]}.json") if self._owner else None
        if note is not None:
            self._put(note, json.dumps({"part": self._dir_key(part)}).encode())
        self._delete(self.key(part / layout.MANIFEST_FILE), etag)
        self._delete_many(self._part_objects(self._dir_key(part)))
        if note is not None:
            self._delete(note)

    def create_commit_record(self, step: Path, record: layout.CommitRecord) -> bool:
        try:
            self._put(self.key(step / layout.COMMIT_FILE), layout.commit_record_bytes(record), if_absent=True)
        except FileExistsError:
            return False
        return True

    def remove_commit_record(self, step: Path) -> None:
        """Deletes the record; the removals of the step's parts that this daemon left cut short (the store
        failed half way) are finished first: a record goes after its parts, every object of them."""
        key = self.key(step / layout.COMMIT_FILE)
        head = self._head(key)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no commit record in {step}")
        if self._owner:
            for obj in list(self._list(self._dir_key(self._tmp()) + f"{_REMOVING}/")):
                self._finish_removal(obj["Key"], under=self._dir_key(step))
        self._delete(key, str(head["ETag"]))

    def read_job_json(self, job: str, name: str, default: Any) -> Any:
        try:
            raw = self._get(self.key(self._root / layout.check_job(job) / _plain_name(name)))
        except FileNotFoundError:
            return default
        try:
            return json.loads(raw)
        except ValueError:
            return default  # as the file-system tier reads an unreadable document

    def write_job_json(self, job: str, name: str, obj: Any) -> None:
        self._put(self.key(self._root / layout.check_job(job) / _plain_name(name)),
                  json.dumps(obj, sort_keys=True).encode())  # one PUT: readers see the old or the new

    # --- chunk stores -------------------------------------------------------------------

    def _store(self, job: str) -> Path:
        return chunks.store_dir(self._root, job)

    def has_chunk_store(self, job: str) -> bool:
        return self._any(self._dir_key(self._store(job)))

    def chunk_location(self, job: str, name: str) -> Path:
        return chunks.chunk_path(self._store(job), name)

    def touch_chunk(self, job: str, name: str) -> bool:
        """Copies the chunk onto itself: its modification time (what a sweep reads) becomes now."""
        key = self.key(self.chunk_location(job, name))
        conn = self.connection
        try:
            with errors("touching", conn, key):
                conn.client.copy_object(Bucket=conn.bucket, Key=key, CopySource={"Bucket": conn.bucket, "Key": key},
                                        MetadataDirective="REPLACE", Metadata={"touched": f"{time.time():.3f}"})
        except FileNotFoundError:
            return False
        return True

    def chunk_size(self, job: str, name: str) -> int:
        key = self.key(self.chunk_location(job, name))
        head = self._head(key)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no chunk {self.connection.where(key)}")
        return int(head["ContentLength"])

    def open_chunk(self, job: str, name: str) -> ObjectReader:
        return ObjectReader(self.connection, self.key(self.chunk_location(job, name)), self._pool("read"))

    def missing_chunks(self, job: str, names: Iterable[str]) -> list[str]:
        names = list(names)
        if len(names) > _MANY:
            held = set(self.list_chunks(job))
            return [n for n in names if n not in held]
        keys = [self.key(self.chunk_location(job, n)) for n in names]
        there = list(self._pool("read").map(self._head, keys))
        return [n for n, head in zip(names, there) if head is None]

    def new_chunks(self, job: str, part: PartWriter | None = None) -> S3ChunkBatch:
        if part is not None:
            assert isinstance(part, S3PartWriter), "a part of this tier stages the batch"
            staging = part.staging / ".new"  # with the part's temporaries: an abort removes it with the rest
        else:
            staging = self._tmp() / f"chunks.{uuid.uuid4().hex[:12]}"
        return S3ChunkBatch(self, job, staging)

    def list_manifests(self, job: str) -> list[Path]:
        """The published parts, and the replacements any daemon is assembling in its temporaries."""
        parts = [p.path for s in self.list_steps(job) for p in s.parts]
        tmp = self._dir_key(self._root / layout.TMP_DIR)
        for owner in self._list(tmp, "/"):
            staging = owner.get("Prefix", "") + f"{_REPLACE_DIR}/{layout.check_job(job)}/"
            for obj in self._list(staging):
                names = obj.get("Key", "")[len(staging):].split("/")
                if len(names) == 3 and names[2] == layout.MANIFEST_FILE and \
                        layout.parse_step_dirname(names[0]) is not None and layout.parse_rank_dirname(names[1]) \
                        is not None:
                    parts.append(self._location(obj["Key"]).parent)
        return parts

    def manifest_version(self, part: Path) -> tuple[int, ...]:
        key = self.key(part / layout.MANIFEST_FILE)
        head = self._head(key)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no manifest {self.connection.where(key)}")
        return version(head["ETag"]), int(head["ContentLength"])

    def list_chunks(self, job: str) -> list[str]:
        out = []
        for obj in self._list(self._dir_key(self._store(job))):
            fan, _, name = obj.get("Key", "").rpartition("/")
            if chunks.is_chunk_name(name) and fan.endswith(f"/{name[:2]}"):  # not .condemned nor .corrupt
                out.append(name)
        return out

    def _condemned(self, job: str, name: str) -> str:
        return self.key(self._store(job) / chunks.CONDEMNED_DIR / name)

    def condemn_chunk(self, job: str, name: str, untouched_since: float) -> bool:
        key = self.key(self.chunk_location(job, name))
        head = self._head(key)
        # S3 keeps modification times to the second: the second it names may run up to 1 s later.
        if head is None or head["LastModified"].timestamp() + 1 > untouched_since:
            return False
        try:
            self._copy(key, self._condemned(job, name), int(head["ContentLength"]))
            self._delete(key, str(head["ETag"]))
        except FileNotFoundError:
            return False  # another node's sweep took it first
        return True

    def condemned_chunks(self, job: str) -> list[str]:
        prefix = self._dir_key(self._store(job) / chunks.CONDEMNED_DIR)
        return [name for obj in self._list(prefix)
                if chunks.is_chunk_name(name := obj.get("Key", "")[len(prefix):])]

    def restore_chunk(self, job: str, name: str) -> None:
        condemned = self._condemned(job, name)
        head = self._head(condemned)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no condemned chunk {self.connection.where(condemned)}")
        self._copy(condemned, self.key(self.chunk_location(job, name)), int(head["ContentLength"]))
        self._delete(condemned)

    def delete_condemned_chunk(self, job: str, name: str) -> int:
        condemned = self._condemned(job, name)
        head = self._head(condemned)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no condemned chunk {self.connection.where(condemned)}")
        self._delete(condemned, str(head["ETag"]))
        return int(head["ContentLength"])

    # --- housekeeping -------------------------------------------------------------------

    def prepare(self) -> None:
        """Checks that the bucket answers to these credentials (a bucket is the operator's to create)."""
        self.check()

    def clean_temporaries(self) -> int:
        """Finishes removals cut short, cleans the parts this daemon's writers left half written under
        their claims, aborts its multipart uploads and deletes its staged objects; returns how many
        entries of ``.tmp/<owner>/`` that was."""
        tmp = self._dir_key(self._tmp())
        entries: set[str] = set()
        for obj in list(self._list(tmp + f"{_REMOVING}/")):
            self._finish_removal(obj["Key"])
            entries.add(_REMOVING)
        for note in [o["Key"] for o in self._list(tmp) if o.get("Key", "").endswith("/" + _WRITER_MARK)]:
            self._finish_writer(note)
        for key in self._abort_uploads(tmp):
            entries.add(key[len(tmp):].split("/")[0])
        keys = [o["Key"] for o in self._list(tmp) if "Key" in o]
        entries.update(k[len(tmp):].split("/")[0] for k in keys)
        self._delete_many(keys)
        return len(entries)

    def _abort_uploads(self, prefix: str) -> list[str]:
        """Aborts every multipart upload under ``prefix``; returns their keys."""
        conn = self.connection
        with errors("listing the multipart uploads under", conn, prefix):
            uploads = [u for page in conn.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=conn.bucket, Prefix=prefix) for u in page.get("Uploads", [])]
        for upload in uploads:
            abort(conn, upload["Key"], upload["UploadId"])
        return [u["Key"] for u in uploads]

    def _finish_writer(self, note: str) -> None:
        """A writer of this daemon that a crash stopped: while the part's claim is still that writer's, its
        uploads are aborted and its objects deleted (unless it published the part), then the claim goes."""
        try:
            info = json.loads(self._get(note))
            part, writer = str(info["part"]), str(info["writer"])
        except FileNotFoundError:
            return
        except (ValueError, KeyError, TypeError):
            return  # not a note of this version: it claimed nothing
        if not part.startswith(self._dir_key(self._root)):
            return
        claim = self.claims.recover(part, writer)
        if claim is None:
            return  # it never took the claim, or another writer broke it since: what is there is not ours
        self._abort_uploads(part)
        if self._head(part + layout.MANIFEST_FILE) is None:
            self._delete_many(self._part_objects(part))
        self.claims.release(claim)

    def _finish_removal(self, note: str, under: str = "") -> None:
        """A removal cut short (of a part under ``under``, if given): the part's remaining objects go,
        unless a part was published there since."""
        try:
            prefix = str(json.loads(self._get(note))["part"])
        except FileNotFoundError:
            return  # finished meanwhile
        except (ValueError, KeyError, TypeError):
            prefix = ""  # not one of ours to finish
        if not prefix.startswith(under):
            return
        if prefix and self._head(prefix + layout.MANIFEST_FILE) is None:
            self._delete_many(self._part_objects(prefix))
        self._delete(note)

    def discard_temporary(self, location: Path) -> bool:
        prefix = self._dir_key(location)
        if not prefix.startswith(self._dir_key(self._tmp())):
            raise OSError(errno.EXDEV, f"{location} is not among the temporaries of {self._owner} on {self.url}")
        uploads = self._abort_uploads(prefix)
        return self._remove_tree(prefix) > 0 or bool(uploads)

    def usage(self) -> Usage:
        """No free space to speak of (see the module docstring): one request, so that the tier probe
        learns whether the store answers; raises OSError when it does not."""
        self._any(self._dir_key(self._root))
        return Usage(free_bytes=0, total_bytes=0, unbounded=True)

    def quarantine_part(self, part: Path) -> Path:
        """Copies the part's objects beside it as ``.corrupt-rank-R-<random>/``, then removes the part."""
        target = part.parent / f"{layout.CORRUPT_PREFIX}{part.name}-{uuid.uuid4().hex[:6]}"
        manifest = self.key(part / layout.MANIFEST_FILE)
        head = self._head(manifest)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no part at {part}")
        source, dest = self._dir_key(part), self._dir_key(target)
        for obj in [o for o in self._list(source) if not o.get("Key", "").endswith("/" + CLAIM_FILE)]:
            self._copy(obj["Key"], dest + obj["Key"][len(source):], int(obj.get("Size", 0)))
        self._remove_published(part, str(head["ETag"]))
        return target

    def quarantine_chunk(self, location: Path) -> Path | None:
        store = location.parent.parent
        if store.name != chunks.CHUNKS_DIR or not chunks.is_chunk_name(location.name):
            return None
        target = store / chunks.CORRUPT_DIR / f"{location.name}-{uuid.uuid4().hex[:6]}"
        key = self.key(location)
        head = self._head(key)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no chunk {self.connection.where(key)}")
        self._copy(key, self.key(target), int(head["ContentLength"]))
        self._delete(key, str(head["ETag"]))
        return target

    def list_quarantined(self) -> list[QuarantinedCopy]:
        found: dict[Path, QuarantinedCopy] = {}
        for job in self.list_jobs():
            job_key = self._dir_key(self._root / job)
            for obj in self._list(job_key + "step-"):
                names = obj.get("Key", "")[len(job_key):].split("/")
                if len(names) < 3 or not names[1].startswith(layout.CORRUPT_PREFIX):
                    continue
                step = layout.parse_step_dirname(names[0])
                rank = layout.parse_rank_dirname(names[1][len(layout.CORRUPT_PREFIX):].rsplit("-", 1)[0])
                if step is not None and rank is not None:
                    where = self._root / job / names[0] / names[1]
                    found[where] = QuarantinedCopy(job, step, rank, where)
        return list(found.values())

    # --- replacing a step ---------------------------------------------------------------
    #
    # A replacement's parts are published in .tmp/<owner>/replace/<job>/step-N/rank-R/. swap_in writes its
    # commit record there first (sealed: from then on a crash rolls it forward), then removes the step in
    # place, its record first (the step stops existing at once, never half there), then its objects
    # (manifests first), copies the staged objects in (manifests last), and writes the record at the step.
    # On an object store the step "is in place" when its commit record is: a step whose record was removed
    # is one a swap was replacing.

    def _staged_step(self, job: str, step: int) -> Path:
        return self._tmp() / _REPLACE_DIR / layout.check_job(job) / layout.step_dirname(step)

    def staged_location(self, job: str, step: int, rank: int) -> Path:
        return self._staged_step(job, step) / layout.rank_dirname(rank)

    def list_staged(self, job: str, step: int) -> list[layout.PartRef]:
        staged = self._staged_step(job, step)
        prefix = self._dir_key(staged)
        found = []
        for obj in self._list(prefix):
            names = obj.get("Key", "")[len(prefix):].split("/")
            rank = layout.parse_rank_dirname(names[0])
            if rank is not None and names[1:] == [layout.MANIFEST_FILE]:
                found.append(layout.PartRef(job, step, rank, staged / names[0], version(obj["ETag"])))
        return sorted(found, key=lambda ref: ref.rank)

    def swap_in(self, record: layout.CommitRecord) -> bool:
        staged = self._staged_step(record.job, record.step)
        if not self.list_staged(record.job, record.step):
            return False
        raw = layout.commit_record_bytes(record)
        self._put(self.key(staged / layout.COMMIT_FILE), raw)  # sealed
        self._move_in(staged, record.job, record.step, raw)
        return True

    def _move_in(self, staged: Path, job: str, step: int, record: bytes) -> None:
        """The staged step becomes the step: the one in place goes (record first), the staged objects are
        copied in (manifests last), then the record is written; the staging area goes last."""
        final = self.step_location(job, step)
        try:
            self._delete(self.key(final / layout.COMMIT_FILE))
        except FileNotFoundError:
            pass
        self._remove_step_objects(final)
        source, dest = self._dir_key(staged), self._dir_key(final)
        objects = [o for o in self._list(source) if o.get("Key", "")[len(source):] != layout.COMMIT_FILE
                   and not o.get("Key", "").endswith("/" + CLAIM_FILE)]
        objects.sort(key=lambda o: o["Key"].endswith("/" + layout.MANIFEST_FILE))  # data first, manifests last
        for obj in objects:
            self._copy(obj["Key"], dest + obj["Key"][len(source):], int(obj.get("Size", 0)))
        self._put(self.key(final / layout.COMMIT_FILE), record)
        self._remove_tree(source)

    def _remove_step_objects(self, step: Path) -> None:
        """Every object of a step, each part's manifest before its files (claims stay: their writers')."""
        keys = self._part_objects(self._dir_key(step))
        self._delete_many([k for k in keys if k.endswith("/" + layout.MANIFEST_FILE)])
        self._delete_many([k for k in keys if not k.endswith("/" + layout.MANIFEST_FILE)])

    def discard_staged(self, job: str, step: int) -> bool:
        return self.discard_temporary(self._staged_step(job, step))

    def recover_staged(self) -> int:
        root = self._dir_key(self._tmp() / _REPLACE_DIR)
        done = 0
        for obj in list(self._list(root)):
            names = obj.get("Key", "")[len(root):].split("/")
            step = layout.parse_step_dirname(names[1]) if len(names) == 3 else None
            if step is None or names[2] != layout.COMMIT_FILE:
                continue
            job = names[0]
            staged = self._staged_step(job, step)
            if self.has_commit_record(self.step_location(job, step)):
                continue  # the old step stays (the swap never began), or the new one is in place already
            try:
                raw = self._get(obj["Key"])
                layout.parse_commit_record(raw, staged / layout.COMMIT_FILE)
                self._move_in(staged, job, step, raw)
            except (OSError, layout.ManifestError) as e:
                log.error("cannot finish the replacement of %s step %d on %s: %s", job, step, self.url, e,
                          extra=fields(job=job, step=step, path=self.url, error=e))
                continue
            log.info("finished the replacement of %s step %d on %s that a crash interrupted", job, step, self.url,
                     extra=fields(job=job, step=step, path=self.url))
            done += 1
        return done


@dataclass
class Claim:
    """A writer's hold on one part's keys: the object ``<part>/.claim``, as this daemon last wrote it."""

    part: str    # the part's key prefix (ends with a slash)
    writer: str  # which writing holds it (the writer's id)
    etag: str    # of the claim object this daemon wrote last
    lost: str = ""  # why it is not this writer's any more ("" while it is)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # a renewal or a release at a time

    @property
    def key(self) -> str:
        return self.part + CLAIM_FILE


class Claims:
    """Which parts this daemon's writers hold, and the renewals that keep them theirs.

    A claim is created only where none is (``If-None-Match: *``). Its holder
    writes it again every ``stale_s / 4`` (``If-Match`` its last ETag: a claim
    broken meanwhile is found lost instead of taken back), so a claim that
    other daemons see unchanged for ``stale_s`` belongs to a daemon that died
    or lost the store that long: they may break it (a delete ``If-Match`` the
    ETag they watched) and take it. A claim of this daemon held by no writer
    of this process was left by its life before a restart, and is taken at
    once. A holder that finds its claim lost completes no upload and commits
    nothing; what it wrote is the new holder's to replace.
    """

    def __init__(self, tier: S3Tier, stale_s: float) -> None:
        if stale_s <= 0:
            raise ValueError(f"a claim goes stale after a positive time, not {stale_s}")
        self._tier = tier
        self.stale_s = stale_s
        self._lock = threading.Lock()
        self._held: dict[str, Claim] = {}               # part prefix -> the claim a writer here holds
        self._seen: dict[str, tuple[str, float]] = {}   # another's claim -> (its ETag, since when, monotonic)
        self._left: dict[str, str] = {}                  # part prefix -> temporaries of a writer that dropped it
        self._keeper: threading.Thread | None = None

    def _body(self, writer: str) -> bytes:
        return json.dumps({"owner": self._tier.owner, "writer": writer, "pid": os.getpid(),
                           "renewed": time.time()}).encode()

    def take(self, part: str, writer: str) -> Claim:
        """Claims the part whose keys start with ``part`` for ``writer``; OSError (EBUSY) naming the
        holder when another writer holds it."""
        tier = self._tier
        key = part + CLAIM_FILE
        broke = False
        for _ in range(3):
            try:
                etag = tier._put(key, self._body(writer), if_absent=True)
            except FileExistsError:
                there = self._read(key)
                if there is None:
                    continue  # given back meanwhile
                info, etag = there
                if not self._abandoned(key, info, etag):
                    raise OSError(errno.EBUSY, f"{tier.connection.where(part)} is being written by "
                                               f"{info.get('owner', '?')} (writer {info.get('writer', '?')}); "
                                               "trying again later") from None
                log.warning("taking over the claim on %s of %s (writer %s), abandoned", tier.connection.where(part),
                            info.get("owner", "?"), info.get("writer", "?"), extra=fields(tier="shared"))
                _quietly(tier._delete, key, etag)
                broke = True
                continue
            claim = Claim(part, writer, etag)
            with self._lock:
                self._held[part] = claim
                self._seen.pop(key, None)
                if self._keeper is None:
                    self._keeper = threading.Thread(target=self._keep, name="s3-claims", daemon=True)
                    self._keeper.start()
            if broke:  # the uploads under the part are the abandoned writer's: ours to abort now
                try:
                    tier._abort_uploads(part)
                except OSError:
                    self.release(claim)
                    raise
                with self._lock:
                    left = self._left.pop(part, None)
                if left is not None:
                    _quietly(tier._remove_tree, left)
            return claim
        raise OSError(errno.EBUSY, f"{tier.connection.where(part)}: its claim keeps changing hands; trying again "
                                   "later")

    def _read(self, key: str) -> tuple[dict[str, Any], str] | None:
        conn = self._tier.connection
        try:
            with errors("reading", conn, key):
                got = conn.client.get_object(Bucket=conn.bucket, Key=key)
                raw = got["Body"].read()
        except FileNotFoundError:
            return None
        try:
            info = json.loads(raw)
        except ValueError:
            info = {}
        return (info if isinstance(info, dict) else {}), str(got["ETag"])

    def _abandoned(self, key: str, info: dict[str, Any], etag: str) -> bool:
        """Whether the claim ``info`` (ETag ``etag``) may be broken: see the class docstring."""
        with self._lock:
            if info.get("owner") == self._tier.owner:
                held = self._held.get(key[:-len(CLAIM_FILE)])
                return held is None or held.writer != info.get("writer")
            now = time.monotonic()
            seen = self._seen.get(key)
            if seen is None or seen[0] != etag:
                self._seen[key] = (etag, now)
                return False
            return now - seen[1] >= self.stale_s

    def check(self, claim: Claim) -> None:
        """Raises OSError when ``claim`` is no longer its writer's (as far as this daemon knows)."""
        if claim.lost:
            raise OSError(errno.EBUSY, f"{self._tier.connection.where(claim.part)}: this writer lost its claim "
                                       f"({claim.lost})")

    def verify(self, claim: Claim) -> None:
        """:meth:`check`, asking the store: the claim object is still the one this daemon wrote last."""
        with claim.lock:
            head = self._tier._head(claim.key)
            if head is None or head["ETag"] != claim.etag:
                self._lose(claim, "its claim was broken by another writer" if head else "its claim is gone")
        self.check(claim)

    def _lose(self, claim: Claim, why: str) -> None:
        claim.lost = why
        with self._lock:
            if self._held.get(claim.part) is claim:
                del self._held[claim.part]

    def drop(self, claim: Claim, why: str, temporaries: str) -> None:
        """Stops holding ``claim`` without giving it back: the object stays, abandoned (see the class), with
        its writer's ``temporaries`` (a key prefix): the next writer of this daemon to take it removes them."""
        with claim.lock:
            self._lose(claim, claim.lost or why)
            with self._lock:
                self._left[claim.part] = temporaries

    def renew(self, claim: Claim) -> None:
        """Writes the claim again (only if it is still the one written last); a claim broken or gone is lost."""
        with claim.lock:
            if claim.lost:
                return
            try:
                claim.etag = self._tier._put(claim.key, self._body(claim.writer), if_match=claim.etag)
            except (FileExistsError, FileNotFoundError) as e:
                self._lose(claim, f"it was broken by another writer or removed: {e}")
            except OSError as e:  # the store does not answer: the uploads fail too; try again next round
                log.warning("cannot renew the claim on %s: %s", self._tier.connection.where(claim.part), e,
                            extra=fields(tier="shared", error=e))

    def release(self, claim: Claim) -> bool:
        """Gives the claim back (deletes it while it is still ours); False when that failed (the daemon's
        next start cleans it through the writer's note)."""
        with claim.lock:
            lost, claim.lost = claim.lost, claim.lost or "given back"
            with self._lock:
                if self._held.get(claim.part) is claim:
                    del self._held[claim.part]
            if lost:
                return True
            try:
                self._tier._delete(claim.key, claim.etag)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("cannot give back the claim on %s: %s", self._tier.connection.where(claim.part), e,
                            extra=fields(tier="shared", error=e))
                return False
        return True

    def recover(self, part: str, writer: str) -> Claim | None:
        """The claim ``writer`` of this daemon left on ``part`` (a crash), renewed so that no other daemon
        breaks it while it is cleaned; None when it is not that writer's (any more)."""
        key = part + CLAIM_FILE
        there = self._read(key)
        if there is None or there[0].get("owner") != self._tier.owner or there[0].get("writer") != writer:
            return None
        with self._lock:
            held = self._held.pop(part, None)
        if held is not None:
            held.lost = "cleaned as a crashed writer's"
        claim = Claim(part, writer, there[1])
        self.renew(claim)
        return None if claim.lost else claim

    def _keep(self) -> None:
        """Renews every held claim each ``stale_s / 4``; ends when none is held."""
        while True:
            time.sleep(self.stale_s / 4)
            with self._lock:
                held = list(self._held.values())
                if not held:
                    self._keeper = None
                    return
            for claim in held:
                self.renew(claim)


def _quietly(call: Callable[..., Any], *args: Any) -> None:
    """A clean-up step whose failure leaves only what the next start removes."""
    try:
        call(*args)
    except OSError as e:
        log.debug("clean-up step failed: %s", e)


def _plain_name(name: str) -> str:
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
            part = tier._dir_key(self.final)
            writer = self.staging.name.rpartition(".")[2]
            note = tier.key(self.staging / _WRITER_MARK)
            tier._put(note, json.dumps({"owner": tier.owner, "writer": writer, "part": part,
                                        "started": time.time()}).encode())
            try:
                self._claim = tier.claims.take(part, writer)
            except OSError:
                _quietly(tier._delete, note)
                raise
            # A published part stays whole until commit asks ``replace``: the new files are staged meanwhile.
            self._staged = tier._head(tier.key(self.final / layout.MANIFEST_FILE)) is not None
        tier.claims.check(self._claim)
        return self._claim

    def create_file(self, name: str, size: int, direct_io: bool, reserve: bool = True) -> UploadSink:
        """A new file of the part, uploaded as it is written (``direct_io`` and ``reserve`` mean nothing
        to an object store); it is completed only while this writer holds the claim."""
        tier = self._tier
        claim = self._hold()
        where = (self.staging if self._staged else self.final) / _plain_name(name)
        sink = UploadSink(tier.connection, tier.key(where), size, tier._piece_bytes, tier._pool("upload"),
                          tier._in_flight, before_complete=lambda: tier.claims.check(claim))
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
        head = tier._head(manifest_key)
        if head is not None and not self._staged:
            raise FileExistsError(errno.EEXIST, f"{self.final} was published meanwhile by a writer that did not "
                                                "hold its claim")
        if head is not None and not (self.replace is not None and self.replace(self.final)):
            raise FileExistsError(errno.EEXIST, f"{self.final} is already committed")
        if head is not None:
            tier._remove_published(self.final, str(head["ETag"]))
        ours = set() if self._staged else {sink.key for sink in self._files.values()}
        tier._delete_many([k for k in tier._part_objects(tier._dir_key(self.final)) if k not in ours])
        if self._staged:
            for name, sink in self._files.items():
                tier._copy(sink.key, tier.key(self.final / name), sink.size)
        raw = layout.manifest_file_bytes(manifest)
        etag = tier._put(manifest_key, raw, if_absent=True)  # last: publishes the part
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
                if tier._head(tier.key(self.final / layout.MANIFEST_FILE)) is None:
                    tier._delete_many(tier._part_objects(tier._dir_key(self.final)))
        except OSError as e:
            # The store fails: the claim and the note stay, and whoever writes the part next (this daemon
            # at once, another once the claim is stale) or this daemon's next start cleans up.
            log.warning("cannot remove what was written at %s: %s", self.final, e, extra=fields(error=e))
            if claim is not None:
                tier.claims.drop(claim, f"left behind: {e}", tier._dir_key(self.staging))
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
                tier._remove_tree(tier._dir_key(self.staging))
            else:  # the note is all there is (a chunk batch staged here removes its own)
                tier._delete(tier.key(self.staging / _WRITER_MARK))
        except OSError as e:  # the daemon's next start removes them
            log.warning("cannot remove the temporaries %s: %s", self.staging, e, extra=fields(error=e))


class S3ChunkBatch:
    """New chunks uploaded under the temporaries, then copied into the store together by :meth:`publish`."""

    def __init__(self, tier: S3Tier, job: str, staging: Path) -> None:
        self._tier = tier
        self._job = job
        self._staging = staging
        self._lock = threading.Lock()
        self._written: dict[str, int] = {}
        self._published = False

    def write(self, name: str, data: memoryview, direct_io: bool) -> None:
        if not chunks.is_chunk_name(name):
            raise ValueError(f"{name!r} is not a chunk name")
        self._tier._put(self._tier.key(self._staging / name), bytes(data))
        with self._lock:
            self._written[name] = len(data)

    def publish(self) -> None:
        """Copies each staged chunk into the store (a chunk of that name there already has the same
        bytes), then removes the staged ones: every chunk is in the store before any manifest names it."""
        with self._lock:
            written, self._written = self._written, {}
        tier = self._tier

        def move(item: tuple[str, int]) -> None:
            name, size = item
            tier._copy(tier.key(self._staging / name), tier.key(tier.chunk_location(self._job, name)), size)

        for _ in tier._pool("upload").map(move, written.items()):
            pass
        self._published = True
        try:
            tier._remove_tree(tier._dir_key(self._staging))
        except OSError as e:  # published all the same; the daemon's next start removes them
            log.warning("cannot remove the temporaries %s: %s", self._staging, e, extra=fields(error=e))

    def discard(self) -> None:
        if not self._published:
            with self._lock:
                self._written.clear()
            self._tier._remove_tree(self._tier._dir_key(self._staging))
