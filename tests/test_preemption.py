"""``Client.on_preemption``: a trainer signalled with notice resumes from the step it was at.

A real trainer subprocess (tests/preemption_trainer.py) saving every 10 steps
gets a real signal at step 17 from the test; a new client on the real daemon
then finds step 17, with the weights of 17 steps, not 10.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from ckptstage.client import Client
from preemption_trainer import STOP_AT, model_and_data, train

TESTS = Path(__file__).parent


def _run_trainer(daemon, tmp_path: Path, job: str, mode: str, sig: int = signal.SIGTERM) -> subprocess.Popen:
    """Starts the trainer, sends ``sig`` once it reports step 17, and waits for it to end."""
    proc = subprocess.Popen([sys.executable, str(TESTS / "preemption_trainer.py"), str(daemon.socket), job, mode,
                             str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == f"at {STOP_AT}", f"trainer said {line!r}; stderr: {proc.stderr.read()}"  # type: ignore[union-attr]
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    proc.stderr_text = proc.stderr.read()  # type: ignore[attr-defined,union-attr]
    return proc


def _assert_resumes_at_17(daemon, job: str) -> None:
    model, x = model_and_data()
    expected = train(model, x, STOP_AT)
    with Client(job, socket=daemon.socket) as c:
        assert c.latest() == STOP_AT
        state = c.load()
    assert state["step"] == STOP_AT
    for key, value in expected.items():
        assert torch.equal(state["model"][key], value), f"{key} is not the weights after {STOP_AT} steps"


@pytest.mark.parametrize("mode, sig, said", [
    ("default", signal.SIGTERM, "step 17 is with the daemon"),  # no handler of the trainer's
    ("watchdog", signal.SIGTERM, "from the watchdog thread"),  # no safe point comes: the watchdog snapshots
    ("check", signal.SIGUSR1, ""),  # SIGUSR1, an explicit check() in a loop without a torch optimizer
])
def test_the_process_dies_by_its_signal_after_the_snapshot(daemon, tmp_path, mode, sig, said):
    proc = _run_trainer(daemon, tmp_path, f"pre-{mode}", mode, sig=sig)
    assert proc.returncode == -sig, proc.stderr_text  # type: ignore[attr-defined]
    assert said in proc.stderr_text  # type: ignore[attr-defined]
    _assert_resumes_at_17(daemon, f"pre-{mode}")


def test_the_trainers_own_handler_runs_after_the_snapshot(daemon, tmp_path):
    proc = _run_trainer(daemon, tmp_path, "pre-handler", "handler")
    assert proc.returncode == 3, proc.stderr_text  # type: ignore[attr-defined]
    # The trainer's handler ran once, with SIGTERM, at the safe point: after step 17, before step 18's update.
    assert (tmp_path / "handler").read_text() == f"{int(signal.SIGTERM)} {STOP_AT}"
    _assert_resumes_at_17(daemon, "pre-handler")


def test_an_ignored_sigterm_stays_ignored(daemon, tmp_path):
    proc = _run_trainer(daemon, tmp_path, "pre-ignore", "ignore")
    assert proc.returncode == 0, proc.stderr_text  # type: ignore[attr-defined]
    assert (tmp_path / "finished").read_text() == "25"  # trained on after the snapshot
    with Client("pre-ignore", socket=daemon.socket) as c:
        steps = [i.step for i in c.list() if i.complete]
        assert steps == [10, STOP_AT, 20], steps
        assert c.load(STOP_AT)["step"] == STOP_AT


def test_close_restores_the_previous_handlers_and_a_second_call_replaces_the_first(daemon):
    def own(signum, frame):
        pass

    before = signal.signal(signal.SIGUSR2, own)
    try:
        c = Client("pre-install", socket=daemon.socket)
        first = c.on_preemption(lambda: (1, {}), signals=(signal.SIGUSR2,))
        assert signal.getsignal(signal.SIGUSR2) == first._on_signal
        second = c.on_preemption(lambda: (1, {}), signals=(signal.SIGUSR2, signal.SIGUSR1))
        assert signal.getsignal(signal.SIGUSR2) == second._on_signal
        assert second.previous[signal.SIGUSR2] is own  # not the first one: nothing chains to itself
        c.close()
        assert signal.getsignal(signal.SIGUSR2) is own
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
        second._watchdog.join(5)
        assert not second._watchdog.is_alive()  # the watchdog thread ended with it
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_installing_off_the_main_thread_is_a_clear_error(daemon):
    errors: list[BaseException] = []
    with Client("pre-thread", socket=daemon.socket) as c:
        def install() -> None:
            try:
                c.on_preemption(lambda: (1, {}))
            except BaseException as e:  # noqa: BLE001 - handed to the test's thread
                errors.append(e)
        t = threading.Thread(target=install)
        t.start()
        t.join()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError), errors
    assert "main thread" in str(errors[0])
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_signals_that_cannot_be_caught_are_refused(daemon):
    with Client("pre-kill", socket=daemon.socket) as c:
        with pytest.raises(ValueError, match="SIGKILL"):
            c.on_preemption(lambda: (1, {}), signals=(signal.SIGKILL,))
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
