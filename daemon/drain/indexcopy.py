"""The shared tier's step indexes, copied onto local SSD for this node's readers: each read once per node.

A reader that needs every part of a step (another world size, DCP's
planner) reads the step's index (:mod:`ckptstage.protos.layout.stepindex`),
which lists all W manifests. Read by each rank from the shared tier, that is
W indexes of W manifests per step: eight copies per node on a file system,
and none at all on an object store, which a reader cannot open. So the
daemon copies it once per node into ``<local>/.state/step-index/`` and
answers that path (``Locate`` with ``step_index``); the readers check every
manifest in it against the commit record, as they would the shared copy. A
file is named by the step's commit fingerprint, so a step replaced later
gets a new copy; the newest :data:`KEEP` copies stay, the older are removed.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from ckptstage.daemon import fsutil
from ckptstage.daemon.tiers.interface import Tier

log = logging.getLogger(__name__)

KEEP = 32  # index copies kept on the local tier (the steps being read now, and a few before)
DIR = "step-index"


class IndexCopies:
    """This node's copies of step indexes in ``directory`` (under the local tier's ``within``)."""

    def __init__(self, shared: Tier, directory: Path, within: Path) -> None:
        self._shared = shared
        self._dir = directory
        self._within = within
        self._lock = threading.Lock()
        self._fetching: dict[str, threading.Lock] = {}

    def path_of(self, job: str, step: int, fingerprint: str) -> Path | None:
        """The node's copy of the index of ``step`` as committed with ``fingerprint``, copied now if it is not
        here yet (one copy however many readers ask at once); None when the shared tier has none or cannot
        be read (the reader then opens each part's manifest)."""
        name = f"{job}.{step}.{fingerprint}.json"
        path = self._dir / name
        with self._lock:
            fetching = self._fetching.setdefault(name, threading.Lock())
        with fetching:
            try:
                if path.exists():
                    return path
                raw = self._shared.read_step_index(self._shared.step_location(job, step))
                if raw is None:
                    return None
                fsutil.makedirs_durable(self._dir, within=self._within)
                fsutil.write_atomic(path, raw, within=self._within)
            except OSError as e:
                log.warning("cannot copy the step index of %s step %d onto the local tier (readers open each "
                            "part's manifest instead): %s", job, step, e)
                return None
            finally:
                with self._lock:
                    self._fetching.pop(name, None)
        self._prune()
        return path

    def _prune(self) -> None:
        """Removes all but the :data:`KEEP` newest copies."""
        try:
            entries = sorted(os.scandir(self._dir), key=lambda e: e.stat().st_mtime, reverse=True)
        except OSError:
            return
        for entry in entries[KEEP:]:
            try:
                os.unlink(entry.path)
            except OSError:
                pass
