"""Reading a committed part back: verify every chunk, then copy each tensor once.

The data file is memory-mapped; each chunk's checksum is checked against the
manifest before any tensor built from it is returned (invariant 7), and
each tensor is copied exactly once, out of the page cache into its own
storage (or into a caller's existing tensor with ``into=``).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import torch

from ckptstage.client import tree
from ckptstage.client.fileplan import dtype_from_name
from ckptstage.protos import layout


def read_part(part: Path, into: Any = None) -> tuple[dict[str, Any], Any]:
    """Returns (manifest, state) of one part; raises :class:`layout.ManifestError` on any mismatch."""
    manifest = layout.read_manifest(part)
    files = layout.manifest_files(manifest)
    entry = files.get(layout.DATA_FILE)
    if entry is None:
        raise layout.ManifestError(f"{part}: manifest lists no {layout.DATA_FILE}")
    path = part / layout.DATA_FILE
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != entry.size:
            raise layout.ChecksumMismatch(path, f"size {size} != {entry.size} in the manifest")
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None
    try:
        if mm is not None:
            mm.madvise(mmap.MADV_SEQUENTIAL)
            _verify(mm, entry, path)
        tensors = [layout.TensorEntry.from_json(t) for t in manifest["tensors"]]
        layout.validate_tensor_table(tensors, int(manifest["data_start"]), size)
        targets = _targets(into, len(tensors))
        u8 = torch.frombuffer(mm, dtype=torch.uint8) if mm is not None else torch.empty(0, dtype=torch.uint8)
        out = [_materialize(u8, t, targets[i] if targets else None) for i, t in enumerate(tensors)]
        del u8
        state = tree.unflatten(manifest["tree"], out.__getitem__)
    finally:
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass
    return manifest, state


def _verify(mm: mmap.mmap, entry: layout.FileEntry, path: Path) -> None:
    view = memoryview(mm)
    try:
        if len(entry.digests) != layout.chunk_count(entry.size, entry.chunk_bytes):
            raise layout.ChecksumMismatch(path, "the manifest's chunk list does not cover the file")
        for i, expected in enumerate(entry.digests):
            got = layout.chunk_digest(view[i * entry.chunk_bytes:(i + 1) * entry.chunk_bytes])
            if got != expected:
                raise layout.ChecksumMismatch(
                    path, f"chunk {i} (bytes {i * entry.chunk_bytes}..) {layout.CHECKSUM} {got} != {expected}")
    finally:
        view.release()


def _materialize(u8: torch.Tensor, t: layout.TensorEntry, target: torch.Tensor | None) -> torch.Tensor:
    dtype = dtype_from_name(t.dtype)
    src = u8[t.offset:t.offset + t.nbytes].view(dtype).view(t.shape) if t.nbytes else None
    if target is not None:
        if target.dtype != dtype or tuple(target.shape) != t.shape:
            raise ValueError(f"into= tensor for {t.name!r} is {target.dtype} {tuple(target.shape)}, "
                             f"the checkpoint has {dtype} {t.shape}")
        if src is not None:
            target.copy_(src)
        return target
    if src is None:
        return torch.empty(t.shape, dtype=dtype)
    return src.clone()


def _targets(into: Any, n: int) -> list[torch.Tensor] | None:
    if into is None:
        return None
    _, tensors, paths = tree.flatten(into)
    if len(tensors) != n:
        raise ValueError(f"into= has {len(tensors)} tensors, the checkpoint has {n}")
    return tensors
