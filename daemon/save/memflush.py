"""At stop, each job's newest step kept only in memory written to local SSD, where the stop's drain takes it.

With ``[local] persist_every`` > 1 most steps are committed in shared memory
only: the session's arena (its trainer alive) or the memory tier (its trainer
gone) holds the image and the manifest vouching for it. A node going away
takes them along, and a daemon restart drops them. So before it stops, and
when it drains on stop (:mod:`ckptstage.daemon.drain.stopdrain`), the daemon writes
each job's newest memory-only step to its local tier, when that step is newer
than every step there and every rank this node holds an image of has one of
it: the part as its save would have written it (the same manifest), each
block checked against the manifest's digest as it is copied out of the arena
(a save that began after the image and never finished may have overwritten
part of it: such a rank is skipped and named), committed, indexed and sealed.
The stop's drain then finds it as the newest whole local step.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ckptstage.daemon.catalog.index import Catalog, Part, TierName
from ckptstage.daemon.catalog.commits import Commits
from ckptstage.daemon.logs import fields
from ckptstage.daemon.save.memtier import Resident, data_entry
from ckptstage.daemon.tiers.interface import Tier
from ckptstage.protos import layout

log = logging.getLogger(__name__)

COPY_BYTES = 16 << 20  # copied out of the arena, checked and written this much at a time


@dataclass(frozen=True)
class Outcome:
    """The parts :func:`persist_newest` committed, and the (job, step, rank, why) of those it could not."""

    written: list[Part]
    missed: list[tuple[str, int, int, str]]


def newest_steps(images: Iterable[Resident], catalog: Catalog) -> list[list[Resident]]:
    """Per job, the images of its newest memory-only step when that step is newer than every step of the job
    on the local tier and has an image for every rank this node holds one of (one attempt, one world size)."""
    by_job: dict[str, list[Resident]] = defaultdict(list)
    for r in images:
        if r.part_dir is None and r.manifest is not None:
            by_job[r.job].append(r)
    chosen = []
    for job, held in sorted(by_job.items()):
        ranks_here = {r.rank for r in held}
        on_local = max((c.step for c in catalog.checkpoints(job) if c.ranks_on(TierName.LOCAL)), default=-1)
        steps: dict[tuple[int, str, int], dict[int, Resident]] = defaultdict(dict)
        for r in held:
            steps[(r.step, r.attempt, r.world_size)][r.rank] = r
        whole = [key for key, ranks in steps.items() if set(ranks) == ranks_here and key[0] > on_local]
        if whole:
            newest = max(whole)
            chosen.append([steps[newest][rank] for rank in sorted(steps[newest])])
    return chosen


def persist_newest(images: Iterable[Resident], catalog: Catalog, tier: Tier, commits: Commits,
                   deadline: float, clock: Callable[[], float] = time.monotonic) -> Outcome:
    """Writes each job's newest memory-only step (:func:`newest_steps`) to ``tier``, indexes and seals it;
    a rank not written by ``deadline`` (on ``clock``) is missed."""
    written: list[Part] = []
    missed: list[tuple[str, int, int, str]] = []
    for ranks in newest_steps(images, catalog):
        job, step = ranks[0].job, ranks[0].step
        for r in ranks:
            if clock() >= deadline:
                missed.append((r.job, r.step, r.rank, "no time left"))
                continue
            try:
                part = _write(r, tier)
            except layout.ChecksumMismatch as e:
                missed.append((r.job, r.step, r.rank, f"the image was overwritten since its commit (a save begun "
                                                      f"after it did not finish): {e}"))
                continue
            except (OSError, ValueError) as e:  # a ManifestError is a ValueError
                missed.append((r.job, r.step, r.rank, str(e)))
                continue
            catalog.add(part)
            written.append(part)
        if any(p.job == job and p.step == step for p in written):
            try:
                commits.seal_local(job, step)
            except OSError as e:
                log.error("cannot write the local commit record of %s step %d: %s (written on restart)", job,
                          step, e, extra=fields(job=job, step=step, tier=TierName.LOCAL, error=e))
    return Outcome(written, missed)


def log_outcome(outcome: Outcome, why: str) -> None:
    """One line per step written (INFO) and per rank that was not (WARNING)."""
    steps: dict[tuple[str, int], list[Part]] = defaultdict(list)
    for part in outcome.written:
        steps[(part.job, part.step)].append(part)
    for (job, step), parts in steps.items():
        nbytes = sum(p.nbytes for p in parts)
        log.info("%s: wrote %s step %d (kept in memory only) to local SSD: ranks %s, %d bytes", why, job, step,
                 ",".join(str(p.rank) for p in parts), nbytes,
                 extra=fields(job=job, step=step, tier=TierName.LOCAL, bytes=nbytes))
    for job, step, rank, reason in outcome.missed:
        log.warning("%s: %s step %d rank %d, kept in memory only, is not written to local SSD: %s; it is lost "
                    "when the daemon exits", why, job, step, rank, reason,
                    extra=fields(job=job, step=step, rank=rank, tier=TierName.LOCAL, error=reason))


def _write(r: Resident, tier: Tier) -> Part:
    """One rank's image as a committed part on ``tier``; every block checked as it leaves the arena."""
    assert r.manifest is not None
    manifest = layout.parse_manifest_file(r.manifest, r.where / layout.MANIFEST_FILE)
    entry = data_entry(r, manifest)
    writer = tier.begin_part(r.job, r.step, r.rank, replace=lambda _: False)
    try:
        sink = writer.create_file(layout.DATA_FILE, r.size, direct_io=False)
        try:
            span = max(entry.chunk_bytes, COPY_BYTES // entry.chunk_bytes * entry.chunk_bytes)
            buf = bytearray(min(span, max(r.size, 1)))
            with r.arena.view[r.offset:r.offset + r.size] as image:
                for start in range(0, r.size, span):
                    n = min(span, r.size - start)
                    buf[:n] = image[start:start + n]
                    with memoryview(buf)[:n] as piece:
                        # Checked after the copy: what is written is what was checked, whatever the arena's
                        # writer does meanwhile.
                        layout.verify_blocks(piece, entry, start // entry.chunk_bytes, r.where / layout.DATA_FILE)
                        sink.write(piece, start)
            sink.sync()
        finally:
            sink.close()
        path = writer.commit(manifest)
    except BaseException:
        writer.abort()
        raise
    return Part.from_manifest(layout.PartRef(r.job, r.step, r.rank, path, writer.ino), TierName.LOCAL, manifest,
                              writer.manifest_digest)
