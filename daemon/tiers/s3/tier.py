"""The object-store tier: :class:`ckptstage.daemon.tiers.interface.Tier` on an S3-compatible bucket.

:class:`S3Tier` is the interface's one class here; each concern it serves
has a module of its own, which it holds and hands the requests to:

* where things are: :mod:`ckptstage.daemon.tiers.s3.keys` (objects mirror
  docs/FORMAT.md's layout under the URL's prefix; locations are
  pseudo-paths under ``/s3:``, on which no file-system call may be made).
  Clients cannot open objects as files either: :meth:`S3Tier.readable_path`
  is None, and a restore goes through the daemon, which fetches the part to
  the local tier first. People are shown URLs (:attr:`S3Tier.location`,
  :meth:`S3Tier.url_of`), never pseudo-paths;
* reading jobs, steps, parts and records: :mod:`ckptstage.daemon.tiers.s3.listing`;
* publishing a part: :mod:`ckptstage.daemon.tiers.s3.writer`, under the
  part's claim (:mod:`ckptstage.daemon.tiers.s3.claims`), the manifest last;
  a part exists if and only if its manifest object does. A step exists only
  through its ``commit.json``, created with a conditional PUT
  (``If-None-Match: *``) so that exactly one of racing daemons creates it;
  a missing record reads as "not published";
* deleting, and this daemon's temporaries: :mod:`ckptstage.daemon.tiers.s3.cleanup`
  (a part's manifest first, each removal noted so that one cut short is
  finished); what a daemon that never comes back left, any other daemon
  cleans once it has been untouched long enough (:meth:`S3Tier.clean_abandoned`,
  :mod:`ckptstage.daemon.tiers.s3.orphans`);
* chunk stores: :mod:`ckptstage.daemon.tiers.s3.chunks`;
* replacing a step: :mod:`ckptstage.daemon.tiers.s3.replacing`;
* the requests and the bytes: :mod:`ckptstage.daemon.tiers.s3.objects`,
  :mod:`ckptstage.daemon.tiers.s3.io`, :mod:`ckptstage.daemon.tiers.s3.client`.

**Room.** An object store sets no limit of its own: :meth:`S3Tier.usage`
says so (``unbounded``, both counts 0), after one request that shows the
store answers. What the tier holds is the catalogue's count
(``ckptstage_tier_used_bytes``); listing the prefix to count it again would
take longer than the tier probe allows on a large bucket, and the probe
would report a healthy store as hung.
"""

from __future__ import annotations

import errno
import json
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from ckptstage.daemon.tiers.interface import Manifest, QuarantinedCopy, Usage
from ckptstage.daemon.tiers.s3.chunkcalls import S3ChunkCalls
from ckptstage.daemon.tiers.s3.chunks import S3Chunks
from ckptstage.daemon.tiers.compression import Compression
from ckptstage.daemon.tiers.s3.claims import CLAIM_STALE_S, Claims
from ckptstage.daemon.tiers.s3.cleanup import Cleanup
from ckptstage.daemon.tiers.s3.conditions import check_conditions
from ckptstage.daemon.tiers.s3.client import MAX_CONNECTIONS, Connection, check, connect
from ckptstage.daemon.tiers.s3.io import MIN_PIECE_BYTES, ObjectReader, Transfers
from ckptstage.daemon.tiers.s3.keys import CLAIM_FILE, Keys
from ckptstage.daemon.tiers.s3.listing import S3Index
from ckptstage.daemon.tiers.s3.objects import Objects
from ckptstage.daemon.tiers.s3.orphans import ABANDONED_AFTER, Scope, clean_abandoned
from ckptstage.daemon.tiers.s3.replacing import S3Replacing
from ckptstage.daemon.tiers.s3.verify import verify_part
from ckptstage.daemon.tiers.s3.writer import S3PartWriter
from ckptstage.protos import layout

PIECE_BYTES = 64 << 20       # a multipart upload's piece (S3 allows 5 MiB to 5 GiB)
IN_FLIGHT = 8                # pieces of one object uploading at once ([shared] multipart_concurrency)
THREADS = 16                 # uploads (and, apart, ranged reads) in flight, across the tier
MAX_THREADS = MAX_CONNECTIONS // 2  # both pools together hold at most the client's connections


class S3Tier(S3ChunkCalls):
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
                 abandoned_s: float | None = None, compression: str = "none") -> None:
        """``compression``: whether chunks are kept compressed (:mod:`.compression`; ``[shared] compression``)."""
        if piece_bytes < MIN_PIECE_BYTES:
            raise ValueError(f"a multipart upload's pieces are at least {MIN_PIECE_BYTES} bytes, not {piece_bytes}")
        self.connection = conn
        self._keys = Keys(conn.location, owner)
        self.objects = Objects(conn, piece_bytes, in_flight)
        self.claims = Claims(self.objects, owner, claim_stale_s)
        self._transfers = Transfers(conn, piece_bytes, in_flight, threads)
        self._cleanup = Cleanup(self.objects, self.claims, self._keys)
        self._index = S3Index(self._keys, self.objects)
        self._chunks = S3Chunks(self._keys, self.objects, self._transfers, Compression(compression), piece_bytes)
        self._replacing = S3Replacing(self._keys, self.objects, self._index, self._cleanup)
        self.abandoned_s = abandoned_s if abandoned_s is not None else ABANDONED_AFTER * claim_stale_s

    @classmethod
    def from_config(cls, config: Any, owner: str) -> S3Tier:
        """The tier ``[shared] url`` names (``config``: a :class:`ckptstage.daemon.config.SharedConfig`):
        pieces of ``multipart_bytes``, ``multipart_concurrency`` of them per file at once, and threads for
        that many per part drained at once."""
        threads = min(MAX_THREADS, max(THREADS, config.multipart_concurrency * config.max_concurrent))
        return cls(connect(config), owner, piece_bytes=config.multipart_bytes,
                   in_flight=config.multipart_concurrency, threads=threads, compression=config.compression)

    @property
    def root(self) -> Path:
        return self._keys.root

    @property
    def compression(self) -> Compression:
        return self._chunks.compression

    @property
    def owner(self) -> str:
        return self._keys.owner

    @property
    def url(self) -> str:
        return self._keys.url

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

    # --- keys (see keys.py) -------------------------------------------------------------

    def key(self, location: Path | PurePosixPath) -> str:
        return self._keys.key(location)

    def url_of(self, location: Path | PurePosixPath) -> str:
        return self._keys.url_of(location)

    def name_of(self, location: Path) -> str:
        return self._keys.url_of(location)

    def dir_key(self, location: Path) -> str:
        return self._keys.dir_key(location)

    def part_location(self, job: str, step: int, rank: int) -> Path:
        return self._keys.part_location(job, step, rank)

    def step_location(self, job: str, step: int) -> Path:
        return self._keys.step_location(job, step)

    # --- the index (see listing.py) -----------------------------------------------------

    def list_jobs(self) -> list[str]:
        return self._index.list_jobs()

    def list_steps(self, job: str, step: int | None = None, known: Mapping[Path, int] | None = None,
                   trust: bool = False) -> Iterator[layout.StepRef]:
        return self._index.list_steps(job, step)  # one listing names every object: nothing to check apart

    def list_step(self, job: str, step: int) -> layout.StepRef | None:
        return next(iter(self._index.list_steps(job, step)), None)

    def has_part(self, part: Path) -> bool:
        return self._index.has_part(part)

    def part_version(self, part: Path) -> int:
        return self._index.part_version(part)

    def read_manifest(self, part: Path) -> tuple[Manifest, str]:
        return self._index.read_manifest(part)

    def has_commit_record(self, step: Path) -> bool:
        return self._index.has_commit_record(step)

    def read_commit_record(self, step: Path) -> layout.CommitRecord | None:
        return self._index.read_commit_record(step)

    def record_version(self, step: Path) -> int:
        return self._index.record_version(step)

    # --- parts and records --------------------------------------------------------------

    def begin_part(self, job: str, step: int, rank: int, replace: Callable[[Path], bool] | None = None,
                   final: Path | None = None) -> S3PartWriter:
        staging = self._keys.writer_temporaries(job, step, rank, uuid.uuid4().hex[:12])
        return S3PartWriter(final or self.part_location(job, step, rank), staging, replace, keys=self._keys,
                            objects=self.objects, claims=self.claims, transfers=self._transfers, cleanup=self._cleanup)

    def open_file(self, part: Path, name: str) -> ObjectReader:
        return self._transfers.reader(self.key(part / name))

    def verify_part(self, part: Path) -> None:
        """Reads every byte of the part by ranges and checks it against the manifest (see verify.py)."""
        verify_part(part, self.read_manifest(part)[0], self._keys, self._transfers, self._chunks)

    def readable_path(self, part: Path) -> Path | None:
        return None  # objects are not files: the daemon fetches the part to the local tier for readers

    def remove_part(self, part: Path) -> None:
        """The manifest first (the part is gone at once), then its files; recorded in the temporaries
        first, so that a removal cut short is finished on start."""
        manifest = self.key(part / layout.MANIFEST_FILE)
        head = self.objects.head(manifest)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no part at {self.url_of(part)}")
        self._cleanup.remove_published(part, str(head["ETag"]))

    def create_commit_record(self, step: Path, record: layout.CommitRecord) -> bool:
        return self.objects.create(self.key(step / layout.COMMIT_FILE), layout.commit_record_bytes(record))

    def write_step_index(self, step: Path, data: bytes) -> None:
        self.objects.put(self.key(step / layout.STEP_INDEX_FILE), data)  # one PUT: readers see all of it or none

    def read_step_index(self, step: Path) -> bytes | None:
        try:
            return self.objects.get(self.key(step / layout.STEP_INDEX_FILE))  # written under the 256 MiB bound
        except FileNotFoundError:
            return None

    def claim_seal(self, step: Path) -> bool:
        return self.objects.create(self.key(step / layout.SEAL_CLAIM_FILE), self.owner.encode())

    def remove_commit_record(self, step: Path) -> None:
        """Deletes the record; the removals of the step's parts that this daemon left cut short (the store
        failed half way) are finished first: a record goes after its parts, every object of them."""
        key = self.key(step / layout.COMMIT_FILE)
        head = self.objects.head(key)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no commit record in {self.url_of(step)}")
        self._cleanup.finish_removals(step)
        self.objects.delete(key, str(head["ETag"]))
        # The claim: one a sealer that died left.
        self.objects.delete_many([self.key(step / layout.STEP_INDEX_FILE), self.key(step / layout.SEAL_CLAIM_FILE)])

    def release_seal(self, step: Path) -> None:
        try:
            self.objects.delete(self.key(step / layout.SEAL_CLAIM_FILE))
        except FileNotFoundError:
            pass

    def read_job_json(self, job: str, name: str, default: Any) -> Any:
        try:
            raw = self.objects.get(self._keys.job_document(job, name))
        except FileNotFoundError:
            return default
        try:
            return json.loads(raw)
        except ValueError:
            return default  # as the file-system tier reads an unreadable document

    def write_job_json(self, job: str, name: str, obj: Any) -> None:
        self.objects.put(self._keys.job_document(job, name),
                         json.dumps(obj, sort_keys=True).encode())  # one PUT: readers see the old or the new

    # --- housekeeping -------------------------------------------------------------------

    def prepare(self) -> None:
        """Checks that the bucket answers to these credentials (a bucket is the operator's to create) and
        that the store honours conditional writes."""
        self.check()
        check_conditions(self.objects, self._keys)

    def clean_temporaries(self) -> int:
        """This daemon's temporaries (:meth:`Cleanup.clean_temporaries`), and the pack uploads its writers left."""
        return self._cleanup.clean_temporaries() + (self._chunks.packs.abort_own_uploads() if self.owner else 0)

    def clean_abandoned(self) -> int:
        """Cleans what other daemons' writers and removals left and have not touched for
        :attr:`abandoned_s` (their daemons are gone: see :mod:`ckptstage.daemon.tiers.s3.orphans`); returns how
        many. Never a live writer's work (its claim is renewed), nor a published part. Meant to run now
        and then (each pass lists the temporaries, and reads each other daemon's notes)."""
        if not self.owner:
            raise ValueError(f"{self.url}: a tier opened without an owner only indexes; it cleans nothing")
        scope = Scope(self._keys.all_temporaries(), self.dir_key(self.root), self.owner)
        return clean_abandoned(self.objects, self.claims, scope, self.abandoned_s)

    def discard_temporary(self, location: Path) -> bool:
        return self._cleanup.discard_temporary(location)

    def usage(self) -> Usage:
        """No free space to speak of (see the module docstring): one request, so that the tier probe
        learns whether the store answers; raises OSError when it does not."""
        self.objects.any_under(self.dir_key(self.root))
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
        self._cleanup.remove_published(part, str(head["ETag"]))
        return target

    def quarantine_chunk(self, location: Path) -> Path | None:
        return self._chunks.quarantine_chunk(location)

    def list_quarantined(self) -> list[QuarantinedCopy]:
        return self._index.list_quarantined()

    def delete_quarantined(self, location: Path) -> int:
        return self._index.delete_quarantined(location)

    # --- replacing a step (see replacing.py) --------------------------------------------

    def staged_location(self, job: str, step: int, rank: int) -> Path:
        return self._replacing.staged_location(job, step, rank)

    def list_staged(self, job: str, step: int) -> list[layout.PartRef]:
        return self._replacing.list_staged(job, step)

    def swap_in(self, record: layout.CommitRecord) -> bool:
        return self._replacing.swap_in(record)

    def discard_staged(self, job: str, step: int) -> bool:
        return self._replacing.discard_staged(job, step)

    def recover_staged(self) -> int:
        return self._replacing.recover_staged()
