"""Lays tensors out as one safetensors file and writes the part manifest.

The data file of every part is a valid safetensors file (readable with
``safetensors.torch.load_file``, no ckptstage needed). Tensors are ordered by
element size, largest first, after a header padded to 64 bytes, so every
tensor starts at an offset aligned to its element size: the client can view
arena memory as the tensor's dtype and copy with one ``Tensor.copy_``.
Dtypes safetensors has no code for (complex, some float8s) are stored as
``U8`` byte strings; the manifest keeps their real dtype and shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from ckptstage.protos import layout

_ST_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
                     ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _ST_CODES[getattr(torch, _name)] = _code

HEADER_ALIGN = 64


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise layout.ManifestError(f"unknown dtype {name!r} in manifest")
    return dtype


@dataclass(frozen=True)
class FilePlan:
    header: bytes                       # the safetensors header, length prefix included
    entries: list[layout.TensorEntry]   # in tensor-list order, absolute file offsets
    data_bytes: int                     # size of the whole file


def plan_file(tensors: list[torch.Tensor], paths: list[str]) -> FilePlan:
    names = _unique_names(paths)
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    rel: dict[int, tuple[int, int]] = {}
    cursor = 0
    for i in order:
        n = tensors[i].numel() * tensors[i].element_size()
        rel[i] = (cursor, cursor + n)
        cursor += n
    header_obj: dict[str, Any] = {"__metadata__": {"format": layout.FORMAT}}
    for i, t in enumerate(tensors):
        code = _ST_CODES.get(t.dtype)
        shape = list(t.shape) if code else [rel[i][1] - rel[i][0]]
        header_obj[names[i]] = {"dtype": code or "U8", "shape": shape, "data_offsets": list(rel[i])}
    header = _padded_header(header_obj)
    start = len(header)
    entries = [layout.TensorEntry(names[i], dtype_name(t.dtype), tuple(t.shape), start + rel[i][0],
                                  rel[i][1] - rel[i][0]) for i, t in enumerate(tensors)]
    return FilePlan(header, entries, start + cursor)


class PlanCache:
    """The last layout planned, reused while the state keeps its structure.

    A trainer saves the same structure every time (same keys, dtypes and
    shapes), so after the first save planning costs one comparison instead of
    a header rebuild (3-4 ms for GPT-2's 592 tensors, on the trainer's thread).
    """

    def __init__(self) -> None:
        self._key: tuple[tuple[str, ...], tuple[tuple[torch.dtype, tuple[int, ...]], ...]] | None = None
        self._plan: FilePlan | None = None

    def plan(self, tensors: list[torch.Tensor], paths: list[str]) -> FilePlan:
        key = (tuple(paths), tuple((t.dtype, tuple(t.shape)) for t in tensors))
        if self._plan is None or key != self._key:
            self._plan, self._key = plan_file(tensors, paths), key
        return self._plan


def build_manifest(plan: FilePlan, tree: Any, job: str, step: int, rank: int, world_size: int,
                   attempt: str = "", extras: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The part manifest as the client sends it; the daemon adds files, times and metrics.

    ``extras`` add to each tensor entry what the file layout does not say:
    its fqn, and for a DTensor's fragment its global shape and offset.
    """
    tensors = [e.to_json() for e in plan.entries]
    for entry, extra in zip(tensors, extras or ()):
        entry.update(extra)
    return {
        "format": layout.FORMAT, "job": job, "step": step, "rank": rank, "world_size": world_size,
        "attempt": attempt, "data_start": len(plan.header), "tensors": tensors, "tree": tree,
    }


def _padded_header(obj: dict[str, Any]) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    pad = -(8 + len(body)) % HEADER_ALIGN
    body += b" " * pad  # safetensors allows trailing spaces in the header
    return len(body).to_bytes(8, "little") + body


def _unique_names(paths: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    names = []
    for p in paths:
        name = p.removeprefix("state")
        name = name or "."
        if name in seen:
            seen[name] += 1
            name = f"{name}#{seen[name]}"
        else:
            seen[name] = 0
        names.append(name)
    return names
