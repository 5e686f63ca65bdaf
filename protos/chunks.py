"""Incremental parts: a data file kept as content-addressed chunks in its job's chunk store.

A part written incrementally has no ``data.safetensors`` of its own. Its
manifest's ``chunks`` names, in file order, the chunks that make up the data
file, each by the xxh3-128 of its bytes and its length; each chunk is a file
of the job's chunk store on the same tier::

    <tier>/<job>/chunks/9f/9f2c51a0d3e4b7c8a1b2c3d4e5f60718    the chunk's bytes, nothing else

Two steps whose bytes agree on a chunk share its file: a step stores (and
drains) only the chunks its tier does not hold yet. Concatenated in the
manifest's order, the chunks are exactly the data file the manifest's
``files`` entry describes (size and per-block xxh3-64 digests), so every
reader verifies an incremental part as it verifies a whole one.

Where a data file is cut (:func:`cut`) is decided by its tensor table, so
that a tensor whose bytes did not change keeps its chunks from step to step:
the body of each tensor of :data:`SMALL_TENSOR_BYTES` or more is cut into
chunks of at most ``body`` bytes that hold nothing else, and what lies between
those bodies (the header, small tensors, the partial pages at each big
tensor's ends) into runs of at most :data:`RUN_BYTES`. A changed small tensor
therefore costs at most a run or two, never a neighbour's body. Every
boundary but the file's end falls on a 4 KiB page, so a chunk's bytes sit at
the same offset within a page in its own file as in the data file: a reader
can read them with O_DIRECT straight into memory laid out for the whole file.

This module is imported by the daemon and the client alike: no torch.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from ckptstage.protos import codec, layout, packs

CHUNKS_DIR = "chunks"
USER_STORE = ".user"          # the store every job of a daemon's user shares on a tier ([persist] dedup = "user")
STORE_FIELD = "chunk_store"   # in a manifest: "user" when its chunks are in that store; absent: its job's
CONDEMNED_DIR = ".condemned"  # in a store: chunks a sweep is about to delete (put back if named again)
CORRUPT_DIR = ".corrupt"      # in a store: chunks that failed verification, kept for forensics
SWEPT_FILE = ".swept"         # in a store: empty; its modification time is when a sweep last finished (any node's)
CHUNK_HASH = "xxh3_128"
PAGE = 4096
SMALL_TENSOR_BYTES = 64 << 10   # tensors this big or bigger get chunks of their own
RUN_BYTES = 256 << 10           # the most a run of small tensors (and the header) puts in one chunk
BODY_BYTES = 8 << 20            # the most one chunk of a big tensor holds (the default)

_DIGEST_RE = re.compile(r"[0-9a-f]{32}")


def digest(data: Any) -> str:
    """The chunk's name: xxh3-128 of its bytes (any buffer), 32 lower-case hex digits."""
    return xxhash.xxh3_128_hexdigest(data)


def hash_unit(data: Any, start: int, block: int, cuts: Sequence[tuple[int, int]]) -> tuple[list[str], list[str]]:
    """One pass over ``data`` (the bytes from ``start`` of a data file, ``start`` a multiple of ``block``): its
    digest blocks' checksums (:func:`layout.block_digests`) and the names of the chunks ``cuts`` (sorted, each
    ``[lo, hi)`` within the data) in the same pass, block by block, while each block is in the CPU's cache
    (measured here: 5.7-6.0 GiB/s against 4.1-4.5 GiB/s hashing the bytes twice)."""
    view = memoryview(data).cast("B")
    blocks: list[str] = []
    names: list[str] = []
    pending: Any = None  # the hash of a chunk begun in an earlier block
    j = 0
    for b0 in range(0, max(len(view), 1), block):
        b1 = min(b0 + block, len(view))
        piece = view[b0:b1]
        blocks.append(layout.chunk_digest(piece))
        while j < len(cuts) and cuts[j][0] - start < b1:
            lo, hi = cuts[j][0] - start, cuts[j][1] - start
            if pending is None and lo >= b0 and hi <= b1:
                names.append(digest(view[lo:hi]))  # whole in this block: one call
            else:
                pending = pending or xxhash.xxh3_128()
                pending.update(view[max(lo, b0):min(hi, b1)])
                if hi > b1:
                    break  # it goes on in the next block
                names.append(pending.hexdigest())
                pending = None
            j += 1
    return blocks, names


def copy_checked(name: str, size: int, read_into: Callable[[memoryview], int | None],
                 write: Callable[[memoryview], None]) -> bool:
    """Reads chunk ``name`` (``size`` bytes) into a page-aligned buffer (its write can then go O_DIRECT) and
    hands it to ``write`` only if it came whole and hashes to its name; False when it did not."""
    buf = mmap.mmap(-1, max(size, 1))
    view = memoryview(buf)[:size]
    try:
        if read_into(view) != size or digest(view) != name:
            return False
        write(view)
        return True
    finally:
        view.release()
        buf.close()


def is_chunk_name(name: str) -> bool:
    return bool(_DIGEST_RE.fullmatch(name))


def store_dir(tier_dir: Path, key: str) -> Path:
    """The chunk store ``key`` names on one tier: a job's (``<tier>/<job>/chunks``), or the one every job of the
    daemon's user shares (:data:`USER_STORE`: ``<tier>/.user/chunks``)."""
    return tier_dir / check_store_key(key) / CHUNKS_DIR


def check_store_key(key: str) -> str:
    """``key`` when it names a store (:data:`USER_STORE`, or a valid job name); else raises
    :class:`layout.InvalidName`."""
    return key if key == USER_STORE else layout.check_job(key)


def store_key(manifest: dict[str, Any]) -> str:
    """The store a manifest's chunks are in (the key :func:`store_dir` and a tier's chunk calls take): its job's,
    or the user's where its :data:`STORE_FIELD` says ``"user"``."""
    where = manifest.get(STORE_FIELD, "job")
    if where == "user":
        return USER_STORE
    if where != "job":
        raise layout.ManifestError(f"manifest of {manifest.get('job')!r} step {manifest.get('step')!r} rank "
                                   f"{manifest.get('rank')!r}: {STORE_FIELD} is {str(where)[:40]!r}, not "
                                   '"job" or "user"')
    return str(manifest["job"])


def chunk_path(store: Path, name: str) -> Path:
    return store / name[:2] / name


def corrupt_location(location: Path) -> Path | None:
    """Where the chunk at ``location`` goes when it fails verification: ``<store>/.corrupt/<name>-<random>``
    (kept for forensics, out of the store). None when ``location`` is not a chunk of a store."""
    store = location.parent.parent
    if store.name != CHUNKS_DIR or not is_chunk_name(location.name):
        return None
    return store / CORRUPT_DIR / f"{location.name}-{uuid.uuid4().hex[:6]}"


def corrupt_chunk_name(name: str) -> str | None:
    """The chunk a file of a store's ``.corrupt/`` holds (``<name>-<random>``); None for any other name."""
    chunk = name.rsplit("-", 1)[0]
    return chunk if "-" in name and is_chunk_name(chunk) else None


def store_of(part: Path, manifest: dict[str, Any]) -> Path:
    """The chunk store a part's manifest refers to, on the part's tier (:func:`store_key`).

    A committed part lies at ``<tier>/<job>/step-N/rank-R``; a replacement
    staged for a swap at ``<tier>/.tmp/<node>/replace/<job>/step-N/rank-R``.
    """
    job_dir = part.parent.parent
    parts = job_dir.parts
    tier = Path(*parts[:parts.index(layout.TMP_DIR)]) if layout.TMP_DIR in parts else job_dir.parent
    return store_dir(tier, store_key(manifest))


def _down(n: int) -> int:
    return n // PAGE * PAGE


def _split(lo: int, hi: int, most: int) -> Iterator[tuple[int, int]]:
    for s in range(lo, hi, most):
        yield s, min(s + most, hi)


def cut(size: int, tensors: Iterable[tuple[int, int]], every: int, body: int = BODY_BYTES) -> list[tuple[int, int]]:
    """Where a data file of ``size`` bytes whose tensors lie at ``(offset, nbytes)`` is cut into chunks.

    Besides the rule in the module's docstring, no chunk straddles a multiple
    of ``every`` (the daemon's streaming chunk: a chunk is whole in the arena
    when it is hashed). ``every`` and ``body`` are multiples of :data:`PAGE`.
    """
    if every % PAGE or body % PAGE or every <= 0 or body <= 0:
        raise ValueError(f"chunk sizes must be positive multiples of {PAGE}: every={every}, body={body}")
    bodies = [(packs.page_up(off), _down(off + n)) for off, n in sorted(tensors) if n >= SMALL_TENSOR_BYTES]
    pieces: list[tuple[int, int]] = []
    pos = 0
    for lo, hi in bodies:
        pieces += _split(pos, lo, RUN_BYTES)
        pieces += _split(lo, hi, body)
        pos = hi
    pieces += _split(pos, size, RUN_BYTES)
    out: list[tuple[int, int]] = []
    for lo, hi in pieces:
        k = (lo // every + 1) * every
        while k < hi:
            out.append((lo, k))
            lo = k
            k += every
        out.append((lo, hi))
    return out


@dataclass(frozen=True)
class Chunk:
    """One chunk of a data file: bytes [lo, hi) of it, stored under ``name``."""

    lo: int
    hi: int
    name: str

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo


def manifest_chunks(manifest: dict[str, Any], file: str = layout.DATA_FILE) -> list[Chunk] | None:
    """The chunks a manifest lists for ``file``, checked; None when the file is stored whole.

    Raises :class:`layout.ManifestError` when the list does not tile the file
    exactly (lengths that do not add up to its size, a boundary off a page,
    a name that is not 32 hex digits).
    """
    listed = manifest.get("chunks")
    if listed is None:
        return None
    where = f"manifest of {manifest.get('job')!r} step {manifest.get('step')!r} rank {manifest.get('rank')!r}"
    if not isinstance(listed, dict) or not isinstance(listed.get(file), list):
        raise layout.ManifestError(f"{where}: 'chunks' lists nothing for {file}")
    size = layout.manifest_files(manifest)[file].size
    out: list[Chunk] = []
    pos = 0
    for item in listed[file]:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and is_chunk_name(item[0])
                and isinstance(item[1], int) and not isinstance(item[1], bool) and item[1] > 0):
            raise layout.ManifestError(f"{where}: chunk {len(out)} of {file} is not [32 hex digits, length]: "
                                       f"{str(item)[:80]}")
        if pos % PAGE:
            raise layout.ManifestError(f"{where}: chunk {len(out)} of {file} starts at {pos}, off a {PAGE}-byte page")
        out.append(Chunk(pos, pos + item[1], item[0]))
        pos += item[1]
    if pos != size and not (size == 0 and not out):
        raise layout.ManifestError(f"{where}: the chunks of {file} hold {pos} bytes, the file {size}")
    return out


def chunk_list(chunks: Sequence[Chunk]) -> list[list[Any]]:
    """The manifest's form of a chunk list."""
    return [[c.name, c.nbytes] for c in chunks]


@dataclass(frozen=True)
class Extent:
    """Bytes [lo, hi) of a part's data file are those of ``path`` from file offset ``lo - base``; ``whole``: the
    file holds exactly those bytes (the data file itself, a chunk's own file), else it holds more (a pack).
    ``coded`` > 0: the file holds them compressed, as a codec frame of that many bytes from ``lo - base``
    (:mod:`ckptstage.protos.codec`), read whole and decoded."""

    lo: int
    hi: int
    path: Path
    base: int
    whole: bool = True
    coded: int = 0

    @property
    def end(self) -> int:
        """Where the extent's bytes end in its file."""
        return self.lo - self.base + (self.coded or self.hi - self.lo)

    def size_error(self, size: int) -> str | None:
        """What is wrong with the extent's file being ``size`` bytes long (None: nothing)."""
        end = self.end
        if size == end or (size > end and not self.whole):
            return None
        return f"size {size} != {end} in the manifest" if self.whole else f"size {size} < {end}, where the chunk ends"

    def decode(self, frame: bytes | bytearray | memoryview) -> memoryview:
        """The extent's bytes, from its frame as read; :class:`layout.ChecksumMismatch` naming its file when the
        frame does not decode to them."""
        return decode_frame(frame, self.hi - self.lo, self.path)


def decode_frame(frame: bytes | bytearray | memoryview, size: int, where: Path) -> memoryview:
    """The ``size`` bytes a compressed chunk's ``frame`` (read from ``where``) holds; :class:`layout.ChecksumMismatch`
    naming ``where`` when it does not hold them (a damaged frame: a copy like any other that fails its checks)."""
    try:
        data = memoryview(codec.decode(frame)).cast("B")
    except codec.CodecError as e:
        raise layout.ChecksumMismatch(where, f"a compressed chunk that does not decode: {e}") from None
    if len(data) != size:
        raise layout.ChecksumMismatch(where, f"a compressed chunk decodes to {len(data)} bytes, not {size}")
    return data


Find = Callable[[str], "packs.Place | None"]


def extents(part: Path, manifest: dict[str, Any], file: str = layout.DATA_FILE, find: Find | None = None
            ) -> list[Extent]:
    """Where the bytes of a part's data file are: the file itself, or its chunks in the job's store.

    ``find(name)`` says where a chunk is (:meth:`packs.StoreIndex.find`, the default, looks in the store's
    packs and for its own file); a chunk found nowhere is named by its own file, which a reader then misses.
    """
    chunks = manifest_chunks(manifest, file)
    if chunks is None:
        return [Extent(0, layout.manifest_files(manifest)[file].size, part / file, 0)]
    store = store_of(part, manifest)
    if find is None:
        found = packs.store_index(store).find_all(c.name for c in chunks)
        find = found.get
    out = []
    for c in chunks:
        place = find(c.name)
        if place is None or place.whole:
            out.append(Extent(c.lo, c.hi, place.path if place else chunk_path(store, c.name), c.lo))
        else:
            out.append(Extent(c.lo, c.hi, place.path, c.lo - place.offset, whole=False, coded=place.size and place.length))
    return out


def loose(store: Path) -> Find:
    """A ``find`` for a store whose chunks are each a file of their own where :func:`chunk_path` says (an
    object store's, whose locations are not files to look for)."""
    return lambda name: packs.Place(chunk_path(store, name), 0, 0, whole=True)


def referenced(manifest: dict[str, Any]) -> set[str]:
    """The chunk names a manifest refers to (none for a part stored whole)."""
    return {c.name for name in manifest.get("chunks") or {} for c in manifest_chunks(manifest, name) or ()}


def missing(store: Path, names: Iterable[str]) -> list[str]:
    """The chunks among ``names`` that are not in ``store``, loose or packed (a sweep took them, or they never
    arrived)."""
    return [n for n, place in packs.store_index(store).find_all(names).items() if place is None]


def read_chunk(store: Path, name: str) -> bytes | memoryview:
    """Chunk ``name``'s bytes from ``store`` (a range of a pack, or its own file; decoded where it is kept
    compressed), unchecked. A pack removed under the read (a repack moved the chunk) is looked up again, once;
    FileNotFoundError: the store lacks it."""
    def read(place: packs.Place) -> bytes | memoryview:
        with open(place.path, "rb") as f:
            f.seek(place.offset)
            data = f.read(place.length)
        if len(data) != place.length:
            raise OSError(errno.EIO, f"{place.path}: shorter than its chunk {name} ({place.length} bytes)")
        return decode_frame(data, place.size, place.path) if place.size else data

    return packs.use_chunk(packs.store_index(store), name, read, str(store))


def verify_part(part: Path, manifest: dict[str, Any] | None = None) -> None:
    """Re-reads every byte of a part (its files, or its chunks) and checks sizes and block checksums.

    Raises :class:`layout.ChecksumMismatch` naming the file or chunk and the first bad block.
    """
    manifest = manifest if manifest is not None else layout.read_manifest(part)
    for name, entry in layout.manifest_files(manifest).items():
        verifier = layout.BlockVerifier(entry, part / name)
        for path, piece in read_pieces(part, manifest, name, memoryview(bytearray(entry.chunk_bytes))):
            verifier.path = path  # a bad block is named by the file its last bytes came from
            verifier.feed(piece)
        check_block_count(part / name, entry, verifier)


def read_pieces(part: Path, manifest: dict[str, Any], file: str, buffer: memoryview, drop_cache: bool = False
                ) -> Iterator[tuple[Path, memoryview]]:
    """The bytes of a part's ``file`` from its start (the file itself, or its chunks wherever the job's store
    holds them), each piece read into ``buffer`` (valid until the next piece) with the path it came from.

    Raises :class:`layout.ChecksumMismatch` naming a path that is missing or shorter than the manifest says.
    A pack removed under the read (a repack moved its chunks, a sweep removed it) is looked up again, once.
    ``drop_cache``: what the read put in the page cache goes again (for a file written around it).
    """
    found = extents(part, manifest, file)
    looked_again = False
    at = 0
    while at < len(found):
        ext = found[at]
        try:
            f = open(ext.path, "rb", buffering=0)  # noqa: SIM115 - closed below, on every path
        except FileNotFoundError as e:
            if not ext.whole and not looked_again:
                packs.store_index(store_of(part, manifest)).reset()
                found, looked_again = extents(part, manifest, file), True  # the same chunks, found again
                continue
            raise layout.ChecksumMismatch(ext.path, f"missing: {e}") from e
        except OSError as e:
            raise layout.ChecksumMismatch(ext.path, f"missing: {e}") from e
        with f:
            wrong = ext.size_error(os.fstat(f.fileno()).st_size)
            if wrong:
                raise layout.ChecksumMismatch(ext.path, wrong)
            f.seek(ext.lo - ext.base)
            if ext.coded:
                decoded = ext.decode(f.read(ext.coded))
                for lo in range(0, len(decoded), len(buffer)):
                    yield ext.path, decoded[lo:lo + len(buffer)]
            else:
                left = ext.hi - ext.lo
                while left:
                    n = f.readinto(buffer[:min(len(buffer), left)])
                    if not n:
                        raise layout.ChecksumMismatch(ext.path, "shorter than the manifest says")
                    yield ext.path, buffer[:n]
                    left -= n
            if drop_cache:
                os.posix_fadvise(f.fileno(), ext.lo - ext.base, ext.end - (ext.lo - ext.base), os.POSIX_FADV_DONTNEED)
        at += 1


def check_block_count(path: Path, entry: layout.FileEntry, verifier: layout.BlockVerifier) -> None:
    """The end of a file that ``verifier`` was fed whole: every byte came, and the manifest lists one
    digest per block (its last, possibly empty, one checked here)."""
    verifier.finish(entry.size)
    blocks = layout.chunk_count(entry.size, entry.chunk_bytes)
    if blocks != len(entry.digests):
        raise layout.ChecksumMismatch(path, f"{blocks} blocks read, the manifest lists {len(entry.digests)}")
