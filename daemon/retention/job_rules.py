"""Per-job retention overrides: what a job asked for, kept across restarts and shared across nodes."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ckptstage.daemon import fsutil
from ckptstage.daemon.errors import InvalidRequest
from ckptstage.daemon.logs import fields
from ckptstage.daemon.retention.planner import KeepBest
from ckptstage.daemon.tiers.interface import Tier

log = logging.getLogger(__name__)

# A job's retention overrides, published beside its checkpoints on the shared tier
# (<shared>/<job>/retention.json, ignored by tier scans) for the other nodes' daemons.
JOB_RULES_FILE = "retention.json"
# How long rules read from the shared tier (another node's job) are used before being read again: the
# drain applies retention after each part, and W parts must not cost W reads of the same small file.
SHARED_RULES_TTL_S = 5.0


@dataclass(frozen=True)
class JobRetention:
    """A job's own retention wishes, sent when its client opens a session (0 / "" = none).

    Policy: a job's rules are *added* to the operator's, so a job can keep
    more than the operator's rules would, never less, and never delete
    anything the operator's rules keep. Concretely:

    * ``local_keep_last`` and ``shared_keep_last`` raise the tier's
      ``keep_last`` up to ``[retention] max_job_keep_last`` (a value below the
      operator's has no effect: it would delete more);
    * ``shared_keep_every`` also keeps every step divisible by it, besides
      the operator's ``keep_every``;
    * ``keep_best_*`` also keeps the job's best ``n`` (``n`` capped at
      ``max_job_keep_last``) by its metric, besides the operator's ``keep_best``.

    Space watermarks (``local.max_bytes``, ``local.min_free_bytes``) stay the
    operator's alone: they protect the node, and still evict drained
    checkpoints a job asked to keep. Pins already let any job keep any step;
    the cap bounds only what rules keep by count.

    The latest session of a job sets its rules (an empty set resets them).
    They outlive the session and restarts (``.state/job-retention.json``),
    and are published on the shared tier beside the job's checkpoints, so
    that every node's daemon, which all apply the shared rules to every job
    they index there, applies the job's rules too.
    """

    local_keep_last: int = 0
    shared_keep_last: int = 0
    shared_keep_every: int = 0
    keep_best_metric: str = ""
    keep_best_mode: str = ""
    keep_best_n: int = 0

    @classmethod
    def parse(cls, overrides: Mapping[str, object]) -> JobRetention:
        """Validates a session's overrides; raises :class:`InvalidRequest` naming the bad one."""
        known = {f: t for f, t in cls.__annotations__.items()}
        values: dict[str, Any] = {}
        for key, value in overrides.items():
            if key not in known:
                raise InvalidRequest(f"unknown retention override {key!r} (known: {', '.join(sorted(known))})")
            if known[key] == "str":
                if not isinstance(value, str):
                    raise InvalidRequest(f"retention override {key} must be a string, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidRequest(f"retention override {key} must be an integer >= 0, got {value!r}")
            values[key] = value
        rules = cls(**values)
        if not rules.keep_best_metric and (rules.keep_best_mode or rules.keep_best_n):
            raise InvalidRequest("retention overrides keep_best_mode / keep_best_n need keep_best_metric")
        try:
            rules.keep_best(cap=max(rules.keep_best_n, 1))
        except ValueError as e:  # the rule's own check, e.g. a mode that is not "min" or "max"
            raise InvalidRequest(f"retention override {e} (keep_best_mode, with keep_best_metric)") from None
        return rules

    def keep_best(self, cap: int) -> KeepBest | None:
        """The job's own keep_best rule with ``n`` (default 1) capped at ``cap``; None without a metric."""
        if not self.keep_best_metric:
            return None
        return KeepBest(self.keep_best_metric, self.keep_best_mode, min(self.keep_best_n or 1, cap))  # type: ignore[arg-type]

    @property
    def empty(self) -> bool:
        return self == JobRetention()


class JobRules:
    """The overrides of every job this daemon knows: its own sessions' and other nodes' published ones."""

    def __init__(self, state_file: Path, shared: Tier | None, clock: Callable[[], float] = time.monotonic) -> None:
        """``shared``: the shared tier's storage, None without one."""
        self._file = state_file
        self._shared = shared
        self._rules: dict[str, JobRetention] = {}
        self._lock = threading.Lock()
        self._unpublished: set[str] = set()  # jobs whose rules the shared tier does not have yet
        self._read: dict[str, tuple[float, JobRetention | None]] = {}  # job -> (when read, rules) from the tier
        self._clock = clock

    def load(self) -> None:
        """Reads the overrides this daemon recorded before it (re)started."""
        try:
            saved = fsutil.read_json(self._file, {})
            self._rules = {str(job): JobRetention.parse(rules) for job, rules in saved.items()}
        except (OSError, ValueError, AttributeError) as e:
            log.error("ignoring job retention overrides in %s: %s", self._file, e, extra=fields(error=e))

    def set(self, job: str, rules: JobRetention) -> bool:
        """The job's latest session sets its rules; they outlive the session (and restarts).

        Returns whether they changed: then the caller has :meth:`publish` run
        on a thread that may wait on the shared tier (never the caller's).
        """
        with self._lock:  # the ranks of a job open their sessions at once
            if self._rules.get(job) == rules:
                return False  # an empty set is recorded too: it resets what an earlier session asked for
            self._rules = {**self._rules, job: rules}  # readers use the dict without the lock
            log.info("job %s retention overrides: %s", job,
                     {k: v for k, v in asdict(rules).items() if v} or "none (the operator's rules)",
                     extra=fields(job=job))
            snapshot = {j: asdict(r) for j, r in sorted(self._rules.items())}
            try:
                fsutil.write_json_atomic(self._file, snapshot)
            except OSError as e:
                log.warning("cannot persist job retention overrides to %s: %s", self._file, e,
                            extra=fields(job=job, tier="local", error=e))
            self._unpublished.add(job)
        return self._shared is not None

    def publish(self) -> None:
        """Writes the rules of jobs whose sessions opened here to the shared tier (retried by the timer)."""
        if self._shared is None:
            return
        with self._lock:
            todo = {job: self._rules[job] for job in self._unpublished if job in self._rules}
        for job, rules in todo.items():
            try:
                self._shared.write_job_json(job, JOB_RULES_FILE, asdict(rules))
            except OSError as e:
                log.warning("cannot publish job %s retention overrides on the shared tier: %s (will retry)", job, e,
                            extra=fields(job=job, tier="shared", error=e))
                continue
            with self._lock:
                if self._rules.get(job) == rules:
                    self._unpublished.discard(job)

    def for_job(self, job: str, read_shared: bool = True) -> JobRetention:
        """The job's rules: from its sessions here, else as another node published them, else none.

        ``read_shared=False`` never touches the shared tier (the local retention pass).
        """
        rules = self._rules.get(job)
        if rules is None and read_shared and self._shared is not None:
            rules = self._published(job, self._shared)
        return rules or JobRetention()

    def _published(self, job: str, shared: Tier) -> JobRetention | None:
        """The rules another node published for ``job``, read at most every :data:`SHARED_RULES_TTL_S`."""
        now = self._clock()
        with self._lock:
            cached = self._read.get(job)
        if cached is not None and now - cached[0] < SHARED_RULES_TTL_S:
            return cached[1]
        rules = None
        try:
            rules = JobRetention.parse(shared.read_job_json(job, JOB_RULES_FILE, {}))
        except (OSError, ValueError, AttributeError) as e:
            log.warning("ignoring %s/%s/%s: %s", shared.location, job, JOB_RULES_FILE, e,
                        extra=fields(job=job, tier="shared", error=e))
        with self._lock:
            self._read[job] = (now, rules)
            for old in [j for j, (t, _) in self._read.items() if now - t >= SHARED_RULES_TTL_S]:
                del self._read[old]
        return rules
