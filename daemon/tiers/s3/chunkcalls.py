"""The chunk-store calls of the object-store tier (:class:`~ckptstage.daemon.tiers.interface.ChunkStorage`),
as :class:`~ckptstage.daemon.tiers.s3.tier.S3Tier` answers them: its :class:`S3Chunks`, and its index for the
manifests a sweep marks from. Packs are a file-system tier's: an object store keeps a chunk per object."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ckptstage.daemon.tiers.interface import NoPacks, PartWriter
from ckptstage.daemon.tiers.s3.chunks import S3ChunkBatch, S3Chunks
from ckptstage.daemon.tiers.s3.compression import DecodedReader
from ckptstage.daemon.tiers.s3.io import ObjectReader
from ckptstage.daemon.tiers.s3.keys import Keys
from ckptstage.daemon.tiers.s3.listing import S3Index


class S3ChunkCalls(NoPacks):
    """The :class:`~ckptstage.daemon.tiers.interface.ChunkStorage` half of the object-store tier."""

    _keys: Keys
    _index: S3Index
    _chunks: S3Chunks

    def has_chunk_store(self, job: str) -> bool:
        return self._chunks.has_chunk_store(job)

    def chunk_location(self, job: str, name: str) -> Path:
        return self._keys.chunk_location(job, name)

    def touch_chunk(self, job: str, name: str) -> bool:
        return self._chunks.touch_chunk(job, name)

    def touch_chunks(self, job: str, names: Iterable[str]) -> set[str]:
        return {name for name in names if self._chunks.touch_chunk(job, name)}  # an object per chunk

    def chunk_size(self, job: str, name: str) -> int:
        return self._chunks.chunk_size(job, name)

    def open_chunk(self, job: str, name: str) -> ObjectReader | DecodedReader:
        return self._chunks.open_chunk(job, name)

    def missing_chunks(self, job: str, names: Iterable[str]) -> list[str]:
        return self._chunks.missing_chunks(job, names)

    def swept_at(self, job: str) -> float | None:
        return self._chunks.swept_at(job)

    def note_swept(self, job: str) -> None:
        self._chunks.note_swept(job)

    def new_chunks(self, job: str, part: PartWriter | None = None) -> S3ChunkBatch:
        return self._chunks.new_chunks(job, part)

    def list_manifests(self, job: str) -> list[Path]:
        return self._index.list_manifests(job)

    def manifest_version(self, part: Path) -> tuple[int, ...]:
        return self._index.manifest_version(part)

    def list_chunks(self, job: str) -> list[str]:
        return self._chunks.list_chunks(job)

    def condemn_chunk(self, job: str, name: str, untouched_since: float) -> bool:
        return self._chunks.condemn_chunk(job, name, untouched_since)

    def condemned_chunks(self, job: str) -> list[str]:
        return self._chunks.condemned_chunks(job)

    def restore_chunk(self, job: str, name: str) -> None:
        self._chunks.restore_chunk(job, name)

    def delete_condemned_chunk(self, job: str, name: str) -> int:
        return self._chunks.delete_condemned_chunk(job, name)
