"""No create, rename or delete follows a symbolic link out of a tier.

Links planted inside a tier (``<tier>/.tmp/<node>``, ``<tier>/<job>``) used to
make the daemon delete files outside its tiers at start and write
checkpoints outside them; a shared tier that reached the local one through a
link was accepted, and local retention then deleted the "shared" copies.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from ckptstage.client import Client, SaveFailed
from ckptstage.daemon import fsutil, tierpath
from ckptstage.daemon.main import EXIT_CONFIG
from ckptstage.daemon.node.node import node_name
from ckptstage.protos import layout
from hangfs import hang


def outside_with_a_file(tmp_path: Path) -> tuple[Path, Path]:
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    precious = outside / "keep" / "precious.txt"
    precious.write_text("not the daemon's")
    return outside, precious


def tree_of(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def run_daemon(d: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptstage.daemon.main", "--config", str(d.config_path)],
                          capture_output=True, text=True, timeout=60)


def one_line(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == EXIT_CONFIG, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


@pytest.mark.parametrize("how", ["shared inside local", "shared is local", "local inside shared"])
def test_tiers_that_overlap_through_a_link_are_refused_at_start(daemon_factory: Any, tmp_path: Path,
                                                                how: str) -> None:
    d = daemon_factory()
    link = tmp_path / "shared-link"
    if how == "local inside shared":
        real_shared = tmp_path / "big"
        (real_shared / "local").mkdir(parents=True)
        link.symlink_to(real_shared, target_is_directory=True)
        local_link = tmp_path / "local-link"
        local_link.symlink_to(real_shared / "local", target_is_directory=True)
        d.write_config(**{"shared.dir": str(link), "local.dir": str(local_link)})
        local = local_link
    else:
        d.local.mkdir(parents=True)
        target = d.local / "inner" if how == "shared inside local" else d.local
        target.mkdir(exist_ok=True)
        link.symlink_to(target, target_is_directory=True)
        d.write_config(**{"shared.dir": str(link)})
        local = d.local
    line = one_line(run_daemon(d))
    assert str(link) in line and str(local) in line and "overlaps" in line


def test_overlap_check_returns_unchecked_on_a_hung_shared_tier(tmp_path: Path) -> None:
    """A shared tier that never answers is not waited on: the check says so and can be repeated."""
    (tmp_path / "local").mkdir()
    shared = tmp_path / "hung"
    shared.mkdir()
    with hang(shared):
        began = time.monotonic()
        assert tierpath.check_disjoint(tmp_path / "local", shared / "ckpt", timeout_s=0.5) is False
        assert tierpath.check_disjoint(tmp_path / "local", shared / "ckpt", timeout_s=0.5) is False
        assert time.monotonic() - began < 5
    assert tierpath.check_disjoint(tmp_path / "local", tmp_path / "other") is True


def test_a_link_planted_as_the_state_directory_is_refused_at_start(daemon_factory: Any, tmp_path: Path) -> None:
    d = daemon_factory()
    outside, precious = outside_with_a_file(tmp_path)
    d.local.mkdir(parents=True)
    (d.local / ".state").symlink_to(outside, target_is_directory=True)
    line = one_line(run_daemon(d))
    assert "local.dir" in line and str(d.local / ".state") in line and "symbolic link" in line
    assert tree_of(outside) == ["keep", "keep/precious.txt"]


def test_a_link_planted_as_the_temporaries_root_is_refused_at_start(daemon_factory: Any, tmp_path: Path) -> None:
    d = daemon_factory()
    outside, precious = outside_with_a_file(tmp_path)
    d.local.mkdir(parents=True)
    (d.local / ".tmp").symlink_to(outside, target_is_directory=True)
    line = one_line(run_daemon(d))
    assert "local.dir" in line and str(d.local / ".tmp") in line and "symbolic link" in line
    assert tree_of(outside) == ["keep", "keep/precious.txt"]


@pytest.mark.parametrize("tier", ["local", "shared"])
def test_a_link_planted_as_the_nodes_temporaries_deletes_nothing_outside(daemon_factory: Any,
                                                                        tmp_path: Path, tier: str) -> None:
    d = daemon_factory()
    outside, precious = outside_with_a_file(tmp_path)
    tmp_root = layout.tmp_root(d.local if tier == "local" else d.shared, node_name(d.local))
    tmp_root.parent.mkdir(parents=True)
    tmp_root.symlink_to(outside, target_is_directory=True)
    d.start()  # start-up removes this node's temporaries: the link itself, never what it points to
    assert precious.read_text() == "not the daemon's" and tree_of(outside) == ["keep", "keep/precious.txt"]
    with Client("job", socket=d.socket) as c:
        c.save(1, {"w": torch.ones(10)}).wait("shared", timeout=60)  # drained through a real directory
    assert tree_of(outside) == ["keep", "keep/precious.txt"]
    assert not tmp_root.is_symlink()


@pytest.mark.parametrize("tier", ["local", "shared"])
def test_a_link_planted_as_a_job_directory_is_never_written_through(daemon_factory: Any, tmp_path: Path,
                                                                    tier: str) -> None:
    d = daemon_factory()
    outside, precious = outside_with_a_file(tmp_path)
    tier_dir = d.local if tier == "local" else d.shared
    tier_dir.mkdir(parents=True)
    (tier_dir / "victim").symlink_to(outside, target_is_directory=True)
    d.start()
    with Client("victim", socket=d.socket) as c:
        h = c.save(1, {"w": torch.ones(10)})
        if tier == "local":
            with pytest.raises(SaveFailed, match="symbolic link"):
                h.wait("local", timeout=30)
        else:
            h.wait("local", timeout=30)  # committed locally; the drain refuses the link and retries
            with pytest.raises(TimeoutError):
                h.wait("shared", timeout=3)
            assert "symbolic link" in d.log.read_text()
            assert c.latest() == 1  # the local copy stays: nothing leaves it before a shared commit
    assert tree_of(outside) == ["keep", "keep/precious.txt"]
    assert precious.read_text() == "not the daemon's"


# ------------------------------------------------- the commit helpers, called directly


@pytest.fixture
def tier(tmp_path: Path) -> Path:
    root = tmp_path / "tier"
    root.mkdir()
    return root


def test_a_part_is_never_committed_through_a_linked_job_directory(tier: Path, tmp_path: Path) -> None:
    outside, _ = outside_with_a_file(tmp_path)
    writer = fsutil.PartWriter(tier, "node", "job", 1, 0)
    writer.path("data").write_bytes(b"x")
    (tier / "job").symlink_to(outside, target_is_directory=True)
    with pytest.raises(OSError, match=f"{tier / 'job'} is a symbolic link") as info:
        writer.commit({"files": []})
    assert info.value.errno == errno.ELOOP
    writer.abort()
    assert tree_of(outside) == ["keep", "keep/precious.txt"]


def test_a_part_is_never_removed_through_a_linked_step_directory(tier: Path, tmp_path: Path) -> None:
    outside, precious = outside_with_a_file(tmp_path)
    (tier / "job").mkdir()
    step = layout.part_dir(tier, "job", 1, 0).parent
    step.symlink_to(outside, target_is_directory=True)
    with pytest.raises(OSError, match="symbolic link"):
        fsutil.remove_part(tier, "node", step / "keep")
    assert precious.read_text() == "not the daemon's"


def test_state_is_never_written_through_a_linked_directory(tier: Path, tmp_path: Path) -> None:
    outside, _ = outside_with_a_file(tmp_path)
    (tier / ".state").symlink_to(outside, target_is_directory=True)
    with pytest.raises(OSError, match=f"{tier / '.state'} is a symbolic link"):
        fsutil.write_json_atomic(tier / ".state" / "pins.json", {"a": 1})
    with pytest.raises(OSError, match="symbolic link"):
        fsutil.write_json_atomic(tier / ".state" / "pins.json", {"a": 1}, within=tier)
    assert tree_of(outside) == ["keep", "keep/precious.txt"]


def test_directories_are_never_made_through_a_link(tier: Path, tmp_path: Path) -> None:
    outside, _ = outside_with_a_file(tmp_path)
    (tier / "job").symlink_to(outside, target_is_directory=True)
    with pytest.raises(OSError, match="symbolic link"):
        fsutil.makedirs_durable(tier / "job" / "step-1", within=tier)
    (tier / "dangling").symlink_to(tmp_path / "nowhere", target_is_directory=True)
    with pytest.raises(OSError):
        fsutil.makedirs_durable(tier / "dangling" / "x")  # even unchecked: never created through the link
    assert tree_of(outside) == ["keep", "keep/precious.txt"] and not (tmp_path / "nowhere").exists()


def test_a_path_outside_the_tier_is_refused(tier: Path, tmp_path: Path) -> None:
    with pytest.raises(OSError, match="not inside the tier"):
        tierpath.check_contained(tier, tmp_path / "elsewhere")
    with pytest.raises(OSError, match="climbs out"):
        tierpath.check_contained(tier, tier / ".." / "elsewhere")


def test_the_temporaries_link_itself_is_removed_not_its_target(tier: Path, tmp_path: Path) -> None:
    outside, _ = outside_with_a_file(tmp_path)
    root = layout.tmp_root(tier, "node")
    root.parent.mkdir(parents=True)
    root.symlink_to(outside, target_is_directory=True)
    assert fsutil.clean_temporaries(tier, "node") == 1
    assert not os.path.lexists(root) and tree_of(outside) == ["keep", "keep/precious.txt"]
