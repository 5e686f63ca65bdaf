"""Reading a part from the daemon's memory tier: map the kept arena, verify it, use it in place.

The daemon hands over the descriptor of the shared memory that still holds
the part's data file image (:mod:`ckptstage.protos.handoff`). It is mapped
``MAP_PRIVATE``: the tensors built on it are the process's own, writable,
copy-on-write pages, and nothing this process does reaches the daemon's copy.
Every digest block is hashed and compared with the manifest before a tensor
is returned (invariant 7), so a load from memory costs one pass over the
bytes (the hash, which also maps the pages) instead of a read and a copy;
with ``into=`` the verified bytes are copied into the caller's tensors.

Tensors of at least :data:`SHARE_MIN` bytes are built on the mapping, each
with a storage of its own (never a view into one large storage: ``torch.save``
of one would write them all, and a few torch functions ignore a storage
offset). Smaller ones are copied out, so that a small tensor a trainer keeps
(an optimizer's ``step``) does not keep the whole image mapped.
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ckptstage.client import tree
from ckptstage.client.fileplan import dtype_from_name
from ckptstage.protos import handoff, layout

SHARE_MIN = 1 << 20  # smaller tensors are copied out of the mapping
VERIFY_THREADS = min(4, os.cpu_count() or 1)


def read_memory_part(socket: Path, job: str, step: int, rank: int, into: Any = None) -> tuple[dict[str, Any], Any]:
    """(manifest, state) of the memory tier's copy of one part.

    Raises :class:`handoff.NotInMemory` when the daemon no longer holds it,
    :class:`layout.ManifestError` when it fails verification, OSError when
    the handoff socket cannot be reached. ``into``: a state whose tensors are
    filled in place, as with :func:`restore.read_part` (untouched when it raises).
    """
    where = Path(f"memory:{job}/step-{step:012d}/rank-{rank:05d}")
    got = handoff.fetch(socket, job, step, rank)
    try:
        # No MAP_POPULATE: on a private writable mapping it would copy every page; the hash maps them.
        mapped = mmap.mmap(got.fd, got.arena_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(got.fd)
    manifest = layout.parse_manifest_file(got.manifest, where)
    if (manifest.get("job"), manifest.get("step"), manifest.get("rank")) != (job, step, rank):
        raise layout.ManifestError(f"{where}: the daemon handed over job {manifest.get('job')!r} step "
                                   f"{manifest.get('step')} rank {manifest.get('rank')}")
    entry = layout.manifest_files(manifest).get(layout.DATA_FILE)
    if entry is None or entry.size != got.size:
        raise layout.ChecksumMismatch(where, f"image of {got.size} bytes, the manifest lists "
                                             f"{entry.size if entry else 'no'} data file")
    entries = [layout.TensorEntry.from_json(t) for t in manifest["tensors"]]
    layout.validate_tensor_table(entries, int(manifest["data_start"]), entry.size)
    targets = tree.flatten(into)[1] if into is not None else None
    if targets is not None and len(targets) != len(entries):
        raise ValueError(f"into= has {len(targets)} tensors, the checkpoint has {len(entries)}")
    with memoryview(mapped) as whole:
        _verify(whole[got.offset:got.offset + got.size], entry, where)
    out = [_tensor(e, mapped, got.offset, copy=targets is not None) for e in entries]
    if targets is not None:  # every shape checked before the first byte lands in the caller's tensors
        for e, src, dst in zip(entries, out, targets, strict=True):
            if dst.dtype != src.dtype or dst.shape != src.shape:
                raise ValueError(f"into= tensor for {e.name!r} is {dst.dtype} {tuple(dst.shape)}, "
                                 f"the checkpoint has {src.dtype} {tuple(src.shape)}")
        for src, dst in zip(out, targets, strict=True):
            dst.copy_(src)
        out = targets
    return manifest, tree.unflatten(manifest["tree"], out.__getitem__)


def _verify(view: memoryview, entry: layout.FileEntry, where: Path) -> None:
    """Every block against its digest, on :data:`VERIFY_THREADS` threads (xxhash lets go of the GIL; the pass
    also maps the pages, and both scale with the cores)."""
    if len(entry.digests) != layout.chunk_count(entry.size, entry.chunk_bytes):
        raise layout.ChecksumMismatch(where, "the manifest's chunk list does not cover the image")
    block, n = entry.chunk_bytes, len(entry.digests)

    def check(lo: int, hi: int) -> None:
        layout.verify_blocks(view[lo * block:hi * block], entry, lo, where)

    threads = max(1, min(VERIFY_THREADS, n // 8))  # a small part: one thread, no pool
    if threads == 1:
        check(0, n)
        return
    cuts = [n * k // threads for k in range(threads + 1)]
    with ThreadPoolExecutor(threads, thread_name_prefix="ckptstage-verify") as pool:
        # In order: the first range that failed raises (its first bad block is the file's first).
        for _ in pool.map(check, cuts[:-1], cuts[1:]):
            pass


def _tensor(t: layout.TensorEntry, mapped: mmap.mmap, base: int, copy: bool) -> torch.Tensor:
    """The tensor ``t``: on the mapping, a storage of its own; copied out when small (or for ``into=``)."""
    dtype = dtype_from_name(t.dtype)
    if not t.nbytes:
        return torch.empty(t.shape, dtype=dtype)
    on_map = torch.frombuffer(mapped, dtype=torch.uint8, count=t.nbytes, offset=base + t.offset)
    on_map = on_map.view(dtype).view(t.shape)
    return on_map.clone() if t.nbytes < SHARE_MIN and not copy else on_map
