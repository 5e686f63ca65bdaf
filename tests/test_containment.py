"""No create, rename or delete follows a symbolic link out of a tier.

Links planted inside a tier (``<tier>/.tmp/<node>``, ``<tier>/<job>``) used to
make the daemon delete files outside its tiers at start and write
checkpoints outside them; a shared tier that reached the local one through a
link was accepted, and local retention then deleted the "shared" copies.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from ckptstage.client import Client, SaveFailed
from ckptstage.daemon.node import node_name
from ckptstage.protos import layout


def outside_with_a_file(tmp_path: Path) -> tuple[Path, Path]:
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    precious = outside / "keep" / "precious.txt"
    precious.write_text("not the daemon's")
    return outside, precious


def tree_of(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_tiers_that_overlap_through_a_link_are_refused_at_start(daemon_factory: Any, tmp_path: Path) -> None:
    d = daemon_factory()
    d.local.mkdir(parents=True)
    link = tmp_path / "shared-link"
    link.symlink_to(d.local / "inner", target_is_directory=True)
    (d.local / "inner").mkdir()
    d.write_config(**{"shared.dir": str(link)})
    out = subprocess.run([sys.executable, "-m", "ckptstage.daemon.main", "--config", str(d.config_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert str(link) in lines[0] and str(d.local) in lines[0] and "overlaps" in lines[0]


def test_a_link_planted_as_the_nodes_temporaries_deletes_nothing_outside(daemon_factory: Any,
                                                                        tmp_path: Path) -> None:
    d = daemon_factory()
    outside, precious = outside_with_a_file(tmp_path)
    tmp_root = layout.tmp_root(d.local, node_name(d.local))
    tmp_root.parent.mkdir(parents=True)
    tmp_root.symlink_to(outside, target_is_directory=True)
    d.start()  # start-up removes this node's temporaries: the link itself, never what it points to
    assert precious.read_text() == "not the daemon's" and tree_of(outside) == ["keep", "keep/precious.txt"]
    with Client("job", socket=d.socket) as c:
        c.save(1, {"w": torch.ones(10)}).wait("local", timeout=30)
    assert tree_of(outside) == ["keep", "keep/precious.txt"]


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
