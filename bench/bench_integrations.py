"""Trainer integrations: how long a real Lightning / Hugging Face Trainer is blocked per checkpoint, per method.

    .venv/bin/python bench/bench_integrations.py                   # both trainers, 5 saves each, ~1.5-2 min
    .venv/bin/python bench/bench_integrations.py --saves 8 --rounds 2 --json out.json
    .venv/bin/python bench/bench_integrations.py --only lightning --save-last

Each trainer trains the same model from the same initial weights on the same
batches once per method (``--rounds`` times, the order rotating each round),
checkpointing ``--saves`` times; one ``ckptstaged`` per trainer
(``_harness.Daemon``: local tier on disk under ``--dir``, no shared tier,
arena budget 2x a checkpoint). Before the timed fits, one tiny fit per
method pays the one-time costs (imports, thread pools, first calls). What is
timed, per checkpoint:

**Lightning** (``lightning.Trainer`` on the CPU, ``logger=False``, no progress
bar; a stack of ``--width`` x ``--width`` Linear layers with ReLU and Adam:
default 6 x 2048^2, 25.2 M parameters, 288 MiB of weights + Adam moments,
batches of 16; ``ModelCheckpoint(every_n_train_steps=--every, save_top_k=-1)``,
default every 10 steps, ``--save-last`` adds ``save_last=True``): the time
inside the ``CheckpointIO`` instance's ``save_checkpoint``, timed by wrapping
that bound method (a seam the benchmark owns; per save the trainer calls
nothing else of the plug-in). Lightning's own ``dump_checkpoint``
(collecting the state dicts, the same for every method) is outside it; the
plug-in's ``teardown`` at the end of the fit is the *tail*. Methods:

* ``none``            ``enable_checkpointing=False`` (the fit's baseline);
* ``torch``           the default ``TorchCheckpointIO`` (``torch.save`` into
                      a buffer, then the file; no fsync);
* ``async``           ``AsyncCheckpointIO(TorchCheckpointIO())``: clones every
                      tensor on the trainer's thread, writes in a thread;
* ``ckptstage``       ``ckptstage.lightning.CkptstageCheckpointIO(job=...)``:
                      returns once the daemon holds the snapshot and the
                      pointer file is written (fsync of the file and of its
                      directory); the client and its arena are created at
                      the first save.

**Hugging Face** (``transformers.Trainer``, ``use_cpu=True``; GPT-2 built from a
config: ``--hf-layers`` blocks of width ``--hf-embd``, GPT-2's vocabulary,
default 6 x 768, 81.9 M parameters, fp32, AdamW, 0.92 GiB of state; batches
of one 32-token sequence; ``save_steps=--hf-every``, default 3). Blocked time
is measured the same way for every method, by a timing callback placed
last: the gap between its ``on_step_end`` and its next ``on_step_begin`` (or
``on_epoch_end`` after the last step). At a save step that gap holds the
Trainer's own save (``_save_checkpoint``, at its save point after
``on_step_end``) or ckptstage's (taken in ``CkptstageCallback.on_step_begin``,
which runs before the timing callback's); at every step it also holds the
Trainer's bookkeeping and the fetch of the next batch. Blocked per save =
the gap at a save step minus the median gap at the other steps. A direct
timer around ``Trainer._save_checkpoint`` / the callback's save
(``_take_pending``) is printed beside it as a cross-check. The tail is
``on_epoch_end`` -> ``on_train_end`` (ckptstage waits there for the last
local commit). Methods: ``none`` (``save_strategy="no"``), ``trainer`` (the
Trainer's ``checkpoint-N`` directories: safetensors weights, ``optimizer.pt``,
scheduler, RNG and trainer state; no fsync), ``ckptstage``
(``ckptstage.hf.CkptstageCallback``, no ``arena_bytes``: the first save
allocates the arena) and ``ckptstage+arena`` (the same with ``arena_bytes``
= the state + 64 MiB, allocated at ``on_train_begin``).

**Floor**: a warm memcpy (``_harness.WarmCopy``, best of 5) of the same
tensors (weights and optimizer state, tied tensors once), measured after
each fit. Reported: per method the median and the range over every save of
every round (the first save of each fit is also printed apart: it pays
one-time costs, ckptstage's arena among them), the ratio against ckptstage
and against the memcpy, and the whole fit's wall time (Trainer construction
excluded, the tail included) against ``none``. Not a test and no target, so
no PASS/MISS; the peers do not fsync, ckptstage's tail waits for durable
local commits.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _harness as h

LIGHTNING_METHODS = ("none", "torch", "async", "ckptstage")
HF_METHODS = ("none", "trainer", "ckptstage", "ckptstage+arena")
LIGHTNING_NAMES = {"torch": "TorchCheckpointIO", "async": "AsyncCheckpointIO", "ckptstage": "ckptstage"}
ARENA_MARGIN = 64 * h.MiB  # ckptstage+arena: room beyond the tensors (trainer state, RNG states, alignment)
HF_NAMES = {"trainer": "Trainer._save_checkpoint", "ckptstage": "ckptstage", "ckptstage+arena": "ckptstage+arena"}


@dataclass
class Fit:
    """One fit of one method: every save's blocked time, the fit's wall time, the memcpy floor after it."""

    method: str
    round: int
    saves: list[float] = field(default_factory=list)     # blocked seconds, in save order
    kinds: list[str] = field(default_factory=list)       # per save: "" or "last" (Lightning's last.ckpt)
    direct: list[float] = field(default_factory=list)    # HF: the direct timer's seconds (cross-check)
    fit_s: float = math.nan
    tail_s: float = 0.0                                  # teardown / after the last step
    memcpy_s: float = math.nan
    nbytes: int = 0
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)


def unique_tensors(state: Any) -> list[Any]:
    """The tensors of a nested state, each storage once (GPT-2's tied embedding and LM head are one)."""
    seen: set[tuple[int, int]] = set()
    out = []
    for t in h.tensors_of(state):
        key = (t.data_ptr(), t.numel())
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def floor_s(tensors: list[Any]) -> float:
    copy = h.WarmCopy(tensors)
    try:
        return copy.best_s(5)
    finally:
        copy.dst = []


def wrap(obj: Any, name: str, before: Callable[..., bool] | None = None,
         after: Callable[[float, tuple[Any, ...], dict[str, Any]], None] | None = None) -> None:
    """Replaces the bound method ``obj.name`` by a timed one (on this instance only).

    ``before(*args)`` says whether this call is to be timed (default: every
    call); ``after(seconds, args)`` receives the time.
    """
    inner = getattr(obj, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        if before is not None and not before(*args, **kwargs):
            return inner(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            if after is not None:
                after(time.perf_counter() - t0, args, kwargs)

    setattr(obj, name, timed)


def tag(rnd: int) -> str:
    return "warmup" if rnd < 0 else str(rnd)


# ------------------------------------------------------------------- Lightning


def lightning_parts() -> Any:
    """The module class and imports, loaded only when the Lightning section runs."""
    import torch
    from lightning.pytorch import LightningModule

    class Blocks(LightningModule):
        """``layers`` Linear(width, width) + ReLU, MSE to a random target, Adam."""

        def __init__(self, width: int, layers: int) -> None:
            super().__init__()
            mods: list[torch.nn.Module] = []
            for _ in range(layers):
                mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
            self.net = torch.nn.Sequential(*mods)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    return Blocks


def lightning_state_bytes(width: int, layers: int) -> int:
    return 3 * 4 * layers * (width * width + width)  # weights, biases, two Adam moments, fp32


def lightning_fit(method: str, rnd: int, work: Path, daemon: h.Daemon | None, args: argparse.Namespace) -> Fit:
    import torch
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from torch.utils.data import DataLoader, TensorDataset

    blocks = lightning_parts()
    steps = args.saves * args.every
    g = torch.Generator().manual_seed(1)
    n = steps * args.batch
    loader = DataLoader(TensorDataset(torch.randn(n, args.width, generator=g), torch.randn(n, args.width, generator=g)),
                        batch_size=args.batch, shuffle=False)
    torch.manual_seed(0)
    model = blocks(args.width, args.layers)
    fit = Fit(method, rnd)
    ckpt_dir = work / f"lightning-{method}-{rnd}"
    kwargs: dict[str, Any] = dict(accelerator="cpu", devices=1, max_steps=steps, default_root_dir=str(work),
                                  logger=False, enable_progress_bar=False, enable_model_summary=False,
                                  num_sanity_val_steps=0, limit_val_batches=0)
    last: dict[str, Any] = {}
    if method == "none":
        kwargs["enable_checkpointing"] = False
    else:
        if method == "torch":
            io: Any = TorchCheckpointIO()
        elif method == "async":
            io = AsyncCheckpointIO(TorchCheckpointIO())
        else:
            from ckptstage.lightning import CkptstageCheckpointIO

            assert daemon is not None
            io = CkptstageCheckpointIO(job=f"bench-lightning-{tag(rnd)}", socket=daemon.socket)

        def saved(seconds: float, call: tuple[Any, ...], kw: dict[str, Any]) -> None:
            path = call[1] if len(call) > 1 else kw["path"]
            fit.saves.append(seconds)
            fit.kinds.append("last" if Path(str(path)).name.startswith("last") else "")
            last["checkpoint"] = call[0] if call else kw["checkpoint"]  # live references to the weights and moments

        def torn_down(seconds: float, call: tuple[Any, ...], kw: dict[str, Any]) -> None:
            fit.tail_s += seconds

        wrap(io, "save_checkpoint", after=saved)
        wrap(io, "teardown", after=torn_down)
        kwargs["plugins"] = [io]
        kwargs["callbacks"] = [ModelCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=args.every, save_top_k=-1,
                                               save_last=args.save_last or None)]
    trainer = Trainer(**kwargs)
    fit.load = h.load()
    with h.Timer() as t:
        trainer.fit(model, loader)
    fit.fit_s = t.s
    state = last.get("checkpoint") or {"model": model.state_dict(), "optim": trainer.optimizers[0].state_dict()}
    tensors = unique_tensors(state)
    fit.nbytes = h.state_bytes(tensors)
    fit.memcpy_s = floor_s(tensors)
    del trainer, model, state, tensors, last
    h.drop_tree(ckpt_dir)
    return fit


# ---------------------------------------------------------------- Hugging Face


SEQ = 32


def hf_model(layers: int, embd: int) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)  # the Trainer seeds only after the model exists
    return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=embd, n_head=max(1, embd // 64), bos_token_id=0,
                                      eos_token_id=0))


def hf_state_bytes(layers: int, embd: int) -> int:
    return 3 * 4 * sum(p.numel() for p in hf_model(layers, embd).parameters())  # a tied parameter is listed once


def hf_fit(method: str, rnd: int, work: Path, daemon: h.Daemon | None, args: argparse.Namespace,
           state_bytes: int) -> Fit:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    steps = args.saves * args.hf_every
    fit = Fit(method, rnd)
    gaps: dict[int, float] = {}

    class Gaps(TrainerCallback):
        """on_step_end -> the next on_step_begin / on_epoch_end, by global step (see the module docstring)."""

        def __init__(self) -> None:
            self.t_end: float | None = None
            self.step = 0
            self.t_epoch_end = math.nan

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t_end, self.step = time.perf_counter(), state.global_step

        def _next(self) -> None:
            if self.t_end is not None:
                gaps[self.step] = time.perf_counter() - self.t_end
                self.t_end = None

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._next()

        def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._next()
            self.t_epoch_end = time.perf_counter()

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            fit.tail_s = time.perf_counter() - self.t_epoch_end  # e.g. waiting for the last local commit

    ids = torch.randint(0, 50257, (steps * args.hf_batch, SEQ), generator=torch.Generator().manual_seed(1))
    samples = [{"input_ids": row, "labels": row} for row in ids]
    out_dir = work / f"hf-{method}-{rnd}"
    settings: dict[str, Any] = dict(per_device_train_batch_size=args.hf_batch, max_steps=steps, learning_rate=1e-4,
                                    seed=7, use_cpu=True, report_to=[], disable_tqdm=True, logging_strategy="no",
                                    dataloader_num_workers=0, save_strategy="no" if method == "none" else "steps",
                                    save_steps=args.hf_every)
    callbacks: list[Any] = []
    cb = None
    if method.startswith("ckptstage"):
        from ckptstage.hf import CkptstageCallback

        assert daemon is not None
        arena = state_bytes + ARENA_MARGIN if method == "ckptstage+arena" else None
        cb = CkptstageCallback(f"bench-hf-{method.replace('+', '-')}-{tag(rnd)}", socket=daemon.socket,
                               arena_bytes=arena)
        callbacks.append(cb)
        wrap(cb, "_take_pending", before=lambda *a, **k: cb._pending is not None,
             after=lambda s, a, k: fit.direct.append(s))
    callbacks.append(Gaps())  # last: its on_step_begin follows the callback's save
    trainer = Trainer(model=hf_model(args.hf_layers, args.hf_embd), args=TrainingArguments(str(out_dir), **settings),
                      train_dataset=samples, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # prints the final metrics dict (disable_tqdm=True)
    if method == "trainer":
        wrap(trainer, "_save_checkpoint", after=lambda s, a, k: fit.direct.append(s))
    fit.load = h.load()
    with h.Timer() as t:
        trainer.train()
    fit.fit_s = t.s
    if cb is not None:
        cb.close()
    save_steps = {s for s in gaps if s % args.hf_every == 0 or s == steps} if method != "none" else set()
    plain = [g for s, g in gaps.items() if s not in save_steps]
    base = h.median(plain)
    fit.saves = [gaps[s] - base for s in sorted(save_steps)]
    fit.kinds = [""] * len(fit.saves)
    assert trainer.model is not None and trainer.optimizer is not None
    tensors = unique_tensors({"model": trainer.model.state_dict(), "optim": trainer.optimizer.state_dict()})
    fit.nbytes = h.state_bytes(tensors)
    fit.memcpy_s = floor_s(tensors)
    del trainer, tensors, samples
    h.drop_tree(out_dir)
    return fit


# ------------------------------------------------------------------- reporting


def blocked_rows(fits: list[Fit], names: dict[str, str], kind: str = "") -> list[h.Row]:
    """memcpy, then one row per method: the median over every save of every round (first saves included)."""
    nbytes = max((f.nbytes for f in fits), default=0)
    rows = [h.Row("memcpy (warm, floor)", h.median([f.memcpy_s for f in fits]), nbytes,
                  [f.memcpy_s for f in fits], [f.load for f in fits], "best of 5 after each fit")]
    for method, name in names.items():
        mine = [f for f in fits if f.method == method]
        runs = [s for f in mine for s, k in zip(f.saves, f.kinds) if k == kind]
        if not runs:
            continue
        firsts = [next(s for s, k in zip(f.saves, f.kinds) if k == kind) for f in mine if kind in f.kinds]
        note = f"first save of a fit {', '.join(h.fmt_s(s) for s in firsts)}"
        if any(f.direct for f in mine):
            note += f"; direct timer median {h.fmt_s(h.median([d for f in mine for d in f.direct]))}"
        rows.append(h.Row(name + (f" ({kind}.ckpt)" if kind else ""), h.median(runs), nbytes, runs,
                          [f.load for f in mine], note))
    return rows


def print_blocked(title: str, rows: list[h.Row], out: Callable[[str], None] = print) -> None:
    """Median, range, bandwidth, ratio against ckptstage (>1: ckptstage faster) and against the memcpy."""
    ref = next((r.seconds for r in rows if r.name.startswith("ckptstage")), math.nan)
    floor = rows[0].seconds if rows else math.nan
    width = max([len(r.name) for r in rows] + [10])
    out(f"\n{title}")
    out(f"  {'':{width}}  {'median':>9}  {'range':>19}  {'GiB/s':>6}  {'x ckptstage':>11}  {'x memcpy':>8}  "
        f"runs (s)                         note")
    for r in rows:
        rng = f"{h.fmt_s(min(r.runs))} - {h.fmt_s(max(r.runs))}" if r.runs else "-"
        runs = " ".join(f"{x:.3f}" for x in r.runs)
        out(f"  {r.name:{width}}  {h.fmt_s(r.seconds):>9}  {rng:>19}  {r.gib_s:6.2f}  {r.seconds / ref:10.2f}x  "
            f"{r.seconds / floor:7.1f}x  {runs:31}  {r.note}")


def fit_rows(fits: list[Fit], methods: tuple[str, ...]) -> list[h.Row]:
    rows = []
    for method in methods:
        mine = [f for f in fits if f.method == method]
        if mine:
            tail = h.median([f.tail_s for f in mine])
            rows.append(h.Row(method, h.median([f.fit_s for f in mine]), 0, [f.fit_s for f in mine],
                              [f.load for f in mine], f"tail {h.fmt_s(tail)}" if tail else ""))
    return rows


def print_fits(title: str, rows: list[h.Row], steps: int, out: Callable[[str], None] = print) -> None:
    """Fit wall time, its excess over ``none`` per save, ratio against ckptstage."""
    ref = next((r.seconds for r in rows if r.name == "ckptstage"), math.nan)
    base = next((r.seconds for r in rows if r.name == "none"), math.nan)
    width = max([len(r.name) for r in rows] + [10])
    out(f"\n{title}")
    out(f"  {'':{width}}  {'fit':>8}  {'per step':>8}  {'vs none':>8}  {'x ckptstage':>11}  runs (s)        note")
    for r in rows:
        runs = " ".join(f"{x:.2f}" for x in r.runs)
        out(f"  {r.name:{width}}  {r.seconds:7.2f}s  {h.fmt_s(r.seconds / steps):>8}  "
            f"{(r.seconds / base - 1) * 100:+7.1f}%  {r.seconds / ref:10.2f}x  {runs:15}  {r.note}")


# ------------------------------------------------------------------------ main


def run_section(label: str, methods: tuple[str, ...], fit_one: Callable[[str, int], Fit], rounds: int,
                warm_up: Callable[[str, bool], Any], out: Callable[[str], None] = print) -> list[Fit]:
    """Untimed first: a tiny fit per method (imports, thread pools, first calls), a short full-size one without
    checkpoints (the first fit at full size also met slower memory); then the timed rounds."""
    with h.Timer() as t:
        for method in methods:
            warm_up(method, True)
        warm_up("none", False)
    out(f"  [{label}] warm-up: one tiny fit per method and a short full-size one, {t.s:.1f} s")
    fits = []
    for r in range(rounds):
        order = list(methods[r % len(methods):] + methods[:r % len(methods)])
        out(f"  [{label}] round {r + 1}/{rounds}: {' -> '.join(order)}  (load {h.load()})")
        for method in order:
            gc.collect()
            fit = fit_one(method, r)
            out(f"    {method:16} fit {fit.fit_s:6.2f} s  saves {' '.join(f'{s:.3f}' for s in fit.saves) or '-'}  "
                f"memcpy {h.fmt_s(fit.memcpy_s)}  (load {h.load()})")
            fits.append(fit)
    return fits


def daemon_settings(state_bytes: int) -> dict[str, Any]:
    return {"arena.max_bytes": max(2 * state_bytes, 256 * h.MiB) // h.MiB * h.MiB}


def lightning_section(work: Path, daemon_root: Path, args: argparse.Namespace) -> dict[str, Any]:
    nbytes = lightning_state_bytes(args.width, args.layers)
    steps = args.saves * args.every
    print(f"\n=== Lightning: {args.layers} x Linear({args.width}, {args.width}) + Adam, "
          f"{nbytes / h.MiB:.1f} MiB of state, {steps} steps of batch {args.batch}, "
          f"a checkpoint every {args.every} steps{' (+ last.ckpt)' if args.save_last else ''}")
    daemon = h.Daemon(daemon_root / "lightning", work / "local-lightning", **daemon_settings(nbytes)).start()
    try:
        tiny = argparse.Namespace(**{**vars(args), "width": 64, "saves": 1, "every": 2})
        short = argparse.Namespace(**{**vars(args), "saves": 1, "every": 5})
        fits = run_section("lightning", LIGHTNING_METHODS,
                           lambda m, r: lightning_fit(m, r, work, daemon, args), args.rounds,
                           lambda m, small: lightning_fit(m, -1, work, daemon, tiny if small else short))
    finally:
        daemon.stop()
    rows = blocked_rows(fits, LIGHTNING_NAMES)
    print_blocked("[lightning] trainer blocked per checkpoint: inside CheckpointIO.save_checkpoint", rows)
    if args.save_last:
        last = blocked_rows(fits, LIGHTNING_NAMES, kind="last")
        print_blocked("[lightning] the same-step last.ckpt save", last)
        rows += last[1:]
    fits_ = fit_rows(fits, LIGHTNING_METHODS)
    print_fits(f"[lightning] whole fit, {steps} steps (trainer.fit wall time)", fits_, steps)
    return {"state_bytes": nbytes, "blocked_rows": rows, "fit_rows": fits_, "fits": fits}


def hf_section(work: Path, daemon_root: Path, args: argparse.Namespace) -> dict[str, Any]:
    nbytes = hf_state_bytes(args.hf_layers, args.hf_embd)
    steps = args.saves * args.hf_every
    print(f"\n=== Hugging Face: GPT-2 {args.hf_layers} layers x {args.hf_embd}, fp32 AdamW, "
          f"{nbytes / h.GiB:.3f} GiB of state, {steps} steps of {args.hf_batch} x {SEQ} tokens, save_steps={args.hf_every}")
    daemon = h.Daemon(daemon_root / "hf", work / "local-hf", **daemon_settings(nbytes)).start()
    try:
        tiny = argparse.Namespace(**{**vars(args), "hf_layers": 1, "hf_embd": 64, "saves": 1, "hf_every": 2})
        short = argparse.Namespace(**{**vars(args), "saves": 1, "hf_every": 3})
        fits = run_section("hf", HF_METHODS, lambda m, r: hf_fit(m, r, work, daemon, args, nbytes), args.rounds,
                           lambda m, small: hf_fit(m, -1, work, daemon, tiny if small else short,
                                                   hf_state_bytes(1, 64) if small else nbytes))
    finally:
        daemon.stop()
    rows = blocked_rows(fits, HF_NAMES)
    print_blocked("[hf] trainer blocked per checkpoint: gap after on_step_end at a save step minus at other steps",
                  rows)
    fits_ = fit_rows(fits, HF_METHODS)
    print_fits(f"[hf] whole fit, {steps} steps (trainer.train wall time)", fits_, steps)
    return {"state_bytes": nbytes, "blocked_rows": rows, "fit_rows": fits_, "fits": fits}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--saves", type=int, default=5, help="checkpoints per fit (default 5)")
    p.add_argument("--every", type=int, default=10, help="Lightning: steps between checkpoints (default 10)")
    p.add_argument("--rounds", type=int, default=1, help="fits per method, order rotating (default 1)")
    p.add_argument("--only", choices=("lightning", "hf"), default=None, help="run one trainer only")
    p.add_argument("--width", type=int, default=2048, help="Lightning: Linear width (default 2048)")
    p.add_argument("--layers", type=int, default=6, help="Lightning: Linear layers (default 6)")
    p.add_argument("--batch", type=int, default=16, help="Lightning: batch size (default 16)")
    p.add_argument("--save-last", action="store_true",
                   help="Lightning: ModelCheckpoint(save_last=True): a last.ckpt save at every checkpoint step")
    p.add_argument("--hf-layers", type=int, default=6, help="Hugging Face: GPT-2 blocks (default 6)")
    p.add_argument("--hf-every", type=int, default=3, help="Hugging Face: save_steps (default 3)")
    p.add_argument("--hf-embd", type=int, default=768, help="Hugging Face: GPT-2 width (default 768)")
    p.add_argument("--hf-batch", type=int, default=1, help=f"Hugging Face: sequences of {SEQ} tokens per step")
    p.add_argument("--dir", type=Path, default=None,
                   help="where the local tier and the peers write (default: a temp dir under /tmp)")
    p.add_argument("--json", type=Path, default=None, help="also write every run here")
    return p.parse_args(argv)


def quiet() -> None:
    """The trainers' banners, tips and progress bars would drown the table (call after importing them)."""
    import transformers

    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning.pytorch.utilities.rank_zero",
                 "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import lightning.pytorch  # noqa: F401 - imported before quiet() tunes its loggers

    quiet()
    started = time.perf_counter()
    sections: dict[str, Any] = {}
    with h.bench_dirs(args.dir, "integrations") as (work, daemon_root, info):
        if args.only in (None, "lightning"):
            sections["lightning"] = lightning_section(work, daemon_root, args)
        if args.only in (None, "hf"):
            sections["hf"] = hf_section(work, daemon_root, args)
    elapsed = time.perf_counter() - started
    print(f"\ndone in {elapsed:.0f} s, load {h.load()}")
    h.write_json(args.json, {"bench": "integrations", "machine": info, "argv": sys.argv, "elapsed_s": elapsed,
                             "args": {k: str(v) for k, v in vars(args).items()},
                             "sections": {k: {**v, "fits": [vars(f) for f in v["fits"]]}
                                          for k, v in sections.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
