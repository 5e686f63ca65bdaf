"""The commit record.

A step exists on a tier once it is there, naming each rank's part (its size and the digest of its manifest) of
one attempt.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptstage.protos.layout.names import (
    COMMIT_FILE,
    FORMAT,
    InvalidName,
    MAX_REPLACES,
    ManifestError,
    check_attempt,
    check_job,
    check_rank,
    check_step,
)
from ckptstage.protos.layout.checksums import chunk_digest
from ckptstage.protos.layout.manifest import verified_body, decode_manifest, manifest_file_bytes

@dataclass(frozen=True)
class CommittedPart:
    """What a commit record says of one rank's part: its bytes and the digest of its manifest file.

    ``created`` and ``metrics`` repeat what the part's manifest says (when it
    was saved, the trainer's metrics), so that a daemon learning of the step
    from its record indexes every part without opening W manifests. Records
    written before they were kept have ``created`` None: their parts are
    indexed from their manifests.
    """

    nbytes: int
    manifest_digest: str
    created: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"bytes": self.nbytes, "manifest_xxh3_64": self.manifest_digest}
        if self.created is not None:
            out["created"] = self.created
            if self.metrics:
                out["metrics"] = dict(sorted(self.metrics.items()))
        return out


@dataclass(frozen=True)
class CommitRecord:
    """``<tier>/<job>/step-N/commit.json``: the step exists on that tier, made of these parts of this attempt.

    Written last and atomically, once every rank's part of one attempt is
    committed on the tier; the part digests pin the exact manifests, so a
    part replaced or changed since does not match the record.
    """

    job: str
    step: int
    attempt: str
    world_size: int
    created: float
    parts: dict[int, CommittedPart]
    # Fingerprints (:meth:`fingerprint`) of the commits of this step that this one replaced (save with
    # overwrite), newest first: a tier holding one of them may have it replaced by this one.
    replaces: tuple[str, ...] = ()
    # The digest of the step's index (:mod:`.stepindex`) written before this record on its tier ("": none):
    # a reader plans from that index alone. Not part of the fingerprint: the same commit on another tier
    # has no index.
    index_digest: str = ""

    def fingerprint(self) -> str:
        """What identifies the commit across tiers: its attempt and its parts (not when it was written).
        Computed once per record (a hash over all W parts, asked for by every rank's Locate)."""
        return self._fingerprint

    @functools.cached_property
    def _fingerprint(self) -> str:
        return chunk_digest(json.dumps([self.attempt, self.world_size, sorted(
            (r, p.nbytes, p.manifest_digest) for r, p in self.parts.items())]).encode())

    def to_json(self) -> dict[str, Any]:
        out = {"format": FORMAT, "kind": "commit", "job": self.job, "step": self.step, "attempt": self.attempt,
               "world_size": self.world_size, "created": self.created,
               "parts": {str(r): p.to_json() for r, p in sorted(self.parts.items())}}
        if self.replaces:
            out["replaces"] = list(self.replaces)
        if self.index_digest:
            out["index_xxh3_64"] = self.index_digest
        return out

    @classmethod
    def from_json(cls, obj: Any, where: str) -> CommitRecord:
        """Validates every field; raises :class:`ManifestError` naming the file and the field."""
        def bad(what: str) -> ManifestError:
            return ManifestError(f"{where}: commit record {what}")

        if not isinstance(obj, dict) or obj.get("format") != FORMAT or obj.get("kind") != "commit":
            raise bad(f"is not a {FORMAT} commit record")
        fields: dict[str, Any] = obj

        def get(key: str) -> Any:
            return fields.get(key)

        try:
            job, step = check_job(get("job")), check_step(get("step"))
            attempt = check_attempt(get("attempt"))
            world = get("world_size")
            check_rank(0, world if type(world) is int else 0)
        except InvalidName as e:
            raise bad(str(e)) from None
        created = get("created")
        if type(created) not in (int, float):
            raise bad(f"has created={created!r}, not a number")
        parts = get("parts")
        if not isinstance(parts, dict) or sorted(parts) != sorted(str(r) for r in range(world)):
            raise bad(f"does not name exactly ranks 0..{world - 1}")
        out: dict[int, CommittedPart] = {}
        for key, entry in parts.items():
            nbytes = entry.get("bytes") if isinstance(entry, dict) else None
            digest = entry.get("manifest_xxh3_64") if isinstance(entry, dict) else None
            if type(nbytes) is not int or nbytes < 0 or not isinstance(digest, str) or \
                    not re.fullmatch(r"[0-9a-f]{16}", digest):
                raise bad(f"has a malformed entry for rank {key}: {entry!r:.100}")
            saved, metrics = entry.get("created"), entry.get("metrics", {})
            if saved is not None and type(saved) not in (int, float) or not isinstance(metrics, dict) or \
                    not all(isinstance(k, str) and type(v) in (int, float) for k, v in metrics.items()):
                raise bad(f"has a malformed created or metrics for rank {key}: {entry!r:.100}")
            out[int(key)] = CommittedPart(nbytes, digest, None if saved is None else float(saved),
                                          {k: float(v) for k, v in metrics.items()})
        replaces = get("replaces") or []
        if not isinstance(replaces, list) or len(replaces) > MAX_REPLACES or \
                not all(isinstance(r, str) and re.fullmatch(r"[0-9a-f]{16}", r) for r in replaces):
            raise bad(f"has a malformed replaces list: {replaces!r:.100}")
        index = get("index_xxh3_64") or ""
        if not isinstance(index, str) or index and not re.fullmatch(r"[0-9a-f]{16}", index):
            raise bad(f"has a malformed index_xxh3_64: {index!r:.100}")
        return cls(job, step, attempt, world, float(created), out, tuple(replaces), index)


def commit_record_bytes(record: CommitRecord) -> bytes:
    """``commit.json`` on disk: the record as one compact JSON line, then its ``xxh3_64:`` digest line."""
    return manifest_file_bytes(record.to_json())


def parse_commit_record(raw: bytes, path: Path) -> CommitRecord:
    """Verifies the trailer, then every field; raises :class:`ManifestError` (a changed byte is never trusted)."""
    body = verified_body(raw, path, "commit record")
    return CommitRecord.from_json(decode_manifest(body, str(path)), str(path))


def read_commit_record(step_path: Path) -> CommitRecord | None:
    """The commit record in a step directory, verified; None when there is none.

    Raises :class:`ManifestError` when it is there but unreadable or fails
    verification: such a record is not trusted, and the step does not exist
    on that tier.
    """
    path = step_path / COMMIT_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ManifestError(f"{path}: unreadable commit record: {e}") from e
    return parse_commit_record(raw, path)
