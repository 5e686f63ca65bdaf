"""``ckptstage demo``: a training run that survives a SIGKILL.

The parent starts a daemon on a temporary config (unless one already
answers), runs a small real PyTorch trainer as a child process that
checkpoints every few steps, SIGKILLs it mid-run, starts it again, and the
new trainer resumes from ``client.latest()``. Model, optimizer and RNG state
are restored and the data is a deterministic function of the step, so the
resumed run recomputes the killed run's last steps with *identical* losses:
the printout compares them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ckptstage.client import commands, errors
from ckptstage.client.rpc import Connection, resolve_socket

JOB = "demo"


# --- the trainer (child process) ---------------------------------------------------


def _emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def train(socket: str, job: str, steps: int, every: int) -> int:
    import torch
    from tqdm import tqdm

    from ckptstage.client import Client

    torch.manual_seed(0)
    torch.set_num_threads(1)  # bit-identical losses across the kill need a fixed reduction order
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    teacher = torch.nn.Linear(64, 10)  # the synthetic task: match a fixed random teacher's argmax

    with Client(job, socket=socket) as client:
        start = client.latest() or 0
        if start:
            state = client.load(start)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            torch.set_rng_state(state["rng"])
            _emit(event="resumed", step=start, loss=state["loss"])
        client.protect(opt)  # opt.step() waits for a snapshot still being copied

        def committed(handle: Any) -> None:
            handle.wait("local")
            _emit(event="committed", step=handle.step)

        bar = tqdm(range(start + 1, steps + 1), initial=start, total=steps, desc="training", unit="step",
                   file=sys.stderr, dynamic_ncols=True)
        for step in bar:
            g = torch.Generator().manual_seed(step)
            x = torch.randn(512, 64, generator=g)
            with torch.no_grad():
                y = teacher(x).argmax(dim=1)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            bar.set_postfix(loss=f"{loss.item():.4f}")
            _emit(event="step", step=step, loss=loss.item())
            if step % every == 0:
                h = client.save(step, {"model": model.state_dict(), "optim": opt.state_dict(),
                                       "rng": torch.get_rng_state(), "step": step, "loss": loss.item()})
                threading.Thread(target=committed, args=(h,), daemon=True).start()
            time.sleep(0.08)  # a "real" step takes a while; lets a person watch the bar
        bar.close()
        client.wait_snapshots()
    return 0


# --- the orchestrator (parent) -----------------------------------------------------------


@contextlib.contextmanager
def _daemon(socket: str | None) -> Iterator[Path]:
    """Uses the daemon that answers on ``socket``; else starts one on a temporary config."""
    path = resolve_socket(socket)
    try:
        with Connection(path) as conn:
            conn.status(timeout=2)
        running = True
    except errors.CkptStageError:
        running = False
    if running:
        print(f"using the running ckptstaged on {path}")
        yield path
        return
    # Only the orchestrator imports the launcher, and only here: the trainer, and whoever imports the
    # client, never load the daemon package.
    from ckptstage.daemon.launcher import DaemonExited, DaemonNotReady, DaemonProcess

    with tempfile.TemporaryDirectory(prefix="ckptstage-demo-") as tmp:
        root = Path(tmp)
        daemon = DaemonProcess(root, {"arena.max_bytes": "256MiB", "arena.min_session_bytes": "64MiB",
                                      "shared.keep_last": 3})
        try:
            daemon.start()
        except (DaemonExited, DaemonNotReady) as e:
            raise SystemExit(str(e)) from None
        try:
            print(f"started a temporary ckptstaged (pid {daemon.pid}) on {daemon.socket}\n"
                  f"  local tier {daemon.local}, shared tier {daemon.shared}")
            yield daemon.socket
        finally:
            daemon.stop()


def _run_trainer(socket: Path, job: str, steps: int, every: int, kill_at: int | None) -> dict[int, float]:
    """Runs one trainer process; returns its per-step losses. SIGKILLs it after ``kill_at``."""
    cmd = [sys.executable, "-m", "ckptstage.client.demo", "--train", "--socket", str(socket), "--job", job,
           "--steps", str(steps), "--every", str(every)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    losses: dict[int, float] = {}
    for line in proc.stdout:
        ev = json.loads(line)
        if ev["event"] == "step":
            losses[ev["step"]] = ev["loss"]
            if kill_at is not None and ev["step"] >= kill_at:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                print(f"\n*** SIGKILL sent to the trainer (pid {proc.pid}) after step {ev['step']}", flush=True)
                return losses
        elif ev["event"] == "committed":
            tqdm_write(f"  checkpoint of step {ev['step']} committed on the local tier")
        elif ev["event"] == "resumed":
            tqdm_write(f"  resumed from the checkpoint of step {ev['step']} (loss there {ev['loss']:.4f})")
    if proc.wait() != 0:
        raise SystemExit(f"the trainer failed with exit code {proc.returncode}")
    return losses


def tqdm_write(text: str) -> None:
    from tqdm import tqdm

    tqdm.write(text, file=sys.stderr)


def run(socket: str | None, steps: int, every: int, kill_at: int) -> int:
    if not 0 < every < kill_at < steps:
        print("ckptstage demo: need 0 < --every < --kill-at < --steps", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    with _daemon(socket) as path:
        job = f"{JOB}-{os.getpid()}"
        print(f"\n== run 1: train job {job!r} for {steps} steps, checkpoint every {every}, "
              f"killed after step {kill_at}")
        first = _run_trainer(path, job, steps, every, kill_at)
        print(f"\n== run 2: restart the trainer; it resumes from client.latest()")
        second = _run_trainer(path, job, steps, every, None)
        _report(first, second, steps)
        with Connection(path) as conn:
            print(f"\n$ ckptstage ls {job}")
            commands.cmd_ls(conn, argparse.Namespace(job=job, json=False))
    print(f"\ndemo finished in {time.monotonic() - t0:.1f}s")
    return 0


def _report(first: dict[int, float], second: dict[int, float], steps: int) -> None:
    redone = sorted(set(first) & set(second))
    resumed_from = min(second) - 1
    print(f"\nkilled run reached step {max(first)}; resumed run restarted after step {resumed_from} "
          f"and recomputed steps {redone[0]}..{redone[-1]}:" if redone else "")
    same = all(first[s] == second[s] for s in redone)
    for s in redone:
        print(f"  step {s:3d}: loss before the kill {first[s]:.6f}, after the restart {second[s]:.6f}")
    if redone:
        print("  identical: the model, optimizer and RNG state came back bit-exact" if same else
              "  MISMATCH: the restored state differs from the one saved")
    print(f"final loss at step {steps}: {second[steps]:.4f} (first logged loss {first[min(first)]:.4f})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckptstage.client.demo")
    p.add_argument("--train", action="store_true", help="run the trainer (the demo's child process)")
    p.add_argument("--socket")
    p.add_argument("--job", default=JOB)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=36)
    args = p.parse_args(argv)
    if args.train:
        return train(args.socket, args.job, args.steps, args.every)
    return run(args.socket, args.steps, args.every, args.kill_at)


if __name__ == "__main__":
    sys.exit(main())
