"""Chunk packs: many chunks of a job's store in one file, found through the pack's index.

A chunk store (:mod:`ckptstage.protos.chunks`) keeps chunks either as a file
each (``<store>/9f/<name>``) or in packs::

    <store>/packs/<id>.pack   the chunks' bytes, each at a 4 KiB-aligned offset
    <store>/packs/<id>.idx    {"format": "ckptstage-pack/1", "chunks": [[name, offset, length], ...]}
                              xxh3_64:<16 hex digits of the line above>

An entry of four, ``[name, offset, length, size]``, is a chunk kept
compressed (a shared tier's, ``[shared] compression``): its ``length``
bytes are a frame of :mod:`ckptstage.protos.codec` that decodes to ``size``.

A writer fills the ``.pack`` file, makes it durable, then writes its ``.idx``
atomically: the index is what publishes the pack, and a pack with no index
is not part of the store (a writer cut short; it is removed once stale).
Packs never change after that. A chunk may be in several packs and loose as
well (a repack copies a pack's live chunks into a new one before the old
goes): any of them holds its bytes, which are checked against the part's
manifest as every read is.

Which pack holds a chunk is the store's business, not the manifest's, so that
chunks can move between packs without a committed manifest changing: a reader
looks its chunks up in the store (:class:`StoreIndex`, which reads each
index once, since none changes). A :class:`PackSource` is how it lists and
reads a store: files here (:class:`FsPackSource`), objects on an object store.

This module is imported by the daemon and the client alike: no torch.
"""

from __future__ import annotations

import errno
import json
import os
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol, TypeVar

from ckptstage.protos import layout

T = TypeVar("T")

PACKS_DIR = "packs"
PACK_SUFFIX = ".pack"
INDEX_SUFFIX = ".idx"
FORMAT = "ckptstage-pack/1"
PAGE = 4096
MAX_INDEX_BYTES = 64 << 20

_ID_RE = re.compile(r"[0-9a-z][0-9a-z_-]{0,99}")
_NAME_RE = re.compile(r"[0-9a-f]{32}")


class PackError(layout.ManifestError):
    """A pack's index that cannot be trusted (torn, changed, not of this format)."""


class Entry(NamedTuple):
    """One chunk of a pack's index: ``length`` bytes at ``offset``; ``size`` > 0: they are a codec frame that
    decodes to ``size`` bytes (0: they are the chunk's bytes)."""

    name: str
    offset: int
    length: int
    size: int = 0


@dataclass(frozen=True)
class Place:
    """Where a chunk's bytes are: ``length`` bytes of ``path`` from ``offset``; ``whole``: the file holds exactly
    those (a chunk stored loose), else a range of a pack. ``size`` > 0: those bytes are a codec frame that
    decodes to ``size`` bytes (a chunk a shared tier keeps compressed in a pack)."""

    path: Path
    offset: int
    length: int
    whole: bool
    size: int = 0

    @property
    def nbytes(self) -> int:
        """The chunk's own size (what it decodes to)."""
        return self.size or self.length


@dataclass(frozen=True)
class Run:
    """Chunks read with one read: ``length`` bytes of ``path`` from ``offset``, holding each chunk ``(name, offset
    in the run, length)``; chunks of a pack lie at page-aligned offsets of the run, with the pack's padding
    between them. A run of a chunk stored on its own (``whole``) is that file, its length what the reader finds.
    A run of a compressed chunk (``coded``) holds it alone: its ``length`` bytes are the frame, the chunk's
    length what it decodes to."""

    path: Path
    offset: int
    length: int
    chunks: tuple[tuple[str, int, int], ...]
    whole: bool = False
    coded: bool = False

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.chunks]

    @property
    def place(self) -> Place:
        """What the run reads, as a :class:`Place` (a compressed chunk's: its frame, and what it decodes to)."""
        return Place(self.path, self.offset, self.length, self.whole, self.chunks[0][2] if self.coded else 0)

    def sized(self, size: int) -> tuple[tuple[str, int, int], ...]:
        """The chunks of the run once its reader says it holds ``size`` bytes (what a whole file's one chunk is)."""
        return ((self.chunks[0][0], 0, size),) if self.whole else self.chunks


def runs(places: Iterable[tuple[str, Place]], max_bytes: int) -> list[Run]:
    """Chunks at ``places`` grouped into as few reads as possible: ranges of one pack that follow each other (up
    to the page padding between them) in runs of at most ``max_bytes`` (a chunk longer is a run alone); a chunk
    stored on its own, or compressed (read whole, then decoded), is a run by itself, first; the others come in
    the order of their files and offsets."""
    places = list(places)
    out: list[Run] = []
    ranged = sorted((p.path, p.offset, p.length, name) for name, p in places if not (p.whole or p.size))
    out += [Run(p.path, 0 if p.whole else p.offset, p.length, ((name, 0, p.nbytes),), whole=p.whole,
                coded=bool(p.size)) for name, p in places if p.whole or p.size]
    held: list[tuple[str, int, int]] = []
    path, lo, hi = Path(), 0, 0
    for where, offset, length, name in ranged:
        follows = where == path and lo <= offset <= page_up(hi) and offset + length - lo <= max_bytes
        if held and not follows:
            out.append(Run(path, lo, hi - lo, tuple(held)))
            held = []
        if not held:
            path, lo, hi = where, offset, offset
        held.append((name, offset - lo, length))
        hi = max(hi, offset + length)
    if held:
        out.append(Run(path, lo, hi - lo, tuple(held)))
    return out


def page_up(n: int) -> int:
    """``n`` rounded up to a page: where the next chunk of a pack may start."""
    return -(-n // PAGE) * PAGE


def packs_dir(store: Path) -> Path:
    return store / PACKS_DIR


def pack_path(store: Path, pack_id: str) -> Path:
    return packs_dir(store) / f"{pack_id}{PACK_SUFFIX}"


def index_path(store: Path, pack_id: str) -> Path:
    return packs_dir(store) / f"{pack_id}{INDEX_SUFFIX}"


def pack_id_of(name: str) -> str | None:
    """The id of a pack's file or index name; None for any other name."""
    for suffix in (PACK_SUFFIX, INDEX_SUFFIX):
        if name.endswith(suffix) and _ID_RE.fullmatch(name[:-len(suffix)]):
            return name[:-len(suffix)]
    return None


def is_pack_file(name: str) -> bool:
    """Whether ``name`` is a pack's file name (``<id>.pack``; one moved aside as corrupt included)."""
    return name.endswith(PACK_SUFFIX) and pack_id_of(name) is not None


def index_beside(pack: Path) -> Path:
    """The index that goes with the pack file at ``pack``."""
    return pack.with_name(pack.name[:-len(PACK_SUFFIX)] + INDEX_SUFFIX)


def encode_index(entries: Sequence[Entry | tuple[str, int, int]]) -> bytes:
    """The ``.idx`` file of a pack holding ``entries`` (name, offset, length[, decoded size])."""
    rows = [list(e[:3]) + ([e[3]] if len(e) > 3 and e[3] else []) for e in entries]  # type: ignore[misc]
    body = json.dumps({"format": FORMAT, "chunks": rows}, separators=(",", ":")).encode()
    return layout.with_trailer(body)


def decode_index(raw: bytes, path: Path) -> list[Entry]:
    """The entries of a ``.idx`` file, checked: its trailer, its format, each name (32 hex digits), each offset
    (on a page), length and decoded size (positive), no two ranges overlapping. Raises :class:`PackError`
    naming ``path``."""
    if len(raw) > MAX_INDEX_BYTES:
        raise PackError(f"{path}: a pack index of {len(raw)} bytes exceeds {MAX_INDEX_BYTES}")
    try:
        doc = json.loads(layout.verified_body(raw, path, "pack index"))
    except (ValueError, layout.ManifestError) as e:
        raise PackError(f"{path}: not a pack index: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("chunks"), list):
        raise PackError(f"{path}: not a {FORMAT} index")
    out: list[Entry] = []
    for item in doc["chunks"]:
        if not (isinstance(item, list) and len(item) in (3, 4) and isinstance(item[0], str)
                and _NAME_RE.fullmatch(item[0])
                and all(isinstance(x, int) and not isinstance(x, bool) for x in item[1:]) and item[1] >= 0 and item[1] % PAGE == 0 and all(x > 0 for x in item[2:])):
            raise PackError(f"{path}: entry {len(out)} is not [32 hex digits, page-aligned offset, length"
                            f"(, decoded size)]: {str(item)[:80]}")
        out.append(Entry(*item))
    ranges = sorted((e.offset, e.offset + e.length) for e in out)
    if any(a_hi > b_lo for (_, a_hi), (b_lo, _) in zip(ranges, ranges[1:])):
        raise PackError(f"{path}: two chunks overlap")
    return out


def read_index(path: Path) -> list[Entry]:
    with open(path, "rb") as f:
        return decode_index(f.read(MAX_INDEX_BYTES + 1), path)


class PackSource(Protocol):
    """How a :class:`StoreIndex` sees one store: what its packs directory lists, an index's entries, a chunk
    stored on its own, whether packs are still there."""

    def index_names(self) -> list[str] | None:
        """The names in the store's packs directory (None: it has none)."""

    def read_index(self, name: str) -> list[Entry]:
        """The entries of index ``name`` ([] when its pack is gone). FileNotFoundError: the index is gone;
        :class:`PackError`: it cannot be trusted."""

    def loose(self, name: str) -> Place | None:
        """Where chunk ``name`` is stored on its own (None: it is not)."""

    def gone(self, paths: set[Path]) -> set[Path]:
        """Those of the pack files ``paths`` that are no longer there."""


class FsPackSource:
    """A store on a file system: its directories and files."""

    def __init__(self, store: Path) -> None:
        self.store = store

    def index_names(self) -> list[str] | None:
        try:
            return os.listdir(packs_dir(self.store))
        except FileNotFoundError:
            return None

    def read_index(self, name: str) -> list[Entry]:
        pack = packs_dir(self.store) / (name[:-len(INDEX_SUFFIX)] + PACK_SUFFIX)
        return read_index(packs_dir(self.store) / name) if pack.exists() else []  # gone: nothing

    def loose(self, name: str) -> Place | None:
        path = self.store / name[:2] / name
        try:
            return Place(path, 0, os.stat(path).st_size, whole=True)
        except FileNotFoundError:
            return None

    def gone(self, paths: set[Path]) -> set[Path]:
        return {path for path in paths if not path.exists()}


class StoreIndex:
    """Where each chunk of one store is: its packs (each index read once) or its own file (or object).

    :meth:`find` looks in the packs read so far, then, once per call that
    misses, reads the indexes published since, then looks for the chunk's own
    file. Thread-safe. An index that fails its checks is left out (the chunks
    it lists are then not found there: a reader falls back to another copy).
    ``source`` lists and reads the store (a file system's by default).
    """

    def __init__(self, store: Path, source: PackSource | None = None) -> None:
        self.store = store
        self._source = source or FsPackSource(store)
        self._lock = threading.Lock()
        self._read: set[str] = set()             # index file names read (or found bad)
        self._places: dict[str, Place] = {}      # chunk -> where in a pack
        self._listed = False                     # refreshed since created or reset

    def refresh(self) -> None:
        """Reads the indexes published since the last call."""
        names = self._source.index_names()
        if names is None:
            return
        with self._lock:
            self._listed = True
            new = [n for n in names if n.endswith(INDEX_SUFFIX) and n not in self._read and pack_id_of(n)]
        for name in sorted(new):
            try:
                entries = self._source.read_index(name)
            except FileNotFoundError:
                continue  # removed meanwhile (a repack's old pack)
            except PackError:
                entries = []
            self._note(packs_dir(self.store) / (name[:-len(INDEX_SUFFIX)] + PACK_SUFFIX), entries)

    def add(self, pack: Path, entries: Sequence[Entry | tuple[str, int, int]]) -> None:
        """A pack this process just published (its index renamed into place): known without a listing."""
        self._note(pack, [Entry(*e) for e in entries])

    def _note(self, pack: Path, entries: Sequence[Entry]) -> None:
        with self._lock:
            self._read.add(pack.name[:-len(PACK_SUFFIX)] + INDEX_SUFFIX)
            for e in entries:
                self._places.setdefault(e.name, Place(pack, e.offset, e.length, whole=False, size=e.size))

    def reset(self) -> None:
        """A pack went (or is going): every index is read again at the next miss (another pack may hold its
        chunks, and only the first pack read was remembered for each)."""
        with self._lock:
            self._read.clear()
            self._places.clear()
            self._listed = False

    def packed(self) -> dict[str, Place]:
        """Every chunk the packs read so far hold, and where."""
        with self._lock:
            return dict(self._places)

    def compressed(self) -> dict[str, int]:
        """The chunks the packs read so far keep compressed: name -> the bytes their frame takes."""
        with self._lock:
            return {name: p.length for name, p in self._places.items() if p.size}

    def find(self, name: str, refreshed: bool = False) -> Place | None:
        """Where chunk ``name`` is (None: nowhere in this store). ``refreshed``: the caller refreshed just now, or
        does not need what was published since the last listing (the store is listed all the same when it was
        never listed since this index was made or reset)."""
        with self._lock:
            refreshed = refreshed and self._listed
        for attempt in range(2):
            with self._lock:
                hit = self._places.get(name)
            if hit is not None:
                return hit
            if attempt or refreshed:
                break
            self.refresh()
        return self._source.loose(name)

    def find_all(self, names: Iterable[str]) -> dict[str, Place | None]:
        """:meth:`find` of every name, refreshing at most once; a pack found gone (removed by a sweep since its
        index was read) is forgotten and its chunks looked up again."""
        names = list(dict.fromkeys(names))
        out: dict[str, Place | None] = {}
        refreshed = False
        for name in names:
            place = self.find(name, refreshed)
            if place is None or place.whole:
                refreshed = True  # find() refreshed on its miss
            out[name] = place
        packed = {p.path for p in out.values() if p is not None and not p.whole}
        gone = self._source.gone(packed)  # one look per pack, not per chunk
        if gone:
            self.reset()
            self.refresh()
            out.update({n: self.find(n, refreshed=True) for n, p in out.items() if p is not None and p.path in gone})
        return out


def touch_each(index: StoreIndex, names: Iterable[str], touch: Callable[[Place], bool]) -> set[str]:
    """``touch(place)`` once per file holding one of ``names`` (a pack, or a chunk's own file), as ``index``
    finds them without looking for a chunk published since it last listed the store; returns the names whose
    file was there (``touch`` True)."""
    touched: dict[Path, bool] = {}  # file -> there
    held = set()
    for name in names:
        place = index.find(name, refreshed=True)
        if place is None:
            continue
        if place.path not in touched:
            touched[place.path] = touch(place)
        if touched[place.path]:
            held.add(name)
    return held


def use_chunk(index: StoreIndex, name: str, use: Callable[[Place], T], where: str) -> T:
    """``use(place)`` of chunk ``name``, where ``index`` finds it; a pack removed under it (a repack moved the
    chunk, a sweep took the pack) is looked up again, once. FileNotFoundError: the store (named ``where``)
    lacks the chunk."""
    for again in (False, True):
        place = index.find(name)
        if place is None:
            raise FileNotFoundError(errno.ENOENT, f"no chunk {name} in {where}")
        try:
            return use(place)
        except FileNotFoundError:
            if place.whole or again:
                raise
            index.reset()
    raise AssertionError("unreachable")


_STORES: dict[Path, StoreIndex] = {}
_STORES_LOCK = threading.Lock()


def store_index(store: Path) -> StoreIndex:
    """The process's :class:`StoreIndex` of ``store`` (one per store, kept: indexes never change)."""
    with _STORES_LOCK:
        found = _STORES.get(store)
        if found is None:
            found = _STORES[store] = StoreIndex(store)
        return found
