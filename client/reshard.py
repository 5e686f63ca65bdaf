"""Loading a sharded step into any mesh, placements or world size: boxes filled from fragments.

Every part of the step is opened (its manifest read and verified); each
tensor the caller wants is a *box* of a global tensor (a DTensor's local
shard, or the whole tensor), filled from every stored fragment that overlaps
it, reading only the byte range of each fragment that holds the overlap.
Plain (non-DTensor) tensors and values come from one part: the caller's own
rank at the same world size, rank 0's at another (DCP's rule for replicated
state). Reads are verified against the manifest's digest blocks (1 MiB); a
block that a read only partly needs is read whole (it is the unit of
verification) and kept for the next fragment in it. Boxes are read in row
pieces of a few MiB on a few threads, so one large part, or one large
tensor, is read in parallel too. A copy that fails verification is reported
and the part's next copy (normally the shared tier's) is read instead. A part
stored as chunks (:mod:`ckptstage.protos.chunks`) is read through its
extents like a whole one (:class:`extentfiles.ExtentFiles`); the verified reads of
each part are :mod:`ckptstage.client.partreader`'s.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckptstage.client import shards, tree
from ckptstage.client.fileplan import dtype_from_name
from ckptstage.client.pagemem import Prefaulter
from ckptstage.client.partreader import PartReader, Report
from ckptstage.client.restore import bytes_of
from ckptstage.protos import layout

log = logging.getLogger(__name__)

_READERS = 4          # reads in flight (a cold disk wants more than the 2 cores); GIL released in preadv
_PIECE = 32 << 20     # a box is read in row pieces of about this size, so one tensor spreads over the readers


@dataclass(frozen=True)
class Source:
    """One stored tensor that holds part of a global tensor: the box it covers and where its bytes are."""

    rank: int
    entry: layout.TensorEntry
    origin: tuple[int, ...]  # global offset of its element 0


@dataclass
class _Task:
    source: Source
    box: shards.Box          # the overlap, in global coordinates
    out: torch.Tensor        # the target box's tensor (CPU)
    out_origin: tuple[int, ...]


@dataclass
class StepView:
    """Every part of one step, indexed by fqn: the fragments of each sharded tensor, and the plain tensors.

    A part is opened for reading (:class:`PartReader`) at its first read: a rank reading two parts of a
    thousand-rank step makes two readers, not a thousand."""

    readers: dict[int, PartReader]      # the parts opened so far
    manifests: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> its verified manifest
    dirs: dict[int, list[Path]] = field(default_factory=dict)           # rank -> its copies, best first
    fragments: dict[str, list[Source]] = field(default_factory=dict)
    plain: dict[int, dict[str, Source]] = field(default_factory=dict)   # rank -> fqn -> its plain tensor
    plain_index: dict[int, list[str]] = field(default_factory=dict)     # rank -> tensor number -> fqn
    sources: dict[int, list[Source]] = field(default_factory=dict)      # rank -> tensor number -> where it is
    ambiguous: set[str] = field(default_factory=set)  # fqns two different tensors share (keys "a.b" and a -> b)
    sharded: dict[str, dict[str, Any]] = field(default_factory=dict)    # fqn -> the "D" node (dtype, shape)
    # Asked, before parts are read, for better copies of them (rank -> its copies, best first): see open().
    copies_for: Callable[[Collection[int]], Mapping[int, list[Path]]] | None = None
    report: Report | None = None
    _names: dict[int, dict[str, tuple[torch.dtype, tuple[int, ...]]]] = field(default_factory=dict)
    _boxes: dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]] = field(default_factory=dict)  # fqn -> stored
    _opening: threading.Lock = field(default_factory=threading.Lock)  # held while parts are opened or switched

    @classmethod
    def open(cls, locations: dict[int, list[Path]], report: Report | None = None,
             committed: Mapping[Path, str] | None = None,
             manifests: Mapping[int, dict[str, Any]] | None = None,
             copies_for: Callable[[Collection[int]], Mapping[int, list[Path]]] | None = None) -> StepView:
        """Opens every rank's part; ``committed``: each part directory's manifest digest as the commit record
        names it (a copy whose manifest differs is a corrupt copy). ``manifests``: ranks' manifests already
        read and checked against those digests (from the step index): their files are not opened until
        a read needs their bytes. ``copies_for(ranks)``: asked before a read of those ranks' parts, it may
        name better copies of some (the node's own, just fetched); they are read instead, with the manifest
        already verified."""
        view = cls({}, dirs=dict(locations), copies_for=copies_for, report=report)
        known = manifests or {}
        try:
            for rank, dirs in sorted(locations.items()):
                if rank in known:
                    view.manifests[rank] = known[rank]
                else:  # its manifest is read from its best copy that verifies, now
                    reader = view.readers[rank] = PartReader(rank, dirs, report, committed or {},
                                                             keep_open=_READERS)
                    view.manifests[rank] = reader.manifest
        except BaseException:
            view.close()
            raise
        for rank, manifest in sorted(view.manifests.items()):
            view._index(rank, manifest)
        return view

    def _index(self, rank: int, manifest: dict[str, Any]) -> None:
        fqns: list[str] = []
        self.plain[rank] = {}
        self.sources[rank] = []
        for raw in manifest["tensors"]:
            entry = layout.TensorEntry.from_json(raw)
            fqn = str(raw.get("fqn", entry.name))
            fqns.append(fqn)
            self.sources[rank].append(Source(rank, entry, (0,) * len(entry.shape)))
            if "global_shape" in raw:
                src = Source(rank, entry, tuple(int(o) for o in raw["global_offset"]))
                # The same box stored by several ranks (replicas a mesh does not call Replicate, e.g. a
                # module on a sub-mesh): any one copy serves. Looked up, not compared pairwise: a tensor of
                # a thousand-rank step has a thousand fragments.
                seen = self._boxes.setdefault(fqn, set())
                if (src.origin, entry.shape) not in seen:
                    seen.add((src.origin, entry.shape))
                    self.fragments.setdefault(fqn, []).append(src)
            elif fqn in self.plain[rank]:
                self.ambiguous.add(fqn)  # a tree node finds its tensor by number; by name, it is refused
            else:
                self.plain[rank][fqn] = self.sources[rank][-1]
        self.plain_index[rank] = fqns
        for node in _sharded_nodes(manifest["tree"]):
            self.sharded.setdefault(str(node["fqn"]), node)

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.readers.values())

    def tree_of(self, rank: int) -> Any:
        return self.manifests[rank]["tree"]

    def names(self, tree_rank: int = 0) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Every tensor of the step as ``tree_rank`` sees it, by fqn: (dtype, global shape); plain ones first."""
        if tree_rank in self._names:
            return self._names[tree_rank]
        out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = self._names.setdefault(tree_rank, {})
        for fqn in self.plain_index[tree_rank]:
            src = self.plain[tree_rank].get(fqn)
            if src is not None:
                out.setdefault(fqn, (dtype_from_name(src.entry.dtype), src.entry.shape))
        for fqn, node in self.sharded.items():
            out[fqn] = (dtype_from_name(str(node["dtype"])), tuple(int(n) for n in node["shape"]))
        return out

    def read_full(self, fqn: str, tree_rank: int = 0) -> torch.Tensor:
        """One whole (unsharded) tensor, assembled from its fragments or ``tree_rank``'s plain copy."""
        dtype, shape = self.names(tree_rank)[fqn]
        sources = self._by_name(fqn, tree_rank)
        tasks: list[_Task] = []
        out = self._fill(fqn, dtype, shape, sources, _Targets(None), tasks, [], [])
        self._run(tasks)
        return out

    def read_box(self, fqn: str, box: shards.Box, out: torch.Tensor, tree_rank: int = 0) -> None:
        """Fills ``out`` (a CPU tensor of the box's sizes) with ``box`` of tensor ``fqn``, from every overlapping
        fragment (or ``tree_rank``'s plain copy)."""
        sources = self._by_name(fqn, tree_rank)
        tasks = [_Task(src, part, out, box[0]) for src in sources
                 if (part := shards.overlap(box, (src.origin, src.entry.shape))) is not None]
        self._run(tasks)

    def _by_name(self, fqn: str, tree_rank: int) -> list[Source]:
        if fqn in self.ambiguous:
            raise ValueError(f"key {fqn!r} names several tensors of the checkpoint once their key paths are joined "
                             "by dots (e.g. keys 'a.b' and a -> b, or 0 and '0'); rename one to read it by name")
        return self.fragments.get(fqn) or [self.plain[tree_rank][fqn]]

    def load(self, tree_rank: int, into: tree.Flat | None, union: bool = False) -> Any:
        """The state of ``tree_rank``'s tree, sharded tensors filled from every part (into ``into``'s where given).

        ``union`` (a load at another world size): sharded tensors that only
        other ranks' trees name (a pipeline stage's layers) are added where
        their key paths lead, so the state holds every sharded tensor.
        """
        if into is not None and self.ambiguous & set(into.fqns):
            self._by_name(sorted(self.ambiguous & set(into.fqns))[0], tree_rank)  # raises, naming the key
        wanted = _Targets(into)
        tasks: list[_Task] = []
        done: list[Callable[[], None]] = []
        fresh: list[torch.Tensor] = []  # allocated here (not the caller's): their pages are mapped ahead

        def sharded(node: dict[str, Any]) -> Any:
            fqn = str(node["fqn"])
            dtype, shape = dtype_from_name(str(node["dtype"])), tuple(int(n) for n in node["shape"])
            return self._fill(fqn, dtype, shape, self.fragments.get(fqn, []), wanted, tasks, done, fresh)

        loaded: dict[Any, Any] = {}

        def plain(i: int | tuple[int, int]) -> Any:
            if i not in loaded:  # a tensor stored once under several keys (tied weights) is read once
                rank, n = i if isinstance(i, tuple) else (tree_rank, i)  # (rank, n): from a merged subtree
                src = self.sources[rank][n]  # by number: two tensors may share a joined key path
                dtype = dtype_from_name(src.entry.dtype)
                loaded[i] = self._fill(self.plain_index[rank][n], dtype, src.entry.shape, [src], wanted, tasks, done,
                                       fresh)
            return loaded[i]

        skeleton = self.tree_of(tree_rank)
        if union:
            for rank in self.manifests:
                if rank != tree_rank:
                    skeleton = _with_sharded_of(skeleton, self.tree_of(rank), rank)
        state = tree.unflatten(skeleton, plain, sharded)
        missing = wanted.unused()
        if missing:
            raise KeyError(f"the checkpoint has no tensor for key(s) {missing[:10]} of the state to load into "
                           f"({len(missing)} in all)")
        # Fresh tensors' pages are mapped ahead of the readers (first touch costs about as much as the read).
        with Prefaulter(sorted((t.data_ptr(), t.numel() * t.element_size()) for t in fresh)):
            self._run(tasks)
        for finish in done:
            finish()
        return state

    def _fill(self, fqn: str, dtype: torch.dtype, shape: tuple[int, ...], sources: list[Source],
              wanted: _Targets, tasks: list[_Task], done: list[Callable[[], None]],
              fresh: list[torch.Tensor]) -> Any:
        target = wanted.take(fqn)
        if target is None:
            box: shards.Box = ((0,) * len(shape), shape)
            out = torch.empty(shape, dtype=dtype)
            fresh.append(out)
            result: Any = out
        else:
            t_shape = tuple(target.shape)
            if t_shape != shape or target.dtype != dtype:
                raise ValueError(f"cannot load key {fqn!r}: the checkpoint has {dtype} of global shape {list(shape)}, "
                                 f"the state to load into has {target.dtype} of global shape {list(t_shape)}")
            local = target.to_local() if shards.is_dtensor(target) else target
            box = shards.local_box(target) if shards.is_dtensor(target) else ((0,) * len(shape), shape)
            direct = local.device.type == "cpu" and local.is_contiguous()
            out = local if direct else torch.empty(box[1], dtype=dtype)
            if not direct:
                done.append(lambda: local.copy_(out))
            result = target
        covered = 0
        for src in sources:
            part = shards.overlap(box, (src.origin, src.entry.shape))
            if part is not None:
                tasks.append(_Task(src, part, out, box[0]))
                covered += math.prod(part[1])
        if covered != math.prod(box[1]):
            raise layout.ManifestError(f"key {fqn!r}: the checkpoint's fragments cover {covered} of the "
                                       f"{math.prod(box[1])} elements of box {box} (a part is missing or overlaps)")
        return result

    def _run(self, tasks: list[_Task]) -> None:
        """Reads every task: in row pieces of about :data:`_PIECE` bytes, each part's in file order,
        spread over :data:`_READERS` threads (a part's pieces too, so one large part reads in parallel)."""
        by_rank: dict[int, list[_Task]] = defaultdict(list)
        for task in tasks:
            by_rank[task.source.rank].extend(_split(task))
        with self._opening:  # the view may be read from several threads
            if self.copies_for is not None and by_rank:
                self._switch(self.copies_for(by_rank.keys()))
            for rank in by_rank:  # opened here, before the reading threads share them
                if rank not in self.readers:
                    self.readers[rank] = PartReader(rank, self.dirs[rank], self.report, keep_open=_READERS,
                                                    manifest=self.manifests[rank])
        groups: list[list[_Task]] = []
        for rank_tasks in by_rank.values():
            rank_tasks.sort(key=lambda t: (t.source.entry.offset, t.box[0]))
            groups += _runs_of(rank_tasks, _PIECE)
        if len(groups) <= 1:
            for group in groups:
                self._read_group(group)
            return
        with ThreadPoolExecutor(max_workers=min(_READERS, len(groups))) as pool:
            list(pool.map(self._read_group, groups))

    def _switch(self, copies: Mapping[int, list[Path]]) -> None:
        """Reads ``copies`` of those ranks' parts from now on (their manifests are the ones already read)."""
        for rank, dirs in copies.items():
            self.dirs[rank] = dirs
            old = self.readers.pop(rank, None)
            if old is not None:
                old.close()

    def _read_group(self, tasks: list[_Task]) -> None:
        reader = self.readers[tasks[0].source.rank]
        try:
            for task in tasks:
                _read_task(reader, task)
        finally:
            reader.drop_cache()  # memory stays bounded by the threads at work, not by the parts of the step


def _split(task: _Task) -> list[_Task]:
    """The task cut along its box's first dimension into pieces of about :data:`_PIECE` bytes."""
    offsets, sizes = task.box
    if not sizes or sizes[0] <= 1:
        return [task]
    rows = max(1, _PIECE // max(1, math.prod(sizes[1:]) * task.out.element_size()))
    if rows >= sizes[0]:
        return [task]
    return [_Task(task.source, ((offsets[0] + i, *offsets[1:]), (min(rows, sizes[0] - i), *sizes[1:])),
                  task.out, task.out_origin) for i in range(0, sizes[0], rows)]


def _runs_of(tasks: list[_Task], size: int) -> list[list[_Task]]:
    """Consecutive tasks grouped into runs of about ``size`` bytes (small fragments share a group's cache)."""
    runs: list[list[_Task]] = [[]]
    held = 0
    for task in tasks:
        nbytes = math.prod(task.box[1]) * task.out.element_size()
        if runs[-1] and held + nbytes > size:
            runs.append([])
            held = 0
        runs[-1].append(task)
        held += nbytes
    return [r for r in runs if r]


def _read_task(reader: PartReader, task: _Task) -> None:
    entry, box, origin = task.source.entry, task.box, task.source.origin
    dtype = dtype_from_name(entry.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    dest = task.out[shards.box_slices(box, task.out_origin)]
    lo, hi = shards.byte_span(box, origin, entry.shape, itemsize)
    full_rows = box[1][1:] == entry.shape[1:]  # then the byte span is exactly the box, row-major
    if full_rows and dest.is_contiguous():
        reader.read(entry.offset + lo, bytes_of(dest))
        return
    buf = torch.empty((hi - lo) // itemsize, dtype=dtype)
    reader.read(entry.offset + lo, bytes_of(buf))
    strides = [1] * len(entry.shape)
    for d in range(len(entry.shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * entry.shape[d + 1]
    dest.copy_(buf.as_strided(box[1], strides))


class _Targets:
    """The caller's ``into=`` tensors by fqn, each handed out once."""

    def __init__(self, flat: tree.Flat | None) -> None:
        self._by_fqn: dict[str, Any] = {}
        if flat is not None:
            self._by_fqn.update({fqn: t for fqn, t, frag in zip(flat.fqns, flat.tensors, flat.fragments)
                                 if frag is None})
            self._by_fqn.update(flat.dtensors)
        self._taken: set[str] = set()

    def take(self, fqn: str) -> Any:
        target = self._by_fqn.get(fqn)
        if target is not None:
            self._taken.add(fqn)
        return target

    def unused(self) -> list[str]:
        return [fqn for fqn in self._by_fqn if fqn not in self._taken]


def _with_sharded_of(mine: Any, theirs: Any, rank: int) -> Any:
    """``mine`` plus the subtrees of rank ``rank``'s tree ``theirs`` that hold sharded tensors ``mine`` lacks.

    Matched through dict and OrderedDict keys (by their encoded form); a
    subtree taken from ``theirs`` keeps that rank's plain values, and its
    plain tensors become ``{"T": (rank, i)}``: tensor ``i`` of that rank's part.
    """
    if not (isinstance(mine, dict) and isinstance(theirs, dict)):
        return mine
    (tag, items), = mine.items()
    (their_tag, their_items), = theirs.items()
    if tag not in ("d", "o") or their_tag not in ("d", "o"):
        return mine
    merged = [list(item) for item in items]
    index = {json.dumps(k, sort_keys=True): i for i, (k, _) in enumerate(merged)}
    for key, value in their_items:
        at = index.get(json.dumps(key, sort_keys=True))
        if at is not None:
            merged[at][1] = _with_sharded_of(merged[at][1], value, rank)
        elif _sharded_nodes(value):
            index[json.dumps(key, sort_keys=True)] = len(merged)
            merged.append([key, _foreign(value, rank)])
    return {tag: merged}


def _foreign(node: Any, rank: int) -> Any:
    """A subtree of rank ``rank``'s tree with its tensor numbers qualified by the rank."""
    if "T" in node:
        return {"T": (rank, node["T"])}
    return tree.map_children(node, lambda x: _foreign(x, rank))


def _sharded_nodes(node: Any) -> list[dict[str, Any]]:
    """Every "D" node of a tree, without recursion (trees may nest deeply)."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        if "D" in n:
            out.append(n["D"])
        else:
            stack.extend(x for _, x in tree.children(n))
    return out


def has_sharded(manifest: dict[str, Any]) -> bool:
    return any("global_shape" in t for t in manifest["tensors"]) or bool(_sharded_nodes(manifest["tree"]))
