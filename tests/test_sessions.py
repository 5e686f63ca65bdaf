"""Session bookkeeping in the daemon: stream positions and the close/begin race, without a process."""

from __future__ import annotations

import os
from typing import Any

import pytest
from ckptstage.daemon.save.arena import Budget
from ckptstage.daemon.errors import InvalidRequest, SessionNotFound
from ckptstage.daemon.save.sessions import Session, SessionInfo

CHUNK = 1 << 20


class _Save:
    """What a Session reads of a save: its id, stream end and released position."""

    def __init__(self, save_id: str, base: int, nbytes: int) -> None:
        self.id, self.end, self.released, self.finished = save_id, base + nbytes, base, False


def _session() -> Session:
    return Session(SessionInfo("job", 0, 1, os.getpid(), "host"), Budget(64 * CHUNK), CHUNK, os.getpid())


def test_stream_positions_follow_the_previous_save_and_refuse_overlap() -> None:
    s = _session()
    assert s.stream_base_for_next_save() == 0
    assert s.stream_base_for_next_save(0) == 0
    s.add_save(_Save("a", 0, CHUNK + 5))  # type: ignore[arg-type]
    assert s.stream_base_for_next_save() == 2 * CHUNK
    for bad in (0, CHUNK, 2 * CHUNK + 512):
        with pytest.raises(InvalidRequest, match=f"stream_base {bad} .*next free one is {2 * CHUNK}"):
            s.stream_base_for_next_save(bad)
    assert s.stream_base_for_next_save(5 * CHUNK) == 5 * CHUNK


def test_a_save_begun_as_its_session_closes_is_either_closed_with_it_or_refused() -> None:
    # BeginSave races close() (client gone, daemon shutting down): a save added before close() is
    # returned by it as unfinished, so the daemon fails it; one added after is refused.
    s = _session()
    early: Any = _Save("early", 0, 10)
    s.add_save(early)
    assert s.close() == [early]
    with pytest.raises(SessionNotFound):
        s.add_save(_Save("late", CHUNK, 10))  # type: ignore[arg-type]
    assert list(s.saves) == ["early"]
