"""Sealing a step on the shared tier: its commit record written once, by one node, at a cost linear in the job.

Every node drains its own ranks' parts to the one shared tier; the step
exists there once its commit record names every rank's part of one attempt
(:mod:`ckptstage.daemon.catalog.commits`). Who writes it, and what that costs
the shared file system's metadata server, is this module's job. For a step of
W ranks drained by N nodes:

* **Once per node, not per part.** A node looks at the step when it has
  published its whole share of it (no other part of the step queued or in
  copy there: :meth:`DrainQueue.copied <ckptstage.daemon.drain.queue.DrainQueue.copied>`),
  with one listing of the step (names only, no part opened). While a rank's
  part is missing it stops there: the node that publishes last finds them all.
  N listings per step.
* **One reader of the W manifests.** The node that finds every part claims
  the step (:data:`layout.SEAL_CLAIM_FILE`, created exactly once across
  nodes), reads each part's manifest once (a record is forever, so it pins the
  manifests themselves, not what an index says of them), writes them all into
  the step index (:mod:`ckptstage.protos.layout.stepindex`: a reader of
  another world size opens that one file, not W manifests) and then the
  record. Nodes that find every part at the same moment lose the claim and
  leave the step to its holder. W manifest reads per step, not W per node.
* **The claim is a hint, never a lock.** Its holder gives it back when it
  cannot seal (parts of two attempts, a part replaced in place still
  draining, chunks another node's sweep took), then looks once more, since a
  node that published meanwhile may have lost the claim to it. A holder that
  dies mid-way leaves a claim nobody honours at recovery: a daemon starting
  seals every step it finds whole (:meth:`Commits.seal_all`), claim or not.

What the others learn of the step comes from its record, which names every
part (size, digest, when it was saved, its metrics): indexing it costs them
one listing and one read, never the W manifests (:meth:`Part.from_record
<ckptstage.daemon.catalog.index.Part.from_record>`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from ckptstage.daemon.catalog.index import Catalog, Part, TierName
from ckptstage.daemon.logs import fields
from ckptstage.daemon.tiers.interface import Manifest, Tier
from ckptstage.protos import chunks, layout

log = logging.getLogger(__name__)

# How many times a node that gave its claim back looks at the step again (see the module docstring).
_LOOKS = 3

Publish = Callable[[str, int, str, int, dict[int, Part], str], "layout.CommitRecord | None"]


def complete_attempt(parts: list[Part]) -> tuple[str, int, dict[int, Part]] | None:
    """The attempt of which ``parts`` (one tier's parts of one step) hold every rank, if any.

    Returns (attempt, world size, rank -> part). Parts of different attempts
    never add up: each attempt must hold ranks 0..world_size-1 by itself.
    """
    by_attempt: dict[str, dict[int, Part]] = {}
    for p in parts:
        by_attempt.setdefault(p.attempt, {})[p.rank] = p
    for attempt, ranks in sorted(by_attempt.items()):
        sizes = {p.world_size for p in ranks.values()}
        if len(sizes) == 1:
            world = sizes.pop()
            if all(r in ranks for r in range(world)):
                return attempt, world, {r: ranks[r] for r in range(world)}
    return None


class SharedSeal:
    """Writes shared commit records: looks at a step once per node, reads its manifests on one node."""

    def __init__(self, catalog: Catalog, shared: Tier, publish: Publish,
                 replaced_here: Callable[[str, int, str, dict[int, Part]], list[int]]) -> None:
        """``publish(job, step, attempt, world, parts)`` creates the record (exactly once) and indexes it;
        ``replaced_here`` names the ranks whose part this node holds a newer version of (see
        :meth:`Commits._replaced_here <ckptstage.daemon.catalog.commits.Commits>`)."""
        self.catalog = catalog
        self.shared = shared
        self._publish = publish
        self._replaced_here = replaced_here

    def seal(self, job: str, step: int, world: int | None) -> layout.CommitRecord | None:
        """The step's record on the shared tier once it is written (here or by another node), else None.

        ``world`` None (recovery at start): no listing shortcut and no claim,
        every whole step found is sealed.
        """
        ckpt = self.catalog.get(job, step)
        if ckpt is not None and TierName.SHARED in ckpt.records:
            return ckpt.records[TierName.SHARED]
        for _ in range(_LOOKS):
            listed = self.shared.list_step(job, step)
            if listed is None:
                return None
            if listed.record_ino is not None:  # another node sealed it: index it, from its record
                self.catalog.sync_job(TierName.SHARED, self.shared, job, step)
                return self.catalog.record(job, step, TierName.SHARED)  # None: there, not trusted (logged)
            if world is None:
                return self._seal_listed(job, step, listed)
            if {p.rank for p in listed.parts} < set(range(world)):
                return None  # a rank's part is on its way: its node seals when it is done
            if not self.shared.claim_seal(listed.path):
                return None  # another node found them all first, and seals
            try:
                sealed = self._seal_listed(job, step, listed)
            finally:
                self._release(job, step, listed.path)
            if sealed is not None:
                return sealed
            again = self.shared.list_step(job, step)
            if again is None or {(p.rank, p.ino) for p in again.parts} == {(p.rank, p.ino) for p in listed.parts}:
                return None  # nothing changed while the claim was held: nobody lost it to us
        return None

    def _release(self, job: str, step: int, where: Path) -> None:
        """Gives the claim back; a tier that fails that now leaves it for the step's removal (or, for a step
        not sealed, for a daemon's recovery at start), and the seal's outcome stands."""
        try:
            self.shared.release_seal(where)
        except OSError as e:
            log.warning("cannot remove the seal claim of %s step %d on the shared tier: %s", job, step, e,
                        extra=fields(job=job, step=step, tier=TierName.SHARED, error=e))

    def _seal_listed(self, job: str, step: int, listed: layout.StepRef) -> layout.CommitRecord | None:
        """Reads each listed part's manifest once and writes the record if they make one attempt whole."""
        read: list[Part] = []
        manifests: dict[int, Manifest] = {}
        for ref in listed.parts:
            try:
                manifests[ref.rank], digest = self.shared.read_manifest(ref.path)
            except layout.ManifestError as e:
                log.warning("not sealing %s step %d on the shared tier: rank %d there is unreadable: %s", job, step,
                            ref.rank, e, extra=fields(job=job, step=step, rank=ref.rank, tier=TierName.SHARED))
                return None
            read.append(Part.from_manifest(ref, TierName.SHARED, manifests[ref.rank], digest))
        for part in read:
            self.catalog.add(part)
        found = complete_attempt(read)
        if found is None:
            return None
        attempt, world, parts = found
        stale = self._replaced_here(job, step, attempt, parts)
        if stale:
            log.info("not sealing %s step %d on the shared tier yet: ranks %s there are older than this node's "
                     "(replaced in place; the new parts are draining)", job, step, stale,
                     extra=fields(job=job, step=step, tier=TierName.SHARED))
            return None
        for rank in parts:
            names = chunks.referenced(manifests[rank])  # none: the part was written whole
            gone = self.shared.missing_chunks(chunks.store_key(manifests[rank]), names) if names else []
            if gone:
                # Another node's sweep took a chunk before this part was published; its drain puts it
                # back, then seals the step itself. Until then the step must not exist.
                log.info("not sealing %s step %d on the shared tier yet: rank %d lacks %d chunks there",
                         job, step, rank, len(gone),
                         extra=fields(job=job, step=step, rank=rank, tier=TierName.SHARED))
                return None
        index = self._write_index(job, step, attempt, world, listed, parts, manifests)
        return self._publish(job, step, attempt, world, parts, index)

    def _write_index(self, job: str, step: int, attempt: str, world: int, listed: layout.StepRef,
                     parts: dict[int, Part], manifests: dict[int, Manifest]) -> str:
        """The step index, before the record (which names its digest, returned; "" when none is written), on
        every tier: a reader plans from the node's copy of it and opens (or fetches) only the parts it reads."""
        index = layout.step_index_bytes(job, step, attempt, world, {r: manifests[r] for r in parts},
                                        {r: p.digest for r, p in parts.items()})
        if index is None:
            return ""
        self.shared.write_step_index(listed.path, index)
        return layout.step_index_digest(index)
