"""Bringing a step's parts onto the local tier for readers: ``Prefetch``, and ``Locate``'s fetch-then-read.

A reader on a node that holds no copy of a part it needs (the job ran on
other nodes, or this node's copy aged out) can open the shared tier's copy
directly when that tier is a file system; an object store's copies cannot be
opened, so the part is first copied onto the local tier, verified block by
block as it is read (:meth:`ckptstage.daemon.drain.copier.PartCopier.fetch`).
:class:`Fetcher` runs those copies:

- **once per part**, however many readers ask at the same time: the eight
  ranks of a node restoring a resharded step each ask for every part, and
  the second asker waits for the copy the first one started;
- **several parts at once** (``parallel``), each part's files read with the
  tier's parallel ranged reads, so a restore is bound by the store's
  bandwidth or the local disk's, not by one request at a time.

A copy that fails its checksums is reported corrupt (the quarantine re-reads
it) and the fetch fails naming the part; nothing half-copied is ever
indexed: a part appears on the local tier only once its manifest is there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from ckptstage.daemon.catalog.index import Part
from ckptstage.daemon.drain.copier import CorruptSource
from ckptstage.daemon.errors import SaveFailed
from ckptstage.daemon.logs import fields
from ckptstage.daemon.tiers.interface import TierName

log = logging.getLogger(__name__)

PARALLEL_PARTS = 4  # parts copied at once; each reads its files with the source tier's own parallelism

Key = tuple[str, int, int, str]  # job, step, rank, the copy's manifest digest


class Fetcher:
    """Copies parts onto the local tier, each at most once at a time, ``parallel`` parts at once.

    ``copy(part)`` makes the local copy and indexes it, raising
    :class:`CorruptSource` when the source fails its checksums;
    ``report_corrupt(part, detail)`` hands such a copy to the quarantine.
    """

    def __init__(self, copy: Callable[[Part], None], report_corrupt: Callable[[Part, str], None],
                 parallel: int = PARALLEL_PARTS) -> None:
        self._copy = copy
        self._report_corrupt = report_corrupt
        self._pool = ThreadPoolExecutor(max(1, parallel), thread_name_prefix="fetch")
        self._lock = threading.Lock()
        self._running: dict[Key, Future[None]] = {}

    def fetch(self, parts: Sequence[Part]) -> int:
        """Copies ``parts`` (shared-tier copies) onto the local tier; returns once every one is there (or
        failed). Returns how many this call copied itself (a part another call was copying counts there).
        Raises :class:`SaveFailed` naming the first part that could not be copied."""
        started = time.monotonic()
        waits: list[tuple[Part, Future[None]]] = []
        mine = 0
        with self._lock:
            for part in parts:
                key = (part.job, part.step, part.rank, part.digest)
                future = self._running.get(key)
                if future is None:
                    future = self._pool.submit(self._one, key, part)
                    self._running[key] = future
                    mine += 1
                waits.append((part, future))
        failure: SaveFailed | None = None
        for part, future in waits:
            try:
                future.result()
            except SaveFailed as e:
                failure = failure or e
        if failure is not None:
            raise failure
        if mine:
            nbytes = sum(p.nbytes for p in parts)
            elapsed = time.monotonic() - started
            log.info("fetched %d part(s) of %s onto the local tier: %d bytes in %.2fs", len(parts),
                     _steps(parts), nbytes, elapsed,
                     extra=fields(job=parts[0].job, step=parts[0].step, tier=TierName.LOCAL, bytes=nbytes,
                                  duration_s=elapsed))
        return mine

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _one(self, key: Key, part: Part) -> None:
        try:
            self._copy(part)
        except CorruptSource as e:
            self._report_corrupt(part, str(e))
            raise SaveFailed(f"cannot fetch {part.job} step {part.step} rank {part.rank}: {e}") from None
        except OSError as e:
            raise SaveFailed(f"cannot fetch {part.job} step {part.step} rank {part.rank} from the "
                             f"{part.tier.value} tier: {e}") from e
        finally:
            with self._lock:
                self._running.pop(key, None)


def _steps(parts: Sequence[Part]) -> str:
    names = sorted({f"{p.job} step {p.step}" for p in parts})
    return ", ".join(names)
