"""The manifest.

Each part's tensor table, files and their block digests, encoded with a trailer that checks the manifest
itself, and read back verified.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptstage.protos.layout.names import (
    CHECKSUM,
    ChecksumMismatch,
    FORMAT,
    InvalidName,
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    ManifestError,
    check_attempt,
)
from ckptstage.protos.layout.checksums import FileEntry, chunk_digest

@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes live in the data file (absolute file offsets)."""

    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> TensorEntry:
        return cls(str(obj["name"]), str(obj["dtype"]), tuple(int(d) for d in obj["shape"]),
                   int(obj["offset"]), int(obj["nbytes"]))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "offset": self.offset, "nbytes": self.nbytes}


def validate_tensor_table(tensors: Sequence[TensorEntry], data_start: int, data_bytes: int) -> None:
    """Checks that every tensor lies inside the data section and none overlap.

    Raises :class:`ManifestError` naming the first offending tensor.
    """
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors)
    prev_end, prev_name = data_start, "<header>"
    for start, end, name in spans:
        if start < prev_end:
            raise ManifestError(f"tensor {name!r} at offset {start} overlaps {prev_name!r} (ends at {prev_end})")
        if end > data_bytes:
            raise ManifestError(f"tensor {name!r} ends at {end}, past the data file's {data_bytes} bytes")
        prev_end, prev_name = end, name


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    """The manifest as compact JSON (one line): what travels in ``BeginSave``."""
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


def manifest_file_bytes(manifest: dict[str, Any]) -> bytes:
    """A part's ``manifest.json`` on disk: the JSON line, then a line with its own digest.

    The manifest vouches for every byte of the data file, and the trailer
    vouches for the manifest: a reader checks it before trusting any field
    (step, tensor names, dtypes, offsets, plain values).
    """
    return with_trailer(encode_manifest(manifest))


def with_trailer(body: bytes) -> bytes:
    """``body``, then a line with its ``xxh3_64:`` digest: the two-line form of every file of the format
    that vouches for itself (manifests, commit records, step indexes)."""
    return body + b"\n" + _manifest_trailer(body) + b"\n"


def _manifest_trailer(body: bytes) -> bytes:
    return f"{CHECKSUM}:{chunk_digest(body)}".encode()


def decode_manifest(raw: bytes, where: str) -> Any:
    """Parses manifest JSON of at most :data:`MAX_MANIFEST_BYTES`; nesting too deep is a ManifestError."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{where}: manifest of {len(raw)} bytes exceeds the limit of {MAX_MANIFEST_BYTES}")
    try:
        return json.loads(raw)
    except RecursionError:
        raise ManifestError(f"{where}: manifest nested too deeply to parse") from None
    except ValueError as e:
        raise ManifestError(f"{where}: manifest is not valid JSON: {e}") from None


def read_manifest(part: Path, committed: str = "") -> dict[str, Any]:
    """Reads, verifies and sanity-checks a part's manifest; raises :class:`ManifestError`.

    The digest trailer is checked before anything is parsed, so a changed
    byte anywhere in the file is an error, never a different checkpoint.
    ``committed``: the manifest's digest as the step's commit record names it
    (:func:`check_committed_manifest`); "" checks the file by itself only.
    """
    manifest, digest = read_manifest_and_digest(part)
    check_committed_manifest(part, digest, committed)
    return manifest


class ManifestNotCommitted(ChecksumMismatch):
    """A part whose manifest verifies by itself but is not the one the step's commit record names: rewritten
    after the commit, or (for a reader) a replacement put in place since the daemon answered."""


def check_committed_manifest(part: Path, digest: str, committed: str) -> None:
    """Raises :class:`ManifestNotCommitted` when the part's ``manifest.json`` (xxh3-64 ``digest``) is not the one
    the step's commit record names (``committed``; "" for none known): a manifest rewritten whole after
    the commit verifies by itself, and would read as another checkpoint."""
    if committed and digest != committed:
        raise ManifestNotCommitted(part / MANIFEST_FILE, f"manifest digest {digest} is not the {committed} the step's "
                                                     "commit record names: the manifest changed after the commit")


def read_manifest_and_digest(part: Path) -> tuple[dict[str, Any], str]:
    """:func:`read_manifest`, and the xxh3-64 of the whole ``manifest.json`` file (what commit records name)."""
    path = part / MANIFEST_FILE
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ManifestError(f"{path}: unreadable manifest: {e}") from e
    return parse_manifest_file(raw, path), chunk_digest(raw)


def verified_body(raw: bytes, path: Path, what: str) -> bytes:
    """The JSON line of a two-line file whose second line is its ``xxh3_64:`` digest; raises if it differs."""
    body, _, trailer = raw[:-1].rpartition(b"\n")
    if not raw.endswith(b"\n") or trailer != _manifest_trailer(body):
        raise ChecksumMismatch(path, f"the {what} does not match its {CHECKSUM} trailer")
    return body


def parse_manifest_file(raw: bytes, path: Path) -> dict[str, Any]:
    """The manifest in the bytes of a ``manifest.json`` file, verified (see :func:`read_manifest`)."""
    manifest = decode_manifest(verified_body(raw, path, "manifest"), str(path))
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ManifestError(f"{path}: not a {FORMAT} manifest (format={manifest.get('format')!r})"
                            if isinstance(manifest, dict) else f"{path}: not a JSON object")
    for key in ("job", "step", "rank", "world_size", "tensors", "files", "tree"):
        if key not in manifest:
            raise ManifestError(f"{path}: missing key {key!r}")
    return manifest


def manifest_attempt(manifest: dict[str, Any]) -> str:
    """The attempt a part belongs to (absent: the anonymous attempt ``""`` of older clients)."""
    attempt = manifest.get("attempt", "")
    try:
        return check_attempt(attempt)
    except InvalidName as e:
        raise ManifestError(f"manifest of {manifest.get('job')!r} step {manifest.get('step')!r}: {e}") from None


def manifest_files(manifest: dict[str, Any]) -> dict[str, FileEntry]:
    return {name: FileEntry.from_json(entry) for name, entry in manifest["files"].items()}


def part_bytes(manifest: dict[str, Any]) -> int:
    return sum(entry.size for entry in manifest_files(manifest).values())
