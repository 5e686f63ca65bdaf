"""The chunk-store calls of the object-store tier (:class:`~ckptstage.daemon.tiers.interface.ChunkStorage`),
as :class:`~ckptstage.daemon.tiers.s3.tier.S3Tier` answers them: its :class:`S3Chunks` (and their packs), and
its index for the manifests a sweep marks from."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ckptstage.daemon.tiers.interface import Pack, PartWriter
from ckptstage.daemon.tiers.s3.chunks import S3Chunks
from ckptstage.daemon.tiers.compression import DecodedReader
from ckptstage.daemon.tiers.s3.io import ObjectReader
from ckptstage.daemon.tiers.s3.listing import S3Index
from ckptstage.daemon.tiers.s3.packbatch import S3PackBatch
from ckptstage.protos import packs


class S3ChunkCalls:
    """The :class:`~ckptstage.daemon.tiers.interface.ChunkStorage` half of the object-store tier."""

    _index: S3Index
    _chunks: S3Chunks

    def has_chunk_store(self, job: str) -> bool:
        return self._chunks.has_chunk_store(job)

    def compressed_sizes(self, job: str) -> dict[str, int]:
        return self._chunks.packs.index(job).compressed()

    def chunk_location(self, job: str, name: str) -> Path:
        return self._chunks.chunk_location(job, name)

    def touch_chunk(self, job: str, name: str) -> bool:
        return name in self._chunks.touch_chunks(job, [name])

    def touch_chunks(self, job: str, names: Iterable[str]) -> set[str]:
        return self._chunks.touch_chunks(job, names)

    def chunk_size(self, job: str, name: str) -> int:
        return self._chunks.chunk_size(job, name)

    def open_chunk(self, job: str, name: str) -> ObjectReader | DecodedReader:
        return self._chunks.open_chunk(job, name)

    def chunk_runs(self, job: str, names: Iterable[str], max_bytes: int) -> list[packs.Run]:
        return self._chunks.chunk_runs(job, names, max_bytes)

    def open_chunk_run(self, job: str, run: packs.Run) -> ObjectReader | DecodedReader:
        return self._chunks.open_chunk_run(job, run)

    def missing_chunks(self, job: str, names: Iterable[str]) -> list[str]:
        return self._chunks.missing_chunks(job, names)

    def swept_at(self, job: str) -> float | None:
        return self._chunks.swept_at(job)

    def note_swept(self, job: str) -> None:
        self._chunks.note_swept(job)

    def new_chunks(self, job: str, part: PartWriter | None = None) -> S3PackBatch:
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

    def list_packs(self, job: str) -> list[Pack]:
        return self._chunks.packs.list_packs(job)

    def condemn_pack(self, job: str, pack_id: str, untouched_since: float) -> bool:
        return self._chunks.packs.condemn_pack(job, pack_id, untouched_since)

    def condemned_packs(self, job: str) -> list[Pack]:
        return self._chunks.packs.condemned_packs(job)

    def restore_pack(self, job: str, pack_id: str) -> None:
        self._chunks.packs.restore_pack(job, pack_id)

    def delete_condemned_pack(self, job: str, pack_id: str) -> int:
        return self._chunks.packs.delete_condemned_pack(job, pack_id)
