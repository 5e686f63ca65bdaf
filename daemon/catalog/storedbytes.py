"""What a job's steps hold on a tier once incremental parts share chunks: stored bytes next to logical ones.

A step's *logical* bytes are its parts' data, as saved. What it *stores* on
a tier differs once parts are incremental (docs/FORMAT.md, "Incremental
parts"): a chunk that several steps name is stored once. Two questions are
asked of that, each answered from the same rows (each part's chunk list,
read from its manifest once per part, since parts never change):

* what a step *added* (:func:`added_bytes`): the chunks no older step on the
  tier names, a chunk the tier keeps compressed counted at what it takes
  there; ``ckptstage ls`` shows it, and the sum over a job's steps is what
  its parts hold there;
* what deleting it would *free* (:func:`~ckptstage.daemon.catalog.chunkstore.stored_bytes`),
  steps deleted oldest first: retention's ``max_bytes`` weighs that.

On the shared tier every node weighs every rank's parts, so there a step's
lists come from its index (:mod:`ckptstage.protos.layout.stepindex`: one
file per step, where reading the manifests is one file per part and per
node, every step), and a step not yet committed there counts its parts whole
until it is (nothing on that tier is weighed by bytes: the lists only feed
``ls`` and the metrics).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from ckptstage.daemon.catalog.parts import Checkpoint
from ckptstage.daemon.tiers.interface import Tier, TierName
from ckptstage.protos import chunks, layout

ChunkList = tuple[tuple[str, int], ...]
Row = tuple[int, int, ChunkList | None]  # (step, a part's logical bytes, its chunks: None when stored whole)


class ChunkLists:
    """Each part's chunk list, per job and tier, read from its manifest once and kept while the part is."""

    def __init__(self, tiers: Mapping[TierName, Tier]) -> None:
        self._tiers = dict(tiers)
        self._lock = threading.Lock()
        self._known: dict[tuple[str, TierName], dict[tuple[Path, int], ChunkList | None]] = {}
        self._added: dict[tuple[str, TierName], int] = {}  # what the job's parts hold there, as last computed

    def rows(self, job: str, tier: TierName, ckpts: Sequence[Checkpoint], read: bool = True) -> list[Row] | None:
        """One row per part of ``ckpts`` on ``tier``; None when the job has no chunk store there (every part
        holds its own bytes). A manifest that fails its checks counts its part whole (read next time); one the
        tier cannot give raises OSError, as retention's pass must then stop. Without ``read`` (an answer that
        must not wait on a tier) every part not read before counts whole."""
        storage = self._tiers.get(tier)
        if storage is None or (read and not storage.has_chunk_store(job)
                               and not storage.has_chunk_store(chunks.USER_STORE)):
            return None
        with self._lock:
            known = dict(self._known.get((job, tier), {}))
        if not read and not known:
            return None
        seen: dict[tuple[Path, int], ChunkList | None] = {}
        rows: list[Row] = []
        for c in ckpts:
            indexed: dict[int, ChunkList | None] | None = None  # the step's lists from its index, read once
            for part in c.on_tier(tier):
                key = (part.path, part.ino)
                if key not in known and (not read or tier == TierName.SHARED and not c.complete_on(tier)):
                    rows.append((c.step, part.nbytes, None))
                    continue
                if key not in known:
                    if tier == TierName.SHARED and indexed is None:
                        indexed = _index_lists(storage, c, tier)
                    try:
                        known[key] = indexed[part.rank] if indexed and part.matches(c.records[tier]) else \
                            _chunk_list(storage.read_manifest(part.path)[0])
                    except layout.ManifestError:
                        rows.append((c.step, part.nbytes, None))  # unreadable now: counted whole, read next time
                        continue
                seen[key] = known[key]
                rows.append((c.step, part.nbytes, seen[key]))
        if read:
            with self._lock:
                self._known[(job, tier)] = seen  # parts gone since leave the cache
        return rows

    def added(self, job: str, tier: TierName, ckpts: Sequence[Checkpoint], read: bool = True) -> dict[int, int]:
        """Per step, the bytes it added on ``tier`` (:func:`added_bytes`; its parts' own bytes when whole);
        ``read``: see :meth:`rows`."""
        rows = self.rows(job, tier, ckpts, read)
        if rows is None:
            rows = [(c.step, p.nbytes, None) for c in ckpts for p in c.on_tier(tier)]
        storage = self._tiers.get(tier)
        coded = {} if storage is None else \
            {**storage.compressed_sizes(chunks.USER_STORE), **storage.compressed_sizes(job)}
        out = added_bytes(rows, coded)
        if read:
            with self._lock:
                self._added[(job, tier)] = sum(out.values())
        return out

    def total(self, tier: TierName, jobs: Iterable[str]) -> int | None:
        """What the parts of ``jobs`` (those the node knows of now) held on ``tier`` when retention last weighed
        each (None: none was weighed yet since the daemon started)."""
        live = set(jobs)
        with self._lock:
            for gone in [key for key in self._added if key[0] not in live]:
                del self._added[gone]
            held = [n for (_, t), n in self._added.items() if t == tier]
        return sum(held) if held else None


def _chunk_list(manifest: dict[str, object]) -> ChunkList | None:
    listed = chunks.manifest_chunks(manifest)
    return None if listed is None else tuple((x.name, x.nbytes) for x in listed)


def _index_lists(storage: Tier, ckpt: Checkpoint, tier: TierName) -> dict[int, ChunkList | None]:
    """Every rank's chunk list from the index that the step's record on ``tier`` names; empty when it names none,
    or the index is gone or fails its checks (each part's manifest is read then)."""
    record = ckpt.records.get(tier)
    if record is None or not record.index_digest:
        return {}
    where = storage.step_location(ckpt.job, ckpt.step)
    try:
        raw = storage.read_step_index(where)
        if raw is None:
            return {}
        index = layout.parse_step_index(raw, where / layout.STEP_INDEX_FILE, record.index_digest)
        return {rank: _chunk_list(index.manifest(rank)) for rank in range(index.world_size)}
    except (OSError, layout.ManifestError):
        return {}


def added_bytes(rows: Iterable[Row], coded: Mapping[str, int] | None = None) -> dict[int, int]:
    """Per step, its whole parts' bytes plus the chunks that no older step (and no other part of the step
    before it) names: what the step added to the tier. Summed over the steps: what the parts hold there.
    ``coded``: the chunks the tier keeps compressed, and what each takes there (the others take their length)."""
    coded = coded or {}
    out: dict[int, int] = {}
    named: set[str] = set()
    for step, nbytes, listed in sorted(rows, key=lambda r: r[0]):
        out.setdefault(step, 0)
        if listed is None:
            out[step] += nbytes
            continue
        for name, length in listed:
            if name not in named:
                named.add(name)
                out[step] += coded.get(name, length)
    return out
