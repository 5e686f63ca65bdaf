"""Names and places of checkpoints on a tier.

The format's constants, what a job, step, rank or attempt may be called, the paths of parts, steps and commit
records, and scans of a tier directory; the errors of a bad name or value.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path


FORMAT = "ckptstage/1"
DATA_FILE = "data.safetensors"
MANIFEST_FILE = "manifest.json"
COMMIT_FILE = "commit.json"
# A node about to read a step's W manifests to seal it claims the step first (created exactly once), so that
# of several nodes finding every part there at once one reads them. A hint, never a lock: see Commits.
SEAL_CLAIM_FILE = "seal.claim"
# Every part's manifest of a step in one file, written by the node that seals it (see layout.stepindex).
STEP_INDEX_FILE = "index.json"
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


def parse_corrupt_dirname(name: str) -> int | None:
    """The rank of a part moved aside as ``.corrupt-rank-RRRRR-<random>``; None for any other name."""
    if not name.startswith(CORRUPT_PREFIX):
        return None
    return parse_rank_dirname(name[len(CORRUPT_PREFIX):].rsplit("-", 1)[0])


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


def scan_steps(tier_dir: Path, job: str, step: int | None = None,
               known: Mapping[Path, int] | None = None, trust: bool = False) -> Iterator[StepRef]:
    """Yields the step directories of one job (or the one step), as :func:`scan_tier` walks them.

    Steps with neither a part nor a commit record are skipped. One listing
    per step: a part directory gets there only by a rename of a whole part
    and leaves by one, so its manifest is looked for (a stat) only where
    nothing else vouches for it: not in a step with a commit record, nor for
    a directory ``known`` (path -> inode) lists with the same inode. A
    watcher re-reading a step of W parts then costs one listing, not W stats.
    ``trust``: no part is looked at (the names are what the caller wants).
    """
    job_dir = tier_dir / check_job(job)
    steps = [step_dirname(step)] if step is not None else [
        e.name for e in _entries(job_dir) if _STEP_RE.fullmatch(e.name)]
    known = known or {}
    for name in steps:
        m = _STEP_RE.fullmatch(name)
        if not m:
            continue
        sdir = job_dir / name
        entries = _entries(sdir)
        record = next((e.inode() for e in entries if e.name == COMMIT_FILE and e.is_file(follow_symlinks=False)),
                      None)
        parts: list[PartRef] = []
        for entry in entries:
            r = _RANK_RE.fullmatch(entry.name)
            if r is None or not entry.is_dir(follow_symlinks=False):
                continue
            path = sdir / entry.name
            vouched = trust or record is not None or known.get(path) == entry.inode()
            if vouched or os.path.isfile(path / MANIFEST_FILE):
                parts.append(PartRef(job, int(m.group(1)), int(r.group(1)), path, entry.inode()))
        if parts or record is not None:
            yield StepRef(job, int(m.group(1)), sdir, tuple(sorted(parts, key=lambda p: p.rank)), record)


def scan_jobs(tier_dir: Path) -> list[str]:
    """The job directories on a tier (links and other names skipped)."""
    return sorted(e.name for e in _entries(tier_dir, follow=True)  # the tier's own root may be a link
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


def _entries(path: str | Path, follow: bool = False) -> list[os.DirEntry[str]]:
    """A directory's entries (their ``path`` is their bare name); none when it vanished meanwhile (another
    node's retention on a shared tier), or is a symbolic link (unless ``follow``) or no directory.

    One open (that never follows a link) and the reads of its entries: the
    few calls a shared file system's metadata server sees per directory.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symbolic link planted in the tier: never followed
            return []
        raise
    try:
        with os.scandir(fd) as it:
            return list(it)
    finally:
        os.close(fd)
