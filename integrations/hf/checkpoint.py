"""What one Trainer checkpoint holds: the states saved at a save point, and ``trainer_state.json`` as bytes."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import TrainerState, TrainingArguments


@dataclass
class Pending:
    """A save the Trainer asked for at ``step``, to be taken at the next event (see the module docstring)."""

    step: int
    rng: dict[str, Any]           # this process's RNG states, as read at the last event before the save point
    control: dict[str, Any]       # TrainerControl.state() as the Trainer would have saved it


def trainer_checkpoint(pending: Pending, args: TrainingArguments, state: TrainerState, kwargs: Mapping[str, Any],
                       history_end: int | None, rngs: list[Any], best_step: int | None) -> dict[str, Any]:
    """The state saved for ``pending``: the model, the TrainerState and, unless ``save_only_model``, the optimizer,
    scheduler, scaler and every process's RNG states (``rngs``)."""
    model, optimizer, scheduler = kwargs.get("model"), kwargs.get("optimizer"), kwargs.get("lr_scheduler")
    if model is None:
        raise RuntimeError("ckptstage: the Trainer passed no model to its callbacks; nothing to save")
    ckpt: dict[str, Any] = {
        "model": model.state_dict(),
        "trainer_state": trainer_state_bytes(state, pending.control, history_end),
        "best_step": best_step,
    }
    if not args.save_only_model:
        ckpt["optimizer"] = optimizer.state_dict() if optimizer is not None else None
        ckpt["scheduler"] = scheduler.state_dict() if scheduler is not None else None
        scaler = getattr(optimizer, "scaler", None)
        ckpt["scaler"] = scaler.state_dict() if scaler is not None else None
        ckpt["rng"] = rngs
    return ckpt


def rng_states() -> dict[str, Any]:
    """This process's RNG states, as the Trainer's ``rng_state.pth`` holds them."""
    states: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                              "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        states["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
    return states


def trainer_state_bytes(state: TrainerState, control: Mapping[str, Any], history_end: int | None) -> torch.Tensor:
    """``trainer_state.json`` as the Trainer writes it at a save, as a byte tensor (it grows with the log)."""
    fields = dataclasses.asdict(state)
    if history_end is not None:
        fields["log_history"] = fields["log_history"][:history_end]
    fields["best_model_checkpoint"] = None  # no directory: the best step is ckptstage's ("best_step")
    callbacks = dict(fields.get("stateful_callbacks") or {})
    if "TrainerControl" in callbacks:
        callbacks["TrainerControl"] = dict(control)
    fields["stateful_callbacks"] = callbacks
    text = json.dumps(fields, indent=2, sort_keys=True) + "\n"
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
