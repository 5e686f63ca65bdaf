"""The memory tier: each rank's newest checkpoint kept in shared memory after its trainer exits.

Most failures of a large job are one process dying on a healthy node. The
bytes of that process's newest committed save are still in its arena: the
trainer copied them there, and the persister wrote them to disk from there.
Instead of freeing the arena when the session closes, the daemon keeps it
(charged to the same ``[arena] max_bytes`` budget), checks that the image
still matches the committed part (a save that began after it and never
finished may have overwritten it), and hands its descriptor to a restarted
trainer (:mod:`ckptstage.daemon.serve.handoff`), which maps it copy-on-write and
verifies it again as it builds its tensors. Nothing is copied a second time.

A copy is never written again once kept: the session that wrote it is
closed, and a new session always gets a new arena. A copy is served only
while its manifest is the committed one of that step and rank on some tier
(so a step deleted or replaced on disk is never read from memory), and
kept for ``[memory] keep_s``; a newer committed step of the same job and
rank, or a session that needs the budget, drops it sooner.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptstage.daemon.save.arena import Arena, Budget
from ckptstage.daemon.logs import fields
from ckptstage.protos import layout

log = logging.getLogger(__name__)

PENDING_WAIT_S = 10.0  # how long a reader waits for a copy still being checked before it reads the disk


@dataclass(frozen=True)
class Resident:
    """A committed save whose file image lies whole, in one piece, in its session's arena."""

    job: str
    step: int
    rank: int
    world_size: int
    attempt: str
    arena: Arena
    offset: int   # of the image's first byte in the arena
    size: int     # the data file's size
    part_dir: Path | None  # the committed part it is an image of; None: a save kept in memory only
    manifest: bytes | None = None  # a memory-only save's manifest.json (the others' is read from part_dir)

    @property
    def where(self) -> Path:
        """What messages name: the part's directory, or where it would be."""
        return self.part_dir or Path(f"memory:{self.job}/step-{self.step:012d}/rank-{self.rank:05d}")


@dataclass
class MemoryCopy:
    resident: Resident
    manifest: bytes   # the part's manifest.json, as committed
    digest: str       # its xxh3-64: what the catalog and commit records name
    kept_at: float    # monotonic
    created: float    # unix seconds, when kept
    verified: bool = False
    dropped: bool = False
    freed: bool = False  # its arena closed and its budget share released

    @property
    def memory_only(self) -> bool:
        return self.resident.part_dir is None

    @property
    def key(self) -> tuple[str, int]:
        return self.resident.job, self.resident.rank


@dataclass(frozen=True)
class MemoryStep:
    """A step kept in memory only, whole: every rank of one attempt (a job on one node)."""

    job: str
    step: int
    world_size: int
    attempt: str
    nbytes: int
    created: float


@dataclass(frozen=True)
class Handout:
    """What a reader gets: a duplicate of the arena's descriptor and where the image is in it."""

    fd: int
    offset: int
    size: int
    arena_size: int
    manifest: bytes


class MemoryTier:
    """The kept copies, at most one per (job, rank): the newest."""

    def __init__(self, budget: Budget, enabled: bool, keep_s: float,
                 committed_digest: Callable[[str, int, int], str | None],
                 newest_complete: Callable[[str], int | None] = lambda job: None) -> None:
        """``committed_digest(job, step, rank)``: the manifest digest of the part the step's commit names now
        (None: no such committed part); ``newest_complete(job)``: the job's newest complete step on disk."""
        self._budget = budget
        self._committed_digest = committed_digest
        self._newest_complete = newest_complete
        self.enabled = enabled
        self.keep_s = keep_s
        self._lock = threading.Lock()
        self._copies: dict[tuple[str, int], MemoryCopy] = {}
        self._verifier: threading.Thread | None = None
        self._pending: list[MemoryCopy] = []
        self._wake = threading.Condition(self._lock)
        self._stopping = False

    # --- taking copies over ---------------------------------------------------------

    def take(self, resident: Resident | None, arena: Arena) -> bool:
        """A closed session lets go of ``arena``; True when this tier keeps it (and its budget share).

        Kept only when it holds the session's newest committed save; the
        image is checked against the committed part's digests on a thread of
        this tier's before it is served.
        """
        if not self.enabled or resident is None or resident.arena is not arena:
            return False
        newest = self._newest_complete(resident.job)
        if newest is not None and newest > resident.step:
            log.info("memory tier: not keeping %s step %d rank %d: step %d is newer", resident.job, resident.step,
                     resident.rank, newest, extra=_fields(resident, newer_step=newest))
            return False  # a session that closes after its job moved on: a restart would not read it
        try:
            manifest = resident.manifest if resident.manifest is not None else \
                (resident.where / layout.MANIFEST_FILE).read_bytes()
            layout.parse_manifest_file(manifest, resident.where / layout.MANIFEST_FILE)  # a torn read is refused
        except (OSError, layout.ManifestError) as e:
            log.info("memory tier: not keeping %s step %d rank %d: %s", resident.job, resident.step,
                     resident.rank, e, extra=_fields(resident, error=e))
            return False
        copy = MemoryCopy(resident, manifest, layout.chunk_digest(manifest), time.monotonic(), time.time())
        with self._lock:
            if self._stopping:
                return False
            arena.unlink()  # a client that never said it mapped the arena left its name: a kept copy has none
            older = self._copies.get(copy.key)
            if older is not None and older.resident.step > resident.step:
                return False  # a newer step of this rank is already kept
            self._pending.append(copy)
            self._start_verifier()
            self._wake.notify_all()
        return True

    def superseded(self, job: str, rank: int, step: int) -> None:
        """``step`` of (job, rank) committed: an older kept copy is no longer the newest; it goes."""
        with self._lock:
            copy = self._copies.get((job, rank))
            if copy is None or copy.resident.step >= step:
                return
            self._drop_locked(copy, "a newer step committed")

    # --- serving ------------------------------------------------------------------------

    def has(self, job: str, step: int, rank: int) -> bool:
        """Whether the verified copy of that committed part is kept."""
        return self._servable(job, step, rank) is not None

    def holds(self, job: str, rank: int) -> bool:
        """Whether a copy of one of ``job``'s steps for ``rank`` is kept (or being checked to be)."""
        with self._lock:
            copy = self._copies.get((job, rank))
            return copy is not None and copy.verified or \
                any(c.key == (job, rank) and not c.dropped for c in self._pending)

    def hand_out(self, job: str, step: int, rank: int) -> Handout | None:
        """A duplicate descriptor of the copy's arena, for the reader; the caller closes ``fd``."""
        copy = self._servable(job, step, rank)
        with self._lock:
            if copy is None or copy.dropped:
                return None
            r = copy.resident
            return Handout(os.dup(r.arena.fd), r.offset, r.size, r.arena.size, copy.manifest)

    def _servable(self, job: str, step: int, rank: int) -> MemoryCopy | None:
        """The kept, verified copy of (job, step, rank), if it is the part committed now (its manifest is
        the one the step's commit names: a step deleted or replaced on disk is never read from memory)."""
        with self._lock:
            # A copy still being checked (a restart right after its trainer died) is waited for, briefly.
            self._wake.wait_for(lambda: not any(c.key == (job, rank) and c.resident.step == step and not c.dropped
                                                for c in self._pending), timeout=PENDING_WAIT_S)
            copy = self._copies.get((job, rank))
            if copy is None or not copy.verified or copy.resident.step != step:
                return None
        committed = self._committed_digest(job, step, rank)
        if copy.memory_only:  # served while no part of that step and rank is committed on disk
            return copy if committed is None else None
        return copy if committed == copy.digest else None

    def memory_steps(self, job: str) -> list[MemoryStep]:
        """``job``'s steps kept in memory only with every rank of one attempt here, newest first."""
        with self._lock:
            only = [c for c in self._copies.values() if c.verified and c.memory_only and c.resident.job == job]
        groups: dict[tuple[int, str, int], list[MemoryCopy]] = {}
        for c in only:
            groups.setdefault((c.resident.step, c.resident.attempt, c.resident.world_size), []).append(c)
        out = [MemoryStep(job, step, world, attempt, sum(c.resident.size for c in group),
                          max(c.created for c in group))
               for (step, attempt, world), group in groups.items()
               if sorted(c.resident.rank for c in group) == list(range(world))
               and all(self._servable(job, step, c.resident.rank) is c for c in group)]
        return sorted(out, key=lambda m: -m.step)

    def step_for(self, job: str, step: int | None) -> MemoryStep | None:
        """The step kept in memory only that a reader of ``step`` (the newest when None) gets: that step, or
        the newest when it is newer than every complete step on disk."""
        layout.check_job(job)
        kept = self.memory_steps(job)
        if step is not None:
            return next((m for m in kept if m.step == step), None)
        disk = self._newest_complete(job)
        return kept[0] if kept and (disk is None or kept[0].step > disk) else None

    def ranks(self, job: str, step: int, world_size: int) -> list[int]:
        """The ranks of a committed step whose part this tier holds."""
        return [r for r in range(world_size) if self.has(job, step, r)]

    def at_risk(self, job: str, rank: int, nbytes: int) -> bool:
        """Whether an arena of ``nbytes`` (the smallest granted, at least) for (job, rank) granted now would
        evict that rank's copy."""
        return self.holds(job, rank) and self._budget.total - self._budget.used < nbytes

    def wait_checked(self, timeout: float) -> bool:
        """Waits until no copy taken over is still being checked (each is then kept or let go); False at the
        timeout."""
        with self._lock:
            return self._wake.wait_for(lambda: not self._pending, timeout)

    def copies(self, job: str | None = None) -> list[MemoryCopy]:
        with self._lock:
            return [c for c in self._copies.values() if c.verified and (job is None or c.resident.job == job)]

    @property
    def bytes_kept(self) -> int:
        with self._lock:
            return sum(c.resident.arena.size for c in self._copies.values()) + \
                sum(c.resident.arena.size for c in self._pending)

    # --- letting go -----------------------------------------------------------------------

    def reclaim(self, need: int, owner: tuple[str, int] | None = None) -> None:
        """Drops copies until ``need`` bytes are back in the budget (or none is left): ``owner``'s own first
        (the (job, rank) asking: its new arena takes the copy's place; it has read it, or never will), then
        the oldest checked ones, then those still being checked (waited for: their memory is freed once
        the check lets go of it)."""
        freed = 0
        waiting: list[MemoryCopy] = []
        with self._lock:
            victims = sorted(list(self._copies.values()) + self._pending,
                             key=lambda c: (c.key != owner, not c.verified, c.kept_at))
            for copy in victims:
                if freed >= need:
                    break
                freed += copy.resident.arena.size
                self._drop_locked(copy, "a session needed the memory")
                if not copy.freed:
                    waiting.append(copy)
            self._wake.wait_for(lambda: all(c.freed for c in waiting), timeout=30)

    def expire(self, now: float | None = None) -> int:
        """Drops copies kept longer than ``keep_s``; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [c for c in self._copies.values() if now - c.kept_at > self.keep_s]
            for copy in old:
                self._drop_locked(copy, f"kept {self.keep_s:g}s")
        return len(old)

    def drop_job(self, job: str, step: int | None = None) -> tuple[int, int]:
        """A step (every step when None) of ``job`` was deleted or replaced: its copies go; (copies, bytes)."""
        with self._lock:
            gone = [c for c in list(self._copies.values()) + self._pending if c.resident.job == job
                    and (step is None or c.resident.step == step) and not c.dropped]
            for copy in gone:
                self._drop_locked(copy, "the step was deleted or replaced")
        return len(gone), sum(c.resident.size for c in gone)

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            for copy in list(self._copies.values()) + self._pending:
                self._drop_locked(copy, "daemon stopping")
            self._wake.notify_all()
            thread = self._verifier
        if thread is not None:
            thread.join(10)

    def _drop_locked(self, copy: MemoryCopy, why: str) -> None:
        if copy.dropped:
            return
        copy.dropped = True
        if self._copies.get(copy.key) is copy:
            del self._copies[copy.key]
        if copy in self._pending:
            return  # the verifier frees it when it is done with it
        self._free(copy, why)

    def _free(self, copy: MemoryCopy, why: str) -> None:
        r = copy.resident
        log.info("memory tier: dropped %s step %d rank %d (%d bytes): %s", r.job, r.step, r.rank, r.size, why,
                 extra=_fields(r, bytes=r.size, reason=why))
        r.arena.close()
        self._budget.release(r.arena.size)
        copy.freed = True
        self._wake.notify_all()

    # --- verification -----------------------------------------------------------------------

    def _start_verifier(self) -> None:
        if self._verifier is None or not self._verifier.is_alive():
            self._verifier = threading.Thread(target=self._verify_loop, name="memory-verify", daemon=True)
            self._verifier.start()

    def _verify_loop(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._stopping:
                    self._wake.wait()
                if not self._pending:
                    return
                copy = self._pending[0]
            try:
                ok, why = (False, "dropped") if copy.dropped else _image_matches(copy)
            except Exception as e:  # noqa: BLE001 - the copy must settle (and its budget go back) whatever failed
                # Unexpected (a bug, not a bad copy): the traceback is wanted.
                log.exception("memory tier: checking %s step %d rank %d failed", copy.resident.job,
                              copy.resident.step, copy.resident.rank, extra=_fields(copy.resident, error=e))
                ok, why = False, f"the check failed: {e}"
            with self._lock:
                self._pending.remove(copy)
                if copy.dropped or not ok:
                    if not copy.dropped:
                        copy.dropped = True
                        log.info("memory tier: %s step %d rank %d not kept: %s", copy.resident.job,
                                 copy.resident.step, copy.resident.rank, why,
                                 extra=_fields(copy.resident, reason=why))
                    self._free(copy, why)
                    continue
                older = self._copies.get(copy.key)
                if older is not None and older.resident.step > copy.resident.step:
                    copy.dropped = True
                    self._free(copy, "a newer step of the rank is kept")
                    continue
                if older is not None:
                    self._drop_locked(older, "a newer step is kept")
                copy.verified = True
                self._copies[copy.key] = copy
                self._wake.notify_all()
                r = copy.resident
                log.info("memory tier: keeping %s step %d rank %d (%d bytes) for a restart on this node",
                         r.job, r.step, r.rank, r.size, extra=_fields(r, bytes=r.size))


def _fields(r: Resident, bytes: int | None = None, error: object = None, **more: Any) -> dict[str, Any]:
    """The log fields of one rank's part in the memory tier."""
    return fields(job=r.job, step=r.step, rank=r.rank, tier="memory", bytes=bytes, error=error, **more)


def data_entry(r: Resident, manifest: dict[str, Any]) -> layout.FileEntry:
    """The (parsed) manifest's entry for the data file whose image ``r`` is, checked to describe exactly that
    image; raises :class:`layout.ManifestError` saying why not."""
    try:
        entry = layout.manifest_files(manifest)[layout.DATA_FILE]
    except KeyError as e:
        raise layout.ManifestError(f"{r.where / layout.MANIFEST_FILE}: no entry for {e}") from None
    if entry.size != r.size:
        raise layout.ManifestError(f"the image is {r.size} bytes, the part {entry.size}")
    if len(entry.digests) != layout.chunk_count(entry.size, entry.chunk_bytes):
        raise layout.ManifestError("the manifest's block list does not cover the image")
    return entry


def _image_matches(copy: MemoryCopy) -> tuple[bool, str]:
    """Whether the arena still holds exactly the committed data file (every digest block)."""
    r = copy.resident
    try:
        entry = data_entry(r, layout.parse_manifest_file(copy.manifest, r.where / layout.MANIFEST_FILE))
    except layout.ManifestError as e:
        return False, f"manifest: {e}"
    block, path = entry.chunk_bytes, r.where / layout.DATA_FILE
    with r.arena.view[r.offset:r.offset + r.size] as image:
        for i in range(len(entry.digests)):
            if copy.dropped:  # evicted meanwhile: its memory is wanted now, not after the whole check
                return False, "dropped while it was checked"
            try:
                layout.verify_block(image[i * block:(i + 1) * block], entry, i, path)
            except layout.ChecksumMismatch as e:
                return False, f"block {i} was overwritten (a later save began): {e.detail}"
    return True, ""
