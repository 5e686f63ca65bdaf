"""Finding a complete step and opening all of its parts: what every multi-part reader starts with.

``Client.load`` of a sharded state, ``ckptstage consolidate`` and the DCP
reader all need the same thing: the daemon's answer to where every rank's
part of one step lies (best copy first), and a :class:`reshard.StepView`
over them whose verification failures are reported to the daemon.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ckptstage.client import errors, reshard, stepindex
from ckptstage.client.progress import size_text
from ckptstage.client.rpc import FETCH_TIMEOUT_S, Connection
from ckptstage.protos.v1 import ckptstage_pb2 as pb

log = logging.getLogger(__name__)

# A fetched part can go again before the reader opens it (retention on a full disk): ask this many times.
_FETCH_ROUNDS = 3

@dataclass(frozen=True)
class LocatedStep:
    """A complete step as the daemon answered it: every rank's part copies, best first."""

    job: str
    step: int
    world_size: int
    attempt: str
    parts: dict[int, list[tuple[pb.Tier, Path]]]  # rank -> [(tier, part dir)]: the copies on disk
    commit: str = ""  # the commit the answer comes from: another value later means the step was replaced
    memory: dict[int, Path] = field(default_factory=dict)  # rank -> handoff socket of its memory-tier copy
    # part dir -> the digest of its manifest.json that the commit record names ("" where not said)
    digests: dict[Path, str] = field(default_factory=dict)
    index: Path | None = None  # this node's copy of the step's index (asked for with step_index)
    index_digest: str = ""     # its digest as the commit record names it

    @property
    def every_part(self) -> bool:
        """Whether every rank's part is listed with a copy a reader can open (else the index names them,
        or a part must be fetched first)."""
        return len(self.parts) == self.world_size and all(self.parts.values())

    def tree_rank(self, rank: int, world_size: int) -> int:
        """Whose plain values a reader gets: its own rank's at the saving world size, else rank 0's."""
        return rank if world_size == self.world_size else 0


def locate(conn: Connection, job: str, step: int | None, rank: int = 0, all_ranks: bool = True,
           memory: bool = False, ranks: Sequence[int] = (), node_copy: bool = False,
           step_index: bool = False) -> LocatedStep:
    """Where the parts of ``step`` (the newest complete one when None) lie: every rank's (only ``ranks``'
    when given), or only ``rank``'s (a whole-part load need not hear of a thousand others); raises
    CheckpointNotFound. ``memory``: also where the memory tier keeps them (:attr:`LocatedStep.memory`).

    Parts whose only copies are where a reader cannot open them (an object store) are fetched onto
    the node's local tier first, verified, by the daemon (``Prefetch`` of just those ranks); with
    ``node_copy`` (other ranks of this node read the same parts) so is every part the node holds no
    copy of, so that the node reads it from the shared tier once. With ``step_index`` nothing is fetched:
    the reader plans from the node's copy of the step's index (:attr:`LocatedStep.index`; where there is
    one, only ``rank``'s part is listed) and asks for the parts it reads (:class:`OpenStep`)."""
    request = pb.LocateRequest(job=job, rank=rank, latest=step is None, step=step or 0, all_ranks=all_ranks,
                               memory=memory, ranks=list(ranks), node_copy=node_copy, step_index=step_index)
    resp = conn.call("Locate", request)
    for _ in range(_FETCH_ROUNDS):
        if not resp.fetch_ranks:
            break
        log.info("fetching %d part(s) of %s step %d (%s) onto this node (from the shared tier or another node)",
                 len(resp.fetch_ranks), job, resp.step, size_text(resp.fetch_bytes))
        try:
            conn.call("Prefetch", pb.PrefetchRequest(job=job, step=resp.step, ranks=resp.fetch_ranks),
                      timeout=FETCH_TIMEOUT_S)
        except errors.CkptStageError as e:
            if not request.node_copy:
                raise  # nothing else can be read
            # A node copy is an economy, not a need (the local tier full, say): read the shared files.
            log.warning("cannot copy %d part(s) of %s step %d onto this node (%s): reading them where they are",
                        len(resp.fetch_ranks), job, resp.step, e)
            request.node_copy = False
        request.latest, request.step = False, resp.step  # the step whose parts were fetched
        resp = conn.call("Locate", request)
    by_rank = {p.rank: p.locations for p in resp.parts}
    if not all_ranks and resp.locations:
        by_rank[rank] = resp.locations
    parts: dict[int, list[tuple[pb.Tier, Path]]] = {}
    kept: dict[int, Path] = {}
    digests: dict[Path, str] = {}
    for r, locs in by_rank.items():  # each path made once: a W-rank step names thousands
        copies = parts[r] = []
        for loc in locs:
            path = Path(loc.dir)
            if loc.tier == pb.MEMORY:
                kept[r] = path
            else:
                copies.append((loc.tier, path))
                digests[path] = loc.manifest_digest
    return LocatedStep(job, int(resp.step), int(resp.world_size), resp.attempt, parts, resp.commit, kept, digests,
                       Path(resp.step_index) if resp.step_index else None, resp.step_index_digest)


class OpenStep:
    """A located step with every part open for verified reads; close it (or use ``with``).

    Located with ``step_index`` (:func:`locate`), a part no reader can open (an object store's) is
    fetched onto the node's local tier only when the view first reads it. ``node_copy``: the reader
    loads at another world size than the step's, so other ranks of its node most likely read the same
    parts: a part whose best copy is the shared tier's is copied too (once for the whole node, however
    many ranks ask) and the view reads that copy (:meth:`_copies_to_read`).
    """

    def __init__(self, conn: Connection, located: LocatedStep, node_copy: bool = False) -> None:
        index = stepindex.read_index(located.index, located.index_digest)
        if index is None and not located.every_part:
            # Nothing to plan from but each part's manifest, and some parts are not listed or cannot be
            # opened where they are: every part is located (and fetched) now.
            located = locate(conn, located.job, located.step)
        self.located = located
        self.conn = conn  # also how a reader holds a LoadLease while it reads (the DCP Reader)
        self._node_copy = node_copy
        self._asked: set[int] = set()  # ranks whose copy was asked for (once each)
        self._lock = threading.Lock()  # a view may be read from several threads
        self.view = reshard.StepView.open({r: [d for _, d in locs] for r, locs in located.parts.items()},
                                          self._report, located.digests, index, self._copies_to_read)

    def _copies_to_read(self, ranks: Collection[int]) -> Mapping[int, list[Path]]:
        """The copies to read of those of ``ranks`` that are not listed yet (the step's index named them),
        have no copy a reader can open (an object store's), or (``node_copy``) whose best is the shared
        tier's, once the daemon has put them on this node's local tier; {} when none needs it, when the
        copy failed (a shared file is read where it is) or when the step changed meanwhile."""
        with self._lock:
            return self._copy_to_node(ranks)

    def _copy_to_node(self, ranks: Collection[int]) -> Mapping[int, list[Path]]:
        located = self.located

        def wanted(r: int) -> bool:  # not listed (the index names it), no copy a reader can open, or
            copies = located.parts.get(r)  # (node_copy) only the shared tier's
            return not copies or self._node_copy and copies[0][0] == pb.SHARED

        remote = sorted(r for r in ranks if r not in self._asked and wanted(r))
        if not remote:
            return {}
        self._asked.update(remote)
        try:
            again = locate(self.conn, located.job, located.step, all_ranks=True, ranks=remote,
                           node_copy=self._node_copy)
        except errors.CkptStageError as e:  # the local tier full, say: a shared file is read where it is
            log.warning("%s step %d: cannot copy %d part(s) onto this node: %s", located.job, located.step,
                        len(remote), e)
            return {}
        if again.commit != located.commit:
            return {}  # replaced meanwhile: the reads find out and the load starts again
        self.located = replace(located, parts={**located.parts, **again.parts},
                               digests={**located.digests, **again.digests})
        return {r: [d for _, d in again.parts[r]] for r in remote if again.parts.get(r)}

    def _report(self, rank: int, copy: int, detail: str) -> None:
        """A copy failed verification: the daemon re-reads it and quarantines it only if its own read fails."""
        located = self.located
        self.conn.call("ReportCorrupt", pb.ReportCorruptRequest(
            job=located.job, step=located.step, rank=rank, tier=located.parts[rank][copy][0], detail=detail))

    def close(self) -> None:
        self.view.close()

    def __enter__(self) -> OpenStep:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_step(conn: Connection, job: str, step: int | None, rank: int = 0,
              world_size: int | None = None) -> OpenStep:
    """The step open for reads by ``rank`` of a job now ``world_size`` ranks (None: unknown): at another
    world size than the step's, the node reads each part it needs from the shared tier once."""
    located = locate(conn, job, step, rank, step_index=True)
    return OpenStep(conn, located, node_copy=world_size is not None and world_size != located.world_size)


def complete_steps(conn: Connection, job: str, most: int = 256) -> list[int]:
    """The daemon's complete steps of ``job``, newest first (at most ``most``)."""
    if most == 1:
        try:
            resp = conn.call("Locate", pb.LocateRequest(job=job, latest=True, rank=0, memory=True))
        except errors.CheckpointNotFound:
            return []
        return [int(resp.step)]
    listed = conn.call("ListCheckpoints", pb.ListRequest(job=job, memory=True)).checkpoints
    return sorted((c.step for c in listed if c.complete), reverse=True)[:most]
