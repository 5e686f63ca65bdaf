"""The storage tier interface: everything the daemon asks of a place that holds checkpoints.

A tier holds parts, commit records, incremental parts' chunk stores, a
job's published retention rules, and this daemon's temporaries (the layout
is docs/FORMAT.md). The persister, the drainer, the catalogue, retention and
the quarantine reach a tier only through :class:`Tier`, so another kind of
tier (an S3-compatible object store) is one new module implementing it;
:class:`ckptstage.daemon.tiers.fs.FsTier` is the file-system implementation
(the local SSD, and a parallel file system as the shared tier).

The operations are named for what they mean, not for POSIX calls, so that
a store without rename or directories can implement them:

* **Publishing is all or nothing.** :meth:`Tier.begin_part` hands out a
  :class:`PartWriter`; its files are invisible until :meth:`PartWriter.commit`
  writes the manifest last and publishes the part (a rename on a file
  system; on an object store, the objects then the manifest as the commit
  marker). A commit record is created at most once, by whoever comes first
  (:meth:`Tier.create_commit_record`: ``link()`` here; a conditional put
  there).
* **Listing is by prefix.** Jobs, a job's steps, a step's parts, a store's
  chunks: nothing walks a tree it does not name.
* **Locations are paths.** A part's location is what :class:`Part.path
  <ckptstage.daemon.catalog.index.Part>` holds: on the file-system tier its
  directory, on an object store its key prefix (a relative path). A step's
  location is the parent of its parts' locations. Readers on the node read
  a part's files directly where :meth:`Tier.readable_path` says they can.
* **Versions tell a replaced object from the one indexed** (the inode on a
  file system; an object's version or ETag elsewhere): the catalogue re-reads
  a part or record only when its version changed.

This module is the bottom of the daemon's storage layer: it imports the
format (:mod:`ckptstage.protos.layout`) and nothing of the daemon.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

from ckptstage.daemon.tiers.compression import Compression
from ckptstage.protos import layout, packs

Manifest = dict[str, Any]


class TierName(str, Enum):
    LOCAL = "local"
    SHARED = "shared"
    MEMORY = "memory"  # the memory tier (memtier.py): never a catalogue part, named by waits and reports
    PEER = "peer"      # other nodes of the job (daemon/peers/): their parts and replicas, and this node's replicas


@dataclass(frozen=True)
class Usage:
    """Room on a tier's storage, in bytes (what an unprivileged writer may still use).

    ``unbounded``: the storage sets no limit of its own (an object store); the two
    counts are then 0 and mean nothing, and nothing is reported or alerted on them.
    """

    free_bytes: int
    total_bytes: int
    unbounded: bool = False


@dataclass(frozen=True)
class QuarantinedCopy:
    """A copy moved aside as corrupt: a part (``step``, ``rank``), or a chunk of a job's store (``chunk``: its
    name; no step or rank, since steps share it). ``nbytes`` it holds; ``since``: when it was moved aside (unix
    time)."""

    job: str
    step: int | None
    rank: int | None
    location: Path
    nbytes: int = 0
    since: float = 0.0
    chunk: str = ""


@dataclass(frozen=True)
class Pack:
    """A pack of a chunk store (docs/FORMAT.md, "Packs"): its chunks (none: no index publishes it, a writer cut
    short) and when it was last written or relied on (unix time)."""

    pack_id: str
    chunks: tuple[tuple[str, int], ...]  # (name, length) of each chunk it holds
    mtime: float

    @classmethod
    def of(cls, pack_id: str, entries: Iterable[packs.Entry], mtime: float) -> Pack:
        """The pack whose index lists ``entries`` (each chunk at what it takes in the pack)."""
        return cls(pack_id, tuple((e.name, e.length) for e in entries), mtime)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(n for n, _ in self.chunks)

    @property
    def nbytes(self) -> int:
        return sum(length for _, length in self.chunks)


class DataSink(Protocol):
    """A file of a part being written, at absolute offsets, from several threads."""

    def write(self, data: memoryview, offset: int) -> None: ...

    def sync(self) -> None:
        """Makes every byte written durable (before the manifest that vouches for them)."""

    def close(self) -> None: ...


class Reader(Protocol):
    """A file or chunk of a tier, read from its start (:meth:`Tier.open_file`, :meth:`Tier.open_chunk`)."""

    size: int  # its size when it was opened

    def readinto(self, buf: memoryview) -> int | None: ...

    def read(self, n: int) -> bytes: ...

    def close(self) -> None: ...

    def __enter__(self) -> Reader: ...

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None: ...


class ChunkBatch(Protocol):
    """New chunks of one job's store, written but not yet in the store (:meth:`Tier.new_chunks`).

    :meth:`write` may be called from several threads. :meth:`publish` makes
    them durable and visible (before any manifest names them); :meth:`discard`
    drops what was not published (a no-op after publishing). A store where a
    write is whole or absent may show each chunk as soon as it is written, and
    leave a discarded batch's chunks to a later save or the sweep (an object
    store): a chunk is named by its bytes, so an early one is a good one, and
    the sweep's grace period covers it until a manifest names it.
    """

    def write(self, name: str, data: memoryview, direct_io: bool) -> None: ...

    def write_run(self, held: Sequence[tuple[str, int, int]], data: memoryview, direct_io: bool) -> None:
        """Writes the chunks ``held`` (name, offset in ``data``, length) that ``data`` holds, with one write where
        the store keeps chunks in packs (a run read with :meth:`ChunkStorage.open_chunk_run`)."""

    def publish(self) -> None: ...

    def discard(self) -> None: ...


class PartWriter(Protocol):
    """One part being written to a tier, invisible until :meth:`commit` (:meth:`Tier.begin_part`)."""

    final: Path            # where the part is published
    manifest_digest: str   # after commit: xxh3-64 of its manifest.json (what a commit record names)
    ino: int               # after commit: the published part's version

    def create_file(self, name: str, size: int, direct_io: bool, reserve: bool = True) -> DataSink:
        """A new file of the part, of ``size`` bytes (reserved up front unless ``reserve`` is False)."""

    def commit(self, manifest: Manifest) -> Path:
        """Writes the manifest last and publishes the part at :attr:`final`; returns that location.

        The caller has synced every file first. Raises FileExistsError when a
        part is already there and the writer's ``replace`` policy refuses it."""

    def abort(self) -> None:
        """Drops everything written (a no-op once committed)."""


@runtime_checkable
class PartIndex(Protocol):
    """What the catalogue reads: jobs, steps, parts, manifests and commit records."""

    def list_jobs(self) -> list[str]: ...

    def list_steps(self, job: str, step: int | None = None, known: Mapping[Path, int] | None = None,
                   trust: bool = False) -> Iterator[layout.StepRef]:
        """The steps of ``job`` (or the one step) that hold a published part or a commit record.

        ``known``: the parts the caller indexed (location -> version); a tier
        that would check each part it lists may trust these unchecked, and
        with ``trust`` every part (the caller reads only what a record names)."""

    def list_step(self, job: str, step: int) -> layout.StepRef | None:
        """One step as one listing names it, no part looked at: whether a step of W parts is all there costs
        one request, not W."""

    def part_location(self, job: str, step: int, rank: int) -> Path: ...

    def step_location(self, job: str, step: int) -> Path: ...

    def has_part(self, part: Path) -> bool: ...

    def part_version(self, part: Path) -> int:
        """The published part's version (0: gone)."""

    def read_manifest(self, part: Path) -> tuple[Manifest, str]:
        """The part's manifest, verified, and the xxh3-64 of its file; raises :class:`layout.ManifestError`."""

    def has_commit_record(self, step: Path) -> bool:
        """Whether the step holds a commit record, trusted or not (one that fails verification is never
        written over)."""

    def read_commit_record(self, step: Path) -> layout.CommitRecord | None:
        """The step's commit record, verified; None when there is none. Raises :class:`layout.ManifestError`
        when it is there but not trusted."""

    def record_version(self, step: Path) -> int:
        """The version of the step's commit record (0: none)."""


@runtime_checkable
class PartStorage(Protocol):
    """What the persister, the drainer, commits and retention write, read and delete."""

    def begin_part(self, job: str, step: int, rank: int, replace: Callable[[Path], bool] | None = None,
                   final: Path | None = None) -> PartWriter:
        """A writer for one part. ``replace(final)``, asked at commit, says whether a part already at
        ``final`` may be replaced; ``final`` overrides where the part is published (a replacement's
        staging area)."""

    def open_file(self, part: Path, name: str) -> Reader:
        """A file of a published part, for a sequential read (the drain's source)."""

    def verify_part(self, part: Path) -> None:
        """Re-reads every byte of a part and checks it against its manifest; raises
        :class:`layout.ChecksumMismatch` naming the file or chunk, or ManifestError caused by the OSError
        of a read that failed."""

    def readable_path(self, part: Path) -> Path | None:
        """Where a reader on this node opens the part's files directly; None where it cannot (the
        daemon fetches such a part to the local tier first)."""

    def remove_part(self, part: Path) -> None:
        """Deletes a published part at once, never half (readers see it or nothing); an emptied step
        goes too. Raises FileNotFoundError when it is gone already."""

    def create_commit_record(self, step: Path, record: layout.CommitRecord) -> bool:
        """Publishes the step's commit record unless one is there; True if this call created it (exactly
        once, also between daemons of several nodes)."""

    def write_step_index(self, step: Path, data: bytes) -> None:
        """Puts the step's index (:data:`layout.STEP_INDEX_FILE`) in place, replacing one there."""

    def read_step_index(self, step: Path) -> bytes | None:
        """The step's index as written (None when it has none); at most :data:`layout.MAX_STEP_INDEX_BYTES`
        + 1 bytes are read, so a larger one reads as too large."""

    def claim_seal(self, step: Path) -> bool:
        """Creates the step's seal claim (:data:`layout.SEAL_CLAIM_FILE`) unless it is there; True if this call
        created it (exactly once across nodes, as a commit record)."""

    def release_seal(self, step: Path) -> None:
        """Deletes the step's seal claim (nothing when it is gone)."""

    def remove_commit_record(self, step: Path) -> None:
        """Deletes the step's commit record (last, after its parts), its index and seal claim, and the step
        if it is empty then. Raises FileNotFoundError when the record is gone already."""

    def read_job_json(self, job: str, name: str, default: Any) -> Any:
        """A small JSON document published beside a job's steps (its retention rules); ``default`` if none."""

    def write_job_json(self, job: str, name: str, obj: Any) -> None:
        """Replaces such a document atomically."""


@runtime_checkable
class ChunkStorage(Protocol):
    """The chunk stores of incremental parts: one per job, and one every job of the user shares; chunks named by
    their content. Each call's ``job`` is the store's key (:func:`ckptstage.protos.chunks.store_key`): a job's
    name, or :data:`~ckptstage.protos.chunks.USER_STORE`.

    The rules that make a sweep safe (leases, the grace period, marking
    twice) are :class:`ckptstage.daemon.catalog.chunkstore.ChunkStore`'s; a tier
    only stores, lists and moves chunks.
    """

    @property
    def compression(self) -> Compression:
        """Whether new chunks are kept compressed (``[shared] compression``; "none" on the local tier), and what
        that did and measured."""

    def has_chunk_store(self, job: str) -> bool: ...

    def compressed_sizes(self, job: str) -> dict[str, int]:
        """The chunks of the store kept compressed, as far as this process has read its packs' indexes: name ->
        the bytes each takes there. From memory only: never waits on the tier."""

    def chunk_location(self, job: str, name: str) -> Path: ...

    def touch_chunk(self, job: str, name: str) -> bool:
        """Marks a chunk as relied on now (its modification time); False when the store lacks it."""

    def touch_chunks(self, job: str, names: Iterable[str]) -> set[str]:
        """:meth:`touch_chunk` of each of ``names`` (a pack holding several touched once); returns those held."""

    def chunk_size(self, job: str, name: str) -> int: ...

    def open_chunk(self, job: str, name: str) -> Reader:
        """Raises FileNotFoundError when the store lacks it."""

    def chunk_runs(self, job: str, names: Iterable[str], max_bytes: int) -> list[packs.Run]:
        """The reads that fetch every chunk among ``names``: chunks side by side in one pack in one read of at
        most ``max_bytes``, every other chunk in one of its own. FileNotFoundError names a chunk the store lacks."""

    def open_chunk_run(self, job: str, run: packs.Run) -> Reader:
        """A reader of a run's bytes. FileNotFoundError: its file is gone (a sweep took a pack a repack emptied:
        :meth:`chunk_runs` finds its chunks where they went)."""

    def missing_chunks(self, job: str, names: Iterable[str]) -> list[str]:
        """The chunks among ``names`` the store does not hold."""

    def swept_at(self, job: str) -> float | None:
        """When a sweep of the store last finished, on any node (unix time; None: none did, or no store)."""

    def note_swept(self, job: str) -> None:
        """Records that a sweep of the store finished now (:meth:`swept_at`; one small write)."""

    def new_chunks(self, job: str, part: PartWriter | None = None) -> ChunkBatch:
        """A batch of new chunks; staged with ``part``'s temporaries when given (they go with it)."""

    def list_manifests(self, job: str) -> list[Path]:
        """Every part of ``job`` whose manifest may name chunks: published or not, of any step, and the
        replacements any daemon is assembling."""

    def manifest_version(self, part: Path) -> tuple[int, ...]:
        """What changes whenever the part's manifest is written again; raises OSError (FileNotFoundError:
        gone)."""

    def list_chunks(self, job: str) -> list[str]:
        """The chunks in the store (not those condemned or quarantined)."""

    def condemn_chunk(self, job: str, name: str, untouched_since: float) -> bool:
        """Moves a chunk nobody touched since ``untouched_since`` (unix time) out of the store, into its
        condemned area; False when it was touched since, or is gone."""

    def condemned_chunks(self, job: str) -> list[str]: ...

    def restore_chunk(self, job: str, name: str) -> None:
        """Puts a condemned chunk back in the store. Raises FileNotFoundError when it is gone."""

    def delete_condemned_chunk(self, job: str, name: str) -> int:
        """Deletes a condemned chunk; returns the bytes freed. Raises FileNotFoundError when it is gone."""

    def list_packs(self, job: str) -> list[Pack]:
        """The packs of the job's store (a store that keeps every chunk on its own has none)."""

    def condemn_pack(self, job: str, pack_id: str, untouched_since: float) -> bool:
        """Moves a pack nobody wrote or relied on since ``untouched_since`` out of the store, as a whole;
        False when it was touched since, or is gone."""

    def condemned_packs(self, job: str) -> list[Pack]: ...

    def restore_pack(self, job: str, pack_id: str) -> None:
        """Puts a condemned pack back. Raises FileNotFoundError when it is gone."""

    def delete_condemned_pack(self, job: str, pack_id: str) -> int:
        """Deletes a condemned pack; returns the bytes freed. Raises FileNotFoundError when it is gone."""


@runtime_checkable
class Housekeeping(Protocol):
    """Start-up, temporaries, room, and corrupt copies moved aside."""

    def prepare(self) -> None:
        """Creates the tier's root if need be (durably)."""

    def clean_temporaries(self) -> int:
        """Removes what a crash of this daemon left in its temporaries; returns how many entries."""

    def discard_temporary(self, location: Path) -> bool:
        """Removes a tree inside this daemon's temporaries (a replacement being assembled); False when absent."""

    def usage(self) -> Usage:
        """Raises OSError when the tier cannot be reached."""

    def clean_abandoned(self) -> int:
        """Cleans what other daemons that died for good left on a tier several share (their writers'
        uploads and objects, their removals cut short), once the tier has seen no sign of life from them
        for long enough; returns how many. A tier that only one daemon writes has nothing to do."""

    def quarantine_part(self, part: Path) -> Path:
        """Moves a corrupt part aside, out of every listing but kept for forensics; returns where it went."""

    def quarantine_chunk(self, location: Path) -> Path | None:
        """Moves a corrupt chunk out of its store, so that no save reuses it; None when ``location`` is not
        a chunk (a part's own file goes with the part)."""

    def list_quarantined(self) -> list[QuarantinedCopy]:
        """Every part and chunk moved aside on the tier, by any daemon."""

    def delete_quarantined(self, location: Path) -> int:
        """Removes a copy :meth:`list_quarantined` lists (nothing else: ValueError); returns the bytes freed.
        Raises FileNotFoundError when it is gone."""


@runtime_checkable
class Replacing(Protocol):
    """Replacing a committed step whole (a save with overwrite; the rules are :mod:`ckptstage.daemon.catalog.overwrite`'s).

    The replacement's parts are published out of sight, in this daemon's
    staging area for the step, and the whole step takes the old one's place
    once every rank's part is there: readers see the old step or the new one,
    never a mix, also after a crash at any point.
    """

    def staged_location(self, job: str, step: int, rank: int) -> Path:
        """Where a replacement's part of (job, step) is published (``begin_part(..., final=...)``): in this
        daemon's temporaries, in no listing but :meth:`list_staged` and :meth:`ChunkStorage.list_manifests`."""

    def list_staged(self, job: str, step: int) -> list[layout.PartRef]:
        """The parts of the replacement of (job, step) published so far (their manifest is there), by rank."""

    def swap_in(self, record: layout.CommitRecord) -> bool:
        """Makes the staged replacement of ``record``'s step the step, whole: ``record`` becomes its commit
        record and the step in place (if any) goes. False when nothing is staged (swapped in already).

        A crash part way leaves what :meth:`recover_staged` turns into the old step or the new one."""

    def discard_staged(self, job: str, step: int) -> bool:
        """Drops the replacement of (job, step) being assembled (the step was deleted); False when there is none."""

    def recover_staged(self) -> int:
        """Finishes the swaps a crash cut short; returns how many replacements it put in place.

        Runs at start, before :meth:`Housekeeping.clean_temporaries` (which drops every replacement left
        staged): a staged step whose commit record was written becomes the step only where no step is in
        place; otherwise the step in place stays (the staged one was never the step, or is the old one)."""


@runtime_checkable
class Tier(PartIndex, PartStorage, ChunkStorage, Housekeeping, Replacing, Protocol):
    """A storage tier, as one daemon (``owner``, the node's name for its temporaries) uses it."""

    @property
    def root(self) -> Path:
        """Where the tier is, as the interface's locations: a directory, or an object store's pseudo-path."""

    @property
    def location(self) -> str:
        """Where the tier is, for people (logs, status, the CLI): a directory, or ``s3://bucket/prefix``."""

    def name_of(self, location: Path) -> str:
        """How messages name one of the tier's locations: its path, or ``s3://bucket/key``."""

    @property
    def owner(self) -> str: ...
