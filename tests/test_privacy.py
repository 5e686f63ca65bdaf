"""Private by default: another local user can neither list nor read anything the daemon creates.

Manifests hold every plain value of a training state (configs, paths,
tokens someone put in a dict). The daemon runs with umask 077, so every
file it creates is 0600 and every directory 0700, on both tiers, in its state
and socket directories and in /dev/shm.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ckptstage.client import Client
from conftest import DaemonProc
from support import drain

OTHER_USER = "nobody"


@pytest.fixture
def world_readable_root() -> Iterator[Path]:
    """A daemon root whose parents anyone may traverse (pytest's tmp_path is private already)."""
    root = Path(tempfile.mkdtemp(prefix="ckptstage-privacy-"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def created_by_daemon(d: DaemonProc) -> list[Path]:
    paths = []
    for top in (d.local, d.shared, d.socket.parent):
        assert top is not None
        paths.append(top)
        paths += list(top.rglob("*"))
    return paths


def as_other_user(*cmd: str) -> subprocess.CompletedProcess[str]:
    user = pwd.getpwnam(OTHER_USER)
    return subprocess.run(["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", *cmd],
                          capture_output=True, text=True, timeout=30)


def test_everything_the_daemon_creates_is_private(world_readable_root: Path) -> None:
    d = DaemonProc(world_readable_root / "node")
    d.root.chmod(0o755)
    old = os.umask(0o022)  # a permissive umask where the daemon starts: its own must win
    d.start()
    try:
        with Client("secret", socket=d.socket) as c:
            c.save(1, {"w": torch.ones(100), "token": "hunter2"}).wait("local", timeout=30)
            drain(d)
            paths = created_by_daemon(d)
            assert any(p.name == "manifest.json" for p in paths)
            for p in paths:
                mode = stat.S_IMODE(p.lstat().st_mode)
                expected = 0o700 if p.is_dir() and not p.is_symlink() else 0o600
                assert mode == expected, f"{p} is {oct(mode)}"
            arenas = [p for p in Path("/dev/shm").glob(f"ckptstage-{d.proc.pid}-*")]
            assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in arenas)
            if os.geteuid() != 0 or shutil.which("setpriv") is None:
                pytest.skip("reading as another user needs root and setpriv")
            # The other user gets as far as the daemon's own directories (else the denials below prove nothing).
            assert as_other_user("ls", str(d.root)).returncode == 0
            for p in paths:
                cmd = ("ls", str(p)) if p.is_dir() else ("cat", str(p))
                if p.is_socket():
                    continue  # connect() needs write permission on it: covered by its 0600 mode above
                result = as_other_user(*cmd)
                assert result.returncode != 0 and "Permission denied" in result.stderr, (p, result)
            assert "hunter2" not in as_other_user("grep", "-r", "hunter2", str(d.root)).stdout
    finally:
        d.stop()
        os.umask(old)


def test_the_commit_helpers_are_private_whatever_the_umask(tmp_path: Path) -> None:
    """Library use (a tool, a test) gets 0600/0700 too: the modes are explicit, not left to the umask."""
    from ckptstage.daemon import fsutil

    tier = tmp_path / "tier"
    tier.mkdir()
    old = os.umask(0o022)
    try:
        writer = fsutil.PartWriter(tier, "node", "job", 1, 0)
        data = fsutil.DataFile(writer.path("data"), 4, direct_io=False)
        data.write(memoryview(b"abcd"), 0)
        data.sync()
        data.close()
        writer.commit({"files": [], "token": "hunter2"})
        fsutil.write_json_atomic(tier / ".state" / "pins.json", {"job": [1]})
        fsutil.makedirs_durable(tier / "a" / "b")
    finally:
        os.umask(old)
    created = [p for p in tier.rglob("*")]
    assert any(p.name == "manifest.json" for p in created) and any(p.name == "pins.json" for p in created)
    for p in created:
        mode = stat.S_IMODE(p.lstat().st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), f"{p} is {oct(mode)}"


def test_another_users_socket_is_named_as_theirs_not_as_a_daemon_to_start(world_readable_root: Path) -> None:
    """Another user's running daemon: the command says whose socket it is and that each user runs their
    own, whether the socket's directory hides it (0700) or the socket itself refuses the connection."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("connecting as another user needs root and setpriv")
    import sys

    d = DaemonProc(world_readable_root / "node")
    d.root.chmod(0o755)
    d.start()
    try:
        cli = (sys.executable, "-m", "ckptstage.client.cli", "--socket", str(d.socket), "status")
        if as_other_user(sys.executable, "-c", "import ckptstage.client.cli").returncode:
            pytest.skip(f"user {OTHER_USER} cannot import ckptstage from here (a private home directory?)")
        hidden = as_other_user(*cli)
        d.socket.parent.chmod(0o755)  # the directory open, the socket itself still 0600
        refused = as_other_user(*cli)
    finally:
        d.stop()
    for result in (hidden, refused):
        assert result.returncode != 0, result
        assert f"permission denied on {d.socket}: it belongs to user 'root'" in result.stderr, result.stderr
        assert "ckptstaged@$USER" in result.stderr and "start it" not in result.stderr, result.stderr
