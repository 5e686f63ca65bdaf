"""Sharded tensors (DTensors) in the universal format: fragments of a global tensor.

A DTensor is stored as *fragments*: each rank writes the box of the global
tensor it holds (its local shard) as an ordinary tensor in its part, and the
manifest entry says which box: the tensor's fqn, its global shape and the
fragment's offset in every dimension. Loading gathers, for each box a caller
wants, the fragments that overlap it from whichever parts hold them, so any
mesh, placements or world size can read any other (the distributed and
consolidated representations of Universal Checkpointing, in one format).

Replicated placements are stored once: a rank writes its local shard only if
its coordinate is 0 on every mesh dimension where the tensor is replicated;
the other replicas hold the same bytes. A DTensor on a sub-mesh is stored by
every slice of the root mesh that holds it: the slices may be copies (the
``dp`` slices of FSDP-only modules under FSDP x TP) or different tensors
under the same name (pipeline stages), and nothing local tells which, so a
reader keeps one copy of identical boxes. Partial placements (pending
reductions) have no bytes of their own and are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in global coordinates


@dataclass(frozen=True)
class Fragment:
    """Where one stored tensor sits in its global tensor."""

    fqn: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"global_shape": list(self.global_shape), "global_offset": list(self.offsets)}


def is_dtensor(obj: Any) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(obj, cls)


def _dtensor_class() -> Any:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def node(dt: Any, fqn: str) -> dict[str, Any]:
    """The tree node of a DTensor: what a reader needs to allocate it whole."""
    return {"fqn": fqn, "dtype": str(dt.dtype).removeprefix("torch."), "shape": list(dt.shape)}


def local_fragment(dt: Any, path: str, fqn: str) -> tuple[torch.Tensor, Fragment] | None:
    """The local shard this rank stores and its place, or None (an empty shard, or a replica another rank stores)."""
    placements = dt.placements
    if any(p.is_partial() for p in placements):
        raise TypeError(f"{path} is a DTensor with a Partial placement ({placements}): its bytes are a pending "
                        "reduction; redistribute it to Replicate or Shard before saving")
    coordinate = dt.device_mesh.get_coordinate()
    if coordinate is None:
        return None  # this rank is not in the tensor's mesh
    if any(c != 0 for c, p in zip(coordinate, placements) if p.is_replicate()):
        return None  # a replica: the coordinate-0 rank of these mesh dimensions stores the same bytes
    local = dt.to_local()
    if local.numel() == 0:
        return None
    chunks = dt.__create_chunk_list__()
    if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(local.shape):
        raise TypeError(f"{path}: DTensor local shard {tuple(local.shape)} is not one box of the global tensor "
                        f"({[tuple(c.sizes) for c in chunks]}); ckptstage stores one box per rank")
    return local, Fragment(fqn, tuple(dt.shape), tuple(int(o) for o in chunks[0].offsets))


def local_box(dt: Any) -> Box:
    """The box of the global tensor that this rank's shard of ``dt`` covers (what a load must fill)."""
    chunks = dt.__create_chunk_list__()
    if len(chunks) != 1:
        raise TypeError(f"DTensor {tuple(dt.shape)} has {len(chunks)} local chunks; ckptstage fills one box per rank")
    return tuple(int(o) for o in chunks[0].offsets), tuple(int(s) for s in chunks[0].sizes)


def overlap(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes, or None when they do not meet (or either is empty)."""
    offs, sizes = [], []
    for ao, an, bo, bn in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        offs.append(lo)
        sizes.append(hi - lo)
    return tuple(offs), tuple(sizes)


def box_slices(box: Box, origin: tuple[int, ...]) -> tuple[slice, ...]:
    """Indexes selecting ``box`` in a tensor whose element 0 sits at global ``origin``."""
    return tuple(slice(o - z, o - z + n) for o, n, z in zip(box[0], box[1], origin))


def byte_span(box: Box, origin: tuple[int, ...], shape: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """The contiguous byte range of a row-major tensor (``shape`` at ``origin``) that holds all of ``box``.

    From the box's first element to just past its last: exact when the box
    spans whole trailing rows, otherwise it includes the gaps between rows
    (read and dropped; a box is never read element by element).
    """
    if not shape:
        return 0, itemsize
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    first = sum((o - z) * s for o, z, s in zip(box[0], origin, strides))
    last = sum((o - z + n - 1) * s for o, n, z, s in zip(box[0], box[1], origin, strides))
    return first * itemsize, (last + 1) * itemsize
