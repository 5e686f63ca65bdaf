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
  writes back any that a sweep took (:func:`chunks.missing`), and no commit
  record is written for a step while a chunk of one of its parts is missing.

A SIGKILL at any point leaves chunks in place or condemned, never a
published part without its chunks: the next sweep (any node's) finishes the
condemned ones the same way, putting back those a part refers to.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ckptstage.daemon import fsutil
from ckptstage.protos import chunks, layout

log = logging.getLogger(__name__)

CONDEMNED_DIR = ".condemned"


class MarkFailed(OSError):
    """A manifest could not be read for a reason other than its own corruption: nothing is swept."""


@dataclass(frozen=True)
class Swept:
    """What one sweep of one job's store did."""

    removed: int = 0
    freed: int = 0
    restored: int = 0


_Seen = dict[Path, tuple[tuple[int, int, int], frozenset[str]]]


def referenced(tier_dir: Path, job: str, seen: _Seen | None = None) -> set[str]:
    """The chunks every part of ``job`` on the tier refers to: committed or not, staged replacements too.

    A manifest that fails its own checks names nothing (that part is unreadable
    anyway, and quarantine removes it); one that cannot be read at all (EIO, a
    permission) raises :class:`MarkFailed`, since its chunks may be live.
    ``seen`` (updated in place) remembers each manifest's names under its
    inode, size and modification time, so that a mark reads only the
    manifests that are new since the last one.
    """
    names: set[str] = set()
    dirs = [p.path for p in layout.scan_tier(tier_dir, job)]
    tmp = tier_dir / layout.TMP_DIR
    for owner in _subdirs(tmp):
        staged_job = owner / "replace" / job
        dirs += [r for s in _subdirs(staged_job) for r in _subdirs(s)]
    known = dict(seen or {})
    if seen is not None:
        seen.clear()
    for part in dirs:
        path = part / layout.MANIFEST_FILE
        try:
            st = os.stat(path)
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            if path in known and known[path][0] == key:
                found = known[path][1]
            else:
                found = frozenset(chunks.referenced(layout.read_manifest(part)))
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
            seen[path] = (key, found)
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


SYNC_THREADS = 8  # fsyncs in flight at once when chunks are made durable


def _each(fn: Callable[[Path], None], paths: Iterable[Path]) -> None:
    """``fn`` on every path, :data:`SYNC_THREADS` at once (fsync releases the GIL); the first error is raised."""
    paths = list(paths)
    if len(paths) <= 1:
        for p in paths:
            fn(p)
        return
    with ThreadPoolExecutor(min(SYNC_THREADS, len(paths)), thread_name_prefix="chunk-sync") as pool:
        for f in [pool.submit(fn, p) for p in paths]:
            f.result()


def _subdirs(path: Path) -> list[Path]:
    try:
        with os.scandir(path) as it:
            return [Path(e.path) for e in it if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


class ChunkStore:
    """The chunk stores (one per job) of one tier, as this daemon uses them."""

    def __init__(self, tier_dir: Path, owner: str, grace_s: float) -> None:
        self.tier_dir = tier_dir
        self.owner = owner
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._leases: Counter[tuple[str, str]] = Counter()
        self._sweeping: Counter[str] = Counter()
        self._released: dict[str, set[str]] = {}  # per job being swept: leases let go during the sweep
        self._seen: dict[str, _Seen] = {}  # per job: what each manifest named at the last mark

    # ------------------------------------------------------------------ writers

    def path(self, job: str, name: str) -> Path:
        return chunks.chunk_path(chunks.store_dir(self.tier_dir, job), name)

    def reuse(self, job: str, name: str) -> bool:
        """Leases ``name`` for a part being written; True when the store holds it (it is touched then).

        Either way the lease holds until :meth:`release`: a chunk that is not
        there yet is written and :meth:`put` under it.
        """
        with self._lock:
            self._leases[(job, name)] += 1
            try:
                os.utime(self.path(job, name))
                return True
            except FileNotFoundError:
                return False

    def put(self, job: str, written: dict[str, Path]) -> None:
        """Moves new chunks (name -> file written under ``.tmp``, leased by :meth:`reuse`) into the store, durably.

        The files are fsynced, renamed into place, and the store directories
        they went to fsynced, each step on :data:`SYNC_THREADS` threads at once
        (fsyncs issued together share the file system's journal commits:
        one by one, a few hundred chunks cost a few hundred of them). A chunk
        of the same name already there (another save's, just now) has the
        same bytes: the rename replaces it, atomically.
        """
        if not written:
            return
        _each(fsutil.fsync_file, written.values())
        parents = {self.path(job, n).parent for n in written}
        for d in parents:
            if not d.is_dir():
                fsutil.makedirs_durable(d, within=self.tier_dir)
        for name, path in written.items():
            final = self.path(job, name)
            fsutil.check_contained(self.tier_dir, final)
            os.rename(path, final)
        _each(layout.fsync_dir, parents)

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
        store = chunks.store_dir(self.tier_dir, job)
        if not store.is_dir():
            return Swept()
        mark = mark or (lambda: referenced(self.tier_dir, job, self._seen.setdefault(job, {})))
        with self._lock:
            self._sweeping[job] += 1
            self._released.setdefault(job, set())
        try:
            marked = mark()
            condemned_dir = store / CONDEMNED_DIR
            cutoff = time.time() - self.grace_s
            for path in self._unmarked(store, marked):
                self._condemn(job, path, condemned_dir, cutoff)
            return self._finish(job, condemned_dir, mark())
        finally:
            with self._lock:
                self._sweeping[job] -= 1
                if not self._sweeping[job]:
                    del self._sweeping[job]
                    self._released.pop(job, None)

    @staticmethod
    def _unmarked(store: Path, marked: set[str]) -> list[Path]:
        out = []
        for sub in _subdirs(store):
            if sub.name.startswith("."):
                continue  # .condemned, and the quarantine's .corrupt
            with os.scandir(sub) as it:
                out += [Path(e.path) for e in it if chunks.is_chunk_name(e.name) and e.name not in marked]
        return out

    def _busy(self, job: str, name: str) -> bool:
        return (job, name) in self._leases or name in self._released.get(job, ())

    def _condemn(self, job: str, path: Path, condemned_dir: Path, cutoff: float) -> None:
        with self._lock:  # against reuse(): a chunk leased here is never condemned
            if self._busy(job, path.name):
                return
            try:
                if os.stat(path).st_mtime >= cutoff:
                    return  # written or relied on within the grace period
                condemned_dir.mkdir(exist_ok=True)
                os.rename(path, condemned_dir / path.name)
            except FileNotFoundError:
                pass  # another node's sweep took it first

    def _finish(self, job: str, condemned_dir: Path, marked: set[str]) -> Swept:
        """Puts back the condemned chunks referred to now (or leased), deletes the others.

        Empty fan-out directories stay: a writer on another node may be about to rename a chunk into one."""
        removed = freed = restored = 0
        try:
            entries = list(os.scandir(condemned_dir))
        except FileNotFoundError:
            return Swept()
        for e in entries:
            if not chunks.is_chunk_name(e.name):
                continue
            path = Path(e.path)
            with self._lock:
                keep = e.name in marked or self._busy(job, e.name)
            try:
                if keep:
                    final = self.path(job, e.name)
                    final.parent.mkdir(exist_ok=True)
                    os.rename(path, final)  # a copy written meanwhile has the same bytes
                    restored += 1
                else:
                    size = path.stat().st_size
                    path.unlink()
                    removed, freed = removed + 1, freed + size
            except FileNotFoundError:
                pass  # another node's sweep finished it
        if removed or restored:
            log.info("swept the chunks of %s on %s: %d removed (%d bytes), %d put back", job, self.tier_dir,
                     removed, freed, restored)
        return Swept(removed, freed, restored)


def write_chunk(path: Path, data: memoryview, direct_io: bool) -> None:
    """Writes one new chunk's file (not fsynced: :meth:`ChunkStore.put` syncs a part's chunks together)."""
    out = fsutil.DataFile(path, len(data), direct_io, reserve=False)
    try:
        out.write(data, 0)
    finally:
        out.close()


class PartChunks:
    """The chunks of one part being written to a tier: those it reuses and those it adds.

    The data file is cut with :func:`chunks.cut` (``every`` is the unit the
    bytes arrive in: no chunk straddles two). Each piece is hashed as its
    unit arrives; one the store already holds is leased and touched, a new one
    is written under ``tmp`` (the part's temporary directory). At
    :meth:`publish` the new chunks are fsynced and renamed into the store, before the
    manifest that refers to them is written; :meth:`release` (always, after
    the part is published or failed) ends the leases.
    """

    def __init__(self, store: ChunkStore, job: str, size: int, tensors: Iterable[tuple[int, int]], every: int,
                 tmp: Path, direct_io: bool) -> None:
        self.store = store
        self.job = job
        self.every = every
        self.tmp = tmp
        self.direct_io = direct_io
        self._cuts = chunks.cut(size, tensors, every)
        self._by_unit: dict[int, list[tuple[int, int]]] = {}
        for lo, hi in self._cuts:
            self._by_unit.setdefault(lo // every, []).append((lo, hi))
        self._lock = threading.Lock()
        self._names: dict[int, str] = {}   # chunk start -> name
        self._leased: set[str] = set()
        self._new: dict[str, Path] = {}    # written here, not yet in the store
        self.reused_bytes = 0
        tmp.mkdir()

    def write(self, unit: int, data: memoryview, start: int) -> None:
        """Hashes (and stores, when new) every chunk of arriving unit ``unit``: ``data`` is bytes from ``start``."""
        for lo, hi in self._by_unit.get(unit, ()):
            piece = data[lo - start:hi - start]
            name = chunks.digest(piece)
            with self._lock:
                self._names[lo] = name
                first = name not in self._leased
                self._leased.add(name)
            if not first:
                with self._lock:
                    self.reused_bytes += hi - lo  # the same bytes twice in one part (zeroed optimizer state)
                continue
            if self.store.reuse(self.job, name):
                with self._lock:
                    self.reused_bytes += hi - lo
                continue
            path = self.tmp / name
            write_chunk(path, piece, self.direct_io)
            with self._lock:
                self._new[name] = path

    def publish(self) -> list[list[object]]:
        """Moves the new chunks into the store (durably); returns the manifest's chunk list."""
        self.store.put(self.job, self._new)
        self._new.clear()
        self.tmp.rmdir()  # the part's directory holds its manifest only
        return [[self._names[lo], hi - lo] for lo, hi in self._cuts]

    def release(self) -> None:
        with self._lock:
            leased, self._leased = self._leased, set()
        self.store.release(self.job, leased)
