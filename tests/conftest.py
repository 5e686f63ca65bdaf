"""Shared fixtures: a real ``ckptstaged`` process on a socket in a temporary directory."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptstage.client.rpc import Connection
from ckptstage.daemon.launcher import DaemonProcess


# What every test daemon runs with unless a test says otherwise: small chunks, fast drain retries, and no
# drain of the newest steps on stop (20 s by default: a test that stops a daemon whose shared tier it broke
# would wait it out; test_stop_drain sets it).
DEFAULTS: dict[str, Any] = {"arena.max_bytes": "512MiB", "persist.chunk_bytes": "1MiB",
                            "arena.min_session_bytes": "1MiB", "shared.retry_initial_s": 0.2, "shared.retry_max_s": 1.0,
                            "shared.drain_on_stop_s": 0}
if os.environ.get("CKPTSTAGE_TEST_WHOLE") == "1":
    DEFAULTS["persist.incremental"] = False  # the whole suite, every part written as one data file


class DaemonProc(DaemonProcess):
    """A ``ckptstaged`` subprocess with its own socket, tiers and log file (see :class:`DaemonProcess`);
    ``settings`` are dotted config keys over :data:`DEFAULTS`, and the daemon logs at DEBUG."""

    def __init__(self, root: Path, **settings: Any) -> None:
        super().__init__(root, settings, defaults=DEFAULTS, log_level="DEBUG")

    def connection(self) -> Connection:
        return Connection(self.socket)


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Any]:
    made: list[DaemonProc] = []

    def make(name: str = "node", **settings: Any) -> DaemonProc:
        d = DaemonProc(tmp_path / name, **settings)
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop()


@pytest.fixture
def daemon(daemon_factory: Any) -> DaemonProc:
    return daemon_factory().start()


def shm_files() -> set[str]:
    """This daemon family's arenas currently visible in /dev/shm."""
    return {p.name for p in Path("/dev/shm").glob("ckptstage-*")}
