"""A tiny trainer for tests/test_preemption.py: a plain loop with ``client.on_preemption`` installed.

``python preemption_trainer.py SOCKET JOB MODE OUT``. Saves every 10 finished
steps; at step 17 it prints ``at 17`` and waits (up to 20 s) for the test's
signal, then trains on. Modes:

* ``default``: SIGTERM with no handler of the trainer's;
* ``handler``: the trainer's own SIGTERM handler (writes OUT/handler, exits 3);
* ``ignore``: SIGTERM ignored before on_preemption; trains on to step 25, exits 0;
* ``watchdog``: after the signal, a long phase without optimizer steps (an
  evaluation), ``timeout=1``;
* ``check``: ``signals=(SIGUSR1,)``; no torch optimizer (a hand-written
  update), ``at_optimizer_step=False`` and ``check()`` at the end of each step.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import torch

from ckptstage.client import Client

STOP_AT = 17
LR = 0.01


def model_and_data() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3), torch.randn(8, 4)


def train(model: torch.nn.Module, x: torch.Tensor, steps: int) -> dict[str, torch.Tensor]:
    """The weights after ``steps`` steps of the loop below, for the test to compare."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(steps):
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def main() -> None:
    socket, job, mode, out = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    model, x = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    done = 0  # finished steps: what a checkpoint of the current tensors is called

    def state_fn() -> tuple[int, dict[str, object]]:
        return done, {"model": model.state_dict(), "step": done}

    if mode == "handler":
        def own(signum: int, frame: object) -> None:
            (out / "handler").write_text(f"{signum} {done}")
            sys.exit(3)
        signal.signal(signal.SIGTERM, own)
    elif mode == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    client = Client(job, socket=socket)
    kwargs: dict[str, object] = {}
    if mode == "watchdog":
        kwargs["timeout"] = 1.0
    if mode == "check":
        kwargs["signals"] = (signal.SIGUSR1,)
        kwargs["at_optimizer_step"] = False
    guard = client.on_preemption(state_fn, **kwargs)  # type: ignore[arg-type]

    last = 25 if mode == "ignore" else 1000
    while done < last:
        model(x).pow(2).sum().backward()
        if mode == "check":
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-LR)  # what SGD computes
                    p.grad = None
        else:
            opt.step()
            opt.zero_grad()
        done += 1
        if done % 10 == 0:
            client.save(done, state_fn()[1]).wait_snapshot()
        if done == STOP_AT:
            print(f"at {done}", flush=True)
            deadline = time.monotonic() + 20
            while guard.received is None and time.monotonic() < deadline:
                time.sleep(0.01)
            if mode == "watchdog":
                time.sleep(30)  # an evaluation: no optimizer step, no safe point
        if mode == "check":
            guard.check()  # the end of a step: the weights and `done` agree
    (out / "finished").write_text(str(done))
    client.close()


if __name__ == "__main__":
    main()
