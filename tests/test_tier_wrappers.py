"""The wrappers around a tier: the byte-rate limit of its writes (tiers/limiter.py) and its backoff (tiers/backoff.py)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, cast

import pytest
from ckptstage.daemon.tiers import backoff, limiter
from ckptstage.daemon.tiers.interface import Tier

MiB = 1 << 20


class Spy(limiter.RateLimiter):
    def __init__(self) -> None:
        super().__init__(1)
        self.taken: list[int] = []

    def acquire(self, n: int) -> None:
        self.taken.append(n)


class Recorder:
    """A part writer, its files and a chunk batch at once: records what is written to it."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, int]] = []
        self.final = Path("/t/job/step-1/rank-0")

    def begin_part(self, job: str, step: int, rank: int, replace: Any = None, final: Path | None = None) -> Recorder:
        return self

    def create_file(self, name: str, size: int, direct_io: bool, reserve: bool = True) -> Recorder:
        return self

    def new_chunks(self, job: str, part: Any = None) -> Recorder:
        return self

    def write(self, *args: Any) -> None:
        data = next(a for a in args if isinstance(a, memoryview))
        self.writes.append(("chunk" if isinstance(args[0], str) else "file", len(data)))

    def write_run(self, held: Any, data: memoryview, direct_io: bool) -> None:
        self.writes.append(("run", len(data)))

    def open_file(self, part: Path, name: str) -> str:
        return "read, never paced"


def test_the_limited_tier_paces_its_writes_a_slice_at_a_time_and_nothing_else() -> None:
    spy, inner = Spy(), Recorder()
    tier = limiter.LimitedTier(cast(Tier, inner), spy)
    writer = tier.begin_part("job", 1, 0)
    assert writer.final == inner.final  # what the wrapper does not override is the tier's own
    writer.create_file("data", 3 * MiB + 1, direct_io=True).write(memoryview(bytes(3 * MiB + 1)), 0)
    assert spy.taken == [MiB, MiB, MiB, 1] and inner.writes == [("file", 3 * MiB + 1)]
    batch = tier.new_chunks("job")
    batch.write("c" * 32, memoryview(bytes(2 * MiB)), True)
    assert spy.taken[4:] == [MiB, MiB] and inner.writes[-1] == ("chunk", 2 * MiB)
    batch.write_run([("c" * 32, 0, MiB), ("d" * 32, MiB, MiB + 1)], memoryview(bytes(2 * MiB + 1)), True)
    assert spy.taken[6:] == [MiB, MiB, 1] and inner.writes[-1] == ("run", 2 * MiB + 1)
    assert tier.open_file(Path("p"), "data") == "read, never paced" and len(spy.taken) == 9


def test_no_rate_means_no_wrapper() -> None:
    inner = cast(Tier, Recorder())
    assert limiter.limited(inner, None) is inner
    assert isinstance(limiter.limited(inner, MiB), limiter.LimitedTier)


def test_the_backoff_doubles_up_to_its_cap_and_a_success_resets_it() -> None:
    now = [100.0]
    b = backoff.Backoff(1.0, 5.0, clock=lambda: now[0])
    assert b.remaining() <= 0
    assert [b.failed() for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert b.remaining() == pytest.approx(5.0)
    now[0] += 5.0
    assert b.remaining() <= 0
    b.succeeded()
    assert b.failed() == 1.0


def test_retry_tries_until_it_works_or_stops() -> None:
    answers = iter([False, False, True])
    assert backoff.retry(lambda: next(answers), 0.001, 0.002, threading.Event())
    stop = threading.Event()
    stop.set()
    assert not backoff.retry(lambda: False, 0.001, 0.002, stop)
