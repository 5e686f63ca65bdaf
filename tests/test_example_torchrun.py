"""examples/torchrun_train.py, run for real: torchrun, 2 gloo ranks, a real daemon, SIGKILL of the whole job.

An uninterrupted run fixes the final parameters' digest; a second job is
SIGKILLed (torchrun and both workers) once it has committed a checkpoint,
relaunched with the same command, and must resume from the newest complete
step and end with the same digest, bit for bit.

torchrun starts each worker in a session of its own: killing torchrun's
process group leaves the workers training. Killing "the whole job" (what a
scheduler does to a cgroup) means killing torchrun and every descendant.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from conftest import DaemonProc
from support import wait_until

from ckptstage.client import Client
from ckptstage.protos.v1 import ckptstage_pb2 as pb

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "torchrun_train.py"
STEPS, EVERY = 30, 5
FINAL_RE = re.compile(r"^final step=(\d+) params_sha256=([0-9a-f]{64})$", re.M)
RESUMED_RE = re.compile(r"^resumed from step (\d+) ", re.M)
RUN_TIMEOUT_S = 90.0


class Job:
    """One ``torchrun --nproc-per-node 2`` of the example, in its own session, output to a file."""

    def __init__(self, socket: Path, job: str, log: Path, *extra: str) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(EXAMPLE), "--job", job, "--steps", str(STEPS), "--save-every", str(EVERY),
               "--device", "cpu", *extra]  # cpu: two ranks cannot share one GPU under NCCL
        env = dict(os.environ, CKPTSTAGE_SOCKET=str(socket), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        self.tree: dict[int, psutil.Process] = {self.proc.pid: psutil.Process(self.proc.pid)}

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def workers(self) -> list[psutil.Process]:
        """torchrun's live descendants, remembered (a killed torchrun's workers are re-parented)."""
        try:
            for p in self.tree[self.proc.pid].children(recursive=True):
                self.tree.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            pass
        return [p for pid, p in self.tree.items() if pid != self.proc.pid]

    def finish(self) -> str:
        """Waits for a clean exit; returns the output."""
        try:
            rc = self.proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"torchrun still running after {RUN_TIMEOUT_S}s:\n{self.output()}")
        assert rc == 0, f"torchrun exited with {rc}:\n{self.output()}"
        return self.output()

    def kill(self) -> None:
        """SIGKILLs torchrun and every worker (each in its own process group), and waits for them to be gone."""
        procs = [self.tree[self.proc.pid], *self.workers()]
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL) if os.getpgid(p.pid) == p.pid else p.kill()
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        self.proc.wait(timeout=30)
        _, alive = psutil.wait_procs(procs, timeout=30)
        alive = [p for p in alive if _running(p)]
        assert not alive, f"still running after SIGKILL: {alive}"


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def complete_steps(d: DaemonProc, job: str) -> list[int]:
    with d.connection() as conn:
        resp = conn.call("ListCheckpoints", pb.ListRequest(job=job))
    return sorted(c.step for c in resp.checkpoints if c.complete)


def final_line(out: str) -> tuple[int, str]:
    found = FINAL_RE.findall(out)
    assert len(found) == 1, f"expected one final line from rank 0:\n{out}"
    return int(found[0][0]), found[0][1]


def digest(model_state: dict) -> str:
    """The example's digest of a model state (name, then raw bytes, in state_dict order)."""
    h = hashlib.sha256()
    for name, t in model_state.items():
        h.update(name.encode() + t.contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProc, str]]:
    """One uninterrupted run of job "ref" on its own daemon: (daemon, its output)."""
    root = tmp_path_factory.mktemp("torchrun")
    d = DaemonProc(root / "node").start()
    job = Job(d.socket, "ref", root / "ref.log")
    try:
        yield d, job.finish()
    finally:
        job.kill()
        d.stop()


def test_uninterrupted_run_saves_every_ranks_part(reference: tuple[DaemonProc, str]) -> None:
    d, out = reference
    step, final = final_line(out)
    assert step == STEPS
    assert not RESUMED_RE.search(out), out
    assert STEPS in complete_steps(d, "ref")
    parts = []
    for rank in (0, 1):
        with Client("ref", socket=d.socket, rank=rank, world_size=2, attempt="check") as c:
            parts.append(c.load(STEPS))
            info = {i.step: i for i in c.list()}
    assert info[STEPS].world_size == 2 and not info[STEPS].ranks_missing and "loss" in info[STEPS].metrics
    for part in parts:  # each rank's part holds the final model (DDP keeps the replicas equal)
        assert part["step"] == STEPS and digest(part["model"]) == final
    # ... and its own RNG state: the ranks' dropout streams differ, so one shared state would be wrong.
    assert not parts[0]["rng"]["cpu"].equal(parts[1]["rng"]["cpu"])


def test_sigkill_of_the_whole_job_resumes_bit_identical(daemon: DaemonProc, reference: tuple[DaemonProc, str],
                                                        tmp_path: Path) -> None:
    _, want = final_line(reference[1])
    # --step-time: the 30 steps take ~3 s, time enough to kill the job between two checkpoints.
    first = Job(daemon.socket, "crash", tmp_path / "first.log", "--step-time", "0.1")
    try:
        wait_until(lambda: any(s >= 2 * EVERY for s in complete_steps(daemon, "crash"))
                   or first.proc.poll() is not None, RUN_TIMEOUT_S, "a checkpoint at step >= 10")
        assert len(first.workers()) == 2, "torchrun should have two workers"
    finally:
        first.kill()
    killed_out = first.output()
    assert not FINAL_RE.search(killed_out), f"the job finished before it was killed:\n{killed_out}"
    committed = max(complete_steps(daemon, "crash"))
    assert 2 * EVERY <= committed < STEPS

    second = Job(daemon.socket, "crash", tmp_path / "second.log")
    try:
        out = second.finish()
    finally:
        second.kill()
    resumed = RESUMED_RE.findall(out)
    assert [int(s) for s in resumed] == [committed], out
    assert final_line(out) == (STEPS, want)
