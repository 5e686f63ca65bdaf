"""The optimizer ``Client.protect`` hooks: the one under an optimizer's wrappers, and what a checkpoint of it holds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ckptstage.client import shards

# Attributes through which known wrappers reach the optimizer they forward ``step`` to.
_WRAPPED_OPTIMIZER_ATTRS = ("optimizer", "_optimizer", "optim", "_optim")


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """What this rank's checkpoint of ``optimizer`` and the parameters it updates holds in tensors (after a
    step): of a sharded tensor (DTensor), only this rank's shard."""
    seen: set[int] = set()
    total = 0
    tensors = [p for g in optimizer.param_groups for p in g["params"]] + \
        [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            local = t.to_local() if shards.is_dtensor(t) else t
            total += local.numel() * local.element_size()
    return total


def innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer at the bottom of ``optimizer``'s wrappers: the one whose ``step`` updates the tensors.

    Wrappers keep the wrapped optimizer in an attribute and forward ``step``
    to it; some subclass ``torch.optim.Optimizer`` without initializing it
    (Accelerate's), so being an Optimizer does not end the walk: an object
    that wraps another optimizer is followed to it (``ZeroRedundancyOptimizer``
    to its local optimizer, whose ``step`` it calls).
    """
    seen = [type(optimizer).__qualname__]
    current = optimizer
    while len(seen) <= 8:
        inner = next((getattr(current, a) for a in _WRAPPED_OPTIMIZER_ATTRS
                      if isinstance(getattr(current, a, None), torch.optim.Optimizer)), None)
        if inner is None or inner is current:
            break
        current = inner
        seen.append(type(current).__qualname__)
    if not isinstance(current, torch.optim.Optimizer) or not hasattr(current, "_optimizer_step_pre_hooks"):
        raise TypeError(f"protect() needs a torch.optim.Optimizer or a wrapper of one; "
                        f"{' -> '.join(seen)} is neither (none of its attributes "
                        f"{', '.join(_WRAPPED_OPTIMIZER_ATTRS)} holds an optimizer): pass the optimizer it wraps")
    return current


def prepare_after_first_step(optimizer: torch.optim.Optimizer, prepare: Callable[[int], None]) -> None:
    """Calls ``prepare`` with :func:`optimizer_bytes` once, after the optimizer's first step: from then on the
    optimizer holds its state, and what a checkpoint of it costs is known."""
    once: list[Any] = []

    def size_arena(*_: Any) -> None:
        once.pop().remove()
        prepare(optimizer_bytes(optimizer))

    once.append(optimizer.register_step_post_hook(size_arena))
