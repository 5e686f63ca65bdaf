"""A located step's index: the one file a resharding reader plans from, when the commit record vouches for it.

The node that seals a step on the shared tier writes ``<step>/index.json``
(:mod:`ckptstage.protos.layout.stepindex`) and its commit record names the
index's digest; each daemon keeps a copy of it on its node for its readers and
answers its path and that digest (``Locate`` with ``step_index``). A reader
whose copy matches plans from it and parses only the manifests of the parts it
reads; a copy that is missing, damaged or of another commit costs the reader the
per-part manifests it would have opened, never a wrong read.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ckptstage.protos import layout

log = logging.getLogger(__name__)


def read_index(path: Path | None, digest: str) -> layout.StepIndex | None:
    """The index at ``path`` if it is the one whose ``digest`` the step's commit record names, else None
    (logged: the reader opens each part's manifest instead)."""
    if path is None or not digest:
        return None
    try:
        return layout.parse_step_index(layout.read_step_index_file(path), path, digest)
    except FileNotFoundError:
        log.info("the step index %s is gone (removed with its step, or the node's copy cleaned): each part's "
                 "manifest is read instead", path)
    except (OSError, layout.ManifestError) as e:
        log.info("not using the step index %s (each part's manifest is read instead): %s", path, e)
    return None
