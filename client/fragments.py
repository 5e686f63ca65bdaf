"""A sharded step's stored tensors as a reader finds them: each sharded tensor's stored boxes, and each part's
tensor table once its manifest is read.

For :class:`ckptstage.client.reshard.StepView`: the boxes come from the step's
table (the step index's header, or every manifest where there is no index),
in origin order, so the few a read crosses are found by bisection on their
first row among a thousand ranks' fragments; a box becomes a :class:`Source`
(its part's tensor entry) only once that part's manifest is parsed.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, NamedTuple

from ckptstage.client import shards
from ckptstage.protos import layout


@dataclass(frozen=True)
class Source:
    """One stored tensor, resolved: the part it is in, its entry there, and its global offset."""

    rank: int
    entry: layout.TensorEntry
    origin: tuple[int, ...]  # global offset of its element 0


class Fragment(NamedTuple):
    """A stored box of a tensor, before its part's manifest is read: tensor ``number`` of rank ``rank``'s part."""

    rank: int
    number: int
    origin: tuple[int, ...]  # global offset of its element 0 (zeros for a plain tensor)
    shape: tuple[int, ...]


def _fragment(entry: list[Any]) -> Fragment:
    rank, number, origin, shape = entry
    return Fragment(int(rank), int(number), tuple(origin), tuple(shape))


class Boxes:
    """The stored boxes of one sharded tensor: those a box crosses found by bisection on their first row
    (the step's table lists them by origin), not by a scan of every rank's fragment."""

    def __init__(self, table: list[list[Any]]) -> None:
        starts = [e[2][0] if e[2] else 0 for e in table]
        if any(b < a for a, b in zip(starts, starts[1:])):  # a table not in origin order (written by hand)
            table = sorted(table, key=lambda e: e[2][0] if e[2] else 0)
            starts = sorted(starts)
        self._table, self._starts = table, starts
        self._longest = max((e[3][0] if e[3] else 1 for e in table), default=0)
        self._all: list[Fragment] | None = None

    def all(self) -> list[Fragment]:
        if self._all is None:
            self._all = [_fragment(e) for e in self._table]
        return self._all

    def crossing(self, box: shards.Box) -> list[Fragment]:
        """The fragments that may overlap ``box`` (those whose rows can reach it; the caller intersects)."""
        if not box[0]:
            return self.all()
        lo = bisect.bisect_left(self._starts, box[0][0] - self._longest + 1)
        hi = bisect.bisect_left(self._starts, box[0][0] + box[1][0])
        return [_fragment(e) for e in self._table[lo:hi]]


@dataclass
class PartTensors:
    """What a view knows of one rank's part once its manifest is read."""

    manifest: dict[str, Any]
    sources: list[Source]   # tensor number -> where it is
    fqns: list[str]         # tensor number -> fqn
    plain: dict[str, int]   # fqn -> the number of its plain (unsharded) tensor
    ambiguous: set[str]     # fqns two different plain tensors share (keys "a.b" and a -> b)

    @classmethod
    def of(cls, rank: int, manifest: dict[str, Any]) -> PartTensors:
        part = cls(manifest, [], [], {}, set())
        for raw in manifest["tensors"]:
            entry = layout.TensorEntry.from_json(raw)
            fqn = str(raw.get("fqn", entry.name))
            sharded = "global_shape" in raw
            origin = tuple(int(o) for o in raw["global_offset"]) if sharded else (0,) * len(entry.shape)
            part.sources.append(Source(rank, entry, origin))
            part.fqns.append(fqn)
            if sharded:
                continue
            if fqn in part.plain:
                part.ambiguous.add(fqn)  # a tree node finds its tensor by number; by name, it is refused
            else:
                part.plain[fqn] = len(part.fqns) - 1
        return part
