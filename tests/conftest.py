"""Shared fixtures: a real ``ckptstaged`` process on a socket in a temporary directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptstage.client.rpc import Connection
from ckptstage.daemon.config import dump_config, load_config


class DaemonProc:
    """A ``ckptstaged`` subprocess with its own socket, tiers and log file."""

    def __init__(self, root: Path, **settings: Any) -> None:
        self.root = root
        self.socket = root / "run" / "ckptstage.sock"
        self.local = root / "local"
        self.shared: Path | None = root / "shared"
        self.log = root / "daemon.log"
        self.settings = settings
        self.proc: subprocess.Popen[bytes] | None = None
        self.config_path = root / "ckptstaged.toml"
        root.mkdir(parents=True, exist_ok=True)
        self.write_config()

    def write_config(self, **settings: Any) -> None:
        """(Re)writes the config; keys are dotted, e.g. ``{"shared.keep_last": 3}``."""
        self.settings.update(settings)
        overrides: dict[str, Any] = {"socket": str(self.socket), "local.dir": str(self.local),
                                     "shared.dir": str(self.shared), "arena.max_bytes": "512MiB",
                                     "persist.chunk_bytes": "1MiB", "arena.min_session_bytes": "1MiB",
                                     "shared.retry_initial_s": 0.2, "shared.retry_max_s": 1.0}
        if os.environ.get("CKPTSTAGE_TEST_INCREMENTAL") == "1":
            overrides["persist.incremental"] = True  # the whole suite, every part written incrementally
        overrides.update(self.settings)
        if overrides.get("shared.dir") in (None, ""):
            overrides["shared.dir"] = ""
            self.shared = None
        cfg = load_config(None, overrides, env={"HOME": str(self.root)})
        self.config_path.write_text(dump_config(cfg))

    def start(self, wait: bool = True) -> DaemonProc:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        logf = open(self.log, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "ckptstage.daemon.main", "--config",
                                      str(self.config_path), "--log-level", "DEBUG"],
                                     stdout=logf, stderr=subprocess.STDOUT, env=env)
        logf.close()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"ckptstaged exited with {self.proc.returncode}:\n{self.log.read_text()}")
            if self.socket.exists():
                try:
                    with Connection(self.socket) as conn:
                        conn.status(timeout=2)
                    return
                except Exception:  # noqa: BLE001 - not up yet
                    pass
            time.sleep(0.05)
        raise TimeoutError(f"ckptstaged not ready after {timeout}s:\n{self.log.read_text()}")

    def kill(self, sig: int = signal.SIGKILL) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=60)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

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
