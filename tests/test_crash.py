"""Crashes with real signals: nothing committed is lost, nothing torn is visible, nothing leaks.

The daemon is a real ``ckptstaged`` process and the faults are real signals:
SIGKILL of the daemon (after a commit, and in the middle of a save), SIGKILL of
a trainer process in the middle of a save, SIGTERM while a save is in flight.

A trainer that must be caught *in the middle* of a save runs as a subprocess
whose state holds a tensor subclass that stops the snapshot thread when its
bytes are about to be copied: the save has begun, earlier tensors are in the
arena and on their way to disk, and the client will never finish it. That
makes "mid-save" a certainty instead of a race.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from ckptstage.client import CkptStageError, Client
from ckptstage.protos import chunks, layout
from support import assert_same, wait_until

T = TypeVar("T")

# A trainer that begins a save and stalls inside it. argv: socket, job, MiB of float64 streamed before the
# stall, step, the read end of the test's gate pipe. Prints "SAVING" once the save is under way, then
# blocks reading the gate: it goes on only if the test writes to it (or closes it), which the tests
# below never do before they kill it.
STALLING_TRAINER = r"""
import os, sys
import torch
from ckptstage.client import Client

socket, job, mib, step, gate = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])


class Stall(torch.Tensor):
    # Any torch call passes through; the copy into the arena first waits for the test's gate.
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            print("SAVING", flush=True)
            os.read(gate, 1)
            print("RELEASED", flush=True)
        return super().__torch_function__(func, types, args, kwargs or {})


client = Client(job, socket=socket)
state = {"big": torch.ones(mib << 17, dtype=torch.float64),             # laid out first (8-byte elements)
         "stall": torch.zeros(4096, dtype=torch.uint8).as_subclass(Stall),  # last
         "step": 1}
handle = client.save(step, state)
handle.wait_snapshot()
print("UNREACHABLE: the snapshot finished", flush=True)
"""


class Gate(torch.Tensor):
    """A tensor whose copy into the arena waits until the test opens its gate (in this process).

    Laid out after the rest of a state, it holds a save at a known point: every
    other byte has been copied (and, when the state streams, reported to the
    daemon), and the save cannot finish until :meth:`open` is called.
    """

    opened = threading.Event()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.copy_:
            cls.opened.wait()
        return super().__torch_function__(func, types, args, kwargs or {})

    @classmethod
    def close(cls) -> None:
        cls.opened.clear()

    @classmethod
    def open(cls) -> None:
        cls.opened.set()


def temporaries(local: Path) -> list[Path]:
    return list(local.glob(f"{layout.TMP_DIR}/*/*"))


def committed_steps(local: Path, job: str) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in (local / job).glob("step-*") if any(p.iterdir()))


def arenas_of(daemon_pid: int) -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(f"ckptstage-{daemon_pid}-*")}


def mapped_arenas(pid: int) -> list[str]:
    """The ckptstage arenas process ``pid`` still maps (unlinked ones read '(deleted)')."""
    return [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/ckptstage-" in line]


def session_for(daemon: Any, pid: int) -> Any:
    with daemon.connection() as conn:
        return next((s for s in conn.status().sessions if s.pid == pid), None)


def training_state(seed: int, n: int = 50_000) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(n, generator=g), "b": torch.randn(n // 7, generator=g).to(torch.bfloat16)},
            "optim": {"state": {0: {"step": torch.tensor(float(seed)), "exp_avg": torch.randn(n, generator=g)}}},
            "rng": g.get_state(), "step": seed}




class Trainer:
    """A stalling trainer subprocess (see STALLING_TRAINER); its stderr goes to ``log``."""

    def __init__(self, daemon: Any, job: str, mib: int, step: int, log: Path) -> None:
        self.log = log
        gate_r, self.gate = os.pipe()  # the trainer blocks reading gate_r; only this test could write to it
        try:
            with open(log, "wb") as err:
                self.proc = subprocess.Popen([sys.executable, "-c", STALLING_TRAINER, str(daemon.socket), job,
                                              str(mib), str(step), str(gate_r)], stdout=subprocess.PIPE, stderr=err,
                                             pass_fds=(gate_r,))
        finally:
            os.close(gate_r)

    def wait_saving(self, timeout: float = 60.0) -> None:
        """Returns once the trainer is inside its save (it prints one line, or dies)."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline().decode() if ready else f"<nothing after {timeout}s>"
        if line.strip() != "SAVING":
            self.kill()
            raise AssertionError(f"trainer did not reach its save: {line!r}\n{self.log.read_text()}")
        # Held at the gate, it stays there: nothing more comes from it until it is killed.
        assert not select.select([self.proc.stdout], [], [], 0)[0] and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        if self.gate >= 0:
            os.close(self.gate)
            self.gate = -1


@pytest.fixture
def trainers(tmp_path: Path) -> Any:
    made: list[Trainer] = []

    def make(daemon: Any, job: str, mib: int = 8, step: int = 5) -> Trainer:
        t = Trainer(daemon, job, mib, step, tmp_path / f"trainer-{len(made)}.log")
        made.append(t)
        return t

    yield make
    for t in made:
        t.kill()


# --- the daemon dies ------------------------------------------------------------------------------


def test_daemon_sigkill_after_commit_then_restart_loads_bit_exact(daemon):
    state = training_state(7)
    with Client("survive", socket=daemon.socket) as c:
        c.save(7, state).wait("local", timeout=30)
        c.save(8, training_state(8)).wait("local", timeout=30)
        old_pid = daemon.proc.pid
        assert daemon.kill(signal.SIGKILL) == -signal.SIGKILL

        daemon.start()
        assert daemon.proc.pid != old_pid
        # The trainer's client outlives the daemon: its next save opens a new session on the successor.
        c.save(10, training_state(10)).wait("local", timeout=30)
        assert c.latest() == 10

    with Client("survive", socket=daemon.socket) as fresh:
        assert [i.step for i in fresh.list()] == [7, 8, 10]
        assert_same(fresh.load(7), state)
        assert_same(fresh.load(8), training_state(8))
        assert_same(fresh.load(), training_state(10))
    assert temporaries(daemon.local) == []


def test_daemon_sigkill_mid_save_leaves_no_trace(daemon_factory, trainers):
    # Deterministic: the trainer has streamed 64 MiB of its state and will never finish.
    d = daemon_factory(**{"arena.max_bytes": "16MiB", "persist.chunk_bytes": "256KiB",
                          "arena.min_session_bytes": "1MiB"}).start()
    with Client("crash", socket=d.socket) as c:
        c.save(1, training_state(1)).wait("local", timeout=30)
    trainer = trainers(d, "crash", mib=64)
    trainer.wait_saving()
    session = session_for(d, trainer.proc.pid)
    assert session is not None and session.saves_in_flight == 1
    wait_until(lambda: temporaries(d.local), 10, "the save's temporary directory exists")
    dead_pid = d.proc.pid
    # An arena left behind by a daemon that died before its client mapped it.
    leftover = Path(f"/dev/shm/ckptstage-{dead_pid}-0123456789abcdef-1")
    leftover.write_bytes(b"\0" * 4096)

    assert d.kill(signal.SIGKILL) == -signal.SIGKILL
    d.start()

    assert arenas_of(dead_pid) == set()
    assert temporaries(d.local) == []
    assert committed_steps(d.local, "crash") == [1]
    with Client("crash", socket=d.socket) as c:
        assert c.latest() == 1
        assert [i.step for i in c.list()] == [1]
        assert_same(c.load(), training_state(1))
        c.save(5, training_state(5)).wait("local", timeout=30)  # the trainer's step 5 was never taken
        assert c.latest() == 5


def test_daemon_sigkill_while_persisting_a_large_state(daemon_factory):
    # A few hundred MiB through a small arena in small chunks: the daemon is
    # busy writing when it is killed. The state's last tensor is held at a gate,
    # so the save cannot have finished (or been committed) before the kill.
    d = daemon_factory(**{"arena.max_bytes": "8MiB", "persist.chunk_bytes": "256KiB",
                          "arena.min_session_bytes": "1MiB", "persist.workers": 1, "shared.dir": ""}).start()
    big = {"w": torch.full((256 << 18,), 0.5), "gate": torch.zeros(16, dtype=torch.uint8).as_subclass(Gate),
           "step": 2}  # 256 MiB, then the gate
    Gate.close()
    with Client("large", socket=d.socket) as c:
        c.save(1, training_state(1)).wait("local", timeout=30)
        try:
            h = c.save(2, big)
            wait_until(lambda: temporaries(d.local) and getattr(session_for(d, os.getpid()), "saves_in_flight", 0),
                       30, "the large save is in flight")
            dead_pid = d.proc.pid
            assert d.kill(signal.SIGKILL) == -signal.SIGKILL
        finally:
            Gate.open()  # the copy goes on, to a dead daemon
        with pytest.raises(CkptStageError):
            h.wait("local", timeout=60)

    d.start()
    assert arenas_of(dead_pid) == set()
    assert temporaries(d.local) == []
    assert committed_steps(d.local, "large") == [1]
    with Client("large", socket=d.socket) as c:
        assert [i.step for i in c.list()] == [1] and c.latest() == 1
        assert_same(c.load(1), training_state(1))


def test_sigterm_finishes_the_in_flight_persist_and_exits_zero(daemon_factory):
    # The client copies into a roomy arena at memory speed; one writer thread
    # is still persisting when its snapshot is done. The daemon is frozen
    # (SIGSTOP) to check, race-free, that the part is not committed yet when
    # SIGTERM is sent; SIGCONT then lets it handle SIGTERM.
    d = daemon_factory(**{"arena.max_bytes": "512MiB", "persist.chunk_bytes": "4MiB",
                          "persist.workers": 1, "shared.dir": ""}).start()
    state = {"w": torch.arange(48 << 20, dtype=torch.int32), "step": 3}  # 192 MiB
    pid = d.proc.pid
    with Client("term", socket=d.socket, arena_bytes=256 << 20) as c, ThreadPoolExecutor(1) as pool:
        for step in (3, 4, 5):
            h = c.save(step, state)
            h.wait_snapshot(timeout=60)
            os.kill(pid, signal.SIGSTOP)
            if step not in committed_steps(d.local, "term"):
                break  # caught in flight
            os.kill(pid, signal.SIGCONT)
        else:
            pytest.fail("every save committed before the daemon could be frozen: no persist was in flight")
        waited = pool.submit(h.wait, "local", 60)  # queued on the socket while the daemon is frozen
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGCONT)
        waited.result(timeout=90)  # the daemon finished the persist and told the client
        assert d.proc.wait(timeout=60) == 0
    assert not d.socket.exists()

    d.start()
    with Client("term", socket=d.socket) as c:
        assert c.latest() == step
        loaded = c.load(step)
    assert loaded["step"] == 3 and torch.equal(loaded["w"], state["w"])


def test_sigterm_fails_an_unfinished_save_cleanly_and_exits_zero(daemon_factory, trainers):
    d = daemon_factory(**{"persist.shutdown_timeout_s": 20}).start()
    trainer = trainers(d, "term2", mib=4)
    trainer.wait_saving()
    t0 = time.monotonic()
    assert d.kill(signal.SIGTERM) == 0
    assert time.monotonic() - t0 < 15  # it does not wait out the timeout for a save nobody will finish
    assert temporaries(d.local) == []
    assert committed_steps(d.local, "term2") == []

    d.start()
    with Client("term2", socket=d.socket) as c:
        assert c.latest() is None and c.list() == []


# --- the trainer dies ------------------------------------------------------------------------------


@pytest.mark.parametrize("streaming", [False, True], ids=["mid-copy", "mid-stream"])
def test_trainer_sigkill_mid_save_frees_its_session_and_memory(daemon_factory, trainers, streaming):
    # A state that fits in the arena is persisted only once copied (snapshot
    # first); a larger one streams, and the daemon is writing it when the trainer dies.
    daemon = daemon_factory(**{"arena.max_bytes": "24MiB" if streaming else "512MiB"}).start()
    other = Client("bystander", socket=daemon.socket)
    try:
        other.save(1, training_state(1)).wait("local", timeout=30)
        trainer = trainers(daemon, "victim", mib=32 if streaming else 16)
        trainer.wait_saving()
        # BeginSave is answered while the copy runs: the daemon holds the save in flight.
        victim = wait_until(lambda: next((s for s in [session_for(daemon, trainer.proc.pid)]
                                          if s is not None and s.saves_in_flight == 1), None),
                            20, "the daemon holds the victim's save in flight")
        assert victim.arena_bytes > 0
        assert temporaries(daemon.local)  # its data file exists, not committed
        arena_prefix = f"/ckptstage-{daemon.proc.pid}-{victim.session_id}-"
        assert any(arena_prefix in line for line in mapped_arenas(daemon.proc.pid))

        trainer.kill()

        def reaped() -> Any:
            with daemon.connection() as conn:
                status = conn.status()
            bystander_only = [s.job for s in status.sessions] == ["bystander"]
            return bystander_only and status.arena_used_bytes == status.sessions[0].arena_bytes

        wait_until(reaped, 20, "the dead trainer's session is closed and its arena back in the budget")
        # Its arena is unmapped in the daemon too, so the memory is really free.
        wait_until(lambda: not any(arena_prefix in line for line in mapped_arenas(daemon.proc.pid)), 10,
                   "the daemon unmapped the dead trainer's arena")
        assert not any(victim.session_id in name for name in arenas_of(daemon.proc.pid))
        assert temporaries(daemon.local) == []
        assert not (daemon.local / "victim").exists() or committed_steps(daemon.local, "victim") == []

        # The daemon keeps serving: the bystander saves and loads, a new trainer of the job starts over.
        other.save(2, training_state(2)).wait("local", timeout=30)
        assert_same(other.load(2), training_state(2))
        with Client("victim", socket=daemon.socket) as again:
            assert again.latest() is None and again.list() == []
            again.save(5, training_state(3)).wait("local", timeout=30)
            assert_same(again.load(5), training_state(3))
    finally:
        other.close()
    with daemon.connection() as conn:
        # What is still granted is the memory tier's: the newest committed part of each rank that exited
        # (the bystander's, the restarted victim's); nothing of the killed one's unfinished save.
        status = wait_until(lambda: (s := conn.status()).memory_parts == 2 and s, 20, "both parts kept in memory")
    assert list(status.sessions) == [] and status.arena_used_bytes == status.memory_bytes


# A trainer that finishes its snapshot, says so, and then hangs until killed.
SNAPSHOT_THEN_HANG = r"""
import sys, time
import torch
from ckptstage.client import Client

client = Client(sys.argv[2], socket=sys.argv[1])
handle = client.save(7, {"big": torch.arange(int(sys.argv[3]) << 17, dtype=torch.float64)})
handle.wait_snapshot()
print("SNAPSHOT", flush=True)
time.sleep(3600)
"""


def test_trainer_sigkill_after_its_snapshot_still_commits(daemon_factory, tmp_path):
    """Bytes that reached the daemon survive the trainer: the daemon persists from its own mapping."""
    d = daemon_factory(**{"persist.workers": 1, "arena.max_bytes": "1GiB"}).start()
    mib = 256
    proc = subprocess.Popen([sys.executable, "-c", SNAPSHOT_THEN_HANG, str(d.socket), "orphan", str(mib)],
                            stdout=subprocess.PIPE, stderr=open(tmp_path / "trainer.log", "wb"))
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready and proc.stdout.readline().strip() == b"SNAPSHOT", (tmp_path / "trainer.log").read_text()
        proc.kill()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    wait_until(lambda: committed_steps(d.local, "orphan") == [7], 120, "the orphaned save to commit")
    part = layout.part_dir(d.local, "orphan", 7, 0)
    chunks.verify_part(part)
    assert layout.read_manifest(part)["files"][layout.DATA_FILE]["size"] > mib << 20
    with Client("orphan", socket=d.socket) as c:
        loaded = c.load(7)["big"]
    assert torch.equal(loaded, torch.arange(mib << 17, dtype=torch.float64))
    wait_until(lambda: session_for(d, proc.pid) is None, 30, "the dead trainer's session to be reaped")
    with d.connection() as conn:
        # Its arena is the memory tier's now (the orphaned save is its newest committed part), and only that.
        wait_until(lambda: (s := conn.status()).memory_parts == 1 and s.arena_used_bytes == s.memory_bytes, 30,
                   "its arena kept by the memory tier, nothing else left in the budget")
    assert not arenas_of(d.proc.pid)


def test_second_daemon_on_the_same_local_tier_refuses_to_start(daemon_factory, tmp_path):
    first = daemon_factory("a").start()
    second = daemon_factory("b")
    second.socket = tmp_path / "b-run" / "other.sock"
    second.local = first.local
    second.write_config()
    second.start(wait=False)
    assert second.proc is not None
    assert second.proc.wait(timeout=60) != 0
    assert f"another daemon already uses the local tier {first.local}" in second.log.read_text()
    with first.connection() as conn:
        assert conn.status().pid == first.proc.pid
