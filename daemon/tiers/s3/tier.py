"""The object-store tier: :class:`ckptstage.daemon.tiers.interface.Tier` on an S3-compatible bucket.

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
which fetches the part to the local tier first. People are shown URLs
(:attr:`S3Tier.location`, :meth:`S3Tier.url_of`), never pseudo-paths.

**Publishing** is the part writer's (:mod:`ckptstage.daemon.tiers.s3.writer`): a
part's objects go to their keys under the part's claim
(:mod:`ckptstage.daemon.tiers.s3.claims`), the manifest last; a part exists if and
only if its manifest object does. A step exists only through its
``commit.json``, created with a conditional PUT (``If-None-Match: *``) so
that exactly one of racing daemons creates it; a missing record reads as
"not published".

**Deleting.** A part's manifest goes first (the part vanishes at once),
then its files; a removal is recorded in the temporaries first, so that one
cut short (a crash, or the store failing half way) is finished when the
step's record is removed (:meth:`S3Tier.remove_commit_record`: a record goes
after every object of its parts) or when the daemon starts
(:meth:`S3Tier.clean_temporaries`, which also aborts this daemon's multipart
uploads and cleans the parts its writers left half written, through their
notes). What a daemon that never comes back left, any other daemon cleans
once it has been untouched long enough (:meth:`S3Tier.clean_abandoned`).

**Versions** are the ETag of the manifest (or record) object, as an integer:
an object written again with other bytes has another one. Written again with
the same bytes it keeps it, and then nothing a reader indexed differs.

**Room.** An object store sets no limit of its own: :meth:`S3Tier.usage`
says so (``unbounded``, both counts 0), after one request that shows the
store answers. What the tier holds is the catalogue's count
(``ckptstage_tier_used_bytes``); listing the prefix to count it again would
take longer than the tier probe allows on a large bucket, and the probe
would report a healthy store as hung.

**Chunk stores** (incremental parts): new chunks go straight to their keys
(:class:`ckptstage.daemon.tiers.s3.writer.S3ChunkBatch` says why that is safe). A
chunk reused is touched with a tag naming the time (:data:`TOUCHED_TAG`),
which a sweep reads besides the modification time before it condemns the
chunk: no bytes move, and a versioned bucket keeps no extra version of the
chunk for each save that reuses it. A store that refuses tags has its chunks
copied onto themselves instead, as S3 sets no modification time otherwise.

**Replacing a step** (a save with ``overwrite``): the replacement is staged
in the temporaries and swapped in as described above :meth:`S3Tier.swap_in`;
there is no atomic exchange of many objects, so readers see the old step,
then no step (no record) for the time of the copies, then the new one.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

from ckptstage.daemon.logs import fields
from ckptstage.daemon.tiers.s3.claims import CLAIM_FILE, CLAIM_STALE_S, WRITER_NOTE, Claim, Claims, discard_unpublished, part_objects, quietly
from ckptstage.daemon.tiers.s3.client import MAX_CONNECTIONS, Connection, check, connect, is_refused
from ckptstage.daemon.tiers.s3.io import MIN_PIECE_BYTES, ObjectReader, UploadSink
from ckptstage.daemon.tiers.s3.objects import Objects, version
from ckptstage.daemon.tiers.s3.orphans import ABANDONED_AFTER, REMOVING, REPLACE_DIR, Scope, clean_abandoned
from ckptstage.daemon.tiers.s3.writer import S3ChunkBatch, S3PartWriter, plain_name
from ckptstage.daemon.tiers.interface import Manifest, PartWriter, QuarantinedCopy, Usage
from ckptstage.protos import chunks, layout

# Claims, the part writer and the chunk batch live in modules of their own; importable from here too.
__all__ = ["CLAIM_FILE", "CLAIM_STALE_S", "Claim", "Claims", "S3ChunkBatch", "S3PartWriter", "S3Tier", "version"]

log = logging.getLogger(__name__)

PSEUDO_ROOT = Path("/s3:")  # locations on an object store: never a directory of this node
PIECE_BYTES = 64 << 20       # a multipart upload's piece (S3 allows 5 MiB to 5 GiB)
IN_FLIGHT = 8                # pieces of one object uploading at once ([shared] multipart_concurrency)
THREADS = 16                 # uploads (and, apart, ranged reads) in flight, across the tier
MAX_THREADS = MAX_CONNECTIONS // 2  # both pools together hold at most the client's connections
VERIFY_PIECE_BYTES = 64 << 20  # read at once (as several ranged GETs) by verify_part
_MANY = 256                  # more chunk names than this: list the store instead of asking for each
TOUCHED_TAG = "ckptstage-touched"  # a chunk's tag: when a writer last relied on it (unix time, touch_chunk)


class S3Tier:
    """One bucket and prefix holding checkpoints, as the daemon ``owner`` uses it.

    ``owner`` names this daemon's temporaries (``.tmp/<owner>/``); a tier used
    only to index needs none. ``piece_bytes`` and ``in_flight`` shape uploads
    (:class:`ckptstage.daemon.tiers.s3.io.UploadSink`); ``threads`` run them, and
    the ranged reads (each kind its own pool); ``claim_stale_s`` is when
    another daemon's claim counts as abandoned
    (:class:`ckptstage.daemon.tiers.s3.claims.Claims`), ``abandoned_s`` (several
    times that) when what another daemon's writer left is any daemon's to
    clean (:meth:`clean_abandoned`).
    """

    def __init__(self, conn: Connection, owner: str = "", piece_bytes: int = PIECE_BYTES,
                 in_flight: int = IN_FLIGHT, threads: int = THREADS, claim_stale_s: float = CLAIM_STALE_S,
                 abandoned_s: float | None = None) -> None:
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
        self.objects = Objects(conn, piece_bytes, in_flight)
        self.claims = Claims(self.objects, owner, claim_stale_s)
        self._refused: set[str] = set()  # what the store declined to do ("tagging", "reading tags")
        self.abandoned_s = abandoned_s if abandoned_s is not None else ABANDONED_AFTER * claim_stale_s

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
        """Where the tier is, for people: its URL."""
        return self.url

    def __repr__(self) -> str:
        return f"S3Tier({self.url!r} at {self.connection.endpoint})"

    def check(self) -> None:
        """Whether the bucket is there and the credentials may use it; raises an OSError naming the
        bucket, the endpoint and the credentials' source (see :func:`ckptstage.daemon.tiers.s3.client.check`)."""
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

    def url_of(self, location: Path | PurePosixPath) -> str:
        """How messages name a location of this tier: ``s3://bucket/key``."""
        return f"s3://{self.connection.bucket}/{self.key(location)}"

    def name_of(self, location: Path) -> str:
        return self.url_of(location)

    def _location(self, key: str) -> Path:
        return self._root / key[len(self._prefix):].lstrip("/") if self._prefix else self._root / key

    def dir_key(self, location: Path) -> str:
        """The key prefix of everything below a location (ends with a slash)."""
        key = self.key(location)
        return f"{key}/" if key else ""

    def _tmp(self) -> Path:
        return layout.tmp_root(self._root, self._owner)

    def pool(self, name: str) -> ThreadPoolExecutor:
        """The tier's threads of one kind ("upload", "read"), started on first use."""
        with self._pools_lock:
            pool = self._pools.get(name)
            if pool is None:
                pool = self._pools[name] = ThreadPoolExecutor(self._threads, thread_name_prefix=f"s3-{name}")
            return pool

    def upload_sink(self, key: str, size: int, before_complete: Callable[[], None] | None = None) -> UploadSink:
        """An object of ``size`` bytes uploaded as it is written, in the tier's pieces, on its threads."""
        return UploadSink(self.connection, key, size, self._piece_bytes, self.pool("upload"), self._in_flight,
                          before_complete=before_complete)

    def part_objects(self, prefix: str) -> list[str]:
        """The keys under a part's ``prefix``, but its claim (see :func:`s3claims.part_objects`)."""
        return part_objects(self.objects, prefix)

    # --- the index ---------------------------------------------------------------------

    def list_jobs(self) -> list[str]:
        found = []
        for entry in self.objects.listing(self.dir_key(self._root), "/"):
            name = entry.get("Prefix", "").rstrip("/").rpartition("/")[2]
            try:
                found.append(layout.check_job(name))
            except layout.InvalidName:
                continue  # .tmp, and names the format does not make
        return sorted(found)

    def list_steps(self, job: str, step: int | None = None) -> Iterator[layout.StepRef]:
        """One listing of the job's steps (``<job>/step-``, chunks excluded), read for manifests and records."""
        job_key = self.dir_key(self._root / layout.check_job(job))
        prefix = job_key + (f"{layout.step_dirname(step)}/" if step is not None else "step-")
        parts: dict[int, list[layout.PartRef]] = {}
        records: dict[int, int] = {}
        for obj in self.objects.listing(prefix):
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
        head = self.objects.head(self.key(part / layout.MANIFEST_FILE))
        return version(head["ETag"]) if head else 0

    def read_manifest(self, part: Path) -> tuple[Manifest, str]:
        path = part / layout.MANIFEST_FILE
        try:
            raw = self.objects.get(self.key(path))
        except OSError as e:
            raise layout.ManifestError(f"{self.url_of(path)}: unreadable manifest: {e}") from e
        return layout.parse_manifest_file(raw, path), layout.chunk_digest(raw)

    def has_commit_record(self, step: Path) -> bool:
        return self.record_version(step) != 0

    def read_commit_record(self, step: Path) -> layout.CommitRecord | None:
        path = step / layout.COMMIT_FILE
        try:
            raw = self.objects.get(self.key(path))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise layout.ManifestError(f"{self.url_of(path)}: unreadable commit record: {e}") from e
        return layout.parse_commit_record(raw, path)

    def record_version(self, step: Path) -> int:
        head = self.objects.head(self.key(step / layout.COMMIT_FILE))
        return version(head["ETag"]) if head else 0

    # --- parts and records --------------------------------------------------------------

    def begin_part(self, job: str, step: int, rank: int, replace: Callable[[Path], bool] | None = None,
                   final: Path | None = None) -> S3PartWriter:
        staging = self._tmp() / f"{layout.check_job(job)}.{step}.{rank}.{uuid.uuid4().hex[:12]}"
        return S3PartWriter(self, final or self.part_location(job, step, rank), staging, replace)

    def open_file(self, part: Path, name: str) -> ObjectReader:
        return ObjectReader(self.connection, self.key(part / name), self.pool("read"))

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
                    reader = ObjectReader(self.connection, self.key(ext.path), self.pool("read"))
                except FileNotFoundError as e:
                    raise layout.ChecksumMismatch(ext.path, f"missing: {e}") from e
                except OSError as e:
                    raise layout.ManifestError(f"{self.url_of(ext.path)}: unreadable: {e}") from e
                if reader.size != ext.hi - ext.base:
                    raise layout.ChecksumMismatch(ext.path, f"size {reader.size} != {ext.hi - ext.base} in the "
                                                            "manifest")
                reader.seek(ext.lo - ext.base)
                left = ext.hi - ext.lo
                while left:
                    try:
                        n = reader.readinto(piece[:min(len(piece), left)]) or 0
                    except OSError as e:
                        raise layout.ManifestError(f"{self.url_of(ext.path)}: unreadable: {e}") from e
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
        head = self.objects.head(manifest)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no part at {self.url_of(part)}")
        self.remove_published(part, str(head["ETag"]))

    def remove_published(self, part: Path, etag: str) -> None:
        note = self.key(self._tmp() / REMOVING / f"{uuid.uuid4().hex[:12]}.json") if self._owner else None
        if note is not None:
            self.objects.put(note, json.dumps({"part": self.dir_key(part)}).encode())
        self.objects.delete(self.key(part / layout.MANIFEST_FILE), etag)
        self.objects.delete_many(self.part_objects(self.dir_key(part)))
        if note is not None:
            self.objects.delete(note)

    def create_commit_record(self, step: Path, record: layout.CommitRecord) -> bool:
        try:
            self.objects.put(self.key(step / layout.COMMIT_FILE), layout.commit_record_bytes(record), if_absent=True)
        except FileExistsError:
            return False
        return True

    def remove_commit_record(self, step: Path) -> None:
        """Deletes the record; the removals of the step's parts that this daemon left cut short (the store
        failed half way) are finished first: a record goes after its parts, every object of them."""
        key = self.key(step / layout.COMMIT_FILE)
        head = self.objects.head(key)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no commit record in {self.url_of(step)}")
        if self._owner:
            for obj in list(self.objects.listing(self.dir_key(self._tmp()) + f"{REMOVING}/")):
                self._finish_removal(obj["Key"], under=self.dir_key(step))
        self.objects.delete(key, str(head["ETag"]))

    def read_job_json(self, job: str, name: str, default: Any) -> Any:
        try:
            raw = self.objects.get(self.key(self._root / layout.check_job(job) / plain_name(name)))
        except FileNotFoundError:
            return default
        try:
            return json.loads(raw)
        except ValueError:
            return default  # as the file-system tier reads an unreadable document

    def write_job_json(self, job: str, name: str, obj: Any) -> None:
        self.objects.put(self.key(self._root / layout.check_job(job) / plain_name(name)),
                  json.dumps(obj, sort_keys=True).encode())  # one PUT: readers see the old or the new

    # --- chunk stores -------------------------------------------------------------------

    def _store(self, job: str) -> Path:
        return chunks.store_dir(self._root, job)

    def has_chunk_store(self, job: str) -> bool:
        return self.objects.any_under(self.dir_key(self._store(job)))

    def chunk_location(self, job: str, name: str) -> Path:
        return chunks.chunk_path(self._store(job), name)

    def touch_chunk(self, job: str, name: str) -> bool:
        """Marks the chunk as relied on now: its tag :data:`TOUCHED_TAG` says when, which a sweep reads
        besides its modification time (:meth:`condemn_chunk`). A tag moves no bytes, and makes no new
        version of the chunk in a versioned bucket. Where the store refuses tags, the chunk is copied onto
        itself instead: its modification time becomes now."""
        key = self.key(self.chunk_location(job, name))
        now = f"{math.ceil(time.time() * 1000) / 1000:.3f}"  # to the millisecond, never before the touch
        try:
            if "tagging" not in self._refused:
                try:
                    self.objects.tag(key, {TOUCHED_TAG: now})
                    return True
                except OSError as e:
                    if not is_refused(e):
                        raise
                    self._refuse("tagging", e, "chunks reused are touched by copying them onto themselves")
            self.objects.rewrite(key, {"touched": now})
        except FileNotFoundError:
            return False
        return True

    def _refuse(self, what: str, e: OSError, instead: str) -> None:
        """Notes (once, with a warning) that the store refuses ``what``: the tier does ``instead`` from now on."""
        if what not in self._refused:
            log.warning("%s refuses %s (%s): %s", self.url, what, e, instead,
                        extra=fields(tier="shared", path=self.url, error=e))
        self._refused.add(what)

    def _touched(self, key: str) -> float:
        """When a writer last touched the object by its tag (unix time; 0: never, or the store keeps no
        tags); FileNotFoundError when it is gone."""
        if "reading tags" in self._refused:
            return 0.0
        try:
            tags = self.objects.tags(key)
        except OSError as e:
            if not is_refused(e):
                raise
            self._refuse("reading tags", e, "a sweep knows when a chunk was used last by its modification time only")
            return 0.0
        try:
            return float(tags.get(TOUCHED_TAG, 0))
        except ValueError:
            return 0.0

    def chunk_size(self, job: str, name: str) -> int:
        key = self.key(self.chunk_location(job, name))
        head = self.objects.head(key)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no chunk {self.connection.where(key)}")
        return int(head["ContentLength"])

    def open_chunk(self, job: str, name: str) -> ObjectReader:
        return ObjectReader(self.connection, self.key(self.chunk_location(job, name)), self.pool("read"))

    def missing_chunks(self, job: str, names: Iterable[str]) -> list[str]:
        names = list(names)
        if len(names) > _MANY:
            held = set(self.list_chunks(job))
            return [n for n in names if n not in held]
        keys = [self.key(self.chunk_location(job, n)) for n in names]
        there = list(self.pool("read").map(self.objects.head, keys))
        return [n for n, head in zip(names, there) if head is None]

    def new_chunks(self, job: str, part: PartWriter | None = None) -> S3ChunkBatch:
        """A batch whose chunks go straight into the store (nothing is staged: see :class:`S3ChunkBatch`)."""
        return S3ChunkBatch(self, layout.check_job(job))

    def list_manifests(self, job: str) -> list[Path]:
        """The published parts, and the replacements any daemon is assembling in its temporaries."""
        parts = [p.path for s in self.list_steps(job) for p in s.parts]
        tmp = self.dir_key(self._root / layout.TMP_DIR)
        for owner in self.objects.listing(tmp, "/"):
            staging = owner.get("Prefix", "") + f"{REPLACE_DIR}/{layout.check_job(job)}/"
            for obj in self.objects.listing(staging):
                names = obj.get("Key", "")[len(staging):].split("/")
                if len(names) == 3 and names[2] == layout.MANIFEST_FILE and \
                        layout.parse_step_dirname(names[0]) is not None and layout.parse_rank_dirname(names[1]) \
                        is not None:
                    parts.append(self._location(obj["Key"]).parent)
        return parts

    def manifest_version(self, part: Path) -> tuple[int, ...]:
        key = self.key(part / layout.MANIFEST_FILE)
        head = self.objects.head(key)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no manifest {self.connection.where(key)}")
        return version(head["ETag"]), int(head["ContentLength"])

    def list_chunks(self, job: str) -> list[str]:
        out = []
        for obj in self.objects.listing(self.dir_key(self._store(job))):
            fan, _, name = obj.get("Key", "").rpartition("/")
            if chunks.is_chunk_name(name) and fan.endswith(f"/{name[:2]}"):  # not .condemned nor .corrupt
                out.append(name)
        return out

    def _condemned(self, job: str, name: str) -> str:
        return self.key(self._store(job) / chunks.CONDEMNED_DIR / name)

    def condemn_chunk(self, job: str, name: str, untouched_since: float) -> bool:
        key = self.key(self.chunk_location(job, name))
        head = self.objects.head(key)
        # S3 keeps modification times to the second: the second it names may run up to 1 s later.
        if head is None or head["LastModified"].timestamp() + 1 > untouched_since:
            return False
        try:
            if self._touched(key) > untouched_since:
                return False
            self.objects.copy(key, self._condemned(job, name), int(head["ContentLength"]))
            self.objects.delete(key, str(head["ETag"]))
        except FileNotFoundError:
            return False  # another node's sweep took it first
        return True

    def condemned_chunks(self, job: str) -> list[str]:
        prefix = self.dir_key(self._store(job) / chunks.CONDEMNED_DIR)
        return [name for obj in self.objects.listing(prefix)
                if chunks.is_chunk_name(name := obj.get("Key", "")[len(prefix):])]

    def restore_chunk(self, job: str, name: str) -> None:
        condemned = self._condemned(job, name)
        head = self.objects.head(condemned)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no condemned chunk {self.connection.where(condemned)}")
        self.objects.copy(condemned, self.key(self.chunk_location(job, name)), int(head["ContentLength"]))
        self.objects.delete(condemned)

    def delete_condemned_chunk(self, job: str, name: str) -> int:
        condemned = self._condemned(job, name)
        head = self.objects.head(condemned)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no condemned chunk {self.connection.where(condemned)}")
        self.objects.delete(condemned, str(head["ETag"]))
        return int(head["ContentLength"])

    # --- housekeeping -------------------------------------------------------------------

    def prepare(self) -> None:
        """Checks that the bucket answers to these credentials (a bucket is the operator's to create) and
        that the store honours conditional writes."""
        self.check()
        self._check_conditions()

    def _check_conditions(self) -> None:
        """Raises OSError (ENOTSUP) naming the store when it takes a conditional PUT whose condition fails.

        Commit records (created exactly once across daemons), claims and removals rely on the store
        refusing them; one that ignores the conditions (some S3-compatible stores, or old versions of
        them) would let two daemons both publish a step. Three small requests on an object of this
        daemon's temporaries, then it is deleted."""
        key = f"{self.dir_key(self._tmp())}conditions-{uuid.uuid4().hex[:12]}"
        self.objects.put(key, b"1", if_absent=True)
        try:
            for what, write in (("If-None-Match: * on an object that exists",
                                 lambda: self.objects.put(key, b"2", if_absent=True)),
                                ("If-Match with an ETag the object does not have",
                                 lambda: self.objects.put(key, b"2", if_match='"00000000000000000000000000000000"'))):
                try:
                    write()
                except (FileExistsError, FileNotFoundError):
                    continue  # refused, as it must be
                raise OSError(errno.ENOTSUP, f"the store at {self.connection.endpoint} took a conditional write "
                                             f"whose condition fails ({what}, on {self.url_of(self._location(key))}): "
                                             "it does not honour If-None-Match/If-Match on PutObject, which the "
                                             "shared tier needs so that two daemons never both publish a step; "
                                             "use a store that does (docs/OPERATIONS.md)")
        finally:
            quietly(self.objects.delete, key)

    def clean_temporaries(self) -> int:
        """Finishes removals cut short, cleans the parts this daemon's writers left half written under
        their claims, aborts its multipart uploads and deletes its staged objects; returns how many
        entries of ``.tmp/<owner>/`` that was."""
        tmp = self.dir_key(self._tmp())
        entries: set[str] = set()
        for obj in list(self.objects.listing(tmp + f"{REMOVING}/")):
            self._finish_removal(obj["Key"])
            entries.add(REMOVING)
        for note in [o["Key"] for o in self.objects.listing(tmp) if o.get("Key", "").endswith("/" + WRITER_NOTE)]:
            self._finish_writer(note)
        for key in self.objects.abort_uploads(tmp):
            entries.add(key[len(tmp):].split("/")[0])
        keys = [o["Key"] for o in self.objects.listing(tmp) if "Key" in o]
        entries.update(k[len(tmp):].split("/")[0] for k in keys)
        self.objects.delete_many(keys)
        return len(entries)

    def clean_abandoned(self) -> int:
        """Cleans what other daemons' writers and removals left and have not touched for
        :attr:`abandoned_s` (their daemons are gone: see :mod:`ckptstage.daemon.tiers.s3.orphans`); returns how
        many. Never a live writer's work (its claim is renewed), nor a published part. Meant to run now
        and then (each pass lists the temporaries, and reads each other daemon's notes)."""
        if not self._owner:
            raise ValueError(f"{self.url}: a tier opened without an owner only indexes; it cleans nothing")
        tmp = self.dir_key(self._root / layout.TMP_DIR)
        return clean_abandoned(self.objects, self.claims, Scope(tmp, self.dir_key(self._root), self._owner),
                               self.abandoned_s)

    def _finish_writer(self, note: str) -> None:
        """A writer of this daemon that a crash stopped: while the part's claim is still that writer's, its
        uploads are aborted and its objects deleted (unless it published the part), then the claim goes."""
        try:
            info = json.loads(self.objects.get(note))
            part, writer = str(info["part"]), str(info["writer"])
        except FileNotFoundError:
            return
        except (ValueError, KeyError, TypeError):
            return  # not a note of this version: it claimed nothing
        if not part.startswith(self.dir_key(self._root)):
            return
        claim = self.claims.recover(part, writer)
        if claim is None:
            return  # it never took the claim, or another writer broke it since: what is there is not ours
        self.objects.abort_uploads(part)
        discard_unpublished(self.objects, part)
        self.claims.release(claim)

    def _finish_removal(self, note: str, under: str = "") -> None:
        """A removal cut short (of a part under ``under``, if given): the part's remaining objects go,
        unless a part was published there since."""
        try:
            prefix = str(json.loads(self.objects.get(note))["part"])
        except FileNotFoundError:
            return  # finished meanwhile
        except (ValueError, KeyError, TypeError):
            prefix = ""  # not one of ours to finish
        if not prefix.startswith(under):
            return
        if prefix:
            discard_unpublished(self.objects, prefix)
        self.objects.delete(note)

    def discard_temporary(self, location: Path) -> bool:
        prefix = self.dir_key(location)
        if not prefix.startswith(self.dir_key(self._tmp())):
            raise OSError(errno.EXDEV, f"{self.url_of(location)} is not among the temporaries of {self._owner} on "
                                       f"{self.url}")
        uploads = self.objects.abort_uploads(prefix)
        return self.objects.remove_tree(prefix) > 0 or bool(uploads)

    def usage(self) -> Usage:
        """No free space to speak of (see the module docstring): one request, so that the tier probe
        learns whether the store answers; raises OSError when it does not."""
        self.objects.any_under(self.dir_key(self._root))
        return Usage(free_bytes=0, total_bytes=0, unbounded=True)

    def quarantine_part(self, part: Path) -> Path:
        """Copies the part's objects beside it as ``.corrupt-rank-R-<random>/``, then removes the part."""
        target = part.parent / f"{layout.CORRUPT_PREFIX}{part.name}-{uuid.uuid4().hex[:6]}"
        manifest = self.key(part / layout.MANIFEST_FILE)
        head = self.objects.head(manifest)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no part at {self.url_of(part)}")
        source, dest = self.dir_key(part), self.dir_key(target)
        for obj in [o for o in self.objects.listing(source) if not o.get("Key", "").endswith("/" + CLAIM_FILE)]:
            self.objects.copy(obj["Key"], dest + obj["Key"][len(source):], int(obj.get("Size", 0)))
        self.remove_published(part, str(head["ETag"]))
        return target

    def quarantine_chunk(self, location: Path) -> Path | None:
        target = chunks.corrupt_location(location)
        if target is None:
            return None
        key = self.key(location)
        head = self.objects.head(key)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no chunk {self.connection.where(key)}")
        self.objects.copy(key, self.key(target), int(head["ContentLength"]))
        self.objects.delete(key, str(head["ETag"]))
        return target

    def list_quarantined(self) -> list[QuarantinedCopy]:
        found: dict[Path, QuarantinedCopy] = {}
        for job in self.list_jobs():
            job_key = self.dir_key(self._root / job)
            for obj in self.objects.listing(job_key + "step-"):
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
        return self._tmp() / REPLACE_DIR / layout.check_job(job) / layout.step_dirname(step)

    def staged_location(self, job: str, step: int, rank: int) -> Path:
        return self._staged_step(job, step) / layout.rank_dirname(rank)

    def list_staged(self, job: str, step: int) -> list[layout.PartRef]:
        staged = self._staged_step(job, step)
        prefix = self.dir_key(staged)
        found = []
        for obj in self.objects.listing(prefix):
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
        self.objects.put(self.key(staged / layout.COMMIT_FILE), raw)  # sealed
        self._move_in(staged, record.job, record.step, raw)
        return True

    def _move_in(self, staged: Path, job: str, step: int, record: bytes) -> None:
        """The staged step becomes the step: the one in place goes (record first), the staged objects are
        copied in (manifests last), then the record is written; the staging area goes last."""
        final = self.step_location(job, step)
        try:
            self.objects.delete(self.key(final / layout.COMMIT_FILE))
        except FileNotFoundError:
            pass
        self._remove_step_objects(final)
        source, dest = self.dir_key(staged), self.dir_key(final)
        objects = [o for o in self.objects.listing(source) if o.get("Key", "")[len(source):] != layout.COMMIT_FILE
                   and not o.get("Key", "").endswith("/" + CLAIM_FILE)]
        objects.sort(key=lambda o: o["Key"].endswith("/" + layout.MANIFEST_FILE))  # data first, manifests last
        for obj in objects:
            self.objects.copy(obj["Key"], dest + obj["Key"][len(source):], int(obj.get("Size", 0)))
        self.objects.put(self.key(final / layout.COMMIT_FILE), record)
        self.objects.remove_tree(source)

    def _remove_step_objects(self, step: Path) -> None:
        """Every object of a step, each part's manifest before its files (claims stay: their writers')."""
        keys = self.part_objects(self.dir_key(step))
        self.objects.delete_many([k for k in keys if k.endswith("/" + layout.MANIFEST_FILE)])
        self.objects.delete_many([k for k in keys if not k.endswith("/" + layout.MANIFEST_FILE)])

    def discard_staged(self, job: str, step: int) -> bool:
        return self.discard_temporary(self._staged_step(job, step))

    def recover_staged(self) -> int:
        root = self.dir_key(self._tmp() / REPLACE_DIR)
        done = 0
        for obj in list(self.objects.listing(root)):
            names = obj.get("Key", "")[len(root):].split("/")
            step = layout.parse_step_dirname(names[1]) if len(names) == 3 else None
            if step is None or names[2] != layout.COMMIT_FILE:
                continue
            job = names[0]
            staged = self._staged_step(job, step)
            if self.has_commit_record(self.step_location(job, step)):
                continue  # the old step stays (the swap never began), or the new one is in place already
            try:
                raw = self.objects.get(obj["Key"])
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
