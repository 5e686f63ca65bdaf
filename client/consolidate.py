"""One step of a job as Hugging Face style safetensors files: full tensors, named by their dotted key path.

``consolidate`` reads every rank's part of a step (from a single process, no
process group), assembles each tensor whole from its fragments (a DTensor's
shards) or from rank 0's plain copy, and writes::

    model.safetensors                                  one file, or
    model-00001-of-00003.safetensors ...               several, each at most max_shard_size
    model.safetensors.index.json                       {"metadata": {"total_size": N}, "weight_map": {name: file}}

the layout ``transformers``' ``from_pretrained`` reads. Names are the fqns
(``model.fc.weight``); ``prefix="model."`` keeps only the keys under
``model.`` and strips it, giving the names a model's own ``state_dict()`` has.

It streams: every name, dtype and shape is known from the manifests, so each
file's header is written first and then each tensor's bytes as they are
read, a slab of at most :data:`SLAB_BYTES` at a time. Memory use does not
grow with the model, nor with its largest tensor.

What is not written: plain (non-tensor) values (step counters, hyper-
parameters); and a tensor stored once under several keys (tied weights) is
written once, under its first key, as ``save_pretrained`` does (the others
are in the result's ``aliases``). Dtypes are kept; a dtype safetensors has no
code for (complex, some float8 variants) is an error naming the key.

Nothing half-written is ever named like a finished file: each file is written
under a hidden temporary name, fsynced and renamed into place, and the index
is renamed into place last. An output directory that already holds
``model*.safetensors`` files is refused unless ``overwrite=True``.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import sys
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ckptstage.client import errors, reshard, shards, steps, tree
from ckptstage.client.fileplan import _ST_CODES, _padded_header
from ckptstage.client.restore import bytes_of
from ckptstage.client.rpc import Connection
from ckptstage.protos import layout

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SLAB_BYTES = 64 << 20  # the most tensor bytes held at once (a tensor is read in slabs of whole rows)

_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}

Progress = Literal["auto", "bar", "lines", "none"]


class ConsolidateError(errors.CkptStageError, ValueError):
    """The step cannot be written as safetensors as asked; the message names the key or the file."""


@dataclass(frozen=True)
class Consolidated:
    """What :func:`consolidate` wrote."""

    job: str
    step: int
    out: Path
    files: list[str]                 # file names in ``out``, the index last
    tensors: int                     # tensors written
    bytes: int                       # their bytes (the index's total_size)
    aliases: dict[str, str] = field(default_factory=dict)  # key not written -> the key it is stored under

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job, "step": self.step, "out": str(self.out), "files": self.files,
                "tensors": self.tensors, "bytes": self.bytes, "aliases": self.aliases}


@dataclass(frozen=True)
class _Tensor:
    name: str       # in the output (prefix stripped)
    fqn: str        # in the checkpoint
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def parse_size(value: str | int) -> int:
    """Bytes in ``"5GB"``, ``"500MB"``, ``"2GiB"`` or ``1000``: KB/MB/GB/TB are decimal (as ``transformers``
    reads ``max_shard_size``), KiB/MiB/GiB/TiB binary; case does not matter."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = _SIZE_RE.fullmatch(str(value))
        if m is None or m.group(2).upper() not in _UNITS:
            raise ValueError(f"invalid size {value!r}: a number with an optional unit, e.g. 5GB, 500MB, 2GiB")
        n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise ValueError(f"invalid size {value!r}: must be more than 0 bytes")
    return n


def consolidate(job: str, step: int | None = None, *, out: str | os.PathLike[str], prefix: str = "",
                max_shard_size: str | int = "5GB", overwrite: bool = False,
                socket: str | os.PathLike[str] | None = None, progress: Progress = "auto") -> Consolidated:
    """Writes step ``step`` of ``job`` (the newest complete one when None) into ``out`` as safetensors.

    See the module docstring for the layout. ``progress``: ``"auto"`` draws a
    tqdm bar on stderr when it is a terminal and prints nothing otherwise;
    ``"lines"`` prints a line per file written; ``"bar"`` and ``"none"``
    force either. Raises :class:`CheckpointNotFound` for an unknown job or
    step, :class:`ConsolidateError` for a key that cannot be written,
    ``FileExistsError`` for an ``out`` that already holds a model.
    """
    shard_limit = parse_size(max_shard_size)
    try:
        layout.check_job(job)
        if step is not None:
            layout.check_step(step)
    except layout.InvalidName as e:
        raise errors.InvalidRequest(str(e)) from None
    out_dir = Path(out)
    _check_out(out_dir, overwrite)
    with Connection(socket) as conn, steps.open_step(conn, job, step) as opened:
        view, found = opened.view, opened.located.step
        try:
            tensors, aliases = _select(view, prefix, job, found)
            shards_ = _plan_shards(tensors, shard_limit)
            out_dir.mkdir(parents=True, exist_ok=True)
            with _progress(progress, sum(t.nbytes for t in tensors), f"{job} step {found}") as bar:
                files = _write_all(view, shards_, out_dir, overwrite, {"ckptstage.job": job,
                                                                        "ckptstage.step": str(found)}, bar)
        except layout.ChecksumMismatch as e:
            raise errors.CorruptCheckpoint(f"no copy of {job} step {found} verifies: {e}") from e
    return Consolidated(job, found, out_dir, files, len(tensors), sum(t.nbytes for t in tensors), aliases)


# --- finding and choosing ------------------------------------------------------------------


def _select(view: reshard.StepView, prefix: str, job: str, step: int) -> tuple[list[_Tensor], dict[str, str]]:
    """The tensors to write, in the step's order, with their output names; and the aliases left out."""
    names = view.names(0)
    clashes = sorted(fqn for fqn, n in Counter(view.plain_fqns(0)).items() if n > 1)
    chosen: list[_Tensor] = []
    for fqn, (dtype, shape) in names.items():
        if not fqn.startswith(prefix):
            continue
        name = fqn[len(prefix):]
        if fqn in clashes:
            raise ConsolidateError(f"{job} step {step}: several tensors have the key path {fqn!r} once joined by "
                                   "dots; safetensors needs one name per tensor")
        if not name:
            raise ConsolidateError(f"{job} step {step}: key {fqn!r} would have an empty name once the prefix "
                                   f"{prefix!r} is stripped")
        if dtype not in _ST_CODES:
            raise ConsolidateError(f"{job} step {step}: key {fqn!r} is {dtype}, which safetensors has no dtype "
                                   "for; convert it before saving, or leave it out with a prefix")
        chosen.append(_Tensor(name, fqn, dtype, shape))
    if not chosen:
        some = ", ".join(repr(f) for f in list(names)[:5])
        raise ConsolidateError(f"{job} step {step} has no tensor" + (
            f" whose key starts with {prefix!r} (its keys: {some}{', ...' if len(names) > 5 else ''})"
            if prefix and names else ""))
    aliases = {a[len(prefix):]: first[len(prefix):] for a, first in _aliases(view.tree_of(0),
                                                                              view.plain_fqns(0)).items()
               if a.startswith(prefix) and first.startswith(prefix)}
    return chosen, aliases


def _aliases(root: Any, fqns: Sequence[str]) -> dict[str, str]:
    """Keys that name a tensor stored under an earlier key (tied weights): alias fqn -> stored fqn."""
    out: dict[str, str] = {}
    stack: list[tuple[Any, tuple[str, ...]]] = [(root, ())]
    while stack:  # no recursion: trees may nest deeply
        node, keys = stack.pop()
        if "T" in node:
            fqn = ".".join(keys)
            if fqn != fqns[node["T"]]:
                out[fqn] = fqns[node["T"]]
        else:
            stack.extend((x, keys if seg is None else keys + (seg,)) for seg, x in tree.children(node))
    return dict(sorted(out.items()))


# --- writing -------------------------------------------------------------------------------


def _plan_shards(tensors: list[_Tensor], limit: int) -> list[list[_Tensor]]:
    """Tensors in order, a new file whenever the next one would take the current one past ``limit``
    (as ``transformers`` shards: a tensor larger than the limit gets a file of its own)."""
    files: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        if files[-1] and size + t.nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(t)
        size += t.nbytes
    return files


def _file_names(count: int) -> list[str]:
    if count == 1:
        return [WEIGHTS_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _header(tensors: list[_Tensor], metadata: Mapping[str, str]) -> tuple[bytes, list[_Tensor]]:
    """The file's header and its tensors in file order: largest element first, so each is aligned."""
    order = sorted(tensors, key=lambda t: -t.dtype.itemsize)
    obj: dict[str, Any] = {"__metadata__": {"format": "pt", **metadata}}
    pos = 0
    for t in order:
        obj[t.name] = {"dtype": _ST_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    return _padded_header(obj), order


def _write_all(view: reshard.StepView, files: list[list[_Tensor]], out: Path, overwrite: bool,
               metadata: Mapping[str, str], bar: _Bar) -> list[str]:
    names = _file_names(len(files))
    temps: list[Path] = []
    try:
        for name, tensors in zip(names, files):
            temps.append(_temp_path(out, name))
            _write_file(view, temps[-1], tensors, metadata, bar)
            bar.file_done(name, tensors)
        weight_map = {t.name: name for name, tensors in zip(names, files) for t in tensors}
        index = {"metadata": {"total_size": sum(t.nbytes for f in files for t in f)},
                 "weight_map": dict(sorted(weight_map.items()))}
        temps.append(_temp_path(out, INDEX_NAME))
        _write_bytes(temps[-1], (json.dumps(index, indent=2) + "\n").encode())
        stale = _existing(out) - set(names) - {INDEX_NAME}
        if overwrite:
            _unlink(out / INDEX_NAME)  # no index while the files change: the old one would name a mixture
        for temp, name in zip(temps, [*names, INDEX_NAME]):
            os.replace(temp, out / name)  # the index last: it is what says the set is whole
        layout.fsync_dir(out)
        for name in stale:  # an earlier output's files that the new index does not name
            _unlink(out / name)
        layout.fsync_dir(out)
    except BaseException:
        for temp in temps:
            _unlink(temp)
        raise
    return [*names, INDEX_NAME]


def _write_file(view: reshard.StepView, path: Path, tensors: list[_Tensor], metadata: Mapping[str, str],
                bar: _Bar) -> None:
    header, order = _header(tensors, metadata)
    with open(path, "xb", buffering=0) as f:
        _write_out(f, memoryview(header))
        for t in order:
            for slab in _slabs(view, t):
                _write_out(f, bytes_of(slab))
                bar.update(slab.numel() * slab.element_size())
        os.fsync(f.fileno())


def _slabs(view: reshard.StepView, t: _Tensor) -> Iterator[torch.Tensor]:
    """The tensor's bytes in order, as CPU tensors of whole rows, each at most SLAB_BYTES (or one row)."""
    if t.nbytes <= SLAB_BYTES or len(t.shape) == 0 or t.shape[0] <= 1:
        yield view.read_full(t.fqn, 0)
        return
    row = t.nbytes // t.shape[0]
    rows = max(1, SLAB_BYTES // max(row, 1))
    for r0 in range(0, t.shape[0], rows):
        n = min(rows, t.shape[0] - r0)
        box: shards.Box = ((r0,) + (0,) * (len(t.shape) - 1), (n,) + t.shape[1:])
        buf = torch.empty(box[1], dtype=t.dtype)
        view.read_box(t.fqn, box, buf, 0)
        yield buf
        del buf


def _write_out(f: Any, data: memoryview) -> None:
    while len(data):
        n = f.write(data)
        data = data[n:]


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "xb", buffering=0) as f:
        _write_out(f, memoryview(data))
        os.fsync(f.fileno())


def _temp_path(out: Path, name: str) -> Path:
    """Hidden, and never matching ``model*.safetensors``: a crash leaves nothing named like a finished file."""
    return out / f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def _existing(out: Path) -> set[str]:
    """Files of an earlier output in ``out``."""
    if not out.is_dir():
        return set()
    return {p.name for p in out.iterdir() if p.name.startswith("model")
            and (p.name.endswith(".safetensors") or p.name == INDEX_NAME)}


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} exists and is not a directory")
    found = sorted(_existing(out))
    if found and not overwrite:
        raise FileExistsError(f"{out} already holds {', '.join(found[:3])}{', ...' if len(found) > 3 else ''}; "
                              "choose another directory, or overwrite (--overwrite)")


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


# --- progress ------------------------------------------------------------------------------


class _Bar:
    """Progress: a tqdm bar of bytes, a line per file, or nothing."""

    def __init__(self, mode: Progress, total: int, what: str) -> None:
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "none"
        self._lines = mode == "lines"
        self._tqdm: Any = None
        if mode == "bar":
            from tqdm import tqdm

            self._tqdm = tqdm(total=total, unit="B", unit_scale=True, desc=what, file=sys.stderr)

    def update(self, n: int) -> None:
        if self._tqdm is not None:
            self._tqdm.update(n)

    def file_done(self, name: str, tensors: list[_Tensor]) -> None:
        if self._lines:
            print(f"wrote {name}: {len(tensors)} tensors, {sum(t.nbytes for t in tensors)} bytes",
                  file=sys.stderr, flush=True)

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._tqdm is not None:
            self._tqdm.close()


def _progress(mode: Progress, total: int, what: str) -> _Bar:
    if mode not in ("auto", "bar", "lines", "none"):
        raise ValueError(f"progress must be 'auto', 'bar', 'lines' or 'none', not {mode!r}")
    return _Bar(mode, total, what)


__all__ = ["Consolidated", "ConsolidateError", "INDEX_NAME", "SLAB_BYTES", "WEIGHTS_NAME", "consolidate",
           "parse_size"]
