"""How the drains to the shared tier are going, per job and for the tier: plain records the drain queue fills.

``ckptstage status``, ``ckptstage jobs``, the metrics and the janitor read
them; nothing here imports the rest of the daemon.
"""

from __future__ import annotations

from dataclasses import dataclass

# DrainHealth.state values.
IDLE = "idle"            # nothing of the job waits to be drained
DRAINING = "draining"    # parts are queued or being copied, and no copy failed since the last success
RETRYING = "retrying"    # copies fail with errors that may pass (the tier's backoff); the local copies stay
FAILED = "failed"        # a copy failed for good (a corrupt local copy, a conflicting part on the shared tier)
DISABLED = "disabled"    # the daemon has no shared tier


@dataclass(frozen=True)
class DrainHealth:
    """How one job's drains to the shared tier are going.

    ``last_error``/``last_error_time`` (unix seconds) and
    ``consecutive_failures`` count failed copies of the job's parts since its
    last successful drain; a successful drain clears them.
    """

    state: str
    queued_parts: int
    queued_bytes: int
    last_error: str = ""
    last_error_time: float = 0.0
    consecutive_failures: int = 0


NO_DRAIN = DrainHealth(DISABLED, 0, 0)


@dataclass(frozen=True)
class TierHealth:
    """The shared tier as the drainer sees it: degraded while some job's drains fail (since that job's last
    success) or the tier cannot be indexed; ``last_error`` is the newest such failure ("" none)."""

    degraded: bool
    last_error: str = ""
    last_error_time: float = 0.0
