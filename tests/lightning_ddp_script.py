"""A tiny Lightning model and data for tests/test_lightning.py, and, run as a script, a 2-process DDP run.

As a script (``python lightning_ddp_script.py JOB SOCKET DIR OUT``), Lightning's
``strategy="ddp"`` on 2 CPU processes re-launches this file for rank 1. Both
ranks train 4 steps with ``CkptstageCheckpointIO`` (only global rank 0 is
handed the saves), then a fresh Trainer and plug-in resume with
``ckpt_path="last"`` and train to step 6. Each rank writes ``OUT/rank-R.json``:
the saves its plug-in was asked for, the step and weights at the end of the
first fit, and the step and weights it resumed with.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from ckptstage.lightning import CkptstageCheckpointIO

BATCH = 4


class TinyModel(LightningModule):
    """Three small linear layers and Adam: state enough to tell a resume from a fresh start."""

    def __init__(self, hidden: int = 16, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, hidden),
                                       torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])


def data(n_batches: int, seed: int = 0) -> DataLoader[Any]:
    """``n_batches`` fixed random batches, in the same order every epoch (no shuffling)."""
    g = torch.Generator().manual_seed(seed)
    ds = TensorDataset(torch.randn(n_batches * BATCH, 8, generator=g), torch.randn(n_batches * BATCH, 1, generator=g))
    return DataLoader(ds, batch_size=BATCH, shuffle=False)


def trainer_kwargs(root: Path, **kw: Any) -> dict[str, Any]:
    return dict(accelerator="cpu", default_root_dir=str(root), logger=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0, **kw)


def flat_weights(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


class CountingIO(CkptstageCheckpointIO):
    """Counts the saves Lightning hands this process's plug-in."""

    saves = 0

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        type(self).saves += 1
        super().save_checkpoint(checkpoint, path, storage_options)


class OnStart(Callback):
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.step = trainer.global_step
        self.weights = flat_weights(pl_module)


def main(job: str, socket: str, root: str, out: str) -> None:
    dirpath = Path(root) / "ckpts"
    torch.manual_seed(0)
    model = TinyModel()
    first = Trainer(**trainer_kwargs(Path(root), devices=2, strategy="ddp", max_steps=4, val_check_interval=2,
                                       callbacks=[ModelCheckpoint(
                                           dirpath=dirpath, every_n_train_steps=2, save_last=True)]),
                      plugins=[CountingIO(job=job, socket=socket)])
    first.fit(model, data(8), data(1, seed=1))
    saved_weights, saved_step = flat_weights(model), first.global_step

    torch.manual_seed(1)  # another initialisation: the resume must replace it
    fresh = TinyModel()
    on_start = OnStart()
    second = Trainer(**trainer_kwargs(Path(root), devices=2, strategy="ddp", max_steps=6, val_check_interval=2,
                                        callbacks=[on_start, ModelCheckpoint(
                                            dirpath=dirpath, every_n_train_steps=2, save_last=True)]),
                       plugins=[CkptstageCheckpointIO(job=job, socket=socket)])
    second.fit(fresh, data(8), data(1, seed=1), ckpt_path="last")
    result = {"rank": second.global_rank, "saves": CountingIO.saves, "saved_step": saved_step,
              "saved_weights": saved_weights, "resumed_step": on_start.step, "resumed_weights": on_start.weights,
              "final_step": second.global_step, "final_weights": flat_weights(fresh)}
    Path(out, f"rank-{second.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:5])
