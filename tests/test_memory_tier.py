"""The memory tier: a trainer restarted on its node loads its newest checkpoint from the daemon's memory.

Real trainer processes are SIGKILLed; the restarted trainer is this test
process, reading through the real handoff socket. What must hold: the copy
read from memory is the committed part, verified (never a torn image, a
deleted or a replaced step); the memory it takes is the arena budget's and
goes back when a session needs it or the copy expires; nothing is ever left
in /dev/shm.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support import assert_same, wait_until

from ckptstage.client import Client
from ckptstage.protos import handoff

MiB = 1 << 20
SETTINGS = {"arena.min_session_bytes": "1MiB", "persist.chunk_bytes": "1MiB", "shared.dir": ""}

TRAINER = r"""
import os, sys, time
import torch
from ckptstage.client import Client

socket, job, mib, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]


def state(seed, last):
    return {"w": torch.arange(mib << 18, dtype=torch.float32) * seed, "tail": last, "step": seed}


class Stall(torch.Tensor):
    # Laid out last: its copy into the arena waits, forever, once every other byte is copied.
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            print("SAVING", flush=True)
            time.sleep(3600)
        return super().__torch_function__(func, types, args, kwargs or {})


client = Client(job, socket=socket)
client.save(1, state(1, torch.ones(4096, dtype=torch.uint8))).wait("local", timeout=60)
print("SAVED", flush=True)
if mode == "stall-next":  # the next save overwrites the arena, and never finishes
    client.save(2, state(2, torch.zeros(4096, dtype=torch.uint8).as_subclass(Stall)))
time.sleep(3600)
"""


def saved_state(seed: int, mib: int) -> dict[str, Any]:
    return {"w": torch.arange(mib << 18, dtype=torch.float32) * seed, "tail": torch.ones(4096, dtype=torch.uint8),
            "step": seed}


def run_trainer(d: Any, job: str, mib: int, mode: str, until: str) -> subprocess.Popen[bytes]:
    """Starts a trainer that saves step 1 of ``job``; returns once it prints ``until``."""
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(d.socket), job, str(mib), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline().decode().strip() if ready else ""
        if line == until:
            return proc
        if not ready or not line:
            proc.kill()
            raise AssertionError(f"trainer did not print {until}: {proc.communicate()[1].decode()[-3000:]}")


def kill(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait(30)


def memory_parts(d: Any) -> int:
    with d.connection() as conn:
        return conn.status().memory_parts


def test_a_killed_trainer_restarts_from_memory(daemon_factory):
    d = daemon_factory(**SETTINGS).start()
    kill(run_trainer(d, "flash", 8, "hang", "SAVED"))
    wait_until(lambda: memory_parts(d) == 1, 20, "the dead trainer's part kept in memory")
    # Kept by descriptor only: nothing named in /dev/shm (invariant 5).
    assert not list(Path("/dev/shm").glob(f"ckptstage-{d.proc.pid}-*"))
    ls = subprocess.run([sys.executable, "-m", "ckptstage.client.cli", "--socket", str(d.socket), "ls", "flash"],
                        capture_output=True, text=True, timeout=60)
    assert ls.returncode == 0 and ls.stdout.splitlines()[1].split()[:2] == ["1", "local,memory"], ls.stdout
    with Client("flash", socket=d.socket) as c:
        [info] = c.list()
        assert info.ranks_memory == (0,) and info.tiers == ("local", "memory")
        state = c.load()
        assert c.last_load_tier == "memory"
        assert_same(state, saved_state(1, 8))
        # Copy-on-write: the tensors are the reader's own; writing them changes no one else's copy.
        state["w"].add_(1)
        assert_same(c.load(), saved_state(1, 8))
        into = {"w": torch.empty(8 << 18), "tail": torch.empty(4096, dtype=torch.uint8), "step": 0}
        loaded = c.load(into=into)
        assert c.last_load_tier == "memory" and loaded["w"] is into["w"]
        assert_same(into["w"], saved_state(1, 8)["w"])


def test_an_image_overwritten_by_an_unfinished_save_is_not_kept(daemon_factory):
    # The arena holds one state: the second save copies over the first's image, then the trainer dies.
    d = daemon_factory(**SETTINGS).start()
    kill(run_trainer(d, "torn", 8, "stall-next", "SAVING"))
    wait_until(lambda: "torn step 1 rank 0 not kept: block" in d.log.read_text(), 20,
               "the daemon finding the image overwritten")
    assert memory_parts(d) == 0
    with Client("torn", socket=d.socket) as c:
        assert c.list()[0].ranks_memory == ()
        assert_same(c.load(), saved_state(1, 8))
        assert c.last_load_tier == "local"
    with d.connection() as conn:
        status = conn.status()
    assert status.arena_used_bytes == status.memory_bytes == 0


def test_a_replaced_or_deleted_step_is_never_read_from_memory(daemon_factory):
    d = daemon_factory(**SETTINGS).start()
    with Client("redo", socket=d.socket) as c:
        c.save(1, saved_state(1, 2)).wait("local", timeout=30)
    wait_until(lambda: memory_parts(d) == 1, 20, "step 1 kept in memory")
    with Client("redo", socket=d.socket) as c:
        c.save(1, saved_state(5, 2), overwrite=True).wait("local", timeout=30)
        assert_same(c.load(1), saved_state(5, 2))
        assert c.last_load_tier == "local"
        c.save(2, saved_state(2, 2)).wait("local", timeout=30)
    wait_until(lambda: memory_parts(d) == 1, 20, "step 2 kept in memory")
    with Client("redo", socket=d.socket) as c:
        c.delete(2)
        assert c.latest() == 1 and memory_parts(d) == 0
        assert_same(c.load(), saved_state(5, 2))
        assert c.last_load_tier == "local"


def test_copies_make_way_for_sessions_that_need_the_memory(daemon_factory):
    d = daemon_factory(**{**SETTINGS, "arena.max_bytes": "20MiB"}).start()
    for job in ("old", "new"):
        with Client(job, socket=d.socket) as c:
            c.save(1, saved_state(1, 8)).wait("local", timeout=30)
        wait_until(lambda: memory_parts(d) == (1 if job == "old" else 2), 20, f"{job}'s part kept")
    with Client("third", socket=d.socket) as c:  # needs 8 MiB more than is free: the oldest copy goes
        c.save(1, saved_state(1, 8)).wait("local", timeout=30)
        assert memory_parts(d) == 1
    with Client("old", socket=d.socket) as c:
        assert_same(c.load(), saved_state(1, 8))
        assert c.last_load_tier == "local"
    with Client("new", socket=d.socket) as c:
        assert_same(c.load(), saved_state(1, 8))
        assert c.last_load_tier == "memory"


def test_a_restart_loads_before_its_arena_evicts_the_copy(daemon_factory):
    # Room for one 8 MiB arena: the restarted trainer's arena would push its own copy out.
    d = daemon_factory(**{**SETTINGS, "arena.max_bytes": "12MiB"}).start()
    with Client("tight", socket=d.socket) as c:
        c.save(1, saved_state(1, 8)).wait("local", timeout=30)
    wait_until(lambda: memory_parts(d) == 1, 20, "the part kept")
    with Client("tight", socket=d.socket) as c:
        c.prepare()  # what protect() does at once: put off until the load has read the copy
        assert_same(c.load(), saved_state(1, 8))
        assert c.last_load_tier == "memory"
        c.save(2, saved_state(2, 8)).wait("local", timeout=30)  # the arena, then, in place of the copy
        assert memory_parts(d) == 0


def test_copies_expire_and_can_be_turned_off(daemon_factory):
    d = daemon_factory(**{**SETTINGS, "memory.keep_s": 1, "retention.interval_s": 0.2}).start()
    with Client("brief", socket=d.socket) as c:
        c.save(1, saved_state(1, 2)).wait("local", timeout=30)
    wait_until(lambda: memory_parts(d) == 1, 20, "the part kept")
    with d.connection() as conn:
        wait_until(lambda: conn.status().arena_used_bytes == 0, 20, "the copy expired and its memory freed")
    off = daemon_factory("off", **{**SETTINGS, "memory.enabled": False}).start()
    with Client("never", socket=off.socket) as c:
        c.save(1, saved_state(1, 2)).wait("local", timeout=30)
    with off.connection() as conn:
        wait_until(lambda: conn.status().arena_used_bytes == 0, 20, "the arena freed at close")
        assert conn.status().memory_parts == 0


@pytest.mark.parametrize("request_line", [b"not json\n", b'{"job": "../x", "step": 1, "rank": 0}\n',
                                          b'{"job": "a", "step": -1, "rank": 0}\n', b"x" * 5000 + b"\n",
                                          b'{"job": "a", "step": 1, "rank": 0}\n'])
def test_the_handoff_socket_refuses_bad_requests_and_serves_on(daemon_factory, request_line):
    d = daemon_factory(**SETTINGS).start()
    path = handoff.socket_path(d.socket)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        try:
            s.sendall(request_line)
            answer = s.recv(4096)
        except ConnectionResetError:  # the oversized request: the daemon hung up on it
            answer = b""
    assert b"fds" not in answer and (answer == b"" or b'"error"' in answer)
    with pytest.raises(handoff.NotInMemory, match="not in memory"):
        handoff.fetch(path, "a", 1, 0)  # and it still answers


def test_a_long_socket_path_gets_its_handoff_socket_too(daemon_factory, tmp_path):
    # A gRPC socket path of 105 bytes (the limit is 107): the handoff socket's, 109, is bound through /proc.
    pad = 105 - len(os.fsencode(tmp_path)) - len("/c.sock") - 1
    if pad < 1:
        pytest.skip(f"the temporary directory {tmp_path} is too long for this test")
    sock = tmp_path / ("d" * pad) / "c.sock"
    sock.parent.mkdir(mode=0o700)
    d = daemon_factory(**SETTINGS, socket=str(sock))
    d.socket = sock
    d.start()
    assert len(os.fsencode(d.socket)) == 105 and len(os.fsencode(handoff.socket_path(d.socket))) > 107
    with Client("long", socket=d.socket) as c:
        c.save(1, saved_state(1, 2)).wait("local", timeout=30)
    wait_until(lambda: memory_parts(d) == 1, 20, "the part kept")
    with Client("long", socket=d.socket) as c:
        assert_same(c.load(), saved_state(1, 2))
        assert c.last_load_tier == "memory"
