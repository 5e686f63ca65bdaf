"""Reading what the object store holds: jobs, steps, parts, manifests, commit records and corrupt copies, by prefix.

A part exists if and only if its manifest object does, a step only through
its ``commit.json`` (a missing one reads as "not published"). **Versions**
are the ETag of the manifest (or record) object, as an integer: an object
written again with other bytes has another one. Written again with the same
bytes it keeps it, and then nothing a reader indexed differs.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ckptstage.daemon.tiers.interface import Manifest, QuarantinedCopy
from ckptstage.daemon.tiers.s3.keys import REPLACE_DIR, Keys
from ckptstage.daemon.tiers.s3.objects import Objects, version
from ckptstage.protos import chunks, layout, packs


class S3Index:
    """The listings and reads of the tier under ``keys``' prefix, on one bucket's ``objects``."""

    def __init__(self, keys: Keys, objects: Objects) -> None:
        self._keys = keys
        self._objects = objects

    def list_jobs(self) -> list[str]:
        found = []
        for entry in self._objects.listing(self._keys.dir_key(self._keys.root), "/"):
            name = entry.get("Prefix", "").rstrip("/").rpartition("/")[2]
            try:
                found.append(layout.check_job(name))
            except layout.InvalidName:
                continue  # .tmp, and names the format does not make
        return sorted(found)

    def list_steps(self, job: str, step: int | None = None) -> Iterator[layout.StepRef]:
        """One listing of the job's steps (``<job>/step-``, chunks excluded), read for manifests and records."""
        job_key = self._keys.dir_key(self._keys.root / layout.check_job(job))
        prefix = job_key + (f"{layout.step_dirname(step)}/" if step is not None else "step-")
        parts: dict[int, list[layout.PartRef]] = {}
        records: dict[int, int] = {}
        for obj in self._objects.listing(prefix):
            names = obj.get("Key", "")[len(job_key):].split("/")
            s = layout.parse_step_dirname(names[0])
            if s is None:
                continue
            if names[1:] == [layout.COMMIT_FILE]:
                records[s] = version(obj["ETag"])
            elif len(names) == 3 and names[2] == layout.MANIFEST_FILE:
                r = layout.parse_rank_dirname(names[1])
                if r is not None:
                    parts.setdefault(s, []).append(layout.PartRef(job, s, r, self._keys.part_location(job, s, r),
                                                                  version(obj["ETag"])))
        for s in sorted(parts.keys() | records.keys()):
            yield layout.StepRef(job, s, self._keys.step_location(job, s),
                                 tuple(sorted(parts.get(s, []), key=lambda p: p.rank)), records.get(s))

    def has_part(self, part: Path) -> bool:
        return self.part_version(part) != 0

    def part_version(self, part: Path) -> int:
        head = self._objects.head(self._keys.key(part / layout.MANIFEST_FILE))
        return version(head["ETag"]) if head else 0

    def read_manifest(self, part: Path) -> tuple[Manifest, str]:
        path = part / layout.MANIFEST_FILE
        try:
            raw = self._objects.get(self._keys.key(path))
        except OSError as e:
            raise layout.ManifestError(f"{self._keys.url_of(path)}: unreadable manifest: {e}") from e
        return layout.parse_manifest_file(raw, path), layout.chunk_digest(raw)

    def has_commit_record(self, step: Path) -> bool:
        return self.record_version(step) != 0

    def read_commit_record(self, step: Path) -> layout.CommitRecord | None:
        path = step / layout.COMMIT_FILE
        try:
            raw = self._objects.get(self._keys.key(path))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise layout.ManifestError(f"{self._keys.url_of(path)}: unreadable commit record: {e}") from e
        return layout.parse_commit_record(raw, path)

    def record_version(self, step: Path) -> int:
        head = self._objects.head(self._keys.key(step / layout.COMMIT_FILE))
        return version(head["ETag"]) if head else 0

    def list_manifests(self, job: str) -> list[Path]:
        """The published parts, and the replacements any daemon is assembling in its temporaries."""
        parts = [p.path for s in self.list_steps(job) for p in s.parts]
        tmp = self._keys.all_temporaries()
        for owner in self._objects.listing(tmp, "/"):
            staging = owner.get("Prefix", "") + f"{REPLACE_DIR}/{layout.check_job(job)}/"
            for obj in self._objects.listing(staging):
                names = obj.get("Key", "")[len(staging):].split("/")
                if len(names) == 3 and names[2] == layout.MANIFEST_FILE and \
                        layout.parse_step_dirname(names[0]) is not None and layout.parse_rank_dirname(names[1]) \
                        is not None:
                    parts.append(self._keys.location(obj["Key"]).parent)
        return parts

    def manifest_version(self, part: Path) -> tuple[int, ...]:
        key = self._keys.key(part / layout.MANIFEST_FILE)
        head = self._objects.head(key)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no manifest {self._objects.where(key)}")
        return version(head["ETag"]), int(head["ContentLength"])

    def list_quarantined(self) -> list[QuarantinedCopy]:
        """Parts moved aside (``<job>/step-N/.corrupt-rank-R-<random>/``) and chunks
        (``<job>/chunks/.corrupt/<name>-<random>``, or a pack ``<id>-<random>.pack`` with its index); ``since``: their objects' newest LastModified (the copy
        that moved them aside)."""
        found: dict[Path, QuarantinedCopy] = {}

        def add(job: str, step: int | None, rank: int | None, where: Path, obj: dict[str, Any],
                chunk: str = "") -> None:
            was = found.get(where)
            since = obj["LastModified"].timestamp() if "LastModified" in obj else 0.0
            found[where] = QuarantinedCopy(job, step, rank, where, (was.nbytes if was else 0) + int(obj.get("Size", 0)),
                                           max(since, was.since if was else 0.0), chunk)

        for job in self.list_jobs():
            job_key = self._keys.dir_key(self._keys.root / job)
            for obj in self._objects.listing(job_key + "step-"):
                names = obj.get("Key", "")[len(job_key):].split("/")
                step = layout.parse_step_dirname(names[0])
                rank = layout.parse_corrupt_dirname(names[1]) if len(names) >= 3 else None
                if step is not None and rank is not None:
                    add(job, step, rank, self._keys.root / job / names[0] / names[1], obj)
            corrupt = f"{job_key}{chunks.CHUNKS_DIR}/{chunks.CORRUPT_DIR}/"
            for obj in self._objects.listing(corrupt):
                name = obj.get("Key", "")[len(corrupt):]
                chunk = chunks.corrupt_chunk_name(name) or (name if packs.is_pack_file(name) else None)
                if chunk is not None and "/" not in name:
                    add(job, None, None, self._keys.location(obj["Key"]), obj, chunk)
        return list(found.values())

    def delete_quarantined(self, location: Path) -> int:
        """Deletes the objects of a copy :meth:`list_quarantined` lists; refuses (ValueError) any other."""
        if layout.parse_corrupt_dirname(location.name) is not None and \
                layout.parse_step_dirname(location.parent.name) is not None:
            found = [o for o in self._objects.listing(self._keys.dir_key(location)) if "Key" in o]
        elif (chunks.corrupt_chunk_name(location.name) is not None or packs.is_pack_file(location.name)) \
                and location.parent.name == chunks.CORRUPT_DIR:
            key = self._keys.key(location)
            head = self._objects.head(key)
            found = [] if head is None else [{"Key": key, "Size": int(head["ContentLength"])}]
            if found and packs.is_pack_file(location.name):  # its index went aside with it
                found.append({"Key": self._keys.key(packs.index_beside(location)), "Size": 0})
        else:
            raise ValueError(f"{self._objects.where(self._keys.key(location))} is not a copy moved aside as corrupt")
        if not found:
            raise FileNotFoundError(errno.ENOENT, f"no quarantined copy {self._objects.where(self._keys.key(location))}")
        self._objects.delete_many([o["Key"] for o in found])
        return sum(int(o.get("Size", 0)) for o in found)
