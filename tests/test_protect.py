"""``Client.protect`` through the optimizer wrappers trainers really use: the step waits for the snapshot."""

from __future__ import annotations

import os

import pytest
import torch

from ckptstage.client import Client


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 8))


def _check_step_waits_for_the_snapshot(daemon, job: str, model: torch.nn.Module, step_fn, optimizer) -> None:
    """A save started right before ``step_fn()`` holds the pre-step weights, and the step returned after the copy."""
    with Client(job, socket=daemon.socket) as c:
        c.protect(optimizer)
        model(torch.randn(4, 512)).sum().backward()
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        # Large enough that the copy is still running when step() is called.
        ballast = torch.randn(16 << 20)
        handle = c.save(1, {"model": model.state_dict(), "ballast": ballast})
        step_fn()
        assert handle.snapshot_done(), "optimizer.step() returned before the snapshot was taken"
        assert not torch.equal(model.state_dict()["0.weight"], before["0.weight"])  # the step did update
        handle.wait("local", timeout=60)
        saved = c.load(1)["model"]
    for key, value in before.items():
        assert torch.equal(saved[key], value), f"{key} was saved after the optimizer step changed it"


def test_a_plain_optimizer(daemon):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _check_step_waits_for_the_snapshot(daemon, "protect-plain", model, opt.step, opt)


def test_a_users_own_wrapper(daemon):
    class Wrapped:
        """Forwards step() to the optimizer it keeps, as many training loops' wrappers do."""

        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

        def step(self) -> None:
            self.optimizer.step()

    model = _model()
    wrapped = Wrapped(torch.optim.SGD(model.parameters(), lr=0.5))
    _check_step_waits_for_the_snapshot(daemon, "protect-own", model, wrapped.step, wrapped)


def test_accelerates_accelerated_optimizer(daemon):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.optimizer import AcceleratedOptimizer

    accelerator = accelerate.Accelerator(cpu=True)
    model = _model()
    opt = accelerator.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=0.1))
    assert isinstance(opt, AcceleratedOptimizer)
    _check_step_waits_for_the_snapshot(daemon, "protect-accel", model, opt.step, opt)


def test_lightnings_optimizer_wrapper(daemon):
    pytest.importorskip("lightning")
    from lightning.pytorch.core.optimizer import LightningOptimizer

    model = _model()
    opt = LightningOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1))
    _check_step_waits_for_the_snapshot(daemon, "protect-lightning", model, opt.optimizer.step, opt)


def test_zero_redundancy_optimizer(daemon, tmp_path):
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        model = _model()
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.1)
        _check_step_waits_for_the_snapshot(daemon, "protect-zero", model, opt.step, opt)
    finally:
        dist.destroy_process_group()


def test_something_that_wraps_no_optimizer_is_a_clear_error(daemon):
    class NotAnOptimizer:
        def step(self) -> None:
            pass

    with Client("protect-bad", socket=daemon.socket) as c:
        with pytest.raises(TypeError, match="NotAnOptimizer is neither.*pass the optimizer it wraps"):
            c.protect(NotAnOptimizer())
