"""Repacking: the live chunks of a mostly dead pack copied into a new pack, so that the sweep can remove the old.

A pack goes only as a whole (:mod:`ckptstage.daemon.catalog.chunkstore`). A
pack whose step was deleted but some of whose chunks later steps still name
(the frozen base of a fine-tune, saved with the first step's adapters)
would keep its dead bytes for as long as those chunks live. So a sweep
repacks a pack whose named chunks hold less than :data:`LIVE_BELOW` of its
bytes (and whose dead bytes are worth a copy): the named chunks are read,
each checked against its name (the xxh3-128 of its bytes), written into a
new pack through the tier's batch, and published with its index. Only then
does the old pack hold nothing that no other pack holds, and the same
sweep's condemn (and a later delete) takes it. A crash at any point leaves
every named chunk in at least one published pack: before the new index is
renamed into place the old pack is untouched; after it, both hold them.

Repacks take the node's load gate like drains (a restore comes first) and
copy at most ``budget`` bytes per sweep of a job.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ckptstage.daemon.logs import fields
from ckptstage.daemon.tiers.interface import Pack, Tier
from ckptstage.protos import chunks

log = logging.getLogger(__name__)

LIVE_BELOW = 0.5           # a pack is repacked when its named chunks hold less than this share of its bytes
MIN_DEAD_BYTES = 1 << 20   # ... and it holds at least this many bytes no part names
BUDGET_BYTES = 1 << 30     # live bytes one sweep of a job copies at most


def worth_repacking(pack: Pack, marked: set[str]) -> bool:
    live = sum(n for name, n in pack.chunks if name in marked)
    return 0 < live < LIVE_BELOW * pack.nbytes and pack.nbytes - live >= MIN_DEAD_BYTES


def repack(tier: Tier, job: str, stored: list[Pack], marked: set[str], budget: int = BUDGET_BYTES,
           pace: Callable[[int], None] = lambda n: None) -> int:
    """Repacks the packs of ``stored`` worth it (oldest first) within ``budget``; returns the bytes copied.
    ``pace(n)`` is called before each chunk is written (the load gate). A chunk that fails its check stops
    that pack's repack (the copy stays where it is; the quarantine deals with a corrupt chunk)."""
    copied = 0
    for pack in sorted(stored, key=lambda p: p.mtime):
        if not worth_repacking(pack, marked):
            continue
        live = [(name, n) for name, n in pack.chunks if name in marked]
        if copied + sum(n for _, n in live) > budget:
            break
        try:
            copied += _copy(tier, job, live, pace)
        except (OSError, ValueError) as e:
            log.warning("cannot repack pack %s of %s on %s: %s", pack.pack_id, job, tier.location, e,
                        extra=fields(job=job, error=e, path=tier.location))
            continue
        log.info("repacked pack %s of %s on %s: %d live bytes of %d copied into a new pack", pack.pack_id, job,
                 tier.location, sum(n for _, n in live), pack.nbytes, extra=fields(job=job, path=tier.location))
    return copied


def _copy(tier: Tier, job: str, live: list[tuple[str, int]], pace: Callable[[int], None]) -> int:
    batch = tier.new_chunks(job)
    try:
        for name, size in live:  # size: what the chunk is stored as (a compressed one's frame)
            def write(view: memoryview, name: str = name, size: int = size) -> None:
                pace(size)
                batch.write(name, view, direct_io=True)

            with tier.open_chunk(job, name) as f:  # its bytes, decoded where it is kept compressed
                if not chunks.copy_checked(name, f.size, f.readinto, write):
                    raise ValueError(f"chunk {name} does not hash to its name (or is short): left in place")
        batch.publish()
    finally:
        batch.discard()
    return sum(n for _, n in live)
