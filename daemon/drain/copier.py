"""Copying one part between tiers: every block checked against the source's manifest, published whole.

Each copy reads every source chunk once, checks it against the source
manifest's checksum, writes it under the destination tier's temporaries and
publishes with the same commit protocol as the local tier. A drain copies a
local part to the shared tier (into a replacement being assembled there when
the step was replaced here: :mod:`ckptstage.daemon.catalog.overwrite`); a
prefetch copies a shared part back to the local tier. How fast a copy may
write is the destination tier's business (:mod:`ckptstage.daemon.tiers.limiter`).

A source that fails its own checksums (:class:`CorruptSource`), or a
different part already published under the same name on the destination
(:class:`Conflict`), is a permanent failure: retrying cannot fix it.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ckptstage.daemon import fsutil
from ckptstage.daemon.catalog import overwrite
from ckptstage.daemon.catalog.chunkstore import ChunkStore
from ckptstage.daemon.catalog.commits import Commits
from ckptstage.daemon.catalog.index import Catalog, Part, TierName
from ckptstage.daemon.errors import ShuttingDown
from ckptstage.daemon.metrics import Metrics
from ckptstage.daemon.tiers.interface import ChunkBatch, Manifest, PartWriter, Tier
from ckptstage.protos import chunks, layout, packs

# Reads of an incremental part's chunks at once (each read, its chunks checked against their names, written).
_CHUNK_COPIERS = 4
# The most one of them reads: chunks side by side in a pack are read (and written) together.
_RUN_BYTES = 16 << 20
# Bytes a copy reads, checks and writes at a time (whole digest blocks).
_PIECE_BYTES = 64 << 20


class CorruptSource(Exception):
    """The source copy fails its own manifest: copying it would spread corruption."""


class Conflict(Exception):
    """A different part is already committed under the same name on the target tier."""


class Stopping(Exception):
    """The drain is stopping; the copy is abandoned (its temporary removed) and resumes on restart."""


class PartCopier:
    """Copies parts between ``tiers`` (the local and shared tiers' storage, the shared one rate-limited).

    ``chunk_stores``: where incremental parts' chunks land, per destination tier (their leases);
    ``nice``: added to the copy threads' niceness ([persist] nice); ``stop``: abandons copies under way."""

    def __init__(self, tiers: Mapping[TierName, Tier], catalog: Catalog, commits: Commits, metrics: Metrics,
                 chunk_stores: Mapping[TierName, ChunkStore], nice: int, stop: threading.Event) -> None:
        self.tiers = dict(tiers)
        self.shared = self.tiers[TierName.SHARED]
        self.catalog = catalog
        self.metrics = metrics
        self._commits = commits
        self._chunk_stores = dict(chunk_stores)
        self._nice = nice
        self._stop = stop

    def fetch(self, part: Part) -> Part:
        """Copies a shared part onto the local tier (prefetch before a restart).

        The local copy counts as drained: it came from the shared tier.
        Raises :class:`CorruptSource` if the shared copy fails its checksums.
        """
        try:
            local = self.copy(part, TierName.LOCAL)
        except Stopping:
            raise ShuttingDown() from None
        self.catalog.mark_drained(part.job, part.step, part.rank, local.digest)
        return local

    def publish(self, part: Part) -> list[Part]:
        """Drains one local part; returns the parts this made committed on the shared tier, in place.

        Usually that is the part itself. A part of a step replaced here (a save
        with overwrite) whose old version the shared tier still holds goes into
        the replacement being assembled there instead (:mod:`ckptstage.daemon.catalog.overwrite`):
        [] until every rank's part has arrived, then all of them, swapped in.
        """
        record = self._replacement_of(part)
        if record is None:
            return [self.copy(part, TierName.SHARED)]
        staged = self.shared.staged_location(part.job, part.step, part.rank)
        self.copy(part, TierName.SHARED, final=staged)
        parts = {p.rank: p for p in overwrite.staged_parts(self.shared, TierName.SHARED, part.job, part.step)
                 if p.matches(record)}
        if set(parts) != set(range(record.world_size)):
            return []
        return self._commits.swap_in(TierName.SHARED, record, parts)

    def _replacement_of(self, part: Part) -> layout.CommitRecord | None:
        """The local commit record that names ``part`` and replaces the step the shared tier holds, if so.

        Only a replacement of exactly the commit there (its fingerprint is in the
        local record's ``replaces``) may take its place: anything else is a
        straggler (:class:`Conflict` in :meth:`copy`), e.g. a crashed run's step
        that its successor committed again on another node.
        """
        there = _record_on(self.shared, self.shared.step_location(part.job, part.step))
        if there is None or part.matches(there):
            return None
        local = self.catalog.record(part.job, part.step, TierName.LOCAL)
        if local is None or not part.matches(local) or there.fingerprint() not in local.replaces:
            return None
        return local

    def copy(self, part: Part, tier: TierName, final: Path | None = None) -> Part:
        """Copies one part to ``tier`` with the commit protocol; returns the committed copy.

        A part of another attempt already there is replaced when the step has
        no commit record on that tier (:meth:`Commits.replacer`); a step
        committed by another attempt is a :class:`Conflict` (this part is a
        straggler of a run that did not complete it).
        """
        source, dest = self.tiers[part.tier], self.tiers[tier]
        manifest, digest = source.read_manifest(part.path)
        try:
            layout.check_committed_manifest(part.path, digest, part.digest)  # never spread a rewritten manifest
        except layout.ChecksumMismatch as e:
            raise CorruptSource(f"{source.name_of(e.path)}: {e.detail}") from None
        attempt = layout.manifest_attempt(manifest)
        final = final or dest.part_location(part.job, part.step, part.rank)
        committed = _record_on(dest, final.parent)
        if committed is not None and committed.attempt != attempt:
            raise Conflict(f"{part.job} step {part.step} is committed on {dest.location} by attempt "
                           f"{committed.attempt!r}; this part of attempt {attempt!r} is a straggler and is not "
                           "copied")
        if dest.has_part(final) and not _replaceable(dest, final, manifest):
            return _reuse(dest, final, manifest, part, tier)
        writer = dest.begin_part(part.job, part.step, part.rank,
                                 replace=lambda f: _replaceable(dest, f, manifest), final=final)
        names = chunks.referenced(manifest)
        key = chunks.store_key(manifest)  # the job's chunk store, or the user's: the same on every tier
        store = self._chunk_store(tier, names)
        leased: list[set[str]] = []
        try:
            if names:
                leased.append(names)
                self._copy_chunks(part, key, store, tier, names)
            else:
                for name, entry in layout.manifest_files(manifest).items():
                    self._copy_file(source, part.path, name, writer, entry)
            try:
                published = writer.commit(manifest)
            except OSError:
                if dest.has_part(final):  # published meanwhile (by ourselves before a crash, or a race)
                    return _reuse(dest, final, manifest, part, tier)
                raise
            # Another node's sweep may have taken a chunk this part relied on before the part was
            # published (see chunkstore): put back what it took, before anyone commits the step.
            for _ in range(3):
                gone = dest.missing_chunks(key, names) if names else []
                if not gone:
                    break
                leased.append(set(gone))
                self._copy_chunks(part, key, store, tier, set(gone))
            else:
                raise OSError(f"chunks of {published} keep vanishing from {dest.location}: is another daemon sweeping "
                              "with a shorter [persist] chunk_grace_s?")
            return Part(part.job, part.step, part.rank, part.world_size, tier, published, part.nbytes, part.created,
                        part.metrics, attempt, writer.manifest_digest, writer.ino)
        finally:
            for held in leased:
                store.release(key, held)
            writer.abort()

    def _chunk_store(self, tier: TierName, names: set[str]) -> ChunkStore:
        store = self._chunk_stores.get(tier)
        if names and store is None:
            raise OSError(f"an incremental part cannot be copied to the {tier.value} tier: no chunk store for it")
        return store  # type: ignore[return-value]  # only used when names is not empty

    def _copy_chunks(self, part: Part, key: str, store: ChunkStore, tier: TierName, names: set[str]) -> None:
        """Copies the chunks among ``names`` that ``store`` lacks from the part's own store (each checked
        against its name, the xxh3-128 of its bytes), touching those it holds; leases them all. ``key``: the
        chunk store they are in, on both tiers (:func:`chunks.store_key`)."""
        batch = self.tiers[tier].new_chunks(key)  # store.new_chunks, through the tier's rate limit
        try:
            self._copy_missing(part, key, store, batch, names, tier)
        finally:
            batch.discard()

    def _copy_missing(self, part: Part, key: str, store: ChunkStore, batch: ChunkBatch, names: set[str],
                      tier: TierName) -> None:
        """Touches the chunks ``store`` holds, copies the others on :data:`_CHUNK_COPIERS` threads, then
        makes them durable together (:meth:`ChunkBatch.publish`)."""
        source = self.tiers[part.tier]
        reused = 0
        todo = []
        held = store.reuse(key, names)
        for name in sorted(names):
            if name in held:
                reused += store.tier.chunk_size(key, name)
            else:
                todo.append(name)

        buffers = _Buffers()

        def read(run: packs.Run) -> None:
            with source.open_chunk_run(key, run) as f:
                size = f.size
                with buffers.get(size) as view:  # page-aligned, and so is its length: the write goes O_DIRECT
                    got = f.readinto(view[:size]) or 0
                    held = run.sized(size)
                    where = f"{source.name_of(run.path)} (a chunk of {source.name_of(part.path)})"
                    for name, offset, length in held:
                        if offset + length > got:
                            raise CorruptSource(f"{where}: shorter than its chunk {name} ({offset + length} bytes)")
                        if chunks.digest(view[offset:offset + length]) != name:
                            raise CorruptSource(f"{where}: chunk {name}'s bytes do not hash to its name")
                    batch.write_run(held, view, direct_io=True)

        def copy(run: packs.Run) -> None:
            if self._stop.is_set():
                raise Stopping()
            try:
                try:
                    read(run)
                except FileNotFoundError:
                    if run.whole:
                        raise
                    for again in source.chunk_runs(key, run.names, _RUN_BYTES):
                        read(again)  # the pack went (a sweep after a repack): its chunks are elsewhere now
            except FileNotFoundError as e:
                raise _missing(source, part, e, run.path) from e

        if todo:
            try:
                runs = source.chunk_runs(key, todo, _RUN_BYTES)
            except FileNotFoundError as e:
                raise _missing(source, part, e, source.chunk_location(key, todo[0])) from e
            try:
                with ThreadPoolExecutor(min(_CHUNK_COPIERS, len(runs)), "drain-chunk",
                                        initializer=fsutil.lower_thread_priority, initargs=(self._nice,)) as pool:
                    for f in [pool.submit(copy, r) for r in runs]:
                        f.result()
            finally:
                buffers.close()
        batch.publish()
        self.metrics.chunks_reused.labels(tier.value).inc(reused)

    def _copy_file(self, source: Tier, part: Path, name: str, writer: PartWriter, entry: layout.FileEntry) -> None:
        """Reads piece i+1 while piece i is written: one read, one check per digest block, one write.

        Pieces are whole digest blocks, about :data:`_PIECE_BYTES` each; two
        page-aligned buffers; the destination takes aligned pieces with
        O_DIRECT where the tier allows (see :class:`fsutil.DataFile`).
        Every block is checked against the local manifest before it is written.
        """
        src = part / name
        block = entry.chunk_bytes
        blocks_per_piece = max(1, _PIECE_BYTES // block)
        bufs = [mmap.mmap(-1, block * blocks_per_piece) for _ in range(2)]
        out = writer.create_file(name, entry.size, direct_io=True)
        try:
            with source.open_file(part, name) as fin, \
                    ThreadPoolExecutor(1, "drain-write", initializer=fsutil.lower_thread_priority,
                                       initargs=(self._nice,)) as pool:
                pending: Future[None] | None = None
                total = 0
                for k, first in enumerate(range(0, len(entry.digests), blocks_per_piece)):
                    if self._stop.is_set():
                        raise Stopping()
                    count = min(blocks_per_piece, len(entry.digests) - first)
                    piece = memoryview(bufs[k % 2])[:block * count]
                    n = fin.readinto(piece) or 0
                    piece = piece[:n]
                    for j in range(count):
                        data = piece[j * block:(j + 1) * block]
                        try:
                            layout.verify_block(data, entry, first + j, src)
                        except layout.ChecksumMismatch as e:
                            raise CorruptSource(f"{source.name_of(src)}: {e.detail}") from None
                    if pending is not None:
                        pending.result()  # the other buffer is free again
                    pending = pool.submit(out.write, piece, total)
                    total += n
                if pending is not None:
                    pending.result()
                if total != entry.size or fin.read(1):
                    raise CorruptSource(f"{source.name_of(src)}: size differs from its manifest ({entry.size} bytes)")
            out.sync()
        finally:
            out.close()


class _Buffers:
    """A page-aligned buffer per copying thread, kept from one run to the next (a fresh one costs a page fault
    and a zeroed page for every 4 KiB of it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[mmap.mmap] = []

    @contextlib.contextmanager
    def get(self, size: int) -> Iterator[memoryview]:
        """``size`` bytes rounded up to a page; the bytes past ``size`` zeroed (a pack's padding)."""
        padded = max(packs.page_up(size), packs.PAGE)
        with self._lock:
            buf = self._free.pop() if self._free else None
        if buf is None or len(buf) < padded:
            if buf is not None:
                buf.close()
            buf = mmap.mmap(-1, padded)
        view = memoryview(buf)[:packs.page_up(size)]
        try:
            view[size:] = bytes(len(view) - size)
            yield view
        finally:
            view.release()
            with self._lock:
                self._free.append(buf)

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for buf in free:
            with contextlib.suppress(BufferError):  # a slice still held by an error's traceback: GC frees it
                buf.close()


def _missing(source: Tier, part: Part, error: FileNotFoundError, where: Path) -> CorruptSource:
    """The error for a chunk of ``part`` its store lacks (``error`` names it, else ``where``)."""
    lost = Path(error.filename) if error.filename else where
    return CorruptSource(f"{source.name_of(lost)}: a chunk of {source.name_of(part.path)} is missing")


def _created(manifest: dict[str, object]) -> float:
    value = manifest.get("created", 0.0)
    return float(value) if isinstance(value, (int, float)) else 0.0


def _record_on(storage: Tier, step: Path) -> layout.CommitRecord | None:
    """The step's trusted commit record on a tier (None: none, or one that fails verification)."""
    try:
        return storage.read_commit_record(step)
    except layout.ManifestError:
        return None


def _replaceable(storage: Tier, final: Path, manifest: Manifest) -> bool:
    """Whether the part at ``final`` is an earlier save's, in a step with no commit record there.

    An earlier attempt's (a crashed run's leftovers), or this attempt's own
    earlier version of the part (replaced in place by a save with
    overwrite), even one with the very same bytes: the manifest is part of
    the part (its digest is what a commit record names), so a re-save of
    an unchanged state must still take the old one's place. Earlier, not
    merely other: a crashed attempt's part whose drain resumes after the
    restart must never replace the part its successor already drained (the
    successor's local copy counts as drained and may go).
    """
    if storage.has_commit_record(final.parent):
        return False
    try:
        theirs = storage.read_manifest(final)[0]
    except layout.ManifestError:
        return False  # judged by _reuse: a Conflict, never silently replaced
    return theirs != manifest and _created(theirs) < _created(manifest)


def _reuse(storage: Tier, final: Path, manifest: Manifest, part: Part, tier: TierName) -> Part:
    """A part already committed at ``final``: ours if its files match, else a :class:`Conflict`.

    It is ours when a crash came after the rename but before the index
    learnt of it. A different part under the same name (a job name reused
    with a stale checkpoint left on the shared tier) must never be taken
    for this one: the local copy would be deleted as drained.
    """
    theirs, digest = storage.read_manifest(final)
    if theirs.get("files") != manifest.get("files"):
        raise Conflict(f"{final} already holds a different checkpoint under the same job, step and rank; "
                       "move it away (or use a new job name) to drain this one")
    return Part(part.job, part.step, part.rank, part.world_size, tier, final, part.nbytes, part.created,
                part.metrics, layout.manifest_attempt(theirs), digest, storage.part_version(final))
