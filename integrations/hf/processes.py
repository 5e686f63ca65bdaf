"""The few collectives the callback needs across the Trainer's processes; each is a no-op in one process."""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainingArguments


def process_index_and_count() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def any_process(args: TrainingArguments, flag: bool) -> bool:
    """Whether ``flag`` is set on any process (collective under torch.distributed: one small all-reduce)."""
    if process_index_and_count()[1] == 1:
        return flag
    t = torch.tensor([int(flag)], device=args.device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def gather(obj: Any) -> list[Any]:
    """Every process's ``obj``, by process index (collective under torch.distributed)."""
    _, world = process_index_and_count()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    torch.distributed.all_gather_object(out, obj)
    return out
