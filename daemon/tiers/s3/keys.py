"""The object-store tier's keys: where each location, part, temporary and chunk is in the bucket.

Objects mirror docs/FORMAT.md's layout under the URL's prefix, so that a
person or another tool reads them as the file-system tier's files::

    <prefix>/<job>/step-000000000120/rank-00000/data.safetensors
    <prefix>/<job>/step-000000000120/rank-00000/manifest.json
    <prefix>/<job>/step-000000000120/commit.json
    <prefix>/<job>/chunks/9f/9f2c...          <prefix>/<job>/retention.json
    <prefix>/.tmp/<owner>/...                 this daemon's temporaries

**Locations.** The interface names places by ``Path``. Here a location is a
pseudo-path: :data:`PSEUDO_ROOT` / bucket / prefix / the key below the prefix
(``/s3:/bucket/prefix/job/step-000000000120/rank-00000``), which
:meth:`Keys.key` turns back into the key. No file-system call may be made
on one: nothing exists under ``/s3:``, and the tier's operations are the only
way to its objects. People are shown URLs (:attr:`Keys.url`,
:meth:`Keys.url_of`), never pseudo-paths.

Nothing here sends a request: this is arithmetic on names, shared by the
tier, its part writer, its chunk stores, its replacements and its clean-ups.
"""

from __future__ import annotations

import errno
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from ckptstage.protos import chunks, layout

if TYPE_CHECKING:
    from ckptstage.daemon.tiers.s3.client import Location

PSEUDO_ROOT = Path("/s3:")  # locations on an object store: never a directory of this node
CLAIM_FILE = ".claim"        # <part>/.claim: who writes the part's objects now (see claims.Claims)
WRITER_NOTE = ".writer"      # .tmp/<owner>/<job>.<step>.<rank>.<id>/.writer: a writer's note (its part, its claim)
REMOVING = "removing"        # .tmp/<owner>/removing/<id>.json: a removal under way (its part's prefix)
REPLACE_DIR = "replace"      # .tmp/<owner>/replace/<job>/step-N/: replacements being assembled


def plain_name(name: str) -> str:
    """``name`` as one segment of a key; ValueError for a name with a slash, an empty one, or a dot name."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"{name!r} is not a plain object name")
    return name


class Keys:
    """The keys of one bucket and prefix (``location``) as the daemon ``owner`` names them."""

    def __init__(self, location: Location, owner: str) -> None:
        self._bucket = location.bucket
        self._prefix = location.prefix
        self.url = location.url
        self.owner = owner
        self.root = PSEUDO_ROOT / self._bucket / self._prefix if self._prefix else PSEUDO_ROOT / self._bucket

    def key(self, location: Path | PurePosixPath) -> str:
        """The object key of a location of this tier; raises OSError (EXDEV) for one elsewhere."""
        try:
            rel = PurePosixPath(location).relative_to(PurePosixPath(self.root))
        except ValueError:
            raise OSError(errno.EXDEV, f"{location} is not a location of the tier {self.url}") from None
        text = "" if str(rel) == "." else rel.as_posix()
        return f"{self._prefix}/{text}".strip("/") if self._prefix else text

    def url_of(self, location: Path | PurePosixPath) -> str:
        """How messages name a location of this tier: ``s3://bucket/key``."""
        return f"s3://{self._bucket}/{self.key(location)}"

    def location(self, key: str) -> Path:
        """The location of an object key under the prefix."""
        return self.root / key[len(self._prefix):].lstrip("/") if self._prefix else self.root / key

    def dir_key(self, location: Path) -> str:
        """The key prefix of everything below a location (ends with a slash)."""
        key = self.key(location)
        return f"{key}/" if key else ""

    # --- steps and parts ----------------------------------------------------------------

    def part_location(self, job: str, step: int, rank: int) -> Path:
        return layout.part_dir(self.root, job, step, rank)

    def step_location(self, job: str, step: int) -> Path:
        return layout.step_dir(self.root, job, step)

    def job_document(self, job: str, name: str) -> str:
        """The key of a small JSON document published beside a job's steps (its retention rules)."""
        return self.key(self.root / layout.check_job(job) / plain_name(name))

    # --- temporaries --------------------------------------------------------------------

    def tmp(self) -> Path:
        """This daemon's temporaries (``.tmp/<owner>/``)."""
        return layout.tmp_root(self.root, self.owner)

    def all_temporaries(self) -> str:
        """The key prefix of every daemon's temporaries (``<prefix>/.tmp/``)."""
        return self.dir_key(self.root / layout.TMP_DIR)

    def writer_temporaries(self, job: str, step: int, rank: int, writing: str) -> Path:
        """A part writer's temporaries (its note, and the files of a part replaced in place)."""
        return self.tmp() / f"{layout.check_job(job)}.{step}.{rank}.{writing}"

    def removals(self) -> str:
        """The key prefix of the notes of this daemon's removals under way."""
        return self.dir_key(self.tmp()) + f"{REMOVING}/"

    def removal_note(self, removal: str) -> str:
        """The key of the note of one removal under way."""
        return self.key(self.tmp() / REMOVING / f"{removal}.json")

    def staged_step(self, job: str, step: int) -> Path:
        """Where this daemon assembles the replacement of a step."""
        return self.tmp() / REPLACE_DIR / layout.check_job(job) / layout.step_dirname(step)

    # --- chunk stores -------------------------------------------------------------------

    def store(self, job: str) -> Path:
        return chunks.store_dir(self.root, job)

    def chunk_location(self, job: str, name: str) -> Path:
        return chunks.chunk_path(self.store(job), name)

    def chunk_key(self, job: str, name: str) -> str:
        return self.key(self.chunk_location(job, name))

    def condemned(self, job: str, name: str) -> str:
        """The key of a chunk moved out of its store by a sweep."""
        return self.key(self.store(job) / chunks.CONDEMNED_DIR / name)
