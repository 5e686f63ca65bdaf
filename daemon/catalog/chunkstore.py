"""The chunk stores of one tier: which chunks a save reuses, how new ones land, what a sweep removes.

Incremental parts (:mod:`ckptstage.protos.chunks`) keep their bytes in the
job's chunk store, shared by every step that has them. A chunk may go only
when no part on the tier refers to it; this module decides that with a mark
and sweep that is safe against the savers and drains running meanwhile, in
this daemon and in other nodes' daemons on a shared tier:

* a writer *leases* every chunk it reuses or adds until its part's manifest
  is in the step directory, and *touches* a chunk it reuses (its mtime is the
  last time anyone relied on it);
* a sweep marks the chunks that the manifests of the job's parts (committed
  or not, staged replacements included) refer to, then *condemns* (renames
  into ``chunks/.condemned/``) each unmarked chunk that nobody here leases and
  nobody touched within the grace period; it then marks again, puts back
  every condemned chunk that a part published meanwhile refers to, and only
  then deletes the rest;
* a writer on another node, which no lease of ours can see, checks after
  publishing its part that every chunk it refers to is still in place, and
  writes back any that a sweep took (:meth:`Tier.missing_chunks`), and no commit
  record is written for a step while a chunk of one of its parts is missing.

A SIGKILL at any point leaves chunks in place or condemned, never a
published part without its chunks: the next sweep (any node's) finishes the
condemned ones the same way, putting back those a part refers to.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ckptstage.daemon.catalog import repack
from ckptstage.daemon.logs import fields
from ckptstage.daemon.tiers.interface import ChunkBatch, Pack, PartWriter, Tier
from ckptstage.protos import chunks, layout

log = logging.getLogger(__name__)

CONDEMNED_DIR = chunks.CONDEMNED_DIR


class MarkFailed(OSError):
    """A manifest could not be read for a reason other than its own corruption: nothing is swept."""


@dataclass(frozen=True)
class Swept:
    """What one sweep of one job's store did."""

    removed: int = 0
    freed: int = 0
    restored: int = 0


_Seen = dict[Path, tuple[tuple[int, ...], frozenset[str]]]


def referenced(storage: Tier, key: str, seen: _Seen | None = None) -> set[str]:
    """The chunks that the store ``key`` may hold for a part on the tier: those every part of its job refers to
    (committed or not, staged replacements too), or for the user's store (:data:`chunks.USER_STORE`), those every
    part of every job refers to. (A part's chunks are in one store; marking them in another keeps nothing live
    from going.)

    A manifest that fails its own checks names nothing (that part is unreadable
    anyway, and quarantine removes it); one that cannot be read at all (EIO, a
    permission) raises :class:`MarkFailed`, since its chunks may be live.
    ``seen`` (updated in place) remembers each manifest's names under its
    version (:meth:`Tier.manifest_version`), so that a mark reads only the
    manifests that are new since the last one.
    """
    names: set[str] = set()
    known = dict(seen or {})
    if seen is not None:
        seen.clear()
    jobs = storage.list_jobs() if key == chunks.USER_STORE else [key]
    for part in (p for job in jobs for p in storage.list_manifests(job)):
        path = part / layout.MANIFEST_FILE
        try:
            version = storage.manifest_version(part)
            if path in known and known[path][0] == version:
                found = known[path][1]
            else:
                found = frozenset(chunks.referenced(storage.read_manifest(part)[0]))
        except FileNotFoundError:
            continue  # gone since the walk: its chunks are not its anymore
        except OSError as e:
            raise MarkFailed(f"cannot read {path}: {e}") from e
        except layout.ManifestError as e:
            if isinstance(e.__cause__, OSError) and not isinstance(e.__cause__, FileNotFoundError):
                raise MarkFailed(f"cannot read {path}: {e.__cause__}") from e
            continue  # corrupt: it names nothing we can trust
        names |= found
        if seen is not None:
            seen[path] = (version, found)
    return names


def stored_bytes(parts: Iterable[tuple[int, int, Sequence[tuple[str, int]] | None]]) -> dict[int, int]:
    """Per step, the bytes its deletion frees when steps are deleted oldest first.

    ``parts`` are ``(step, bytes, chunks)``: a part stored whole counts its
    bytes; an incremental one (``chunks``: its ``(name, length)`` list) counts
    each chunk that no newer step names (a chunk shared with newer steps goes
    with the newest of them). Summed over the steps, that is what the job's
    parts hold on the tier, each chunk once.
    """
    whole: dict[int, int] = {}
    newest: dict[str, tuple[int, int]] = {}
    for step, nbytes, listed in parts:
        whole.setdefault(step, 0)
        if listed is None:
            whole[step] += nbytes
            continue
        for name, length in listed:
            if name not in newest or newest[name][0] < step:
                newest[name] = (step, length)
    for step, length in newest.values():
        whole[step] += length
    return whole


class ChunkStore:
    """The chunk stores of one tier (one per job, and the user's: :func:`chunks.store_key`), as this daemon uses
    them: leases, and the sweep."""

    def __init__(self, tier: Tier, grace_s: float, pace: Callable[[int], None] = lambda n: None) -> None:
        """``pace(n)``: called before a repack writes ``n`` bytes (the node's load gate)."""
        self.tier = tier
        self.grace_s = grace_s
        self._pace = pace
        self._lock = threading.Lock()
        self._leases: Counter[tuple[str, str]] = Counter()
        self._sweeping: Counter[str] = Counter()
        self._released: dict[str, set[str]] = {}  # per job being swept: leases let go during the sweep
        self._seen: dict[str, _Seen] = {}  # per job: what each manifest named at the last mark

    # ------------------------------------------------------------------ writers

    def path(self, job: str, name: str) -> Path:
        return self.tier.chunk_location(job, name)

    def reuse(self, job: str, names: Iterable[str]) -> set[str]:
        """Leases each of ``names`` for a part being written; returns those the store holds (touched now).

        Either way a lease holds until :meth:`release`: a chunk that is not
        there yet is written into a :meth:`new_chunks` batch under it.
        """
        names = list(names)
        with self._lock:
            for name in names:
                self._leases[(job, name)] += 1
            return self.tier.touch_chunks(job, names) if names else set()

    def new_chunks(self, job: str, part: PartWriter | None = None) -> ChunkBatch:
        """A batch of new chunks (leased by :meth:`reuse`), published into the store durably and together."""
        return self.tier.new_chunks(job, part)

    def release(self, job: str, names: Iterable[str]) -> None:
        """Ends the leases taken by :meth:`reuse`: the part is published (or failed)."""
        with self._lock:
            released = self._released.get(job)
            for name in names:
                key = (job, name)
                self._leases[key] -= 1
                if self._leases[key] <= 0:
                    del self._leases[key]
                if released is not None:
                    released.add(name)

    # ------------------------------------------------------------------ the sweep

    def sweep(self, job: str, mark: Callable[[], set[str]] | None = None) -> Swept:
        """Removes the chunks of ``job`` that no part refers to (see the module docstring)."""
        if not self.tier.has_chunk_store(job):
            return Swept()
        mark = mark or (lambda: referenced(self.tier, job, self._seen.setdefault(job, {})))
        with self._lock:
            self._sweeping[job] += 1
            self._released.setdefault(job, set())
        try:
            marked = mark()
            cutoff = time.time() - self.grace_s
            stored = self.tier.list_packs(job)
            packed = set().union(*(p.names for p in stored))
            for name in self.tier.list_chunks(job):
                if name not in marked and name not in packed:
                    self._condemn(job, name, cutoff)
            if repack.repack(self.tier, job, stored, marked, pace=self._pace):
                stored = self.tier.list_packs(job)  # with the new packs: the old ones' live chunks are there too
            held = Counter(n for p in stored for n in p.names)
            for pack in stored:
                self._condemn_pack(job, pack, marked, cutoff, held)
            swept = self._finish(job, mark())
            try:
                self.tier.note_swept(job)
            except OSError as e:  # the next pass sweeps a little sooner than it need have
                log.debug("cannot note the sweep of %s on %s: %s", job, self.tier.location, e)
            return swept
        finally:
            with self._lock:
                self._sweeping[job] -= 1
                if not self._sweeping[job]:
                    del self._sweeping[job]
                    self._released.pop(job, None)

    def since_swept(self, job: str) -> float | None:
        """Seconds since a sweep of ``job``'s store last finished on any node sharing the tier (None: none known)."""
        try:
            at = self.tier.swept_at(job)
        except OSError:
            return None
        return None if at is None else max(0.0, time.time() - at)

    def _busy(self, job: str, name: str) -> bool:
        return (job, name) in self._leases or name in self._released.get(job, ())

    def _condemn(self, job: str, name: str, cutoff: float) -> None:
        with self._lock:  # against reuse(): a chunk leased here is never condemned
            if not self._busy(job, name):
                self.tier.condemn_chunk(job, name, cutoff)

    def _condemn_pack(self, job: str, pack: Pack, marked: set[str], cutoff: float, held: Counter[str]) -> None:
        """A pack goes as a whole: only when each of its chunks is neither named nor leased here, or held by
        another pack still in the store (``held``: how many packs hold each chunk; updated as packs go)."""
        with self._lock:  # against reuse(), as for a chunk of its own
            if all(held[n] > 1 or not (n in marked or self._busy(job, n)) for n in pack.names) and \
                    self.tier.condemn_pack(job, pack.pack_id, cutoff):
                held.subtract(pack.names)

    def _finish(self, job: str, marked: set[str]) -> Swept:
        """Puts back the condemned chunks referred to now (or leased), deletes the others.

        Empty fan-out directories stay: a writer on another node may be about to rename a chunk into one."""
        removed = freed = restored = 0
        for name in self.tier.condemned_chunks(job):
            with self._lock:
                keep = name in marked or self._busy(job, name)
            try:
                if keep:
                    self.tier.restore_chunk(job, name)
                    restored += 1
                else:
                    freed += self.tier.delete_condemned_chunk(job, name)
                    removed += 1
            except FileNotFoundError:
                pass  # another node's sweep finished it
        published = Counter(n for p in self.tier.list_packs(job) for n in p.names)
        for pack in self.tier.condemned_packs(job):
            with self._lock:
                keep = any((n in marked or self._busy(job, n)) and not published[n] for n in pack.names)
            try:
                if keep:
                    self.tier.restore_pack(job, pack.pack_id)
                    published.update(pack.names)
                    restored += len(pack.names)
                else:
                    freed += self.tier.delete_condemned_pack(job, pack.pack_id)
                    removed += len(pack.names)
            except FileNotFoundError:
                pass  # another node's sweep finished it
        if removed or restored:
            log.info("swept the chunks of %s on %s: %d removed (%d bytes), %d put back", job, self.tier.location,
                     removed, freed, restored, extra=fields(job=job, bytes=freed, path=self.tier.location))
        return Swept(removed, freed, restored)


class PartChunks:
    """The chunks of one part being written to a tier: those it reuses and those it adds.

    The data file is cut with :func:`chunks.cut` (``every`` is the unit the
    bytes arrive in: no chunk straddles two). Each piece is hashed as its
    unit arrives; one the store already holds is leased and touched, a new one
    is written into a batch staged with ``part`` (the part's writer). At
    :meth:`publish` the batch goes into the store, before the manifest that
    refers to it is written; :meth:`release` (always, after the part is
    published or failed) ends the leases.
    """

    def __init__(self, store: ChunkStore, key: str, size: int, tensors: Iterable[tuple[int, int]], every: int,
                 part: PartWriter, direct_io: bool) -> None:
        """``key``: the chunk store the part's chunks go in (:func:`chunks.store_key`)."""
        self.store = store
        self.key = key
        self.every = every
        self.direct_io = direct_io
        self._cuts = chunks.cut(size, tensors, every)
        self._by_unit: dict[int, list[tuple[int, int]]] = {}
        for lo, hi in self._cuts:
            self._by_unit.setdefault(lo // every, []).append((lo, hi))
        self._lock = threading.Lock()
        self._names: dict[int, str] = {}   # chunk start -> name
        self._leased: set[str] = set()
        self.reused_bytes = 0
        self._new = store.new_chunks(key, part)  # written here, not yet in the store

    def write(self, unit: int, data: memoryview, start: int, block: int) -> list[str]:
        """Hashes (and stores, when new) every chunk of arriving unit ``unit``: ``data`` is bytes from ``start``.
        Returns the unit's digest blocks' checksums (of ``block`` bytes each), taken in the same pass."""
        cuts = self._by_unit.get(unit, [])
        digests, names = chunks.hash_unit(data, start, block, cuts)
        fresh: list[tuple[int, int, str]] = []  # chunks this part did not name before
        for (lo, hi), name in zip(cuts, names):
            with self._lock:
                self._names[lo] = name
                if name in self._leased:
                    self.reused_bytes += hi - lo  # the same bytes twice in one part (zeroed optimizer state)
                    continue
                self._leased.add(name)
            fresh.append((lo, hi, name))
        held = self.store.reuse(self.key, [name for _, _, name in fresh])
        run: list[tuple[str, int, int]] = []  # new chunks side by side in ``data``: (name, offset, length)
        for lo, hi, name in fresh:
            if name in held:
                with self._lock:
                    self.reused_bytes += hi - lo
                continue
            if run and run[-1][1] + run[-1][2] != lo - start:
                self._write_run(run, data)
                run = []
            run.append((name, lo - start, hi - lo))
        if run:
            self._write_run(run, data)
        return digests

    def _write_run(self, run: list[tuple[str, int, int]], data: memoryview) -> None:
        """New chunks that lie side by side in ``data``, with one write (every boundary is on a page, so each
        stays page-aligned in the pack)."""
        first = run[0][1]
        end = run[-1][1] + run[-1][2]
        self._new.write_run([(name, at - first, n) for name, at, n in run], data[first:end], self.direct_io)

    def publish(self) -> list[list[object]]:
        """Moves the new chunks into the store (durably); returns the manifest's chunk list."""
        self._new.publish()  # the part's directory holds its manifest only
        return [[self._names[lo], hi - lo] for lo, hi in self._cuts]

    def release(self) -> None:
        with self._lock:
            leased, self._leased = self._leased, set()
        self.store.release(self.key, leased)
