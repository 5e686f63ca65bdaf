"""The arena is prepared before the first save needs it, off the trainer's path.

Creating shared memory costs about a second per GiB on a small machine; a
first save that had to wait for it blocked 3-13x longer than the others.
Observable here without timing anything: the session holds its arena before
any save, and the first save copies into that arena (generation 1), not a
new one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support import wait_until

from ckptstage.client import ArenaFull, Client

MiB = 1 << 20
SETTINGS = {"arena.max_bytes": "64MiB", "arena.min_session_bytes": "1MiB", "persist.chunk_bytes": "1MiB"}


def _state(mib: int) -> dict[str, torch.Tensor]:
    return {"w": torch.ones(mib * MiB // 4), "b": torch.zeros(7)}


def _arena(d: Any, c: Client) -> tuple[int, list[int]]:
    """(arena bytes, generations of the arenas the daemon maps) of ``c``'s session."""
    with d.connection() as conn:
        [session] = [s for s in conn.status().sessions if s.session_id == c._session_id]
    names = {line.split()[-2] if line.endswith("(deleted)") else line.split()[-1]
             for line in Path(f"/proc/{d.proc.pid}/maps").read_text().splitlines() if c._session_id in line}
    return session.arena_bytes, sorted(int(n.rsplit("-", 1)[1]) for n in names)


def test_a_resumed_rank_finds_its_arena_ready_at_its_first_save(daemon_factory):
    d = daemon_factory("resume", **SETTINGS).start()
    with Client("ahead", socket=d.socket) as c:
        c.save(1, _state(8)).wait("local", timeout=30)
    with Client("ahead", socket=d.socket) as c:  # the restarted trainer: nothing saved yet in this session
        size, generations = wait_until(lambda: (a := _arena(d, c))[0] and a, 20, "the arena prepared ahead")
        assert size >= 8 * MiB and generations == [1]
        c.save(2, _state(8)).wait("local", timeout=30)
        assert _arena(d, c) == (size, [1])  # the first save used it: no new arena on its path


def test_prepare_sizes_the_arena_for_a_fresh_job(daemon_factory):
    d = daemon_factory("fresh", **SETTINGS).start()
    with Client("fresh", socket=d.socket) as c:
        assert _arena(d, c) == (0, [])  # nothing known of the job: nothing prepared
        state = _state(6)
        c.prepare(state)
        size, generations = wait_until(lambda: (a := _arena(d, c))[0] and a, 20, "the prepared arena")
        assert size >= 6 * MiB and generations == [1]
        c.save(1, state).wait("local", timeout=30)
        assert _arena(d, c) == (size, [1])


def test_a_protected_optimizers_first_step_sizes_the_arena(daemon_factory):
    d = daemon_factory("protect", **SETTINGS).start()
    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weights, 8 MiB more of Adam moments after a step
    opt = torch.optim.Adam(model.parameters())
    with Client("protect", socket=d.socket) as c:
        c.protect(opt)
        model(torch.ones(2, 1024)).sum().backward()
        assert _arena(d, c) == (0, [])
        opt.step()
        size, generations = wait_until(lambda: (a := _arena(d, c))[0] and a, 20, "the arena sized by the step")
        assert size >= 12 * MiB and generations == [1]
        c.save(1, {"model": model.state_dict(), "opt": opt.state_dict()}).wait("local", timeout=30)
        assert _arena(d, c) == (size, [1])
        opt.step()  # the hook sized the arena once; later steps leave it alone
        assert _arena(d, c) == (size, [1])


def test_a_reader_that_asks_for_no_arena_gets_none(daemon_factory):
    d = daemon_factory("reader", **SETTINGS).start()
    with Client("reader", socket=d.socket) as c:
        c.save(1, _state(8)).wait("local", timeout=30)
    with Client("reader", socket=d.socket, arena_bytes=0) as c:
        assert torch.equal(c.load(1)["w"], _state(8)["w"])
        assert _arena(d, c) == (0, [])


def test_an_arena_that_does_not_fit_the_budget_is_not_an_error_until_a_save_needs_it(daemon_factory):
    d = daemon_factory("budget", **{**SETTINGS, "arena.max_bytes": "8MiB"}).start()
    with Client("budget", socket=d.socket) as hog, Client("budget-2", socket=d.socket) as c:
        hog.prepare(8 * MiB)
        wait_until(lambda: _arena(d, hog)[0], 20, "the first client's arena")
        c.prepare(4 * MiB)  # nothing left: logged, not raised
        with pytest.raises(ArenaFull, match=str(8 * MiB)):  # the save asks again and says what it lacks
            c.save(1, {"w": torch.ones(3)}).wait("local", timeout=30)
        assert _arena(d, c) == (0, [])
    with Client("budget-2", socket=d.socket) as c:  # the budget is free again
        c.save(1, {"w": torch.ones(3)}).wait("local", timeout=30)
