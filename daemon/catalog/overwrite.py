"""Replacing a committed step (``save(..., overwrite=True)``): the old step stays until the new one is whole.

A committed step is never written over in place. The replacement's parts
are committed on a tier into its staging area for the step
(:meth:`Tier.staged_location <ckptstage.daemon.tiers.interface.Replacing.staged_location>`:
on the file-system tier ``<tier>/.tmp/<node>/replace/<job>/step-N/rank-R/``),
and once every rank's part of the replacement is there, the tier swaps the
whole step in with its new commit record (:meth:`Tier.swap_in
<ckptstage.daemon.tiers.interface.Replacing.swap_in>`), and the old step goes.

Crash safety follows from one rule the tier applies on start, before its
temporaries are removed (:meth:`Tier.recover_staged
<ckptstage.daemon.tiers.interface.Replacing.recover_staged>`): a staged step with a
commit record becomes the step only if no step is in place (the crash fell
between taking the old one out and putting the new one in); otherwise the
step in place is the one that stays (the staged one was never acknowledged
as the step, or it is the old one swapped out). At every point exactly one
of the two is there after recovery.

Replacing needs the whole replacement on one daemon per tier: on the local
tier, every rank of the job saves through this daemon (a single-node job);
on the shared tier, this daemon drains every part of it (they are its local
parts). A step saved from several nodes cannot be replaced in place: delete
it, or save a new step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from ckptstage.daemon.catalog.index import Catalog, Part, TierName
from ckptstage.daemon.logs import fields
from ckptstage.daemon.tiers.interface import Tier
from ckptstage.protos import layout

log = logging.getLogger(__name__)


def staged_parts(storage: Tier, tier: TierName, job: str, step: int) -> list[Part]:
    """The replacement's parts committed so far on a tier (unreadable ones skipped)."""
    out = []
    for ref in storage.list_staged(job, step):
        try:
            out.append(Part.read(ref, tier, storage))
        except (OSError, layout.ManifestError) as e:
            log.warning("ignoring the staged part %s: %s", ref.path, e,
                        extra=fields(job=job, step=step, rank=ref.rank, tier=tier, error=e))
    return out


class Swapper:
    """Puts a whole staged replacement in place of a step on a tier, and tells the catalogue."""

    def __init__(self, catalog: Catalog, tiers: Mapping[TierName, Tier]) -> None:
        self.catalog = catalog
        self.tiers = dict(tiers)
        # One swap at a time per tier (two threads may complete the same set); never across tiers, so
        # that a swap on a hung shared tier holds up no local one.
        self._locks = {tier: threading.Lock() for tier in self.tiers}

    def swap_in(self, tier: TierName, record: layout.CommitRecord, parts: dict[int, Part]) -> list[Part]:
        """Makes the staged replacement the step on ``tier``, with ``record``; returns the new parts.

        ``parts`` are the staged parts ``record`` names (rank -> part).
        Returns [] when another thread swapped this replacement in already.
        """
        job, step = record.job, record.step
        storage = self.tiers[tier]
        with self._locks[tier]:
            if not storage.swap_in(record):
                return []
            moved = [Part(job, step, rank, part.world_size, tier, where, part.nbytes, part.created, part.metrics,
                          part.attempt, part.digest, storage.part_version(where))
                     for rank, part in sorted(parts.items())
                     for where in [storage.part_location(job, step, rank)]]
            version = storage.record_version(storage.step_location(job, step))
            self.catalog.replace_tier(tier, record, version, moved)
        log.info("replaced %s step %d on the %s tier: %d ranks of attempt %r", job, step, tier.value,
                 record.world_size, record.attempt, extra=fields(job=job, step=step, tier=tier, attempt=record.attempt))
        return moved
