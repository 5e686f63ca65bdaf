"""SharedSync's bookkeeping stays bounded: a whole-job re-read supersedes the one-step re-reads before it."""

from __future__ import annotations

from pathlib import Path

from ckptstage.daemon.catalog.index import Catalog
from ckptstage.daemon.tiers.fs import FsTier
from ckptstage.daemon.drain import sharedsync
from ckptstage.daemon.drain.sharedsync import SharedSync


def test_step_rereads_are_forgotten_once_the_whole_job_is_reread(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    (shared / "job").mkdir(parents=True)
    sync = SharedSync(Catalog(tmp_path / "state" / "pins.json"), FsTier(shared), max_age_s=0.0)
    for step in range(50):  # a WaitStep per step, as a long job makes
        assert sync.fresh("job", step, wait_s=5)
    assert len(sync._synced) == 50
    assert sync.fresh("job", wait_s=5)
    assert list(sync._synced) == [("job", None, sharedsync.EVERYTHING)]
