"""Which implementation serves a tier: the one place a new kind of tier is plugged in.

A tier is named by its configuration: a directory (``[local] dir``,
``[shared] dir``) is the file-system tier (:class:`FsTier`); ``[shared] url =
"s3://bucket/prefix"`` is an S3-compatible object store
(:class:`ckptstage.daemon.tiers.s3.tier.S3Tier`). A new kind is one module
implementing :class:`ckptstage.daemon.tiers.interface.Tier`, and one line here.

The object-store tier needs the ``s3`` extra (boto3): it is imported here,
and only when a config names it, so the daemon without that extra never
loads it.
"""

from __future__ import annotations

from ckptstage.daemon.config import Config, ConfigError, SharedConfig
from ckptstage.daemon.tiers.fs import FsTier
from ckptstage.daemon.tiers.interface import Tier, TierName


def open_tiers(config: Config, owner: str) -> dict[TierName, Tier]:
    """The storage of each disk tier ``config`` names, as the daemon ``owner`` uses it (no shared tier:
    no entry)."""
    tiers: dict[TierName, Tier] = {TierName.LOCAL: FsTier(config.local.dir, owner)}
    if config.shared.url is not None:
        tiers[TierName.SHARED] = open_object_store(config.shared, owner)
    elif config.shared.dir is not None:
        tiers[TierName.SHARED] = FsTier(config.shared.dir, owner, config.shared.compression)
    return tiers


def open_object_store(config: SharedConfig, owner: str) -> Tier:
    """The object-store tier ``config.url`` names; nothing is sent to it yet (its ``prepare`` checks it).

    Raises :class:`ConfigError` naming ``shared.url`` when the ``s3`` extra is not installed.
    """
    try:
        from ckptstage.daemon.tiers.s3 import tier as s3tier  # the s3 extra: loaded only for a tier that needs it
    except ImportError as e:
        raise ConfigError("shared.url", f"{config.url} is an object store, which needs the s3 extra "
                                        f"(pip install 'ckptstage[s3]'): {e}") from None
    return s3tier.S3Tier.from_config(config, owner)

