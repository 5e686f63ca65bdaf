"""The ``ckptstage`` command against a real daemon, and the demo end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from ckptstage.client import Client


def ckptstage(*args: str, socket=None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "ckptstage.client.cli"]
    if socket is not None:
        cmd += ["--socket", str(socket)]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout)


def test_status_and_ls_json(daemon):
    with Client("cli-job", socket=daemon.socket) as c:
        c.save(5, {"w": torch.ones(100)}, metrics={"val_loss": 0.5}).wait("shared", timeout=30)
        st = json.loads(ckptstage("status", "--json", socket=daemon.socket).stdout)
        assert st["sessions"][0]["job"] == "cli-job"
        assert int(st["arena_used_bytes"]) > 0
    ls = json.loads(ckptstage("ls", "cli-job", "--json", socket=daemon.socket).stdout)
    (ck,) = ls["checkpoints"]
    assert int(ck["step"]) == 5 and ck["complete"] is True
    assert ck["ranks_local"] == [0] and ck["ranks_shared"] == [0]
    assert ck["drain_state"] == "drained" and ck["metrics"] == {"val_loss": 0.5}
    human = ckptstage("ls", "cli-job", socket=daemon.socket).stdout
    assert human.splitlines()[0].split()[:3] == ["STEP", "TIERS", "SIZE"]
    step, tiers = human.splitlines()[1].split()[:2]
    assert step == "5" and tiers in ("local,shared", "local,shared,memory")  # memory: kept once verified


def test_ls_names_the_missing_ranks_of_an_incomplete_step(daemon):
    with Client("cli-gaps", socket=daemon.socket, rank=1, world_size=4, attempt="run-a") as c:
        c.save(9, {"w": torch.ones(10)}).wait("local", timeout=30)
    row = ckptstage("ls", "cli-gaps", socket=daemon.socket).stdout.splitlines()[1]
    assert row.split()[0] == "9" and row.split()[1].startswith("local:1/4"), row  # one part of four, no record
    assert "no (missing ranks 0,2-3)" in row and "run-a" in row, row
    (ck,) = json.loads(ckptstage("ls", "cli-gaps", "--json", socket=daemon.socket).stdout)["checkpoints"]
    assert ck["ranks_missing"] == [0, 2, 3] and ck["attempt"] == "run-a"


def test_pin_gc_and_drain_commands(daemon):
    with Client("cli-gc", socket=daemon.socket) as c:
        for step in (1, 2, 3, 4):
            c.save(step, {"w": torch.full((10,), float(step))}).wait("shared", timeout=30)
    assert ckptstage("drain", "--wait", "--timeout", "30", socket=daemon.socket).returncode == 0
    # default local keep_last = 2: steps 1 and 2 already went from local; pin 3 and gc changes nothing
    assert ckptstage("pin", "cli-gc", "3", socket=daemon.socket).returncode == 0
    dry = ckptstage("gc", "--dry-run", socket=daemon.socket)
    assert dry.returncode == 0 and "nothing to delete" in dry.stdout
    ls = json.loads(ckptstage("ls", "cli-gc", "--json", socket=daemon.socket).stdout)["checkpoints"]
    pinned = [int(c["step"]) for c in ls if c.get("pinned")]
    assert pinned == [3]


def test_pin_unpin_and_rm_of_a_step_that_does_not_exist_fail_naming_it(daemon):
    with Client("cli-none", socket=daemon.socket) as c:
        c.save(2, {"w": torch.ones(4)}).wait("local", timeout=30)
    for command in ("pin", "unpin", "rm"):
        result = ckptstage(command, "cli-none", "7", socket=daemon.socket)
        assert result.returncode != 0, (command, result)
        assert "no step 7 of job 'cli-none'" in result.stderr, (command, result.stderr)
    # A step that exists: unpinning one never pinned is no failure (scripts may repeat it).
    assert ckptstage("unpin", "cli-none", "2", socket=daemon.socket).returncode == 0


def test_no_daemon_exit_code_and_message(tmp_path):
    res = ckptstage("status", socket=tmp_path / "nothing.sock")
    assert res.returncode == 3
    assert str(tmp_path / "nothing.sock") in res.stderr


def test_demo_survives_a_kill(daemon):
    env = dict(os.environ, CKPTSTAGE_SOCKET=str(daemon.socket))
    res = subprocess.run([sys.executable, "-m", "ckptstage.client.cli", "demo", "--steps", "14", "--every", "4",
                          "--kill-at", "10"], capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stderr
    assert "SIGKILL sent to the trainer" in res.stdout
    assert "identical: the model, optimizer and RNG state came back bit-exact" in res.stdout
    assert "resumed from the checkpoint of step 8" in res.stderr
