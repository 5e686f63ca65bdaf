"""Loading a sharded step into any mesh, placements or world size: boxes filled from fragments.

The step is planned from its index (every sharded tensor's stored boxes, in
one file the commit record vouches for), or where it has none from every
part's manifest; a part's manifest is parsed, and the part opened, when a
read needs it. Each tensor the caller wants is a *box* of a global tensor (a
DTensor's local shard, or the whole tensor), filled from every stored
fragment that overlaps it, reading only the byte range of each fragment that
holds the overlap.
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
from ckptstage.client.fragments import Boxes, Fragment, PartTensors, Source
from ckptstage.client.fileplan import dtype_from_name
from ckptstage.client.pagemem import Prefaulter
from ckptstage.client.partreader import PartReader, Report
from ckptstage.client.restore import bytes_of
from ckptstage.protos import layout

log = logging.getLogger(__name__)

_READERS = 4          # reads in flight (a cold disk wants more than the 2 cores); GIL released in preadv
_PIECE = 32 << 20     # a box is read in row pieces of about this size, so one tensor spreads over the readers


@dataclass
class _Task:
    source: Source
    box: shards.Box          # the overlap, in global coordinates
    out: torch.Tensor        # the target box's tensor (CPU)
    out_origin: tuple[int, ...]


@dataclass
class StepView:
    """Every part of one step: the fragments of each sharded tensor, and each part's plain tensors.

    Planned from the step's index (:class:`layout.StepIndex`) where the commit record vouches for one: a
    part's manifest is parsed, and its file opened (:class:`PartReader`), at the first read from it; a
    rank reading two parts of a thousand-rank step touches two manifests, not a thousand. Without an index
    every part's manifest is read when the view opens."""

    readers: dict[int, PartReader]      # the parts opened so far
    dirs: dict[int, list[Path]] = field(default_factory=dict)           # rank -> its copies, best first
    sharded: dict[str, dict[str, Any]] = field(default_factory=dict)    # fqn -> "fqn", "dtype", global "shape"
    # Asked, before parts are read, for better copies of them (rank -> its copies, best first): see open().
    copies_for: Callable[[Collection[int]], Mapping[int, list[Path]]] | None = None
    report: Report | None = None
    world_size: int = 0
    _index: layout.StepIndex | None = None
    _table: layout.Fragments = field(default_factory=dict)  # fqn -> [[rank, n, origin, shape], ...], as stored
    _boxes: dict[str, Boxes] = field(default_factory=dict)  # the same, made on first use
    _parts: dict[int, PartTensors] = field(default_factory=dict)
    _names: dict[int, dict[str, tuple[torch.dtype, tuple[int, ...]]]] = field(default_factory=dict)
    _opening: threading.Lock = field(default_factory=threading.Lock)  # held while parts are opened or switched

    @classmethod
    def open(cls, locations: dict[int, list[Path]], report: Report | None = None,
             committed: Mapping[Path, str] | None = None, index: layout.StepIndex | None = None,
             copies_for: Callable[[Collection[int]], Mapping[int, list[Path]]] | None = None) -> StepView:
        """The step whose parts have these copies (rank -> part dirs, best first). ``committed``: each part
        directory's manifest digest as the commit record names it (a copy whose manifest differs is a
        corrupt copy). ``index``: the step's index, which the commit record vouches for: the view plans
        from it, and ``locations`` may name only some ranks (the others are asked of ``copies_for``).
        ``copies_for(ranks)``: asked before a read of those ranks' parts, it may name better copies of some
        (the node's own, just fetched), or copies of ranks not located yet; they are read instead, with the
        manifest already verified."""
        view = cls({}, dirs=dict(locations), copies_for=copies_for, report=report, _index=index)
        if index is not None:
            view.world_size, view._table, sharded = index.world_size, index.fragments, index.sharded
        else:
            try:
                for rank, dirs in sorted(locations.items()):  # each manifest read from its best copy that verifies
                    reader = view.readers[rank] = PartReader(rank, dirs, report, committed or {},
                                                             keep_open=_READERS)
                    view._parts[rank] = PartTensors.of(rank, reader.manifest)
            except BaseException:
                view.close()
                raise
            view.world_size = len(locations)
            view._table, sharded = layout.step_table({r: p.manifest for r, p in view._parts.items()})
        view.sharded = {fqn: {"fqn": fqn, **node} for fqn, node in sharded.items()}
        return view

    def _part(self, rank: int) -> PartTensors:
        part = self._parts.get(rank)
        if part is None:
            if self._index is None:
                raise KeyError(f"the step has no part for rank {rank} (world size {self.world_size})")
            part = self._parts[rank] = PartTensors.of(rank, self._index.manifest(rank))
        return part

    def fragments_of(self, fqn: str) -> list[Fragment]:
        """The stored boxes of sharded tensor ``fqn`` (each distinct box once), [] for any other."""
        return self._boxes_of(fqn).all()

    def _boxes_of(self, fqn: str) -> Boxes:
        found = self._boxes.get(fqn)
        if found is None:
            found = self._boxes[fqn] = Boxes(self._table.get(fqn, []))
        return found

    def _source(self, frag: Fragment) -> Source:
        """Where the bytes of ``frag`` are, from its part's manifest (which must agree with the table)."""
        sources = self._part(frag.rank).sources
        src = sources[frag.number] if frag.number < len(sources) else None
        if src is None or src.origin != frag.origin or src.entry.shape != frag.shape:
            raise layout.ManifestError(f"rank {frag.rank}'s part has no tensor {frag.number} at {frag.origin} of "
                                       f"shape {frag.shape}, which the step's table names")
        return src

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.readers.values())

    def tree_of(self, rank: int) -> Any:
        return self._part(rank).manifest["tree"]

    def plain_fqns(self, rank: int) -> list[str]:
        """Rank ``rank``'s part's tensors' fqns, by tensor number (sharded ones too)."""
        return self._part(rank).fqns

    def names(self, tree_rank: int = 0) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Every tensor of the step as ``tree_rank`` sees it, by fqn: (dtype, global shape); plain ones first."""
        if tree_rank in self._names:
            return self._names[tree_rank]
        out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = self._names.setdefault(tree_rank, {})
        part = self._part(tree_rank)
        for fqn in part.fqns:
            n = part.plain.get(fqn)
            if n is not None:
                entry = part.sources[n].entry
                out.setdefault(fqn, (dtype_from_name(entry.dtype), entry.shape))
        for fqn, node in self.sharded.items():
            out[fqn] = (dtype_from_name(str(node["dtype"])), tuple(int(n) for n in node["shape"]))
        return out

    def read_full(self, fqn: str, tree_rank: int = 0) -> torch.Tensor:
        """One whole (unsharded) tensor, assembled from its fragments or ``tree_rank``'s plain copy."""
        dtype, shape = self.names(tree_rank)[fqn]
        tasks: list[_Task] = []
        out = self._fill(fqn, dtype, shape, self._by_name(fqn, tree_rank), _Targets(None), tasks, [], [])
        self._run(tasks)
        return out

    def read_box(self, fqn: str, box: shards.Box, out: torch.Tensor, tree_rank: int = 0) -> None:
        """Fills ``out`` (a CPU tensor of the box's sizes) with ``box`` of tensor ``fqn``, from every overlapping
        fragment (or ``tree_rank``'s plain copy)."""
        tasks = [_Task(self._source(f), part, out, box[0]) for f in self._by_name(fqn, tree_rank)(box)
                 if (part := shards.overlap(box, (f.origin, f.shape))) is not None]
        self._run(tasks)

    def _by_name(self, fqn: str, tree_rank: int) -> Callable[[shards.Box], list[Fragment]]:
        """Where tensor ``fqn``'s boxes are: for a box, the fragments that may cross it (a sharded tensor's), or
        ``tree_rank``'s plain copy."""
        if fqn in self._table:
            return self._boxes_of(fqn).crossing
        part = self._part(tree_rank)
        if fqn in part.ambiguous:
            raise ValueError(f"key {fqn!r} names several tensors of the checkpoint once their key paths are joined "
                             "by dots (e.g. keys 'a.b' and a -> b, or 0 and '0'); rename one to read it by name")
        found = [self._plain(tree_rank, part.plain[fqn])]
        return lambda box: found

    def _plain(self, rank: int, n: int) -> Fragment:
        src = self._part(rank).sources[n]
        return Fragment(rank, n, src.origin, src.entry.shape)

    def _ranks(self) -> list[int]:
        return list(range(self._index.world_size)) if self._index is not None else sorted(self._parts)

    def load(self, tree_rank: int, into: tree.Flat | None, union: bool = False) -> Any:
        """The state of ``tree_rank``'s tree, sharded tensors filled from every part (into ``into``'s where given).

        ``union`` (a load at another world size): sharded tensors that only
        other ranks' trees name (a pipeline stage's layers) are added where
        their key paths lead, so the state holds every sharded tensor (then
        every rank's tree is read; where ``tree_rank``'s names them all, none).
        """
        clash = self._part(tree_rank).ambiguous & set(into.fqns) if into is not None else set()
        if clash:
            self._by_name(sorted(clash)[0], tree_rank)  # raises, naming the key
        wanted = _Targets(into)
        tasks: list[_Task] = []
        done: list[Callable[[], None]] = []
        fresh: list[torch.Tensor] = []  # allocated here (not the caller's): their pages are mapped ahead

        def sharded(node: dict[str, Any]) -> Any:
            fqn = str(node["fqn"])
            dtype, shape = dtype_from_name(str(node["dtype"])), tuple(int(n) for n in node["shape"])
            return self._fill(fqn, dtype, shape, self._boxes_of(fqn).crossing, wanted, tasks, done, fresh)

        loaded: dict[Any, Any] = {}

        def plain(i: int | tuple[int, int]) -> Any:
            if i not in loaded:  # a tensor stored once under several keys (tied weights) is read once
                rank, n = i if isinstance(i, tuple) else (tree_rank, i)  # (rank, n): from a merged subtree
                frag = self._plain(rank, n)  # by number: two tensors may share a joined key path
                dtype = dtype_from_name(self._part(rank).sources[n].entry.dtype)
                loaded[i] = self._fill(self._part(rank).fqns[n], dtype, frag.shape, lambda box: [frag], wanted,
                                       tasks, done, fresh)
            return loaded[i]

        skeleton = self.tree_of(tree_rank)
        if union and not self.sharded.keys() <= {str(d["fqn"]) for d in layout.sharded_nodes(skeleton)}:
            for rank in self._ranks():
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

    def _fill(self, fqn: str, dtype: torch.dtype, shape: tuple[int, ...],
              crossing: Callable[[shards.Box], list[Fragment]], wanted: _Targets, tasks: list[_Task],
              done: list[Callable[[], None]], fresh: list[torch.Tensor]) -> Any:
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
        for frag in crossing(box):
            part = shards.overlap(box, (frag.origin, frag.shape))
            if part is not None:
                tasks.append(_Task(self._source(frag), part, out, box[0]))
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
                    if not self.dirs.get(rank):  # not located: the step was replaced or removed meanwhile
                        raise FileNotFoundError(f"no copy of rank {rank}'s part of the step is known to this "
                                                "node now (replaced or removed since it was located)")
                    self.readers[rank] = PartReader(rank, self.dirs[rank], self.report, keep_open=_READERS,
                                                    manifest=self._part(rank).manifest)
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
        elif next(layout.sharded_nodes(value), None) is not None:
            index[json.dumps(key, sort_keys=True)] = len(merged)
            merged.append([key, _foreign(value, rank)])
    return {tag: merged}


def _foreign(node: Any, rank: int) -> Any:
    """A subtree of rank ``rank``'s tree with its tensor numbers qualified by the rank."""
    if "T" in node:
        return {"T": (rank, node["T"])}
    return tree.map_children(node, lambda x: _foreign(x, rank))


def has_sharded(manifest: dict[str, Any]) -> bool:
    return any("global_shape" in t for t in manifest["tensors"]) or \
        next(layout.sharded_nodes(manifest["tree"]), None) is not None
