"""Local retention and a drain finishing while it plans: the step's only commit is never the one deleted.

A local copy may go once its step is committed on the shared tier. A drain
marks a part drained when its copy is there, and the step's shared record
follows once every rank's copy is (the seal): in between, the local record
is the step's only commit. A retention pass that read the catalogue before
a drain finished and its drained marks after saw a drained step with no
shared copy in view, took it for one the shared rules had already deleted,
and deleted the local commit; a load of the step then found no record
anywhere until the seal. The pass, in process, against a drain that
finishes exactly between its reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptstage.daemon.catalog.index import Catalog
from ckptstage.daemon.catalog.parts import Part
from ckptstage.daemon.config import load_config
from ckptstage.daemon.metrics import Metrics
from ckptstage.daemon.retention.janitor import Janitor
from ckptstage.daemon.retention.job_rules import JobRules
from ckptstage.daemon.tiers.fs import FsTier
from ckptstage.daemon.tiers.interface import TierName
from ckptstage.protos import layout
from support import booked_part

JOB = "racing"

class DrainFinishingNow:
    """The drain queue as the pass asks it: step 1's part finishes draining at the first question about it
    (its shared copy indexed and marked, as the drainer books a copy), its record not yet written."""

    def __init__(self, catalog: Catalog, shared_copy: Part) -> None:
        self._catalog = catalog
        self._copy = shared_copy
        self.finished = False

    def drained(self, job: str, step: int, rank: int) -> bool:
        if step == 1 and not self.finished:
            self.finished = True
            self._catalog.add(self._copy)
            self._catalog.mark_drained(job, step, rank, self._copy.digest)
        return self._catalog.was_drained(job, step, rank)


def test_a_drain_that_finishes_while_local_retention_plans_never_costs_the_steps_only_commit(tmp_path: Path) -> None:
    local, shared = tmp_path / "local", tmp_path / "shared"
    config = load_config(None, {"local.dir": str(local), "shared.dir": str(shared), "local.keep_last": 1},
                         env={"HOME": str(tmp_path)})
    tiers = {TierName.LOCAL: FsTier(local, "n"), TierName.SHARED: FsTier(shared, "n")}
    catalog = Catalog(tmp_path / "state" / "pins.json")
    for step in (1, 2):
        booked_part(catalog, tiers[TierName.LOCAL], TierName.LOCAL, JOB, step)
    shared_copy = booked_part(Catalog(tmp_path / "elsewhere.json"), tiers[TierName.SHARED], TierName.SHARED, JOB, 1,
                              record=False)  # written; the drain books it in this catalogue as it finishes
    drain: Any = DrainFinishingNow(catalog, shared_copy)
    janitor = Janitor(config, catalog, Metrics(), drain, JobRules(tmp_path / "rules.json", tiers[TierName.SHARED]),
                      lambda job, step, rank: False, tiers=tiers)
    assert janitor.apply(JOB, dry_run=True, local=True, shared=False) == []  # step 1 has no shared record yet
    assert drain.finished
    catalog.set_record(TierName.SHARED, layout.CommitRecord(JOB, 1, "a", 1, 1.0, {  # the seal
        0: layout.CommittedPart(drain._copy.nbytes, drain._copy.digest, 1.0, {})}))
    assert [(a.step, a.tier) for a in janitor.apply(JOB, dry_run=True, local=True, shared=False)] == [
        (1, TierName.LOCAL)]
