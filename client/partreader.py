"""Verified reads of byte ranges of one rank's part, from its best copy that verifies (the next copy after a
failure), for the readers of a sharded step (:class:`ckptstage.client.reshard.StepView`)."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ckptstage.client.extentfiles import ExtentFiles
from ckptstage.protos import chunks, layout

log = logging.getLogger(__name__)

_CACHED_BLOCKS = 2    # partly used verified blocks each reading thread keeps for the next fragment in them
_SPAN = 16 << 20      # the largest single read of whole blocks

Report = Callable[[int, int, str], None]  # (rank, index of the copy, what failed)


class PartReader:
    """Verified reads of byte ranges of one part's data file, from its best copy that verifies.

    Thread-safe: several threads read one part at once (positional reads on
    the same descriptors), each with its own cache of partly used blocks; a
    copy that fails verification (or cannot be read here) is abandoned for
    the next by whichever thread finds it, and the others follow on their
    next read.
    """

    def __init__(self, rank: int, dirs: list[Path], report: Report | None = None,
                 committed: Mapping[Path, str] | None = None, keep_open: int = 4,
                 manifest: dict[str, Any] | None = None) -> None:
        """``manifest``: the part's manifest, already checked against the digest its commit record names (the
        step index's): no copy's manifest file is opened then; every copy has that same manifest."""
        if not dirs:
            raise layout.ManifestError(f"rank {rank}: no copy of this part to read")
        self.rank = rank
        self.dirs = dirs
        self._committed = committed or {}
        self._keep_open = keep_open  # chunk files kept open while no read is using them (a whole part has one)
        self._report = report
        self._lock = threading.Lock()
        self._copy = -1
        self._files: ExtentFiles | None = None  # the current copy's, opened at the first read
        self._extents: list[chunks.Extent] = []
        self._exhausted: BaseException | None = None  # every copy failed: what the last one did
        self._opened: list[ExtentFiles] = []  # closed only at close(): another thread may still read an abandoned copy
        self._local = threading.local()
        self.bytes_read = 0
        self.manifest: dict[str, Any] = {}
        self._known = manifest
        self._next_copy(None)

    def _next_copy(self, failure: BaseException | None) -> None:
        """Moves to the next copy whose manifest reads; raises the last failure when none is left."""
        while True:
            self._copy += 1
            if self._copy >= len(self.dirs):
                self._exhausted = failure or layout.ManifestError(f"rank {self.rank}: no copy to read")
                raise self._exhausted
            try:
                manifest = self._known or layout.read_manifest(self.dirs[self._copy],
                                                               self._committed.get(self.dirs[self._copy], ""))
                entry = layout.manifest_files(manifest)[layout.DATA_FILE]
                extents = chunks.extents(self.dirs[self._copy], manifest)
            except (layout.ManifestError, KeyError) as e:
                failure = self._failed(self._copy, e)
                continue
            if self.manifest and layout.manifest_files(self.manifest)[layout.DATA_FILE] != entry:
                failure = layout.ManifestError(f"{self.dirs[self._copy]}: this copy's data differs from the first's")
                continue
            if len(entry.digests) != layout.chunk_count(entry.size, entry.chunk_bytes):
                failure = self._failed(self._copy, layout.ChecksumMismatch(
                    self.dirs[self._copy] / layout.DATA_FILE, "the manifest's digest list does not cover the file"))
                continue
            # The data file is opened at the first read: a rank that reads from two parts of a
            # thousand-rank step holds two descriptors, not a thousand.
            self._files, self._extents = None, extents
            self.manifest, self.file = self.manifest or manifest, entry
            return

    def _failed(self, copy: int, e: BaseException) -> BaseException:
        if isinstance(e, KeyError):
            e = layout.ManifestError(f"{self.dirs[copy]}: manifest lists no {layout.DATA_FILE}")
        if self._report is not None and layout.is_verification_failure(e):
            self._report(self.rank, copy, str(e))
        log.warning("rank %d part at %s: %s", self.rank, self.dirs[copy], e)
        return e

    def drop_cache(self) -> None:
        """Forgets this thread's partly used blocks."""
        self._cache().clear()

    def close(self) -> None:
        for files in self._opened:
            files.close()
        self._opened.clear()
        self._files = None

    def read(self, offset: int, dest: memoryview) -> None:
        """Fills ``dest`` with the file's bytes at ``offset``, every block they touch verified."""
        while True:
            with self._lock:
                if self._exhausted is not None:  # another thread found the last copy bad
                    raise self._exhausted
                if self._files is None:
                    self._files = ExtentFiles(self.dirs[self._copy] / layout.DATA_FILE, self._extents, self._keep_open)
                    self._opened.append(self._files)
                copy, files = self._copy, self._files
            try:
                self._read(copy, files, offset, dest)
                return
            except (layout.ManifestError, OSError) as e:
                # A bad copy (a flipped byte, a missing chunk), or one this process cannot read (its
                # own trouble, reported to no one): either way the next copy may serve.
                failure = e
                if not isinstance(e, layout.ManifestError):
                    failure = layout.ManifestError(f"{self.dirs[copy] / layout.DATA_FILE}: cannot read: {e}")
                    failure.__cause__ = e
                with self._lock:
                    if self._copy == copy and self._exhausted is None:  # else another thread moved on already
                        self._next_copy(self._failed(copy, failure))
                self.drop_cache()

    def _cache(self) -> OrderedDict[tuple[int, int], bytearray]:
        cache = getattr(self._local, "cache", None)
        if cache is None:
            cache = self._local.cache = OrderedDict()
        return cache

    def _read(self, copy: int, files: ExtentFiles, offset: int, dest: memoryview) -> None:
        bs, end, pos = self.file.chunk_bytes, offset + len(dest), offset
        while pos < end:
            b0 = pos // bs * bs
            if pos == b0 and end - pos >= min(bs, self.file.size - b0):
                # Whole blocks, straight into dest: one read of up to _SPAN bytes, then a digest per block.
                n = min(end, self.file.size) - pos
                n = min(max(bs, _SPAN // bs * bs), n if end >= self.file.size else n // bs * bs)
                self._pread_verified(copy, files, pos, dest[pos - offset:pos - offset + n])
                pos += n
                continue
            stop = min(end, b0 + bs)
            block = self._block(copy, files, pos // bs)
            dest[pos - offset:stop - offset] = memoryview(block)[pos - b0:stop - b0]
            pos = stop

    def _block(self, copy: int, files: ExtentFiles, b: int) -> bytearray:
        cache = self._cache()
        buf = cache.get((copy, b))
        if buf is None:
            bs = self.file.chunk_bytes
            buf = bytearray(min(bs, self.file.size - b * bs))
            self._pread_verified(copy, files, b * bs, memoryview(buf))
            cache[(copy, b)] = buf
            while len(cache) > _CACHED_BLOCKS:
                cache.popitem(last=False)
        else:
            cache.move_to_end((copy, b))
        return buf

    def _pread_verified(self, copy: int, files: ExtentFiles, offset: int, view: memoryview) -> None:
        """Reads whole blocks at ``offset`` (block-aligned) into ``view`` and checks each one's digest."""
        files.pread_exact("buffered", [view], offset)
        with self._lock:
            self.bytes_read += len(view)
        layout.verify_blocks(view, self.file, offset // self.file.chunk_bytes, files.path, files.where)
