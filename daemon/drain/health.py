"""How the drains to the shared tier are going, per job and for the tier: the records, and the book of failures.

``ckptstage status``, ``ckptstage jobs`` and the metrics read
the records; the drain queue keeps the :class:`FailureBook` they are made
from. Nothing here imports the rest of the daemon.
"""

from __future__ import annotations

from collections.abc import Callable
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


@dataclass
class _Failures:
    """A job's failed copies since its last successful drain."""

    count: int = 0
    error: str = ""
    when: float = 0.0       # unix seconds
    gave_up: bool = False   # one of them was permanent (a corrupt local copy, a conflict)


class FailureBook:
    """The failed copies of each job since its last successful drain, and the tier's own error (it cannot be
    indexed or re-read): what the records above are made of. Not locked: the drain queue holds its lock."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock  # wall time of failures (what operators read)
        self._jobs: dict[str, _Failures] = {}
        self._tier_error: tuple[str, float] | None = None

    def failed(self, job: str, error: str, permanent: bool) -> None:
        """One more failed copy of ``job``'s; ``permanent``: one that retrying cannot fix."""
        failures = self._jobs.setdefault(job, _Failures())
        failures.count += 1
        failures.error = error
        failures.when = self._clock()
        failures.gave_up = failures.gave_up or permanent

    def succeeded(self, job: str) -> None:
        """A copy of ``job``'s worked: its drains, and the tier, work again."""
        self._jobs.pop(job, None)
        self._tier_error = None

    def gone(self, job: str) -> None:
        """Nothing of ``job`` waits for the tier any more: what kept failing is gone (a failure for good stays)."""
        failures = self._jobs.get(job)
        if failures is not None and not failures.gave_up:
            del self._jobs[job]

    def set_tier_error(self, error: str | None) -> None:
        self._tier_error = None if error is None else (error, self._clock())

    def job(self, job: str, queued_bytes: list[int], staged: bool) -> DrainHealth:
        """``job``'s record, given the sizes of its parts in the queue and whether a replacement of its waits."""
        failures = self._jobs.get(job) or _Failures()
        if failures.gave_up:
            state = FAILED
        elif failures.count and queued_bytes:
            state = RETRYING
        elif queued_bytes or staged:
            state = DRAINING
        else:
            state = IDLE
        return DrainHealth(state, len(queued_bytes), sum(queued_bytes), failures.error, failures.when, failures.count)

    def tier(self) -> TierHealth:
        """Degraded while a job's drains fail (since its last success) or the tier cannot be indexed."""
        errors = [(f.when, f.error) for f in self._jobs.values() if f.count]
        if self._tier_error is not None:
            errors.append((self._tier_error[1], self._tier_error[0]))
        if not errors:
            return TierHealth(False)
        when, error = max(errors)
        return TierHealth(True, error, when)
