"""CkptstageCheckpointIO under a real ``lightning.Trainer`` (CPU, a tiny model) and a real daemon."""

from __future__ import annotations

import copy
import datetime
import json
import os
import signal
import subprocess
import sys
from http import HTTPStatus
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_ddp_script import CountingIO, TinyModel, data, flat_weights, trainer_kwargs
from support import assert_same, drain

from ckptstage.client import CheckpointNotFound, Client
from ckptstage.lightning import (
    POINTER_FORMAT,
    CkptstageCheckpointIO,
    Pointer,
    PointerError,
    list_pointers,
    load,
    read_pointer,
    write_pointer,
)

TESTS = Path(__file__).resolve().parent


class Capture(Callback):
    """Copies the model's and the optimizer's state after every optimizer step, by global step."""

    def __init__(self) -> None:
        self.states: dict[int, dict[str, Any]] = {}
        self.start_step: int | None = None
        self.start: dict[str, Any] | None = None

    def _state(self, trainer: Trainer, module: LightningModule) -> dict[str, Any]:
        return copy.deepcopy({"model": module.state_dict(), "optim": trainer.optimizers[0].state_dict()})

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start_step, self.start = trainer.global_step, self._state(trainer, pl_module)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self.states[trainer.global_step] = self._state(trainer, pl_module)


def fit(root: Path, io: Any, max_steps: int, callbacks: list[Any], seed: int = 0, ckpt_path: str | None = None,
        n_batches: int = 8) -> tuple[Trainer, TinyModel]:
    torch.manual_seed(seed)
    model = TinyModel()
    trainer = Trainer(**trainer_kwargs(root, devices=1, max_steps=max_steps, val_check_interval=1,
                                         callbacks=callbacks), plugins=[io] if io is not None else None)
    trainer.fit(model, data(n_batches), data(1, seed=1), ckpt_path=ckpt_path)
    return trainer, model




def client_for(daemon: Any, job: str) -> Client:
    return Client(job, socket=daemon.socket, rank=0, world_size=1)


def committed(daemon: Any, job: str) -> dict[int, Any]:
    with client_for(daemon, job) as c:
        return {i.step: i for i in c.list() if i.complete}


def test_topk_and_last_keep_exactly_their_steps(daemon: Any, tmp_path: Path) -> None:
    """save_top_k=2 on val_loss + save_last every 2 steps: pointers for exactly the top 2 and last, steps for
    exactly those (the others deleted on both tiers), pinned, and each one holds the state at its step."""
    dirpath = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=2, save_last=True, every_n_train_steps=2)
    io, capture = CountingIO(job="topk", socket=daemon.socket), Capture()
    CountingIO.saves = 0
    trainer, _ = fit(tmp_path, io, max_steps=12, callbacks=[capture, cb])

    expected = {Path(p) for p in cb.best_k_models} | {Path(cb.last_model_path)}
    assert set(list_pointers(dirpath)) == expected
    assert sorted(p.name for p in dirpath.iterdir()) == sorted(p.name for p in expected)  # no temporaries left
    named = {read_pointer(p).step for p in expected}
    assert read_pointer(cb.last_model_path) == Pointer("topk", 12)
    # val_loss does not fall at every step here: last.ckpt moved past steps that top-k had already dropped.
    assert 12 not in {read_pointer(p).step for p in cb.best_k_models}
    steps = committed(daemon, "topk")
    assert set(steps) == named
    assert all(steps[s].pinned for s in named)
    assert CountingIO.saves > len(expected)  # some checkpoints were saved, then removed
    drain(daemon)
    on_shared = {int(p.name.removeprefix("step-")) for p in (daemon.shared / "topk").glob("step-*")}
    assert on_shared == named

    # Each pointer holds the state of its step, although training went on right after every save.
    for path in expected:
        step = read_pointer(path).step
        loaded = io.load_checkpoint(path)
        assert loaded["global_step"] == step
        assert_same(loaded["state_dict"], capture.states[step]["model"], f"{path.name} state_dict")
        assert_same(loaded["optimizer_states"][0], capture.states[step]["optim"], f"{path.name} optimizer")
    io.teardown()


def test_save_last_link(daemon: Any, tmp_path: Path) -> None:
    """save_last="link": last.ckpt is Lightning's symlink to the top-1 pointer; one step is kept, and it loads."""
    dirpath = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=1, save_last="link")
    io = CkptstageCheckpointIO(job="link", socket=daemon.socket)
    fit(tmp_path, io, max_steps=6, callbacks=[cb])
    last = dirpath / "last.ckpt"
    assert last.is_symlink() and last.resolve() == Path(cb.best_model_path).resolve()
    assert set(list_pointers(dirpath).values()) == {Pointer("link", 6)}
    assert set(committed(daemon, "link")) == {6}
    assert io.load_checkpoint(last)["global_step"] == 6
    io.teardown()


def test_a_step_named_in_another_callbacks_directory_is_kept(daemon: Any, tmp_path: Path) -> None:
    """Two ModelCheckpoints share step 4; after a restart, one drops its file: the other's file keeps the step."""
    def callbacks() -> list[Any]:
        return [ModelCheckpoint(dirpath=tmp_path / "a", every_n_train_steps=2),
                ModelCheckpoint(dirpath=tmp_path / "b", every_n_train_steps=4, save_top_k=-1)]

    fit(tmp_path, CkptstageCheckpointIO(job="two", socket=daemon.socket), max_steps=4, callbacks=callbacks())
    kept_by_b = tmp_path / "b" / "epoch=0-step=4.ckpt"
    assert set(list_pointers(tmp_path / "a").values()) == {Pointer("two", 4)}
    # A new process: a fresh plug-in that has written nothing to b/ yet. (Resuming from a/'s file would make
    # Lightning keep that file: it never removes the checkpoint it resumed from.)
    fit(tmp_path, CkptstageCheckpointIO(job="two", socket=daemon.socket), max_steps=6, callbacks=callbacks(),
        ckpt_path=str(kept_by_b))
    assert set(list_pointers(tmp_path / "a").values()) == {Pointer("two", 6)}
    assert set(list_pointers(tmp_path / "b").values()) == {Pointer("two", 4)}
    assert set(committed(daemon, "two")) == {4, 6}
    assert load(kept_by_b, socket=daemon.socket)["global_step"] == 4


def test_lightning_temporaries_stay_files(daemon: Any, tmp_path: Path) -> None:
    """ddp_spawn hands the weights to the main process in a hidden ``.temp.ckpt`` (a bare state_dict), the tuner
    keeps ``.lr_find_*.ckpt``: written, read and removed as torch files, never as steps."""
    io = CkptstageCheckpointIO(job="temps", socket=daemon.socket)
    weights = {"net.weight": torch.randn(3, 3)}
    temp = tmp_path / ".temp.ckpt"
    io.save_checkpoint(weights, temp)
    assert read_pointer(temp) is None
    assert_same(io.load_checkpoint(temp), weights)
    io.remove_checkpoint(temp)
    assert not temp.exists()
    io.save_checkpoint({"global_step": 3, "state_dict": weights}, tmp_path / ".lr_find_x.ckpt")
    assert read_pointer(tmp_path / ".lr_find_x.ckpt") is None
    io.teardown()
    assert committed(daemon, "temps") == {}


def test_resume_from_last_continues_as_an_uninterrupted_run(daemon: Any, tmp_path: Path) -> None:
    """fit to step 4, then a fresh model resumed with ckpt_path="last" to step 8: at its start and at its end
    the weights and the optimizer are bit-identical to one run of 8 steps at steps 4 and 8."""
    whole = Capture()
    fit(tmp_path / "whole", None, max_steps=8, callbacks=[whole], n_batches=4)

    def ckpt(root: Path) -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=root / "ckpts", every_n_train_steps=2, save_last=True)

    root = tmp_path / "split"
    first, _ = fit(root, CkptstageCheckpointIO(job="resume", socket=daemon.socket), max_steps=4,
                   callbacks=[ckpt(root)], n_batches=4)
    assert first.global_step == 4
    second = Capture()
    trainer, model = fit(root, CkptstageCheckpointIO(job="resume", socket=daemon.socket), max_steps=8,
                         callbacks=[second, ckpt(root)], seed=1, ckpt_path="last", n_batches=4)
    assert second.start_step == 4
    assert second.start is not None
    assert_same(second.start["model"], whole.states[4]["model"], "model at the resume")
    assert_same(second.start["optim"], whole.states[4]["optim"], "optimizer at the resume")
    assert trainer.global_step == 8
    assert_same(second.states[8], whole.states[8], "state at step 8")
    assert read_pointer(root / "ckpts" / "last.ckpt") == Pointer("resume", 8)


def test_load_a_specific_path_and_map_location(daemon: Any, tmp_path: Path) -> None:
    """ckpt_path=<an older top-k file> resumes from that step; load(), map_location, and a torch.save file."""
    dirpath = tmp_path / "ckpts"
    capture = Capture()
    cb = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1)
    io = CkptstageCheckpointIO(job="specific", socket=daemon.socket)
    fit(tmp_path, io, max_steps=6, callbacks=[capture, cb])
    older = dirpath / "epoch=0-step=2.ckpt"
    assert read_pointer(older) == Pointer("specific", 2)

    again = Capture()
    trainer, _ = fit(tmp_path / "again", CkptstageCheckpointIO(job="specific", socket=daemon.socket),
                     max_steps=3, callbacks=[again], seed=5, ckpt_path=str(older))
    assert again.start_step == 2
    assert again.start is not None
    assert_same(again.start["model"], capture.states[2]["model"], "model resumed from step 2")
    assert_same(again.start["optim"], capture.states[2]["optim"], "optimizer resumed from step 2")

    for where in (None, "cpu", torch.device("cpu"), {"cpu": "cpu"}, lambda storage, loc: storage):
        loaded = load(older, map_location=where, socket=daemon.socket)
        assert_same(loaded["state_dict"], capture.states[2]["model"], f"load(map_location={where!r})")
    with pytest.raises(TypeError, match="map_location"):
        load(older, map_location=3, socket=daemon.socket)

    # A checkpoint written by Lightning's own CheckpointIO still loads through the plug-in.
    plain = tmp_path / "plain.ckpt"
    TorchCheckpointIO().save_checkpoint(load(older, socket=daemon.socket), plain)
    assert read_pointer(plain) is None
    assert_same(io.load_checkpoint(plain)["state_dict"], capture.states[2]["model"], "torch.save checkpoint")
    io.teardown()


def test_write_pointer_makes_a_ckptstage_step_resumable(daemon: Any, tmp_path: Path) -> None:
    """The reverse direction: a step saved with Client.save is resumed by Lightning through write_pointer."""
    capture = Capture()
    fit(tmp_path / "src", CkptstageCheckpointIO(job="src", socket=daemon.socket), max_steps=2,
        callbacks=[capture, ModelCheckpoint(dirpath=tmp_path / "src" / "ckpts", every_n_train_steps=2)])
    state = load(tmp_path / "src" / "ckpts" / "epoch=0-step=2.ckpt", socket=daemon.socket)
    with client_for(daemon, "other") as c:
        c.save(2, state).wait("local")
        c.save(7, {"x": torch.zeros(1)}).wait("local")

    assert write_pointer(tmp_path / "p" / "latest.ckpt", "other", socket=daemon.socket) == Pointer("other", 7)
    target = tmp_path / "p" / "two.ckpt"
    assert write_pointer(target, "other", 2, socket=daemon.socket) == Pointer("other", 2)
    raw = json.loads(target.read_text())
    assert raw["format"] == POINTER_FORMAT and (raw["job"], raw["step"]) == ("other", 2)
    with pytest.raises(CheckpointNotFound, match="no complete step 3"):
        write_pointer(tmp_path / "p" / "three.ckpt", "other", 3, socket=daemon.socket)
    assert not (tmp_path / "p" / "three.ckpt").exists()

    resumed = Capture()
    fit(tmp_path / "dst", CkptstageCheckpointIO(job="dst", socket=daemon.socket), max_steps=3,
        callbacks=[resumed], seed=9, ckpt_path=str(target))
    assert resumed.start_step == 2
    assert resumed.start is not None
    assert_same(resumed.start["model"], capture.states[2]["model"], "model from a pointer written by hand")
    # Removing a pointer to another job's step never deletes that step.
    io = CkptstageCheckpointIO(job="dst", socket=daemon.socket)
    io.remove_checkpoint(target)
    io.teardown()
    assert not target.exists()
    assert set(committed(daemon, "other")) == {2, 7}


class HparamModel(TinyModel):
    """hyper_parameters of the kinds users pass: a Path, an Enum, numpy values, a dtype, a set, an AttributeDict."""

    def __init__(self, data_dir: Path, status: HTTPStatus, scale: Any, table: Any, dtype: torch.dtype,
                 tags: set[str], nested: AttributeDict, when: datetime.date) -> None:
        super().__init__()
        self.save_hyperparameters()


def test_hyperparameters_of_many_types_round_trip(daemon: Any, tmp_path: Path) -> None:
    hparams: dict[str, Any] = dict(data_dir=tmp_path / "data", status=HTTPStatus.OK, scale=np.float64(0.5),
                   table=np.arange(2048, dtype=np.int32).reshape(32, 64), dtype=torch.bfloat16, tags={"a", "b"},
                   nested=AttributeDict(depth=3, widths=(4, 8)), when=datetime.date(2026, 1, 2))
    io = CkptstageCheckpointIO(job="hparams", socket=daemon.socket)
    model = HparamModel(**hparams)
    trainer = Trainer(**trainer_kwargs(tmp_path, devices=1, max_steps=1), plugins=[io])
    trainer.fit(model, data(2))
    trainer.save_checkpoint(tmp_path / "h.ckpt")
    loaded = io.load_checkpoint(tmp_path / "h.ckpt")["hyper_parameters"]
    assert set(loaded) == set(hparams) | {"hidden", "lr"}
    for key, value in hparams.items():
        assert type(loaded[key]) is type(value), key
        if isinstance(value, np.ndarray):
            assert value.dtype == loaded[key].dtype and np.array_equal(value, loaded[key])
        else:
            assert loaded[key] == value, key
    io.teardown()


def test_fabric_save_and_load(daemon: Any, tmp_path: Path) -> None:
    """Fabric hands the plug-in the same kind of dict; its "global_step" names the step."""
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[CkptstageCheckpointIO(job="fabric", socket=daemon.socket)])
    torch.manual_seed(0)
    model, opt = fabric.setup(*_model_and_adam())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    fabric.save(tmp_path / "f.ckpt", {"model": model, "optimizer": opt, "global_step": 1})
    assert read_pointer(tmp_path / "f.ckpt") == Pointer("fabric", 1)
    other, other_opt = fabric.setup(*_model_and_adam())
    state = {"model": other, "optimizer": other_opt, "global_step": 0}
    assert fabric.load(tmp_path / "f.ckpt", state) == {}
    assert state["global_step"] == 1
    assert_same(other.state_dict(), model.state_dict(), "model")
    assert_same(other_opt.state_dict(), opt.state_dict(), "optimizer")
    fabric.strategy.teardown()


def _model_and_adam() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(8, 2)
    return model, torch.optim.Adam(model.parameters())


def test_ddp_only_rank0_saves_and_both_ranks_resume(daemon: Any, tmp_path: Path) -> None:
    """strategy="ddp" on 2 processes: rank 0 alone saves a one-part step; both ranks resume from it."""
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([sys.executable, str(TESTS / "lightning_ddp_script.py"), "ddp", str(daemon.socket),
                           str(tmp_path / "run"), str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [r["saves"] > 0 for r in ranks] == [True, False]  # Lightning hands the saves to global rank 0 only
    for r in ranks:
        assert (r["saved_step"], r["resumed_step"], r["final_step"]) == (4, 4, 6)
        assert r["resumed_weights"] == ranks[0]["saved_weights"]  # rank 1 loaded the step rank 0 saved
    assert ranks[0]["final_weights"] == ranks[1]["final_weights"]
    steps = committed(daemon, "ddp")
    assert set(steps) == {6}  # step 4 deleted once nothing named it
    assert steps[6].world_size == 1
    assert read_pointer(tmp_path / "run" / "ckpts" / "last.ckpt") == Pointer("ddp", 6)


def test_bad_pointers_and_bad_state_get_clear_errors(daemon: Any, tmp_path: Path) -> None:
    io = CkptstageCheckpointIO(job="bad", socket=daemon.socket)
    missing = tmp_path / "missing.ckpt"
    missing.write_text(json.dumps({"format": POINTER_FORMAT, "job": "bad", "step": 41}))
    with pytest.raises(CheckpointNotFound) as e:
        io.load_checkpoint(missing)
    assert str(missing) in str(e.value) and "'bad'" in str(e.value) and "step 41" in str(e.value)
    # The same through the Trainer.
    with pytest.raises(CheckpointNotFound, match="step 41"):
        fit(tmp_path, io, max_steps=1, callbacks=[], ckpt_path=str(missing))

    cases = {
        "{not json": "not JSON",
        json.dumps({"format": "something/2", "job": "bad", "step": 1}): "format is 'something/2'",
        json.dumps({"format": POINTER_FORMAT, "job": "../etc", "step": 1}): "invalid job name",
        json.dumps({"format": POINTER_FORMAT, "job": "bad", "step": -3}): "invalid step",
        json.dumps({"format": POINTER_FORMAT, "job": "bad", "step": True}): "invalid step",
        json.dumps({"job": "bad", "step": 1}): "format is None",
        "": "is empty",
    }
    for i, (text, why) in enumerate(cases.items()):
        path = tmp_path / f"broken-{i}.ckpt"
        path.write_text(text)
        with pytest.raises(PointerError, match=why) as err:
            io.load_checkpoint(path)
        assert str(path) in str(err.value)
    with pytest.raises(FileNotFoundError, match="nowhere.ckpt"):
        io.load_checkpoint(tmp_path / "nowhere.ckpt")

    # State ckptstage cannot store: a TypeError naming the file and the key; no pointer is written.
    target = tmp_path / "odd.ckpt"
    with pytest.raises(TypeError) as te:
        io.save_checkpoint({"global_step": 3, "hyper_parameters": {"thing": object()}}, target)
    assert str(target) in str(te.value) and "['thing']" in str(te.value)
    assert not target.exists()
    with pytest.raises(ValueError, match="global_step"):
        io.save_checkpoint({"state_dict": {}}, tmp_path / "nostep.ckpt")
    with pytest.raises(ValueError, match="only loads"):
        CkptstageCheckpointIO(job=None, socket=daemon.socket).save_checkpoint({"global_step": 1}, target)
    with pytest.raises(ValueError, match="invalid job name"):
        CkptstageCheckpointIO(job="a/b")
    io.teardown()
    assert committed(daemon, "bad") == {}



class SigtermAt(Callback):
    """Sends this process SIGTERM as training batch ``batch_idx`` starts (a node given notice mid-batch)."""

    def __init__(self, batch_idx: int) -> None:
        self.batch_idx = batch_idx

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.batch_idx and trainer.global_step == batch_idx:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_saves_the_step_it_came_in_and_fit_resumes_there(daemon: Any, tmp_path: Path) -> None:
    """SIGTERM during the third batch: Lightning stops after it, PreemptionCheckpoint saves step 3 through the
    plug-in, the handler installed before fit ran; the next fit (ckpt_path "last") starts at step 3."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from ckptstage.lightning import PreemptionCheckpoint

    calls: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    ckpts = tmp_path / "ckpts"
    try:
        capture = Capture()
        io = CkptstageCheckpointIO("lt-preempt", socket=daemon.socket)
        with pytest.raises(SIGTERMException):
            fit(tmp_path, io, 20, [capture, SigtermAt(2), PreemptionCheckpoint(ckpts)])
        assert calls == [signal.SIGTERM]  # Lightning calls the handler that was there before it
    finally:
        signal.signal(signal.SIGTERM, before)
    assert read_pointer(ckpts / "preempted.ckpt") == Pointer("lt-preempt", 3)
    saved = load(ckpts / "preempted.ckpt", socket=daemon.socket)
    assert saved["global_step"] == 3
    assert_same(saved["state_dict"], capture.states[3]["model"], exact_dicts=False)

    resumed = Capture()
    fit(tmp_path, CkptstageCheckpointIO("lt-preempt", socket=daemon.socket), 4,
        [resumed, PreemptionCheckpoint(ckpts)])
    assert resumed.start_step == 3
    assert_same(resumed.start["model"], capture.states[3]["model"], exact_dicts=False)
