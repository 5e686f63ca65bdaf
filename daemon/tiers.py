"""Which implementation serves a tier: the one place a new kind of tier is plugged in.

A tier is named by its configuration (``[local] dir``, ``[shared] dir``):
a directory is the file-system tier (:class:`FsTier`). A new kind (an
S3-compatible object store under ``[shared] url``, say) is one module
implementing :class:`ckptstage.daemon.tier.Tier`, and one line here.
"""

from __future__ import annotations

from pathlib import Path

from ckptstage.daemon.config import Config
from ckptstage.daemon.fstier import FsTier
from ckptstage.daemon.tier import Tier, TierName


def open_tiers(config: Config, owner: str) -> dict[TierName, Tier]:
    """The storage of each disk tier ``config`` names, as the daemon ``owner`` uses it (no shared tier:
    no entry)."""
    tiers: dict[TierName, Tier] = {TierName.LOCAL: FsTier(config.local.dir, owner)}
    if config.shared.dir is not None:
        tiers[TierName.SHARED] = FsTier(config.shared.dir, owner)
    return tiers


def as_tier(where: Tier | Path, owner: str = "") -> Tier:
    """``where`` as a tier: a path is the file-system tier at that directory (what callers written before
    :class:`Tier` existed pass). ``owner`` names this daemon's temporaries there; indexing needs none."""
    return FsTier(where, owner) if isinstance(where, Path) else where


def holding(part: Path) -> Tier:
    """The file-system tier a published part lies in (``<tier>/<job>/step-N/rank-R``), for callers that
    were given a part but not its tier."""
    return FsTier(part.parents[2])
