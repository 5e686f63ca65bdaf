"""Retention rules for the local and shared tiers, as pure functions.

Checkpoint records in, a :class:`Plan` out: every step is either kept, with the
first rule that kept it, or deleted, with the rule that deleted it. There is no
I/O and no clock here: the caller lists a tier, plans, and carries out
``plan.delete``. Keeping the decision pure is what lets the tests check
invariant 2 of the architecture on thousands of cases: retention never deletes
the only copy (an undrained local checkpoint), the newest complete checkpoint,
or a pinned one.

Reason strings are stable: they are printed by ``ckptstage gc --dry-run`` and,
through :func:`rule_name`, used as Prometheus label values.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

# Keep reasons, in the priority order used to report the one that kept a step.
PINNED = "pinned"
NEWEST = "newest"
UNDRAINED = "undrained"
INCOMPLETE_NEWER = "incomplete_newer"
KEEP_LAST = "keep_last"
KEEP_EVERY = "keep_every"
KEEP_BEST = "keep_best"
NO_RULES = "no_rules"
KEEP_REASONS = (
    PINNED, NEWEST, UNDRAINED, INCOMPLETE_NEWER,
    KEEP_LAST, KEEP_EVERY, KEEP_BEST, NO_RULES,
)

# Delete reasons, as rule names (a keep_last deletion reads "keep_last=N").
MAX_BYTES = "max_bytes"
MIN_FREE_BYTES = "min_free_bytes"
UNKEPT = "unkept"
REQUESTED = "requested"   # not a rule: a user deleted the step (Client.delete, ckptstage rm)
REPLACED = "replaced"     # not a rule: a save with overwrite replaced the step
DELETE_REASONS = (KEEP_LAST, MAX_BYTES, MIN_FREE_BYTES, UNKEPT, REQUESTED, REPLACED)


def _check_count(name: str, value: int | None, minimum: int = 0) -> None:
    """Reject a non-int or too-small setting early, naming it, instead of planning nonsense."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class Record:
    """One checkpoint (one job, one step) as it exists on one tier.

    ``drained`` says the checkpoint is committed on the shared tier; pass True
    when judging the shared tier itself or when there is no shared tier.
    ``complete`` says every rank's part is present.
    """

    step: int
    nbytes: int
    drained: bool = True
    pinned: bool = False
    complete: bool = True
    metrics: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_count("step", self.step)
        _check_count("nbytes", self.nbytes)


@dataclass(frozen=True)
class KeepBest:
    """Keep the ``n`` checkpoints with the lowest (``"min"``) or highest (``"max"``) metric."""

    metric: str
    mode: Literal["min", "max"]
    n: int

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ValueError(f"keep_best mode must be 'min' or 'max', got {self.mode!r}")
        if not self.metric:
            raise ValueError("keep_best metric must be a non-empty name")
        _check_count("keep_best n", self.n)


@dataclass(frozen=True)
class LocalRules:
    """Rules for the node-local tier: a count, then two space watermarks.

    ``min_free_bytes`` is only applied when the caller passes ``free_bytes``.
    """

    keep_last: int | None = None
    max_bytes: int | None = None
    min_free_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_count("keep_last", self.keep_last)
        _check_count("max_bytes", self.max_bytes)
        _check_count("min_free_bytes", self.min_free_bytes)


@dataclass(frozen=True)
class SharedRules:
    """Rules for the shared tier: a checkpoint is kept if any configured rule keeps it."""

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: KeepBest | None = None

    def __post_init__(self) -> None:
        _check_count("keep_last", self.keep_last)
        _check_count("keep_every", self.keep_every, minimum=1)


@dataclass(frozen=True)
class Plan:
    """The verdict on every input step: ``keep`` and ``delete`` partition them.

    Both map step -> reason and iterate in ascending step order.
    """

    keep: Mapping[int, str]
    delete: Mapping[int, str]


def rule_name(reason: str) -> str:
    """The stable rule name in a reason (``"keep_last=2"`` -> ``"keep_last"``), for metric labels."""
    return reason.partition("=")[0]


def explain(plan: Plan) -> list[str]:
    """One human line per step, by step, e.g. ``"step 12: delete (keep_last=2)"``."""
    verdicts = [(step, "keep", why) for step, why in plan.keep.items()]
    verdicts += [(step, "delete", why) for step, why in plan.delete.items()]
    return [f"step {step}: {verdict} ({why})" for step, verdict, why in sorted(verdicts)]


def _by_step(records: Iterable[Record]) -> list[Record]:
    """Sort by step so plans do not depend on listing order; a step names one checkpoint."""
    ordered = sorted(records, key=lambda r: r.step)
    for older, newer in zip(ordered, ordered[1:]):
        if older.step == newer.step:
            raise ValueError(f"duplicate step {newer.step} in retention input")
    return ordered


def _newest_complete(ordered: Sequence[Record]) -> int | None:
    """The step a restore would pick: the newest one with every rank's part present."""
    return max((r.step for r in ordered if r.complete), default=None)


def _protection(record: Record, newest: int | None, local: bool) -> str | None:
    """Why no rule may delete this checkpoint, or None if rules decide.

    Incomplete checkpoints newer than the newest complete one (all of them when
    none is complete) may still be completing, so they are left alone.
    """
    if record.pinned:
        return PINNED
    if record.step == newest:
        return NEWEST
    if local and not record.drained:
        return UNDRAINED  # the only copy: it leaves local only once on shared
    if not record.complete and (newest is None or record.step > newest):
        return INCOMPLETE_NEWER
    return None


def _newest_steps(ordered: Sequence[Record], n: int) -> set[int]:
    """The ``n`` newest steps of a step-sorted sequence."""
    return {r.step for r in ordered[max(len(ordered) - n, 0):]}


def _finish(keep: dict[int, str], delete: dict[int, str]) -> Plan:
    """Freeze the verdicts into a Plan in ascending step order."""
    return Plan(keep=dict(sorted(keep.items())), delete=dict(sorted(delete.items())))


# --- local tier -------------------------------------------------------------


def _local_count_rule(
    ordered: Sequence[Record], protected: Mapping[int, str], keep_last: int | None
) -> tuple[dict[int, str], dict[int, str]]:
    """Apply protections and ``keep_last``; with no count rule every step stays for now."""
    recent = _newest_steps(ordered, keep_last) if keep_last is not None else set()
    keep: dict[int, str] = {}
    delete: dict[int, str] = {}
    for r in ordered:
        if r.step in protected:
            keep[r.step] = protected[r.step]
        elif keep_last is None:
            keep[r.step] = NO_RULES
        elif r.step in recent:
            keep[r.step] = KEEP_LAST
        else:
            delete[r.step] = f"{KEEP_LAST}={keep_last}"
    return keep, delete


def _evict(
    candidates: list[Record],
    keep: dict[int, str],
    delete: dict[int, str],
    reason: str,
    excess: int,
) -> None:
    """Delete the oldest candidates until ``excess`` bytes are freed or none are left.

    Candidates are kept, drained and unprotected, oldest first; running out of
    them means the watermark cannot be met, and protected checkpoints still stay.
    """
    while excess > 0 and candidates:
        victim = candidates.pop(0)
        del keep[victim.step]
        delete[victim.step] = reason
        excess -= victim.nbytes


def plan_local(
    records: Iterable[Record], rules: LocalRules, free_bytes: int | None = None
) -> Plan:
    """Decide which checkpoints stay on the node-local tier.

    Order: protections (pinned, newest complete, undrained, incomplete newer);
    then ``keep_last``; then ``max_bytes`` evicts the oldest evictable kept
    checkpoints while the kept total is over it; then, when ``free_bytes`` is
    given, ``min_free_bytes`` evicts more while ``free_bytes`` plus what this
    plan frees is under it. With no rules every checkpoint is kept.
    """
    ordered = _by_step(records)
    newest = _newest_complete(ordered)
    protected = {
        r.step: why for r in ordered if (why := _protection(r, newest, local=True))
    }
    keep, delete = _local_count_rule(ordered, protected, rules.keep_last)
    # Undrained ones are protected, so every candidate already has a shared copy.
    candidates = [r for r in ordered if r.step in keep and r.step not in protected]
    nbytes = {r.step: r.nbytes for r in ordered}
    if rules.max_bytes is not None:
        kept_bytes = sum(nbytes[s] for s in keep)
        _evict(candidates, keep, delete, MAX_BYTES, kept_bytes - rules.max_bytes)
    if rules.min_free_bytes is not None and free_bytes is not None:
        freed = sum(nbytes[s] for s in delete)
        _evict(candidates, keep, delete, MIN_FREE_BYTES,
               rules.min_free_bytes - free_bytes - freed)
    return _finish(keep, delete)


# --- shared tier ------------------------------------------------------------


def _has_metric(record: Record, metric: str) -> bool:
    """A record ranks for keep_best only with a real number for the metric (NaN is not)."""
    value = record.metrics.get(metric)
    return value is not None and not math.isnan(value)


def _best_steps(ordered: Sequence[Record], best: KeepBest) -> set[int]:
    """The ``best.n`` steps with the best metric; on a tie the newer step wins."""
    sign = 1.0 if best.mode == "min" else -1.0
    scored = [(sign * r.metrics[best.metric], -r.step) for r in ordered
              if _has_metric(r, best.metric)]
    return {-neg_step for _, neg_step in sorted(scored)[:best.n]}


def _shared_keepers(
    ordered: Sequence[Record], rules: SharedRules
) -> list[tuple[str, set[int]]]:
    """The steps each configured shared rule keeps, in reason priority order."""
    keepers: list[tuple[str, set[int]]] = []
    if rules.keep_last is not None:
        keepers.append((KEEP_LAST, _newest_steps(ordered, rules.keep_last)))
    if rules.keep_every is not None:
        every = rules.keep_every
        keepers.append((KEEP_EVERY, {r.step for r in ordered if r.step % every == 0}))
    if rules.keep_best is not None:
        keepers.append((KEEP_BEST, _best_steps(ordered, rules.keep_best)))
    return keepers


def _shared_reason(step: int, keepers: Sequence[tuple[str, set[int]]]) -> str | None:
    """The first configured rule that keeps ``step``; NO_RULES when none is configured."""
    if not keepers:
        return NO_RULES
    return next((why for why, steps in keepers if step in steps), None)


def plan_shared(records: Iterable[Record], rules: SharedRules, *more: SharedRules) -> Plan:
    """Decide which checkpoints stay on the shared tier.

    A checkpoint stays if it is protected (pinned, newest complete, incomplete
    newer) or any configured rule keeps it: among the ``keep_last`` newest,
    a multiple of ``keep_every``, or among the ``keep_best``. Everything else
    is deleted as ``"unkept"``. With no rules every checkpoint is kept.

    ``more`` are further rule sets (a job's own overrides) whose keepers are
    added to those of ``rules``: extra rule sets can only keep more, never
    delete what ``rules`` alone would keep.
    """
    ordered = _by_step(records)
    newest = _newest_complete(ordered)
    per_set = [_shared_keepers(ordered, rs) for rs in (rules, *more)]
    # A rule set with no rules keeps everything, so the union does too (NO_RULES);
    # otherwise reasons follow the documented priority, whichever set kept the step.
    keepers = [] if any(not ks for ks in per_set) else sorted(
        (k for ks in per_set for k in ks), key=lambda k: KEEP_REASONS.index(k[0]))
    keep: dict[int, str] = {}
    delete: dict[int, str] = {}
    for r in ordered:
        why = _protection(r, newest, local=False) or _shared_reason(r.step, keepers)
        if why is None:
            delete[r.step] = UNKEPT
        else:
            keep[r.step] = why
    return _finish(keep, delete)
