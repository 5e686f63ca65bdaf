"""A located step's manifests from its step index: one file read where a resharding reader would open W.

The node that seals a step on the shared tier writes every part's manifest into
``<step>/index.json`` (:mod:`ckptstage.protos.layout.stepindex`). A reader that
needs every part (another world size, a sharded state, DCP's planner) reads it
once instead of opening each part's ``manifest.json``; each manifest in it is
checked against the digest the commit record names for its rank, so a stale or
damaged index only costs the reader the per-part opens it would have made.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckptstage.protos import layout
from ckptstage.protos.v1 import ckptstage_pb2 as pb

log = logging.getLogger(__name__)


def manifests_of(parts: Mapping[int, list[tuple[pb.Tier, Path]]], named_digests: Mapping[Path, str],
                 node_copy: Path | None = None, rank_digests: Mapping[int, str] | None = None
                 ) -> dict[int, dict[str, Any]]:
    """Rank -> its verified manifest, for every rank of a located step (``parts``: rank -> its copies,
    ``named_digests``: part dir -> the manifest digest the commit record names, ``rank_digests``: rank ->
    the same, where the daemon said it per rank); empty when no index serves (a step only on the local
    tier, an index missing, too large, stale or damaged). ``node_copy``: this node's copy of the index
    (the daemon's), read first; else the shared tier's beside the parts."""
    digests: dict[int, str] = {}
    steps: list[Path] = [node_copy] if node_copy is not None else []
    for rank, copies in parts.items():
        named = {named_digests.get(d, "") for _, d in copies} or {(rank_digests or {}).get(rank, "")}
        if len(named) != 1 or "" in named:
            return {}  # the daemon did not say which manifest the record names: nothing to check against
        digests[rank] = named.pop()
        for tier, d in copies:
            if tier == pb.SHARED and d.parent / layout.STEP_INDEX_FILE not in steps:
                steps.append(d.parent / layout.STEP_INDEX_FILE)
    for path in steps:
        try:
            return layout.parse_step_index(layout.read_step_index_file(path), path, digests)
        except FileNotFoundError:
            continue
        except (OSError, layout.ManifestError) as e:
            log.info("not using the step index %s (each part's manifest is read instead): %s", path, e)
    return {}
