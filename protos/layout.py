"""Checkpoints at rest: names, paths on a tier, the manifest and its checksums.

Both the daemon (which writes and drains checkpoints) and the client (which
reads them back) import this module, so it must stay free of torch and of the
daemon. The format is described for people in docs/FORMAT.md.

A tier directory looks like::

    <tier>/<job>/step-000000000010/rank-00000/data.safetensors
                                             /manifest.json
    <tier>/<job>/step-000000000010/commit.json   the step's commit record, written last
    <tier>/.tmp/<node>/<random>/   temporaries, renamed into place on commit

A *part* is one rank's share of one step. A part directory exists only once
it is complete: it is written under ``.tmp``, every file fsynced, the
manifest written last, then renamed into place and its parent fsynced.

A *step* exists on a tier only once its commit record (:class:`CommitRecord`)
is there: written when every rank's part of one *attempt* (one run of the
job, agreed by all its ranks) is committed on that tier, and naming each
part's size and the digest of its manifest file.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

FORMAT = "ckptstage/1"
DATA_FILE = "data.safetensors"
MANIFEST_FILE = "manifest.json"
COMMIT_FILE = "commit.json"
TMP_DIR = ".tmp"
CORRUPT_PREFIX = ".corrupt-"  # a part moved aside as corrupt: <step>/.corrupt-rank-RRRRR-<random>
# The unit the daemon streams and writes a part in (its [persist] chunk_bytes default).
DEFAULT_CHUNK_BYTES = 64 << 20
CHECKSUM = "xxh3_64"
# The checksum granularity on disk: one digest per block of this many bytes (per chunk when the
# daemon's chunks are smaller or not a multiple of it). Per-block sums let writers and readers hash
# in parallel and verify while they copy, without a second pass; and a reader that wants part of a
# file (one rank's box of another rank's fragment) reads and verifies only the blocks that hold it.
DIGEST_BLOCK_BYTES = 1 << 20
# Largest manifest accepted, on the wire and on disk: the layout of ~100k tensors and their plain values.
MAX_MANIFEST_BYTES = 64 << 20
# Deepest nesting of containers in a saved state (real ones are under 10 deep), and the largest str or
# bytes value kept in the manifest: bigger blobs belong in a tensor (torch.frombuffer).
MAX_TREE_DEPTH = 100
MAX_PLAIN_VALUE_BYTES = 16 << 20
# The limit is of the value as the state holds it (a str's UTF-8 bytes, a bytes value's own bytes), never of
# its form in the manifest (base64 for bytes): plain_value_bytes measures it, check_plain_value applies it,
# on both sides.
# How many replaced commits of a step a commit record remembers (see CommitRecord.replaces).
MAX_REPLACES = 16

_JOB_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_ATTEMPT_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_STEP_RE = re.compile(r"step-(\d{12})")
_RANK_RE = re.compile(r"rank-(\d{5})")
MAX_STEP = 10**12 - 1
MAX_RANK = 10**5 - 1


class InvalidName(ValueError):
    """A job name, step or rank that cannot name a directory safely."""


class PlainValueTooLarge(ValueError):
    """A str or bytes value over :data:`MAX_PLAIN_VALUE_BYTES`; the message names its key path and size."""

    def __init__(self, path: str, nbytes: int) -> None:
        super().__init__(f"{path} is a str/bytes value of {nbytes} bytes, over the limit of {MAX_PLAIN_VALUE_BYTES} "
                         f"bytes (16 MiB) for a plain value: plain values travel in the manifest; store it as a "
                         "tensor instead (torch.frombuffer(bytearray(value), dtype=torch.uint8))")
        self.path, self.nbytes = path, nbytes


def plain_value_bytes(value: str | bytes, base64_text: bool = False) -> int:
    """The size :data:`MAX_PLAIN_VALUE_BYTES` limits: a str's UTF-8 bytes, a bytes value's length.

    ``base64_text``: ``value`` is a bytes value as the manifest holds it (a ``"y"`` node, base64); its
    decoded length is counted exactly (padding excluded), so a value the client accepted is never
    refused by the daemon for the two or three bytes its encoding adds.
    """
    if isinstance(value, bytes):
        return len(value)
    if not base64_text:
        return len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
    n = len(value)
    return n // 4 * 3 - (value[-2:].count("=") if n % 4 == 0 else 0) + (n % 4) * 3 // 4


def check_plain_value(value: str | bytes, path: str, base64_text: bool = False) -> None:
    """Raises :class:`PlainValueTooLarge` for a str or bytes value over the limit (see :func:`plain_value_bytes`)."""
    if len(value) > MAX_PLAIN_VALUE_BYTES // 4:  # smaller ones fit whatever their encoding
        nbytes = plain_value_bytes(value, base64_text)
        if nbytes > MAX_PLAIN_VALUE_BYTES:
            raise PlainValueTooLarge(path, nbytes)


class ManifestError(ValueError):
    """A manifest that is missing, unreadable, or inconsistent with its files."""


class ChecksumMismatch(ManifestError):
    """A data file whose size or checksum differs from its manifest."""

    def __init__(self, path: Path, detail: str) -> None:
        super().__init__(f"{path}: {detail}")
        self.path = path
        self.detail = detail


def is_verification_failure(error: BaseException) -> bool:
    """Whether ``error`` proves a copy corrupt: a read that completed and did not match its manifest.

    A :class:`ManifestError` caused by the reader's own trouble (out of file
    descriptors or memory, an interrupted or failed read, a permission) says
    nothing about the bytes on disk and never counts; a file that is missing
    from a committed part does.
    """
    if not isinstance(error, ManifestError):
        return False
    cause = error.__cause__
    return not isinstance(cause, OSError) or isinstance(cause, FileNotFoundError)


def check_job(job: str) -> str:
    """Returns ``job`` if it is a safe directory name, else raises :class:`InvalidName`."""
    if not isinstance(job, str) or not _JOB_RE.fullmatch(job) or ".." in job:
        raise InvalidName(
            f"invalid job name {job!r}: use 1-128 characters from [A-Za-z0-9._-], "
            "starting with a letter or digit, without '..'"
        )
    return job


def check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise InvalidName(f"invalid step {step!r}: an int in [0, {MAX_STEP}]")
    return step


def check_rank(rank: int, world_size: int) -> int:
    if not 1 <= world_size <= MAX_RANK + 1:
        raise InvalidName(f"invalid world_size {world_size!r}: an int in [1, {MAX_RANK + 1}]")
    if not 0 <= rank < world_size:
        raise InvalidName(f"invalid rank {rank!r} for world_size {world_size}")
    return rank


def check_attempt(attempt: str) -> str:
    """Returns ``attempt`` if valid: empty (the anonymous attempt) or 1-128 of ``[A-Za-z0-9._:-]``."""
    if not isinstance(attempt, str) or (attempt and not _ATTEMPT_RE.fullmatch(attempt)):
        raise InvalidName(f"invalid attempt {attempt!r}: empty, or 1-128 characters from [A-Za-z0-9._:-]")
    return attempt


def step_dirname(step: int) -> str:
    return f"step-{check_step(step):012d}"


def rank_dirname(rank: int) -> str:
    return f"rank-{rank:05d}"


def parse_step_dirname(name: str) -> int | None:
    m = _STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def parse_rank_dirname(name: str) -> int | None:
    m = _RANK_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def part_dir(tier_dir: Path, job: str, step: int, rank: int) -> Path:
    return tier_dir / check_job(job) / step_dirname(step) / rank_dirname(rank)


def step_dir(tier_dir: Path, job: str, step: int) -> Path:
    return tier_dir / check_job(job) / step_dirname(step)


def commit_path(tier_dir: Path, job: str, step: int) -> Path:
    """Where a step's commit record lies on a tier."""
    return step_dir(tier_dir, job, step) / COMMIT_FILE


def tmp_root(tier_dir: Path, owner: str) -> Path:
    """Where one daemon keeps its temporaries on a tier.

    ``owner`` is the node's name: daemons of several nodes share the shared
    tier, and each cleans only its own temporaries on start.
    """
    return tier_dir / TMP_DIR / check_job(owner)


@dataclass(frozen=True)
class PartRef:
    """A committed part found on a tier."""

    job: str
    step: int
    rank: int
    path: Path
    ino: int = 0  # of the part directory: a part replaced under the same name has another


@dataclass(frozen=True)
class StepRef:
    """A step directory found on a tier: its committed parts and whether it holds a commit record."""

    job: str
    step: int
    path: Path
    parts: tuple[PartRef, ...]
    record_ino: int | None  # inode of commit.json; None when there is none


def scan_steps(tier_dir: Path, job: str, step: int | None = None) -> Iterator[StepRef]:
    """Yields the step directories of one job (or the one step), as :func:`scan_tier` walks them.

    Steps with neither a part nor a commit record are skipped.
    """
    job_dir = tier_dir / check_job(job)
    if not job_dir.is_dir() or job_dir.is_symlink():
        return
    steps = [job_dir / step_dirname(step)] if step is not None else [
        Path(e.path) for e in _entries(job_dir) if _STEP_RE.fullmatch(e.name)]
    for sdir in steps:
        m = _STEP_RE.fullmatch(sdir.name)
        if not m or sdir.is_symlink():
            continue
        parts: list[PartRef] = []
        record: int | None = None
        for entry in _entries(sdir):
            if entry.name == COMMIT_FILE:
                if entry.is_file(follow_symlinks=False):
                    record = entry.inode()
                continue
            r = _RANK_RE.fullmatch(entry.name)
            if r and entry.is_dir(follow_symlinks=False) and \
                    os.path.isfile(os.path.join(entry.path, MANIFEST_FILE)):
                parts.append(PartRef(job, int(m.group(1)), int(r.group(1)), Path(entry.path), entry.inode()))
        if parts or record is not None:
            yield StepRef(job, int(m.group(1)), sdir, tuple(sorted(parts, key=lambda p: p.rank)), record)


def scan_jobs(tier_dir: Path) -> list[str]:
    """The job directories on a tier (links and other names skipped)."""
    if not tier_dir.is_dir():
        return []
    return sorted(e.name for e in _entries(tier_dir)
                  if _JOB_RE.fullmatch(e.name) and ".." not in e.name and e.is_dir(follow_symlinks=False))


def scan_tier(tier_dir: Path, job: str | None = None, step: int | None = None) -> Iterator[PartRef]:
    """Yields every renamed-into-place part directory that has a manifest.

    ``job`` and ``step`` narrow the walk (cheap on a big shared tier). Only
    names this module produces are considered; anything else on the tier
    (an operator's notes, another tool's files) is left alone, and
    directories deleted while the walk runs are skipped, not errors. Symbolic
    links are never followed: a link planted in a tier (to a job directory
    elsewhere, say) would make retention delete files outside the tier.
    """
    for name in [job] if job is not None else scan_jobs(tier_dir):
        for sref in scan_steps(tier_dir, name, step):
            yield from sref.parts


def _entries(path: str | Path) -> list[os.DirEntry[str]]:
    """A directory's entries; none when it vanished meanwhile (another node's retention on a shared tier)."""
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


# --- checksums --------------------------------------------------------------


def chunk_digest(data: Any) -> str:
    """xxh3_64 of one chunk (any buffer), as 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


def digest_block_bytes(chunk_bytes: int) -> int:
    """The digest block for a daemon writing chunks of ``chunk_bytes``: blocks never straddle a chunk."""
    return DIGEST_BLOCK_BYTES if chunk_bytes % DIGEST_BLOCK_BYTES == 0 else chunk_bytes


def block_digests(data: Any, block: int) -> list[str]:
    """The digests of ``data`` (any buffer) cut into blocks of ``block`` bytes; one digest when empty."""
    view = memoryview(data).cast("B")
    return [chunk_digest(view[i:i + block]) for i in range(0, max(len(view), 1), block)]


# Where bytes [lo, hi) of a data file are kept, as a suffix for an error message (" (chunk files: ...)"),
# or "" where the file is where its path says. Asked only once a block failed.
Locate = Callable[[int, int], str]


def block_mismatch(path: Path, entry: FileEntry, index: int, got: str,
                   locate: Locate | None = None) -> ChecksumMismatch:
    """The error for block ``index`` of a file whose bytes hash to ``got``: the one message every verifying
    reader of a part gives (the block, its first byte, both digests, and where the block is kept)."""
    bs = entry.chunk_bytes
    want = entry.digests[index] if index < len(entry.digests) else None
    held = locate(index * bs, min((index + 1) * bs, entry.size)) if locate is not None else ""
    return ChecksumMismatch(path, f"chunk {index} (bytes {index * bs}..) {CHECKSUM} {got} != "
                                  f"{want or 'nothing'} in the manifest{held}")


def verify_block(data: Any, entry: FileEntry, index: int, path: Path, locate: Locate | None = None) -> None:
    """Checks block ``index`` of a file (``data``: its bytes) against the manifest's digest of it.

    Raises :class:`ChecksumMismatch` naming ``path`` and the block (:func:`block_mismatch`).
    """
    got = xxhash.xxh3_64_hexdigest(data)
    if index >= len(entry.digests) or got != entry.digests[index]:
        raise block_mismatch(path, entry, index, got, locate)


def verify_blocks(data: Any, entry: FileEntry, first: int, path: Path, locate: Locate | None = None) -> None:
    """Checks consecutive blocks of a file, ``first`` and on (``data``: their bytes, whole blocks but for the
    file's last one, which may be short; empty: the empty file's one block).

    Raises :class:`ChecksumMismatch` for the first block that differs (:func:`block_mismatch`).
    """
    view = memoryview(data).cast("B")
    bs, digests = entry.chunk_bytes, entry.digests
    for index, at in enumerate(range(0, max(len(view), 1), bs), first):
        got = xxhash.xxh3_64_hexdigest(view[at:at + bs])
        if index >= len(digests) or got != digests[index]:
            raise block_mismatch(path, entry, index, got, locate)


class BlockVerifier:
    """Checks a file's bytes as they arrive: fed in file order from ``pos`` (a block's first byte), in pieces
    of any size, each block is hashed as its bytes go by and checked once it is complete (the file's last
    one at its end), so a reader verifies while it copies, without a second pass.

    Raises :class:`ChecksumMismatch` for the first block that differs (:func:`block_mismatch`).
    """

    __slots__ = ("entry", "path", "pos", "_block", "_hasher", "_locate")

    def __init__(self, entry: FileEntry, path: Path, pos: int = 0, locate: Locate | None = None) -> None:
        if pos % entry.chunk_bytes:
            raise ValueError(f"a verifier starts on a block: {pos} is not a multiple of {entry.chunk_bytes}")
        self.entry = entry
        self.path = path
        self.pos = pos  # the next byte expected
        self._block = entry.chunk_bytes
        self._hasher = xxhash.xxh3_64()
        self._locate = locate

    def feed(self, data: Any) -> None:
        """The next bytes of the file (any buffer of bytes)."""
        block, size = self._block, self.entry.size
        while data:
            take = block - self.pos % block
            if take < len(data):
                self._hasher.update(data[:take])
                data = data[take:]
            else:
                self._hasher.update(data)
                take, data = len(data), b""
            self.pos += take
            if self.pos % block == 0 or self.pos == size:
                self._check((self.pos - 1) // block)

    def finish(self, end: int) -> None:
        """Checks that bytes up to ``end`` (a block's end, or the file's) were all fed; the empty file's one
        block is checked here (no byte ever completes it)."""
        if self.pos != end:
            raise ChecksumMismatch(self.path, f"bytes {self.pos}..{end} were not read")
        if end == 0 == self.entry.size:
            self._check(0)

    def _check(self, index: int) -> None:
        got = self._hasher.hexdigest()
        self._hasher.reset()
        digests = self.entry.digests
        if index >= len(digests) or got != digests[index]:
            raise block_mismatch(self.path, self.entry, index, got, self._locate)


def chunk_count(size: int, chunk_bytes: int) -> int:
    return max(1, -(-size // chunk_bytes))


def fsync_path(path: Path, directory: bool = False) -> None:
    """Makes a file's bytes durable (written through another descriptor, or by another process), or a
    directory's entries (creations, renames, unlinks)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Makes a directory's entries (creations, renames, unlinks) durable."""
    fsync_path(path, directory=True)


# --- the manifest -------------------------------------------------------------


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


@dataclass(frozen=True)
class FileEntry:
    size: int
    chunk_bytes: int
    digests: tuple[str, ...]

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> FileEntry:
        return cls(int(obj["size"]), int(obj["chunk_bytes"]), tuple(obj[CHECKSUM]))

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "chunk_bytes": self.chunk_bytes, CHECKSUM: list(self.digests)}


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
    body = encode_manifest(manifest)
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


def _verified_body(raw: bytes, path: Path, what: str) -> bytes:
    """The JSON line of a two-line file whose second line is its ``xxh3_64:`` digest; raises if it differs."""
    body, _, trailer = raw[:-1].rpartition(b"\n")
    if not raw.endswith(b"\n") or trailer != _manifest_trailer(body):
        raise ChecksumMismatch(path, f"the {what} does not match its {CHECKSUM} trailer")
    return body


def parse_manifest_file(raw: bytes, path: Path) -> dict[str, Any]:
    """The manifest in the bytes of a ``manifest.json`` file, verified (see :func:`read_manifest`)."""
    manifest = decode_manifest(_verified_body(raw, path, "manifest"), str(path))
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


# --- the commit record --------------------------------------------------------


@dataclass(frozen=True)
class CommittedPart:
    """What a commit record says of one rank's part: its bytes and the digest of its manifest file."""

    nbytes: int
    manifest_digest: str


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

    def fingerprint(self) -> str:
        """What identifies the commit across tiers: its attempt and its parts (not when it was written)."""
        return chunk_digest(json.dumps([self.attempt, self.world_size, sorted(
            (r, p.nbytes, p.manifest_digest) for r, p in self.parts.items())]).encode())

    def to_json(self) -> dict[str, Any]:
        out = {"format": FORMAT, "kind": "commit", "job": self.job, "step": self.step, "attempt": self.attempt,
               "world_size": self.world_size, "created": self.created,
               "parts": {str(r): {"bytes": p.nbytes, "manifest_xxh3_64": p.manifest_digest}
                         for r, p in sorted(self.parts.items())}}
        if self.replaces:
            out["replaces"] = list(self.replaces)
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
            out[int(key)] = CommittedPart(nbytes, digest)
        replaces = get("replaces") or []
        if not isinstance(replaces, list) or len(replaces) > MAX_REPLACES or \
                not all(isinstance(r, str) and re.fullmatch(r"[0-9a-f]{16}", r) for r in replaces):
            raise bad(f"has a malformed replaces list: {replaces!r:.100}")
        return cls(job, step, attempt, world, float(created), out, tuple(replaces))


def commit_record_bytes(record: CommitRecord) -> bytes:
    """``commit.json`` on disk: the record as one compact JSON line, then its ``xxh3_64:`` digest line."""
    return manifest_file_bytes(record.to_json())


def parse_commit_record(raw: bytes, path: Path) -> CommitRecord:
    """Verifies the trailer, then every field; raises :class:`ManifestError` (a changed byte is never trusted)."""
    body = _verified_body(raw, path, "commit record")
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
