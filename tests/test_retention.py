"""Retention rules: table-driven cases per rule and protection, plus random invariants."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from ckptstage.daemon.retention.planner import (
    DELETE_REASONS,
    KEEP_REASONS,
    KeepBest,
    LocalRules,
    Plan,
    Record,
    SharedRules,
    explain,
    plan_local,
    plan_shared,
    rule_name,
)


def rec(step: int, nbytes: int = 10, **kw: Any) -> Record:
    """A record with 10 bytes, drained, complete, unpinned unless told otherwise."""
    return Record(step, nbytes, **kw)


def steps(*numbers: int, **kw: Any) -> list[Record]:
    return [rec(n, **kw) for n in numbers]


def same(steps_: range | list[int], why: str) -> dict[int, str]:
    return {s: why for s in steps_}


# --- the example from the issue ---------------------------------------------


def test_issue_example_local_and_shared() -> None:
    saved = steps(*range(1, 26))  # steps 1..25, all drained
    local = plan_local(saved, LocalRules(keep_last=2))
    shared = plan_shared(saved, SharedRules(keep_last=3, keep_every=10))
    assert set(local.keep) == {24, 25}
    assert set(local.delete) == set(range(1, 24))
    assert set(shared.keep) == {10, 20, 23, 24, 25}
    assert set(shared.delete) == set(range(1, 26)) - {10, 20, 23, 24, 25}


# --- local tier ---------------------------------------------------------------

LOCAL_CASES = [
    pytest.param(
        steps(1, 2, 3), LocalRules(), None,
        {1: "no_rules", 2: "no_rules", 3: "newest"}, {},
        id="no-rules-keeps-everything",
    ),
    pytest.param(
        [], LocalRules(keep_last=2, max_bytes=0, min_free_bytes=10), 0,
        {}, {},
        id="empty-input",
    ),
    pytest.param(
        steps(1, 2, 3, 4, 5), LocalRules(keep_last=2), None,
        {4: "keep_last", 5: "newest"}, same([1, 2, 3], "keep_last=2"),
        id="keep-last",
    ),
    pytest.param(
        steps(1, 2, 3), LocalRules(keep_last=0), None,
        {3: "newest"}, same([1, 2], "keep_last=0"),
        id="keep-last-zero-still-keeps-newest",
    ),
    pytest.param(
        steps(1, 2), LocalRules(keep_last=5), None,
        {1: "keep_last", 2: "newest"}, {},
        id="keep-last-larger-than-input",
    ),
    pytest.param(
        [rec(1, pinned=True), *steps(2, 3, 4)], LocalRules(keep_last=1), None,
        {1: "pinned", 4: "newest"}, same([2, 3], "keep_last=1"),
        id="pinned-beats-keep-last",
    ),
    pytest.param(
        [*steps(1, 2), rec(3, pinned=True)], LocalRules(keep_last=0), None,
        {3: "pinned"}, same([1, 2], "keep_last=0"),
        id="pinned-newest-reports-pinned",
    ),
    pytest.param(
        [rec(1, drained=False), *steps(2, 3, 4)], LocalRules(keep_last=1), None,
        {1: "undrained", 4: "newest"}, same([2, 3], "keep_last=1"),
        id="undrained-beats-keep-last",
    ),
    pytest.param(
        [*steps(1, 2), rec(3, drained=False)], LocalRules(keep_last=0), None,
        {3: "newest"}, same([1, 2], "keep_last=0"),
        id="undrained-newest-reports-newest",
    ),
    pytest.param(
        steps(1, 2, 3, 4), LocalRules(max_bytes=25), None,
        {3: "no_rules", 4: "newest"}, same([1, 2], "max_bytes"),
        id="max-bytes-evicts-oldest-first",
    ),
    pytest.param(
        steps(1, 2, 3, 4), LocalRules(max_bytes=40), None,
        {1: "no_rules", 2: "no_rules", 3: "no_rules", 4: "newest"}, {},
        id="max-bytes-exactly-met",
    ),
    pytest.param(
        [rec(1, drained=False), rec(2, drained=False), *steps(3, 4)],
        LocalRules(max_bytes=25), None,
        {1: "undrained", 2: "undrained", 4: "newest"}, {3: "max_bytes"},
        id="undrained-survive-max-bytes-unmet",
    ),
    pytest.param(
        [rec(1, pinned=True), *steps(2, 3, 4)], LocalRules(max_bytes=25), None,
        {1: "pinned", 4: "newest"}, same([2, 3], "max_bytes"),
        id="max-bytes-skips-pinned",
    ),
    pytest.param(
        [rec(1, pinned=True), rec(2, pinned=True), rec(3)], LocalRules(max_bytes=0), None,
        {1: "pinned", 2: "pinned", 3: "newest"}, {},
        id="max-bytes-cannot-be-met-all-protected",
    ),
    pytest.param(
        steps(1, 2, 3, 4, 5), LocalRules(keep_last=3, max_bytes=15), None,
        {5: "newest"}, {**same([1, 2], "keep_last=3"), **same([3, 4], "max_bytes")},
        id="keep-last-then-max-bytes",
    ),
    pytest.param(
        [rec(1, 30), rec(2, 5), rec(3, 5)], LocalRules(max_bytes=15), None,
        {2: "no_rules", 3: "newest"}, {1: "max_bytes"},
        id="max-bytes-stops-once-under",
    ),
    pytest.param(
        steps(1, 2, 3, 4), LocalRules(min_free_bytes=25), 5,
        {3: "no_rules", 4: "newest"}, same([1, 2], "min_free_bytes"),
        id="min-free-bytes",
    ),
    pytest.param(
        steps(1, 2, 3, 4), LocalRules(min_free_bytes=25), 100,
        {1: "no_rules", 2: "no_rules", 3: "no_rules", 4: "newest"}, {},
        id="min-free-bytes-already-met",
    ),
    pytest.param(
        steps(1, 2, 3, 4), LocalRules(min_free_bytes=10**9), None,
        {1: "no_rules", 2: "no_rules", 3: "no_rules", 4: "newest"}, {},
        id="min-free-bytes-ignored-without-free-bytes",
    ),
    pytest.param(
        steps(1, 2, 3, 4), LocalRules(keep_last=2, min_free_bytes=25), 0,
        {4: "newest"}, {**same([1, 2], "keep_last=2"), 3: "min_free_bytes"},
        id="min-free-bytes-counts-what-keep-last-frees",
    ),
    pytest.param(
        steps(1, 2, 3, 4, 5), LocalRules(max_bytes=35, min_free_bytes=30), 0,
        {4: "no_rules", 5: "newest"}, {1: "max_bytes", 2: "max_bytes", 3: "min_free_bytes"},
        id="max-bytes-then-min-free-bytes",
    ),
    pytest.param(
        [rec(1, drained=False), rec(2, pinned=True), rec(3)],
        LocalRules(min_free_bytes=10**9), 0,
        {1: "undrained", 2: "pinned", 3: "newest"}, {},
        id="min-free-bytes-cannot-be-met-all-protected",
    ),
    pytest.param(
        [*steps(1, 2, 3), rec(4, complete=False), rec(5, complete=False)],
        LocalRules(keep_last=1), None,
        {3: "newest", 4: "incomplete_newer", 5: "incomplete_newer"},
        same([1, 2], "keep_last=1"),
        id="incomplete-newer-kept-newest-complete-kept",
    ),
    pytest.param(
        [rec(1), rec(2, complete=False), rec(3), rec(4)], LocalRules(keep_last=1), None,
        {4: "newest"}, same([1, 2, 3], "keep_last=1"),
        id="incomplete-older-subject-to-keep-last",
    ),
    pytest.param(
        [rec(1, complete=False), rec(2), rec(3)], LocalRules(max_bytes=20), None,
        {2: "no_rules", 3: "newest"}, {1: "max_bytes"},
        id="incomplete-older-subject-to-max-bytes",
    ),
    pytest.param(
        [rec(1, complete=False), rec(2, complete=False)],
        LocalRules(keep_last=0, max_bytes=0), None,
        {1: "incomplete_newer", 2: "incomplete_newer"}, {},
        id="nothing-complete-keeps-all-incomplete",
    ),
    pytest.param(
        [rec(1, drained=False, complete=False), rec(2)], LocalRules(keep_last=0), None,
        {1: "undrained", 2: "newest"}, {},
        id="undrained-incomplete-older-kept",
    ),
]


@pytest.mark.parametrize("records, rules, free_bytes, keep, delete", LOCAL_CASES)
def test_plan_local(
    records: list[Record], rules: LocalRules, free_bytes: int | None,
    keep: dict[int, str], delete: dict[int, str],
) -> None:
    assert plan_local(records, rules, free_bytes) == Plan(keep=keep, delete=delete)


# --- shared tier ------------------------------------------------------------


def loss(step: int, value: float) -> Record:
    return rec(step, metrics={"loss": value})


METRIC_RECORDS = [loss(1, 0.5), loss(2, 0.2), rec(3), loss(4, 0.9), loss(5, 0.7), rec(6)]

SHARED_CASES = [
    pytest.param(
        steps(1, 2, 3), SharedRules(),
        {1: "no_rules", 2: "no_rules", 3: "newest"}, {},
        id="no-rules-keeps-everything",
    ),
    pytest.param([], SharedRules(keep_last=1), {}, {}, id="empty-input"),
    pytest.param(
        steps(1, 2, 3, 4), SharedRules(keep_last=2),
        {3: "keep_last", 4: "newest"}, same([1, 2], "unkept"),
        id="keep-last",
    ),
    pytest.param(
        steps(*range(1, 26)), SharedRules(keep_every=10),
        {10: "keep_every", 20: "keep_every", 25: "newest"},
        same(sorted(set(range(1, 26)) - {10, 20, 25}), "unkept"),
        id="keep-every",
    ),
    pytest.param(
        steps(0, 5, 10, 11), SharedRules(keep_every=5),
        {0: "keep_every", 5: "keep_every", 10: "keep_every", 11: "newest"}, {},
        id="keep-every-includes-step-zero",
    ),
    pytest.param(
        steps(*range(1, 26)), SharedRules(keep_last=3, keep_every=10),
        {10: "keep_every", 20: "keep_every", 23: "keep_last", 24: "keep_last",
         25: "newest"},
        same(sorted(set(range(1, 26)) - {10, 20, 23, 24, 25}), "unkept"),
        id="issue-example-reasons",
    ),
    pytest.param(
        steps(8, 9, 10), SharedRules(keep_last=2, keep_every=5),
        {9: "keep_last", 10: "newest"}, {8: "unkept"},
        id="newest-beats-keep-every-and-keep-last",
    ),
    pytest.param(
        steps(10, 11, 12), SharedRules(keep_last=3, keep_every=10),
        {10: "keep_last", 11: "keep_last", 12: "newest"}, {},
        id="keep-last-beats-keep-every",
    ),
    pytest.param(
        METRIC_RECORDS, SharedRules(keep_best=KeepBest("loss", "min", 2)),
        {1: "keep_best", 2: "keep_best", 6: "newest"}, same([3, 4, 5], "unkept"),
        id="keep-best-min-missing-metric-never-best",
    ),
    pytest.param(
        METRIC_RECORDS, SharedRules(keep_best=KeepBest("loss", "max", 2)),
        {4: "keep_best", 5: "keep_best", 6: "newest"}, same([1, 2, 3], "unkept"),
        id="keep-best-max-missing-metric-never-best",
    ),
    pytest.param(
        METRIC_RECORDS, SharedRules(keep_best=KeepBest("loss", "min", 10)),
        {1: "keep_best", 2: "keep_best", 4: "keep_best", 5: "keep_best", 6: "newest"},
        {3: "unkept"},
        id="keep-best-n-larger-than-ranked",
    ),
    pytest.param(
        METRIC_RECORDS, SharedRules(keep_best=KeepBest("accuracy", "max", 3)),
        {6: "newest"}, same([1, 2, 3, 4, 5], "unkept"),
        id="keep-best-metric-nowhere",
    ),
    pytest.param(
        METRIC_RECORDS, SharedRules(keep_best=KeepBest("loss", "min", 0)),
        {6: "newest"}, same([1, 2, 3, 4, 5], "unkept"),
        id="keep-best-zero",
    ),
    pytest.param(
        [loss(1, 0.1), loss(2, 0.1), loss(3, 0.1), rec(4)],
        SharedRules(keep_best=KeepBest("loss", "min", 2)),
        {2: "keep_best", 3: "keep_best", 4: "newest"}, {1: "unkept"},
        id="keep-best-tie-prefers-newer",
    ),
    pytest.param(
        [loss(1, math.nan), loss(2, 0.3), rec(3)],
        SharedRules(keep_best=KeepBest("loss", "min", 1)),
        {2: "keep_best", 3: "newest"}, {1: "unkept"},
        id="keep-best-min-nan-never-best",
    ),
    pytest.param(
        [loss(1, math.nan), loss(2, 0.3), rec(3)],
        SharedRules(keep_best=KeepBest("loss", "max", 1)),
        {2: "keep_best", 3: "newest"}, {1: "unkept"},
        id="keep-best-max-nan-never-best",
    ),
    pytest.param(
        [loss(10, 0.1), loss(12, 0.2), loss(13, 0.3)],
        SharedRules(keep_every=10, keep_best=KeepBest("loss", "min", 2)),
        {10: "keep_every", 12: "keep_best", 13: "newest"}, {},
        id="keep-every-beats-keep-best",
    ),
    pytest.param(
        [rec(1, pinned=True), *steps(2, 3)], SharedRules(keep_last=1),
        {1: "pinned", 3: "newest"}, {2: "unkept"},
        id="pinned",
    ),
    pytest.param(
        [rec(1), rec(2), rec(3, complete=False)], SharedRules(keep_last=0),
        {2: "newest", 3: "incomplete_newer"}, {1: "unkept"},
        id="incomplete-newer-kept",
    ),
    pytest.param(
        [rec(1, complete=False), rec(2), rec(3)], SharedRules(keep_last=1),
        {3: "newest"}, same([1, 2], "unkept"),
        id="incomplete-older-subject-to-rules",
    ),
    pytest.param(
        [rec(10, complete=False), rec(11)], SharedRules(keep_every=10),
        {10: "keep_every", 11: "newest"}, {},
        id="incomplete-older-kept-by-a-rule",
    ),
]


@pytest.mark.parametrize("records, rules, keep, delete", SHARED_CASES)
def test_plan_shared(
    records: list[Record], rules: SharedRules,
    keep: dict[int, str], delete: dict[int, str],
) -> None:
    assert plan_shared(records, rules) == Plan(keep=keep, delete=delete)


# --- errors -----------------------------------------------------------------


@pytest.mark.parametrize(
    "plan",
    [
        pytest.param(lambda rs: plan_local(rs, LocalRules()), id="local"),
        pytest.param(lambda rs: plan_shared(rs, SharedRules()), id="shared"),
    ],
)
def test_duplicate_steps_are_rejected_naming_the_step(plan) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=r"duplicate step 7\b"):
        plan([rec(3), rec(7), rec(5), rec(7, 99)])


@pytest.mark.parametrize(
    "make, error, message",
    [
        pytest.param(lambda: LocalRules(keep_last=-1), ValueError, "keep_last", id="local-keep-last"),
        pytest.param(lambda: LocalRules(max_bytes=-1), ValueError, "max_bytes", id="max-bytes"),
        pytest.param(lambda: LocalRules(min_free_bytes=-5), ValueError, "min_free_bytes",
                     id="min-free-bytes"),
        pytest.param(lambda: SharedRules(keep_every=0), ValueError, "keep_every", id="keep-every"),
        pytest.param(lambda: SharedRules(keep_last=-2), ValueError, "keep_last",
                     id="shared-keep-last"),
        pytest.param(lambda: KeepBest("loss", "lowest", 1), ValueError, "mode", id="best-mode"),
        pytest.param(lambda: KeepBest("loss", "min", -1), ValueError, "n", id="best-n"),
        pytest.param(lambda: KeepBest("", "min", 1), ValueError, "metric", id="best-metric"),
        pytest.param(lambda: Record(1, -1), ValueError, "nbytes", id="record-nbytes"),
        pytest.param(lambda: Record(-1, 1), ValueError, "step", id="record-step"),
        pytest.param(lambda: LocalRules(keep_last="2"), TypeError, "keep_last", id="not-an-int"),
    ],
)
def test_bad_settings_are_rejected_naming_them(make, error, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=message):
        make()


# --- explain and labels -----------------------------------------------------


def test_explain_lists_every_step_by_step() -> None:
    plan = plan_local(steps(12, 2, 30, 24), LocalRules(keep_last=2))
    assert explain(plan) == [
        "step 2: delete (keep_last=2)",
        "step 12: delete (keep_last=2)",
        "step 24: keep (keep_last)",
        "step 30: keep (newest)",
    ]


def test_explain_empty_plan() -> None:
    assert explain(Plan(keep={}, delete={})) == []


@pytest.mark.parametrize(
    "reason, name",
    [("keep_last=2", "keep_last"), ("max_bytes", "max_bytes"), ("unkept", "unkept")],
    ids=["with-parameter", "max-bytes", "unkept"],
)
def test_rule_name_strips_the_parameter(reason: str, name: str) -> None:
    assert rule_name(reason) == name


# --- invariants on random cases ---------------------------------------------


def random_records(rng: random.Random, shared: bool) -> list[Record]:
    chosen = rng.sample(range(60), rng.randint(0, 12))
    return [
        Record(
            step=s,
            nbytes=rng.choice([0, 1, 10, 100, rng.randint(0, 1000)]),
            drained=shared or rng.random() < 0.7,
            pinned=rng.random() < 0.1,
            complete=rng.random() < 0.8,
            metrics=random_metrics(rng),
        )
        for s in chosen
    ]


def random_metrics(rng: random.Random) -> dict[str, float]:
    roll = rng.random()
    if roll < 0.2:
        return {}
    if roll < 0.25:
        return {"loss": math.nan}
    return {"loss": rng.choice([0.5, rng.random()])}  # repeated values exercise ties


def maybe(rng: random.Random, value: int) -> int | None:
    return value if rng.random() < 0.6 else None


def random_local_rules(rng: random.Random) -> tuple[LocalRules, int | None]:
    rules = LocalRules(
        keep_last=maybe(rng, rng.randint(0, 6)),
        max_bytes=maybe(rng, rng.randint(0, 1500)),
        min_free_bytes=maybe(rng, rng.randint(0, 1500)),
    )
    return rules, maybe(rng, rng.randint(0, 1000))


def random_shared_rules(rng: random.Random) -> SharedRules:
    best = KeepBest("loss", rng.choice(["min", "max"]), rng.randint(0, 4))
    return SharedRules(
        keep_last=maybe(rng, rng.randint(0, 6)),
        keep_every=maybe(rng, rng.randint(1, 15)),
        keep_best=best if rng.random() < 0.5 else None,
    )


def protected_steps(records: list[Record], local: bool) -> set[int]:
    """What no rule may delete, computed independently of the module."""
    newest = max((r.step for r in records if r.complete), default=None)
    return {
        r.step for r in records
        if r.pinned
        or r.step == newest
        or (local and not r.drained)
        or (not r.complete and (newest is None or r.step > newest))
    }


def check_common_invariants(records: list[Record], plan: Plan, local: bool) -> None:
    all_steps = {r.step for r in records}
    assert set(plan.keep).isdisjoint(plan.delete)
    assert set(plan.keep) | set(plan.delete) == all_steps
    assert list(plan.keep) == sorted(plan.keep)
    assert list(plan.delete) == sorted(plan.delete)
    assert protected_steps(records, local) <= set(plan.keep)
    assert {r.step for r in records if r.pinned}.isdisjoint(plan.delete)
    newest = max((r.step for r in records if r.complete), default=None)
    assert newest is None or newest in plan.keep
    assert set(plan.keep.values()) <= set(KEEP_REASONS)
    assert {rule_name(why) for why in plan.delete.values()} <= set(DELETE_REASONS)


def check_local_invariants(
    records: list[Record], rules: LocalRules, free_bytes: int | None, plan: Plan
) -> None:
    assert {r.step for r in records if not r.drained}.isdisjoint(plan.delete)
    size = {r.step: r.nbytes for r in records}
    protected = protected_steps(records, local=True)
    unprotected_kept = set(plan.keep) - protected
    kept_bytes = sum(size[s] for s in plan.keep)
    if rules.keep_last is not None:
        recent = sorted(size)[-rules.keep_last:] if rules.keep_last else []
        assert unprotected_kept <= set(recent)
    if rules.max_bytes is not None and kept_bytes > rules.max_bytes:
        assert not unprotected_kept  # over the watermark only when all left is protected
    if rules.min_free_bytes is not None and free_bytes is not None:
        freed = sum(size[s] for s in plan.delete)
        if free_bytes + freed < rules.min_free_bytes:
            assert not unprotected_kept
    watermark_victims = [s for s, why in plan.delete.items() if why != f"keep_last={rules.keep_last}"]
    if unprotected_kept and watermark_victims:  # evictions take the oldest first
        assert max(watermark_victims) < min(unprotected_kept)


def check_shared_invariants(records: list[Record], rules: SharedRules, plan: Plan) -> None:
    if rules == SharedRules():
        assert not plan.delete
    if rules.keep_every is not None:
        assert not {s for s in plan.delete if s % rules.keep_every == 0}
    if rules.keep_last is not None and rules.keep_last > 0:
        assert set(sorted(r.step for r in records)[-rules.keep_last:]) <= set(plan.keep)


def shuffled(rng: random.Random, records: list[Record]) -> list[Record]:
    copy = list(records)
    rng.shuffle(copy)
    return copy


@pytest.mark.parametrize("seed", range(300))
def test_random_plans_keep_the_invariants(seed: int) -> None:
    rng = random.Random(seed)

    local_records = random_records(rng, shared=False)
    local_rules, free_bytes = random_local_rules(rng)
    local = plan_local(local_records, local_rules, free_bytes)
    check_common_invariants(local_records, local, local=True)
    check_local_invariants(local_records, local_rules, free_bytes, local)
    assert plan_local(shuffled(rng, local_records), local_rules, free_bytes) == local
    assert list(plan_local(reversed(local_records), local_rules, free_bytes).keep.items()) \
        == list(local.keep.items())

    shared_records = random_records(rng, shared=True)
    shared_rules = random_shared_rules(rng)
    shared = plan_shared(shared_records, shared_rules)
    check_common_invariants(shared_records, shared, local=False)
    check_shared_invariants(shared_records, shared_rules, shared)
    assert plan_shared(iter(shuffled(rng, shared_records)), shared_rules) == shared


# --- a job's extra rule sets (per-job overrides) -----------------------------------


EXTRA_CASES = [
    pytest.param(
        steps(*range(1, 10)), SharedRules(keep_last=2), [SharedRules(keep_every=4)],
        {4: "keep_every", 8: "keep_last", 9: "newest"},
        id="extra-keep-every-adds-keepers",
    ),
    pytest.param(
        steps(*range(1, 6)), SharedRules(keep_last=2), [SharedRules(keep_last=1)],
        {4: "keep_last", 5: "newest"},
        id="extra-smaller-keep-last-deletes-nothing-more",
    ),
    pytest.param(
        steps(*range(1, 6)), SharedRules(), [SharedRules(keep_last=1)],
        {1: "no_rules", 2: "no_rules", 3: "no_rules", 4: "no_rules", 5: "newest"},
        id="operator-without-rules-keeps-everything-whatever-the-extra-set",
    ),
    pytest.param(
        METRIC_RECORDS, SharedRules(keep_last=1), [SharedRules(keep_best=KeepBest("loss", "min", 1))],
        {2: "keep_best", 6: "newest"},
        id="extra-keep-best",
    ),
    pytest.param(
        steps(*range(1, 13)), SharedRules(keep_every=10), [SharedRules(keep_last=3)],
        {10: "keep_last", 11: "keep_last", 12: "newest"},
        id="reasons-follow-priority-across-sets",
    ),
]


@pytest.mark.parametrize("records, rules, extra, keep", EXTRA_CASES)
def test_plan_shared_with_extra_rule_sets(records, rules, extra, keep) -> None:  # type: ignore[no-untyped-def]
    plan = plan_shared(records, rules, *extra)
    assert plan.keep == keep
    assert set(plan.delete) == {r.step for r in records} - set(keep)
    # Extra rule sets only ever keep more than the operator's rules alone.
    assert set(plan.delete) <= set(plan_shared(records, rules).delete)


@pytest.mark.parametrize("seed", range(100))
def test_random_extra_rule_sets_only_keep_more(seed: int) -> None:
    rng = random.Random(seed)
    records = random_records(rng, shared=True)
    rules = random_shared_rules(rng)
    extra = [random_shared_rules(rng) for _ in range(rng.randint(1, 2))]
    plan = plan_shared(records, rules, *extra)
    check_common_invariants(records, plan, local=False)
    assert set(plan.delete) <= set(plan_shared(records, rules).delete)
    for one in (rules, *extra):
        assert set(plan.delete) <= set(plan_shared(records, one).delete)


def test_a_jobs_keep_best_override_is_the_operators_rule_with_its_n_capped() -> None:
    from ckptstage.daemon.errors import InvalidRequest
    from ckptstage.daemon.retention.job_rules import JobRetention

    wide = JobRetention.parse({"keep_best_metric": "loss", "keep_best_mode": "max", "keep_best_n": 50})
    assert wide.keep_best(cap=8) == KeepBest("loss", "max", 8)
    assert JobRetention.parse({"keep_best_metric": "loss", "keep_best_mode": "min"}).keep_best(cap=8) == \
        KeepBest("loss", "min", 1)
    assert JobRetention().keep_best(cap=8) is None
    with pytest.raises(InvalidRequest, match="'min' or 'max'.*keep_best_mode"):
        JobRetention.parse({"keep_best_metric": "loss", "keep_best_mode": "lowest"})
    with pytest.raises(InvalidRequest, match="need keep_best_metric"):
        JobRetention.parse({"keep_best_n": 2})
