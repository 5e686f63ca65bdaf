"""The step index: one file a reader plans a whole step from, touching only the parts it reads.

``<shared tier>/<job>/step-N/index.json`` is written by the node that seals the
step, before its commit record, which names the index's digest
(``index_xxh3_64``): an index whose digest the record names is as trusted as
the record; any other (left by an earlier commit of the step, or damaged) is
not used, and the reader opens each part's ``manifest.json`` instead. The file:

* a header line (compact JSON): ``format``, ``kind`` ("index"), ``version``
  (2), ``job``, ``step``, ``attempt``, ``world_size``; ``manifests``: W + 1
  byte offsets (from the line after the header), rank r's manifest file lying
  between the r-th and the next; ``fragments``: fqn -> ``[[rank, n, origin, shape], ...]``, each
  distinct stored box of a sharded tensor once, in origin order (tensor ``n``
  of that rank's manifest; the lowest rank where several store the same
  box); ``sharded``:
  fqn -> ``{"dtype", "shape"}`` of every sharded tensor any rank's tree names;
* every part's ``manifest.json``, byte for byte, in rank order;
* the ``xxh3_64:`` line of everything before it.

A reader of a thousand-rank step parses the header (a few bytes per
fragment) and only the manifests of the parts it reads: planning costs what the
tensors' table costs, not W manifests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptstage.protos.layout.checksums import chunk_digest
from ckptstage.protos.layout.manifest import verified_body, manifest_file_bytes, parse_manifest_file, with_trailer
from ckptstage.protos.layout.names import CHECKSUM, FORMAT, ManifestError

# Largest step index written or read: past it readers open the parts' manifests (a step of thousands of
# ranks whose manifests each list thousands of tensors).
MAX_STEP_INDEX_BYTES = 256 << 20
INDEX_VERSION = 2

Fragments = dict[str, list[list[Any]]]  # fqn -> [[rank, n, origin, shape], ...]
Sharded = dict[str, dict[str, Any]]    # fqn -> {"dtype": ..., "shape": [...]}


def sharded_nodes(tree: Any) -> Iterator[dict[str, Any]]:
    """Every ``"D"`` node (a sharded tensor: ``fqn``, ``dtype``, global ``shape``) of a manifest's tree, without
    recursion (trees may nest deeply). Any one-key object ``{"D": {...}}`` of the tree's JSON is one: the
    encoding puts a state's own keys in lists, never as object keys."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            d = node.get("D") if len(node) == 1 else None
            if isinstance(d, dict):
                yield d
            else:
                stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def step_table(manifests: Mapping[int, dict[str, Any]]) -> tuple[Fragments, Sharded]:
    """The fragments and sharded tensors of a step whose parts have these (verified) ``manifests``, as
    the index's header holds them: what a reader of any box looks up."""
    fragments: Fragments = {}
    seen: dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    sharded: Sharded = {}
    for rank, manifest in sorted(manifests.items()):
        for n, t in enumerate(manifest["tensors"]):
            if "global_shape" not in t:
                continue
            fqn = str(t.get("fqn", t["name"]))
            origin, shape = tuple(int(o) for o in t["global_offset"]), tuple(int(s) for s in t["shape"])
            # The same box stored by several ranks (replicas a mesh does not call Replicate): one serves.
            boxes = seen.setdefault(fqn, set())
            if (origin, shape) not in boxes:
                boxes.add((origin, shape))
                fragments.setdefault(fqn, []).append([rank, n, list(origin), list(shape)])
        for node in sharded_nodes(manifest["tree"]):
            sharded.setdefault(str(node["fqn"]), {"dtype": str(node["dtype"]),
                                                  "shape": [int(s) for s in node["shape"]]})
    for stored in fragments.values():
        stored.sort(key=lambda e: e[2])  # in origin order: a reader finds those its box crosses by bisection
    return fragments, sharded


def step_index_bytes(job: str, step: int, attempt: str, world_size: int, manifests: Mapping[int, dict[str, Any]],
                     digests: Mapping[int, str]) -> bytes | None:
    """``index.json`` for the step whose parts have these ``manifests`` (rank -> parsed manifest); None when
    one of them does not re-encode to the file its digest names (nothing to vouch with) or it would be too
    large to be worth reading. Its digest (:func:`step_index_digest`) goes into the step's commit record."""
    if sorted(manifests) != list(range(world_size)):
        return None  # a commit names every rank of its world
    files: list[bytes] = []
    offsets = [0]
    for rank, manifest in sorted(manifests.items()):
        file = manifest_file_bytes(manifest)
        if chunk_digest(file) != digests.get(rank):
            return None
        files.append(file)
        offsets.append(offsets[-1] + len(file))
    fragments, sharded = step_table(manifests)
    header = json.dumps({"format": FORMAT, "kind": "index", "version": INDEX_VERSION, "job": job, "step": step,
                         "attempt": attempt, "world_size": world_size, "manifests": offsets,
                         "fragments": fragments, "sharded": sharded}, sort_keys=True, separators=(",", ":"))
    raw = with_trailer(header.encode() + b"\n" + b"".join(files))
    return raw if len(raw) <= MAX_STEP_INDEX_BYTES else None


def step_index_digest(raw: bytes) -> str:
    """The digest a commit record names for the index ``raw`` (that of everything before its trailer)."""
    return raw[:-1].rpartition(b"\n")[2].decode().removeprefix(f"{CHECKSUM}:")


def read_step_index_file(path: Path) -> bytes:
    """A step index file's bytes, at most :data:`MAX_STEP_INDEX_BYTES` + 1 (so a larger one parses as too
    large); FileNotFoundError when there is none."""
    with open(path, "rb") as f:
        return f.read(MAX_STEP_INDEX_BYTES + 1)


@dataclass
class StepIndex:
    """A step index whose digest its commit record names: the step's table, and each part's manifest on
    demand (parsed at the first ask, from the index's own bytes)."""

    path: Path
    world_size: int
    fragments: Fragments
    sharded: Sharded
    _body: bytes
    _offsets: list[int]
    _manifests: dict[int, dict[str, Any]] = field(default_factory=dict)

    def manifest(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s manifest, as its part's ``manifest.json`` reads; ManifestError when it has none."""
        found = self._manifests.get(rank)
        if found is None:
            if not 0 <= rank < self.world_size:
                raise ManifestError(f"{self.path}: the step index has no manifest for rank {rank}")
            raw = self._body[self._offsets[rank]:self._offsets[rank + 1]]
            found = self._manifests[rank] = parse_manifest_file(raw, self.path)
            if found.get("rank") != rank:
                raise ManifestError(f"{self.path}: the step index's manifest for rank {rank} is rank "
                                    f"{found.get('rank')!r}'s")
        return found


def parse_step_index(raw: bytes, path: Path, digest: str) -> StepIndex:
    """The index in ``raw``, which must be the one whose digest the commit record names (``digest``); raises
    :class:`ManifestError` naming what does not hold."""
    if len(raw) > MAX_STEP_INDEX_BYTES:
        raise ManifestError(f"{path}: step index of {len(raw)} bytes exceeds {MAX_STEP_INDEX_BYTES}")
    body = verified_body(raw, path, "step index")
    if step_index_digest(raw) != digest:
        raise ManifestError(f"{path}: not the step index the commit record names ({digest or 'none'})")
    end = body.find(b"\n")
    try:
        header = json.loads(body[:end])
    except ValueError as e:
        raise ManifestError(f"{path}: step index header is not valid JSON: {e}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("kind") != "index" or \
            header.get("version") != INDEX_VERSION:
        raise ManifestError(f"{path}: not a version {INDEX_VERSION} {FORMAT} step index")
    offsets, fragments, sharded = header.get("manifests"), header.get("fragments"), header.get("sharded")
    world = header.get("world_size")
    if not (type(world) is int and isinstance(offsets, list) and len(offsets) == world + 1
            and isinstance(fragments, dict) and isinstance(sharded, dict)):
        raise ManifestError(f"{path}: step index header lacks its manifests, fragments or sharded table")
    return StepIndex(path, world, fragments, sharded, body[end + 1:], offsets)
