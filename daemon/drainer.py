"""Local tier -> shared tier, in the background, bounded, rate-limited, retried and verified.

Order: newest first. When saves arrive faster than the shared file system
absorbs them, the checkpoint a job would restart from after losing this node
is the newest one, so it goes first; older parts drain when the backlog
allows. Nothing leaves the local tier before its shared copy is committed
(retention sees undrained parts as protected), so a backlog costs local disk,
never a checkpoint; ``ckptstage_drain_queue_*`` and ``ckptstage_drain_lag_seconds``
make it visible.

Each copy reads every source chunk once, checks it against the local
manifest's checksum, writes it under the shared tier's ``.tmp/<node>/`` and
publishes with the same commit protocol as the local tier.
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ckptstage.daemon import fsutil
from ckptstage.daemon.catalog import Catalog, Checkpoint, Part, TierName
from ckptstage.daemon.config import SharedConfig
from ckptstage.daemon.errors import SaveFailed
from ckptstage.daemon.metrics import Metrics
from ckptstage.protos import layout

log = logging.getLogger(__name__)

Key = tuple[str, int, int]  # job, step, rank


class RateLimiter:
    """A token bucket shared by the drain workers (``[shared] max_bandwidth``)."""

    def __init__(self, rate: int | None, burst_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate = rate
        self._burst = (rate or 0) * burst_s
        self._tokens = self._burst
        self._clock, self._sleep = clock, sleep
        self._last = clock()
        self._lock = threading.Lock()

    def acquire(self, n: int) -> None:
        if not self.rate:
            return
        with self._lock:
            now = self._clock()
            self._tokens = min(self._burst, self._tokens + (now - self._last) * self.rate) - n
            self._last = now
            debt = -self._tokens
        if debt > 0:
            self._sleep(debt / self.rate)


class CorruptSource(Exception):
    """The local copy fails its own manifest: draining it would spread corruption."""


class Drainer:
    def __init__(self, config: SharedConfig, local_dir: Path, owner: str, catalog: Catalog, metrics: Metrics,
                 on_drained: Callable[[Part], None], on_corrupt: Callable[[Part, str], None] | None = None) -> None:
        assert config.dir is not None
        self.config = config
        self.shared_dir = config.dir
        self.local_dir = local_dir
        self.owner = owner
        self.catalog = catalog
        self.metrics = metrics
        self.reachable: bool | None = None
        self._on_drained = on_drained
        self._on_corrupt = on_corrupt
        self._limiter = RateLimiter(config.max_bandwidth)
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, int, Key]] = []  # (not_before, -step, seq, key)
        self._parts: dict[Key, Part] = {}      # queued or draining
        self._draining: set[Key] = set()
        self._failed: dict[Key, str] = {}      # permanent failures
        self._attempts: dict[Key, int] = {}
        self._seq = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # --- life cycle -----------------------------------------------------------------

    def recover(self) -> None:
        """Cleans this node's shared temporaries, indexes the shared tier, queues what is missing there."""
        try:
            fsutil.makedirs_durable(self.shared_dir)
            removed = fsutil.clean_temporaries(self.shared_dir, self.owner)
            n = self.catalog.load_tier(TierName.SHARED, self.shared_dir)
            self.reachable = True
            log.info("shared tier %s: %d committed parts, %d temporaries removed", self.shared_dir, n, removed)
        except OSError as e:
            self.reachable = False
            log.error("shared tier %s unreachable at start: %s (draining will retry)", self.shared_dir, e)
        for part in self.catalog.all_parts(TierName.LOCAL):
            self.enqueue(part)

    def start(self) -> None:
        for i in range(self.config.max_concurrent):
            t = threading.Thread(target=self._work, name=f"drain-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    # --- queue -------------------------------------------------------------------------

    def enqueue(self, part: Part, not_before: float = 0.0) -> None:
        key = (part.job, part.step, part.rank)
        if self._on_shared(key):
            return
        with self._cond:
            if key in self._parts and not_before == 0.0:
                return
            self._parts[key] = part
            self._failed.pop(key, None)
            self._seq += 1
            heapq.heappush(self._heap, (not_before, -part.step, self._seq, key))
            self._cond.notify()

    def pending(self) -> tuple[int, int]:
        with self._cond:
            return len(self._parts), sum(p.nbytes for p in self._parts.values())

    def lag_s(self) -> float:
        with self._cond:
            oldest = min((p.created for p in self._parts.values()), default=None)
        return max(0.0, time.time() - oldest) if oldest is not None else 0.0

    def busy_with(self, part: Part) -> bool:
        with self._cond:
            return (part.job, part.step, part.rank) in self._draining

    def checkpoint_state(self, ckpt: Checkpoint) -> str:
        keys = [(ckpt.job, ckpt.step, r) for r in ckpt.ranks_on(TierName.LOCAL)]
        with self._cond:
            if any(k in self._failed for k in keys):
                return "failed"
            if any(k in self._draining for k in keys):
                return "draining"
            if any(k in self._parts for k in keys):
                return "pending"
        return "drained"

    def wait_part(self, job: str, step: int, rank: int, timeout: float) -> bool:
        """True once the part is on the shared tier; raises if it never can be."""
        key = (job, step, rank)
        with self._cond:
            self._cond.wait_for(lambda: self._on_shared(key) or key in self._failed or key not in self._parts,
                                timeout)
            if self._on_shared(key):
                return True
            if key in self._failed:
                raise SaveFailed(f"draining {job} step {step} rank {rank} failed: {self._failed[key]}")
            if key not in self._parts:
                raise SaveFailed(f"{job} step {step} rank {rank} is neither queued for draining nor on the "
                                 "shared tier (deleted before it drained?)")
            return False

    def wait_idle(self, job: str | None, timeout: float) -> tuple[int, int]:
        """Waits until nothing (of ``job``) is queued; returns (still pending, failed)."""
        def counts() -> tuple[int, int]:
            mine = [k for k in self._parts if job in (None, k[0])]
            failed = [k for k in self._failed if job in (None, k[0])]
            return len(mine), len(failed)

        with self._cond:
            self._cond.wait_for(lambda: counts()[0] == 0, timeout)
            return counts()

    # --- copies ----------------------------------------------------------------------------

    def fetch(self, part: Part) -> Part:
        """Copies a shared part onto the local tier (prefetch before a restart)."""
        dest = self._copy(part, self.local_dir, rate_limited=False)
        return Part(part.job, part.step, part.rank, part.world_size, TierName.LOCAL, dest, part.nbytes,
                    part.created, part.metrics)

    def _work(self) -> None:
        while not self._stop.is_set():
            key = self._next()
            if key is None:
                continue
            part = self._parts[key]
            started = time.monotonic()
            try:
                dest = self._copy(part, self.shared_dir, rate_limited=True)
            except CorruptSource as e:
                self._give_up(key, f"local copy is corrupt: {e}")
                if self._on_corrupt is not None:
                    self._on_corrupt(part, str(e))
                continue
            except (OSError, layout.ManifestError) as e:
                self._retry(key, part, e)
                continue
            self.reachable = True
            self.metrics.drain_seconds.observe(time.monotonic() - started)
            self.metrics.saves_committed.labels("shared").inc()
            self.metrics.bytes_persisted.labels("shared").inc(part.nbytes)
            shared = Part(part.job, part.step, part.rank, part.world_size, TierName.SHARED, dest, part.nbytes,
                          part.created, part.metrics)
            self.catalog.add(shared)
            with self._cond:
                self._draining.discard(key)
                self._parts.pop(key, None)
                self._attempts.pop(key, None)
                self._cond.notify_all()
            log.info("drained %s step %d rank %d to %s (%d bytes, %.2fs)", part.job, part.step, part.rank,
                     self.shared_dir, part.nbytes, time.monotonic() - started)
            self._on_drained(shared)

    def _next(self) -> Key | None:
        with self._cond:
            while not self._stop.is_set():
                now = time.monotonic()
                ready = [e for e in self._heap if e[0] <= now and e[3] in self._parts and e[3] not in self._draining]
                if ready:
                    entry = min(ready, key=lambda e: (e[1], e[2]))
                    self._heap.remove(entry)
                    heapq.heapify(self._heap)
                    self._draining.add(entry[3])
                    return entry[3]
                waits = [e[0] - now for e in self._heap if e[3] in self._parts]
                self._cond.wait(min(waits) if waits else None)
            return None

    def _retry(self, key: Key, part: Part, error: Exception) -> None:
        attempt = self._attempts.get(key, 0) + 1
        self._attempts[key] = attempt
        delay = min(self.config.retry_max_s, self.config.retry_initial_s * 2 ** (attempt - 1))
        self.reachable = False
        self.metrics.drain_retries.inc()
        log.warning("drain of %s step %d rank %d failed (attempt %d): %s; retrying in %.1fs; the local copy "
                    "stays", part.job, part.step, part.rank, attempt, error, delay)
        with self._cond:
            self._draining.discard(key)
            self._seq += 1
            heapq.heappush(self._heap, (time.monotonic() + delay, -part.step, self._seq, key))
            self._cond.notify_all()

    def _give_up(self, key: Key, reason: str) -> None:
        log.error("not draining %s step %d rank %d: %s", *key, reason)
        with self._cond:
            self._draining.discard(key)
            self._parts.pop(key, None)
            self._failed[key] = reason
            self._cond.notify_all()

    def _on_shared(self, key: Key) -> bool:
        ckpt = self.catalog.get(key[0], key[1])
        return ckpt is not None and TierName.SHARED in ckpt.parts.get(key[2], {})

    def _copy(self, part: Part, tier_dir: Path, rate_limited: bool) -> Path:
        """Copies one part to ``tier_dir`` with the commit protocol; returns the committed directory."""
        manifest = layout.read_manifest(part.path)
        final = layout.part_dir(tier_dir, part.job, part.step, part.rank)
        if final.exists():
            layout.read_manifest(final)  # committed earlier (a crash after the rename): reuse it
            return final
        writer = fsutil.PartWriter(tier_dir, self.owner, part.job, part.step, part.rank)
        try:
            for name, entry in layout.manifest_files(manifest).items():
                self._copy_file(part.path / name, writer.path(name), entry, rate_limited)
            return writer.commit(manifest)
        finally:
            writer.abort()

    def _copy_file(self, src: Path, dst: Path, entry: layout.FileEntry, rate_limited: bool) -> None:
        buf = bytearray(entry.chunk_bytes)
        view = memoryview(buf)
        total = 0
        with open(src, "rb", buffering=0) as fin, open(dst, "wb", buffering=0) as fout:
            for i, expected in enumerate(entry.digests):
                n = fin.readinto(view)
                if layout.chunk_digest(view[:n]) != expected:
                    raise CorruptSource(f"{src} chunk {i}: checksum differs from its manifest")
                if rate_limited:
                    self._limiter.acquire(n)
                fsutil.pwrite_all(fout.fileno(), view[:n], total)
                total += n
            if total != entry.size or fin.read(1):
                raise CorruptSource(f"{src}: size differs from its manifest ({entry.size} bytes)")
            os.fsync(fout.fileno())
