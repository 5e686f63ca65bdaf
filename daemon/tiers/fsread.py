"""Reading a file-system tier's files: a part's file, a chunk's own file, or a range of a pack."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import TracebackType

from ckptstage.daemon.tiers.compression import DecodedReader
from ckptstage.protos import packs


class FileReader:
    """A file read from its start with unbuffered reads (:class:`ckptstage.daemon.tiers.interface.Reader`); with
    ``place``, only the ``length`` bytes from ``offset`` (a chunk in a pack), as if they were the file."""

    def __init__(self, path: Path, sequential: bool, place: packs.Place | None = None) -> None:
        self._file = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        try:
            self.size = os.fstat(self._file.fileno()).st_size
            self._left = self.size
            if place is not None and not place.whole:
                if place.offset + place.length > self.size:
                    raise FileNotFoundError(errno.ENOENT, f"{path} ends before its chunk at {place.offset} "
                                                          f"({place.length} bytes)")
                self._file.seek(place.offset)
                self.size = self._left = place.length
            if sequential:
                os.posix_fadvise(self._file.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except BaseException:
            self._file.close()
            raise

    def readinto(self, buf: memoryview) -> int | None:
        n = self._file.readinto(buf[:self._left]) or 0
        self._left -= n
        return n

    def read(self, n: int) -> bytes:
        data = self._file.read(min(n, self._left)) or b""
        self._left -= len(data)
        return data

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def open_place(place: packs.Place, sequential: bool = False) -> FileReader | DecodedReader:
    """A reader of what the chunk at ``place`` holds: its bytes in the file, or where it is kept compressed, its
    frame read whole and decoded (a frame that does not decode is served as it is, and fails the reader's check
    of the chunk's name)."""
    reader = FileReader(place.path, sequential, place=place)
    if not place.size:
        return reader
    with reader:
        return DecodedReader(reader.read(place.length))
