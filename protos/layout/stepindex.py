"""The step index: every part's manifest of one step in one file, so that a reader opens one file, not W.

``<shared tier>/<job>/step-N/index.json`` is written by the node that seals the
step (before its commit record), in the manifests' two-line form (compact
JSON, then its ``xxh3_64:`` digest). It holds each rank's manifest as a JSON
object; a reader re-encodes each one as its ``manifest.json`` file would read
and checks that file's digest against the one the commit record names for
that rank, so an index vouches for nothing the record does not: a stale or
altered index fails that check and the reader opens the parts' own manifests
instead. It is an optimisation, never a source of truth.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckptstage.protos.layout.checksums import chunk_digest
from ckptstage.protos.layout.manifest import _verified_body, manifest_file_bytes, parse_manifest_file
from ckptstage.protos.layout.names import FORMAT, ManifestError

# Largest step index written or read: past it readers open the parts' manifests (a step of thousands of
# ranks whose manifests each list thousands of tensors).
MAX_STEP_INDEX_BYTES = 256 << 20


def step_index_bytes(job: str, step: int, attempt: str, manifests: Mapping[int, dict[str, Any]],
                     digests: Mapping[int, str]) -> bytes | None:
    """``index.json`` for the step whose parts have these ``manifests`` (rank -> parsed manifest); None when
    one of them does not re-encode to the file its digest names (nothing to vouch with) or it would be too
    large to be worth reading."""
    for rank, manifest in manifests.items():
        if chunk_digest(manifest_file_bytes(manifest)) != digests.get(rank):
            return None
    raw = manifest_file_bytes({"format": FORMAT, "kind": "index", "job": job, "step": step, "attempt": attempt,
                               "manifests": {str(r): m for r, m in sorted(manifests.items())}})
    return raw if len(raw) <= MAX_STEP_INDEX_BYTES else None


def read_step_index_file(path: Path) -> bytes:
    """A step index file's bytes, at most :data:`MAX_STEP_INDEX_BYTES` + 1 (so a larger one parses as too
    large); FileNotFoundError when there is none."""
    with open(path, "rb") as f:
        return f.read(MAX_STEP_INDEX_BYTES + 1)


def parse_step_index(raw: bytes, path: Path, digests: Mapping[int, str]) -> dict[int, dict[str, Any]]:
    """The manifests of the ranks in ``digests`` (rank -> the manifest digest the commit record names), each
    checked against it; raises :class:`ManifestError` naming the rank that does not match."""
    if len(raw) > MAX_STEP_INDEX_BYTES:
        raise ManifestError(f"{path}: step index of {len(raw)} bytes exceeds {MAX_STEP_INDEX_BYTES}")
    body = _verified_body(raw, path, "step index")
    try:
        index = json.loads(body)
    except ValueError as e:
        raise ManifestError(f"{path}: step index is not valid JSON: {e}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("kind") != "index" or \
            not isinstance(index.get("manifests"), dict):
        raise ManifestError(f"{path}: not a {FORMAT} step index")
    out: dict[int, dict[str, Any]] = {}
    for rank, digest in digests.items():
        manifest = index["manifests"].get(str(rank))
        if not isinstance(manifest, dict):
            raise ManifestError(f"{path}: the step index has no manifest for rank {rank}")
        file = manifest_file_bytes(manifest)
        if chunk_digest(file) != digest:
            raise ManifestError(f"{path}: rank {rank}'s manifest in the step index is not the one the commit "
                                f"record names ({digest})")
        out[rank] = parse_manifest_file(file, path)
    return out
