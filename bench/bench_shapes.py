"""Characterization: checkpoint cost by model shape, measured where it fits, projected where it does not.

    .venv/bin/python bench/bench_shapes.py                  # ~4 min: tables on stdout, bench/out/shapes.png + docs/shapes.png
    .venv/bin/python bench/bench_shapes.py --models gpt2-124m,lora-124m --repeats 3
    .venv/bin/python bench/bench_shapes.py --json out.json --docs-png ""   # no copy into docs/

Layouts (real parameter shapes, HF names):

* ``gpt2-124m`` / ``gpt2-355m``: wte, wpe, per layer ln_1, attn.c_attn,
  attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj (weights and biases, Conv1D
  ``[in, out]``), ln_f; the LM head is tied to wte (not stored twice). State =
  fp32 weights + an AdamW ``state_dict()`` (int keys, 0-d ``step``,
  ``exp_avg``, ``exp_avg_sq``) + the step: 12 bytes per parameter.
* ``lora-124m``: GPT-2 124M frozen in bf16 plus rank-8 LoRA adapters
  (``lora_A [in, 8]``, ``lora_B [8, out]``, fp32) on every attn.c_attn and
  attn.c_proj; AdamW state for the adapters only. **The checkpoint holds the
  adapters and their optimizer state only**: the frozen base never changes
  during the fine-tune and is reloaded from its pretrained file, so writing it
  every time would be 50x the bytes for nothing. ``lora-124m+base`` (the base's
  bf16 weights too, e.g. for a self-contained export) is measured beside it.
* ``gpt2-1.5b`` and ``llama-7b`` (vocab 32000, d 4096, 32 layers, MLP 11008,
  untied head): **computed from their shapes, not measured** (fp32 state is
  18.7 GB and 80.9 GB: it does not fit this 24 GiB machine next to the
  arena). Two variants each: fp32 weights + 2 moments (12 B/param) and mixed
  precision, bf16 weights + fp32 master + 2 moments (14 B/param).

For every measured model, in one run, each on a fresh client of one real
daemon (local tier on disk under ``--dir``, no shared tier, arena >= the
state, 64 MiB chunks, defaults otherwise):

* **memcpy**: warm copy of every tensor into pre-faulted tensors, best of 5
  before each timed save; the floor is the best over the repeats;
* **blocked**: ``client.save()`` call -> ``wait_snapshot()`` return, after one
  untimed save (the arena exists and is mapped);
* **persist**: ``client.save()`` call -> ``wait("local")`` return (the same save);
* **torch.save+fsync** of the same state to one file on the same disk;
* **restore**: ``client.load(step)`` (a fresh client, the saving one closed so
  its arena is freed) with the file evicted from the page cache
  (``POSIX_FADV_DONTNEED``), then again with it cached ("warm": the file is
  read through the page cache first, since ckptstage reads cold data with
  ``O_DIRECT``, which caches nothing); and
  ``torch.load(weights_only=True)`` of the torch.save file, cold and warm.
  Restores run after both files are written, in alternating order
  (ckptstage first on odd repeats): on the development VM the first read of
  a file written moments before at full speed competes with write-back below
  the guest. Each restore starts after ``--settle`` s idle, so every peer
  allocates its state from memory the host has taken back (a state freed
  less than ~1 s before is refaulted several times faster, and the peer run
  right after another would win; see ``_harness.settle``). "warm" = the file
  is in the page cache, the destination memory is still fresh; then ``client.load(step, into=...)`` cold, into
  pre-faulted tensors of the same structure (a restart into the trainer's
  existing model and optimizer: no allocation, no first-touch faults);
* **dd conv=fsync** of the same bytes (the disk's limit for persist).

Every restored ckptstage state is compared with the saved one (first repeat).

Projections use the bandwidths of the largest measured full-state model
(``gpt2-355m``): blocked at the warm memcpy's GB/s (the floor) and at
ckptstage's measured blocked GB/s; persist and restore at their measured
GB/s; torch.save/torch.load likewise. They assume an arena as large as the
state and the same disk; they are labelled as projections everywhere.

Targets: blocked <= 1.5x the warm memcpy; restore >= 1.5x faster
than ``torch.load``. The load average is recorded with every measurement.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import _harness as h
import torch

REPO = Path(__file__).resolve().parent.parent
MEASURED = ("gpt2-124m", "gpt2-355m", "lora-124m", "lora-124m+base")
TARGET_BLOCKED_X_MEMCPY = 1.5
TARGET_RESTORE_SPEEDUP = 1.5
GPT2 = {"gpt2-124m": (768, 12), "gpt2-355m": (1024, 24), "gpt2-774m": (1280, 36), "gpt2-1.5b": (1600, 48)}
GPT2_VOCAB, GPT2_CTX = 50257, 1024
LORA_RANK = 8


# ------------------------------------------------------------------ shapes


def gpt2_shapes(d: int, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of a GPT-2 (HF ``GPT2LMHeadModel``, head tied to wte)."""
    s: list[tuple[str, tuple[int, ...]]] = [("transformer.wte.weight", (GPT2_VOCAB, d)),
                                            ("transformer.wpe.weight", (GPT2_CTX, d))]
    for i in range(layers):
        p = f"transformer.h.{i}."
        s += [(p + "ln_1.weight", (d,)), (p + "ln_1.bias", (d,)),
              (p + "attn.c_attn.weight", (d, 3 * d)), (p + "attn.c_attn.bias", (3 * d,)),
              (p + "attn.c_proj.weight", (d, d)), (p + "attn.c_proj.bias", (d,)),
              (p + "ln_2.weight", (d,)), (p + "ln_2.bias", (d,)),
              (p + "mlp.c_fc.weight", (d, 4 * d)), (p + "mlp.c_fc.bias", (4 * d,)),
              (p + "mlp.c_proj.weight", (4 * d, d)), (p + "mlp.c_proj.bias", (d,))]
    s += [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]
    return s


def llama7b_shapes() -> list[tuple[str, tuple[int, ...]]]:
    v, d, layers, ff = 32000, 4096, 32, 11008
    s: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, d))]
    for i in range(layers):
        p = f"model.layers.{i}."
        s += [(p + f"self_attn.{x}_proj.weight", (d, d)) for x in "qkvo"]
        s += [(p + "mlp.gate_proj.weight", (ff, d)), (p + "mlp.up_proj.weight", (ff, d)),
              (p + "mlp.down_proj.weight", (d, ff)),
              (p + "input_layernorm.weight", (d,)), (p + "post_attention_layernorm.weight", (d,))]
    s += [("model.norm.weight", (d,)), ("lm_head.weight", (v, d))]
    return s


def lora_shapes(d: int, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """Rank-8 adapters on attn.c_attn ([d, 3d]) and attn.c_proj ([d, d]) of every layer."""
    s: list[tuple[str, tuple[int, ...]]] = []
    for i in range(layers):
        for mod, out in (("attn.c_attn", 3 * d), ("attn.c_proj", d)):
            p = f"transformer.h.{i}.{mod}."
            s += [(p + "lora_A.weight", (d, LORA_RANK)), (p + "lora_B.weight", (LORA_RANK, out))]
    return s


def numel(shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    return sum(math.prod(shape) for _, shape in shapes)


# ------------------------------------------------------------------ states


def _fill(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator, lo: float, hi: float) -> torch.Tensor:
    """A tensor with every page written (random values), so no copy reads the kernel's zero page."""
    return torch.empty(shape, dtype=torch.float32).uniform_(lo, hi, generator=g).to(dtype)


def adamw_state(params: dict[str, torch.Tensor], g: torch.Generator) -> dict[str, Any]:
    """``torch.optim.AdamW(params).state_dict()`` after 100 steps, shape for shape."""
    state: dict[int, Any] = {}
    for i, w in enumerate(params.values()):
        state[i] = {"step": torch.tensor(100.0),
                    "exp_avg": _fill(w.shape, torch.float32, g, -1e-3, 1e-3),
                    "exp_avg_sq": _fill(w.shape, torch.float32, g, 0, 1e-6)}
    groups = [{"lr": 3e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
               "foreach": None, "maximize": False, "capturable": False, "differentiable": False,
               "fused": None, "decoupled_weight_decay": True, "params": list(range(len(params)))}]
    return {"state": state, "param_groups": groups}


def make_model_state(name: str, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    if name.startswith("gpt2-"):
        d, layers = GPT2[name]
        model = {n: _fill(s, torch.float32, g, -0.02, 0.02) for n, s in gpt2_shapes(d, layers)}
        return {"model": model, "optim": adamw_state(model, g), "step": 100}
    if name.startswith("lora-124m"):
        d, layers = GPT2["gpt2-124m"]
        adapters = {n: _fill(s, torch.float32, g, -0.02, 0.02) for n, s in lora_shapes(d, layers)}
        state: dict[str, Any] = {"adapters": adapters, "optim": adamw_state(adapters, g), "step": 100}
        if name.endswith("+base"):
            state["base"] = {n: _fill(s, torch.bfloat16, g, -0.02, 0.02) for n, s in gpt2_shapes(d, layers)}
        return state
    raise ValueError(name)


# ------------------------------------------------------------------ measuring


@dataclass
class Measured:
    model: str
    params_total: int                # parameters of the model (LoRA: base + adapters)
    params_in_ckpt: int              # parameters whose weights the checkpoint holds
    tensors: int
    state_bytes: int
    ckpt_disk_bytes: int             # the committed part directory (data file + manifest)
    torch_save_bytes: int
    memcpy_s: float
    blocked_s: list[float] = field(default_factory=list)
    save_return_s: list[float] = field(default_factory=list)
    persist_s: list[float] = field(default_factory=list)
    restore_cold_s: list[float] = field(default_factory=list)
    restore_warm_s: list[float] = field(default_factory=list)
    restore_into_s: list[float] = field(default_factory=list)  # cold, load(step, into=) pre-faulted tensors
    memcpy_runs: list[float] = field(default_factory=list)     # best of 5, once per repeat
    torch_save_s: list[float] = field(default_factory=list)
    torch_load_cold_s: list[float] = field(default_factory=list)
    torch_load_warm_s: list[float] = field(default_factory=list)
    dd_s: float = math.nan
    loads: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)

    def med(self, key: str) -> float:
        xs = getattr(self, key)
        return statistics.median(xs) if xs else math.nan


def note_load(m: Measured, key: str) -> None:
    m.loads.setdefault(key, []).append(h.load())


def clone_structure(state: Any) -> Any:
    """The same nested structure with new, pre-faulted tensors (zero-filled: every page touched)."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: clone_structure(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(clone_structure(v) for v in state)
    return state


def check_equal(a: Any, b: Any, path: str = "state") -> None:
    """Restored state == saved state (values, dtypes, structure): a wrong restore must not be timed as fast."""
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)):
            raise AssertionError(f"{path}: restored tensor differs")
    elif isinstance(a, dict):
        if set(a) != set(b):
            raise AssertionError(f"{path}: keys differ: {sorted(map(str, a))[:5]} vs {sorted(map(str, b))[:5]}")
        for k in a:
            check_equal(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            raise AssertionError(f"{path}: lengths differ")
        for i, (x, y) in enumerate(zip(a, b)):
            check_equal(x, y, f"{path}[{i}]")
    elif a != b:
        raise AssertionError(f"{path}: {a!r} != {b!r}")


def measure(name: str, daemon: h.Daemon, work: Path, args: argparse.Namespace,
            out: Callable[[str], None] = print) -> Measured:
    from ckptstage.client import Client
    from ckptstage.protos import layout

    with h.Timer() as t_make:
        state = make_model_state(name)
    nbytes = h.state_bytes(state)
    tensors = len(h.tensors_of(state))
    d, layers = GPT2["gpt2-124m" if name.startswith("lora") else name]
    base = numel(gpt2_shapes(d, layers))
    if name.startswith("lora"):
        adapters = numel(lora_shapes(d, layers))
        total, in_ckpt = base + adapters, adapters + (base if name.endswith("+base") else 0)
    else:
        total = in_ckpt = base
    out(f"\n=== {name}: {total / 1e6:.1f} M params, checkpoint holds {in_ckpt / 1e6:.2f} M params' weights, "
        f"{tensors} tensors, {nbytes / 1e6:.1f} MB (built in {t_make.s:.1f} s), load {h.load()}")

    # Pre-faulted tensors of the same structure: the warm memcpy's destination, and load(into=)'s target.
    into = clone_structure(state)
    src, dst = h.tensors_of(state), h.tensors_of(into)

    def memcpy_once(dst: list[torch.Tensor] = dst, src: list[torch.Tensor] = src) -> None:
        for dd, ss in zip(dst, src):
            dd.copy_(ss)

    m = Measured(name, total, in_ckpt, tensors, nbytes, 0, 0, math.nan)

    chunk = 64 * h.MiB
    job = name.replace("+", "-").replace(".", "_")
    # An arena the whole file fits in (header included): the save is a snapshot, not a stream.
    client = Client(job, socket=daemon.socket, arena_bytes=-(-(nbytes + 4 * h.MiB) // chunk) * chunk)
    pt_paths: list[Path] = []
    try:
        first = client.save(0, state)  # untimed: maps the arena, pays one-time costs
        first.wait("local")
        h.drop_page_cache(daemon.local)
        for r in range(1, args.repeats + 1):
            gc.collect()
            m.memcpy_runs.append(min(h.timed(memcpy_once) for _ in range(5)))
            note_load(m, "memcpy")
            h.settle(args.settle)
            t0 = time.perf_counter()
            handle = client.save(r, state)
            t_ret = time.perf_counter() - t0
            handle.wait_snapshot()
            t_blk = time.perf_counter() - t0
            handle.wait("local")
            t_loc = time.perf_counter() - t0
            m.save_return_s.append(t_ret)
            m.blocked_s.append(t_blk)
            m.persist_s.append(t_loc)
            note_load(m, "ckptstage.save")
            part = layout.part_dir(daemon.local, job, r, 0)
            m.ckpt_disk_bytes = h.du_bytes(part)
            h.drop_page_cache(part)

            path = work / f"{job}-{r}.pt"
            pt_paths.append(path)
            gc.collect()
            h.settle(args.settle)
            with h.Timer() as t, open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            m.torch_save_s.append(t.s)
            note_load(m, "torch.save")
            m.torch_save_bytes = path.stat().st_size
            h.drop_page_cache(path)
            out(f"  save {r}: memcpy {h.fmt_s(m.memcpy_runs[-1])} (best of 5); "
                f"ckptstage returned {t_ret * 1e3:.1f} ms, blocked {h.fmt_s(t_blk)}, durable on local "
                f"{h.fmt_s(t_loc)}; torch.save+fsync {h.fmt_s(t.s)} (load {h.load()})")
    finally:
        client.close()  # frees the arena (the daemon keeps the checkpoints)
    gc.collect()
    m.memcpy_s = min(m.memcpy_runs)  # the floor: the best copy seen

    # Restores, after both peers' files are written: on this VM the first read of a file written
    # moments before at full speed competes with the write-back below the guest, so the peers are
    # read in alternating order (ABBA over repeats). Every restore allocates its state afresh, and a
    # page the guest freed less than ~1 s ago is still host-backed (see _harness.settle): a peer that
    # runs right after another one freed its state faults its pages in several times faster. So every
    # restore below starts after the same pause: each meets "cold" memory (skipped for tiny states).
    def pause() -> None:
        gc.collect()
        h.settle(args.settle if nbytes >= 64 * h.MiB else 0)

    reader = Client(job, socket=daemon.socket)  # no arena: it only reads
    try:
        for r in range(1, args.repeats + 1):
            part = layout.part_dir(daemon.local, job, r, 0)
            path = pt_paths[r - 1]

            def ckpt_load(kind: str, r: int = r, part: Path = part, saved: Any = state) -> None:
                if kind == "cold":
                    h.drop_page_cache(part)
                else:
                    h.cache_files(part)
                pause()
                with h.Timer() as t:
                    restored = reader.load(r)
                (m.restore_cold_s if kind == "cold" else m.restore_warm_s).append(t.s)
                note_load(m, f"ckptstage.load.{kind}")
                if kind == "cold" and r == 1:
                    check_equal(saved, restored)  # a wrong restore must not be timed as a fast one
                del restored

            def torch_load(kind: str, path: Path = path) -> None:
                if kind == "cold":
                    h.drop_page_cache(path)
                else:
                    h.cache_files(path)
                pause()
                with h.Timer() as t:
                    restored = torch.load(path, weights_only=True)
                (m.torch_load_cold_s if kind == "cold" else m.torch_load_warm_s).append(t.s)
                note_load(m, f"torch.load.{kind}")
                del restored

            order: list[Callable[[str], None]] = [ckpt_load, torch_load] if r % 2 else [torch_load, ckpt_load]
            for fn in order:
                fn("cold")
                fn("warm")  # the file read into the page cache first
                h.drop_page_cache(part)
                h.drop_page_cache(path)
            # In place, as a trainer restarting into its existing model and optimizer tensors does:
            # no allocation, no first-touch page faults (cold file).
            pause()
            with h.Timer() as t:
                reader.load(r, into=into)
            m.restore_into_s.append(t.s)
            note_load(m, "ckptstage.load.into.cold")
            if r == 1:
                check_equal(state, into)
            h.drop_page_cache(part)
            out(f"  restore {r} ({'ckptstage first' if r % 2 else 'torch.load first'}): ckptstage load cold "
                f"{h.fmt_s(m.restore_cold_s[-1])}, warm {h.fmt_s(m.restore_warm_s[-1])}; torch.load cold "
                f"{h.fmt_s(m.torch_load_cold_s[-1])}, warm {h.fmt_s(m.torch_load_warm_s[-1])}; ckptstage load(into=) "
                f"cold {h.fmt_s(m.restore_into_s[-1])} (load {h.load()})")
    finally:
        reader.close()
        for path in pt_paths:
            path.unlink(missing_ok=True)
    h.settle(args.settle)
    m.dd_s = h.dd_fsync(work, nbytes).seconds
    note_load(m, "dd")
    out(f"  dd conv=fsync of the same bytes: {h.fmt_s(m.dd_s)}")
    del state, into, src, dst
    gc.collect()
    return m


# ------------------------------------------------------------------ projecting


@dataclass
class Projected:
    model: str
    variant: str
    params: int
    state_bytes: int
    blocked_memcpy_s: float      # at the warm memcpy's GB/s (the floor)
    blocked_s: float             # at ckptstage's measured blocked GB/s
    persist_s: float
    restore_s: float
    torch_save_s: float
    torch_load_s: float


def project(ref: Measured) -> tuple[list[Projected], dict[str, float]]:
    bw = {"memcpy": ref.state_bytes / ref.memcpy_s,
          "blocked": ref.state_bytes / ref.med("blocked_s"),
          "persist": ref.state_bytes / ref.med("persist_s"),
          "restore": ref.state_bytes / ref.med("restore_cold_s"),
          "torch_save": ref.state_bytes / ref.med("torch_save_s"),
          "torch_load": ref.state_bytes / ref.med("torch_load_cold_s")}
    out = []
    for model, shapes in (("gpt2-1.5b", gpt2_shapes(*GPT2["gpt2-1.5b"])), ("llama-7b", llama7b_shapes())):
        n = numel(shapes)
        for variant, per_param in (("fp32 + AdamW", 12), ("bf16 + fp32 master + AdamW", 14)):
            b = n * per_param
            out.append(Projected(model, variant, n, b, b / bw["memcpy"], b / bw["blocked"], b / bw["persist"],
                                 b / bw["restore"], b / bw["torch_save"], b / bw["torch_load"]))
    return out, bw


# ------------------------------------------------------------------ output


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def s3(x: float) -> str:
    if math.isnan(x):
        return "-"
    return f"{x * 1e3:.1f} ms" if x < 0.1 else f"{x:.2f} s"


def print_tables(ms: list[Measured], proj: list[Projected], bw: dict[str, float], ref: str) -> list[dict[str, Any]]:
    print("\n## Measured (this machine, one run; median of the timed repeats, memcpy: best)\n")
    print("| model | params (in ckpt) | tensors | state bytes | ckptstage on disk | torch.save file "
          "| memcpy (warm) | blocked | blocked / memcpy | blocked (best) | best / memcpy | persist (save -> local) | persist GB/s | dd conv=fsync "
          "| restore cold | restore warm | restore into= (cold) | torch.save+fsync | torch.load cold | torch.load warm "
          "| torch.load / restore (cold) | (warm) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    verdicts: list[dict[str, Any]] = []
    for m in ms:
        blk, mc = m.med("blocked_s"), m.memcpy_s
        sp_cold = m.med("torch_load_cold_s") / m.med("restore_cold_s")
        sp_warm = m.med("torch_load_warm_s") / m.med("restore_warm_s")
        print(f"| {m.model} | {m.params_total / 1e6:.1f} M ({m.params_in_ckpt / 1e6:.2f} M) | {m.tensors} "
              f"| {gb(m.state_bytes)} | {gb(m.ckpt_disk_bytes)} | {gb(m.torch_save_bytes)} | {s3(mc)} | {s3(blk)} "
              f"| {blk / mc:.2f}x | {s3(min(m.blocked_s))} | {min(m.blocked_s) / mc:.2f}x | {s3(m.med('persist_s'))} | {m.state_bytes / m.med('persist_s') / 1e9:.2f} "
              f"| {s3(m.dd_s)} | {s3(m.med('restore_cold_s'))} | {s3(m.med('restore_warm_s'))} "
              f"| {s3(m.med('restore_into_s'))} "
              f"| {s3(m.med('torch_save_s'))} | {s3(m.med('torch_load_cold_s'))} | {s3(m.med('torch_load_warm_s'))} "
              f"| {sp_cold:.2f}x | {sp_warm:.2f}x |")
        for label, value, op, target, unit in (
                (f"{m.model}: blocked / warm memcpy", blk / mc, "<=", TARGET_BLOCKED_X_MEMCPY, "x"),
                (f"{m.model}: torch.load / ckptstage restore (cold)", sp_cold, ">=", TARGET_RESTORE_SPEEDUP, "x"),
                (f"{m.model}: torch.load / ckptstage restore (warm)", sp_warm, ">=", TARGET_RESTORE_SPEEDUP, "x")):
            line, ok = h.verdict(label, value, op, target, unit)
            verdicts.append({"line": line.strip(), "pass": ok})
    print("\nload averages (1/5/15 min) per measurement:")
    for m in ms:
        print(f"  {m.model}: " + "; ".join(f"{k} {v[0]}" for k, v in m.loads.items()))

    print(f"\n## Projected (COMPUTED from shapes, not measured) at {ref}'s measured bandwidths\n")
    print(f"bandwidths used: memcpy {bw['memcpy'] / 1e9:.2f} GB/s, ckptstage blocked {bw['blocked'] / 1e9:.2f} GB/s, "
          f"persist {bw['persist'] / 1e9:.2f} GB/s, restore (cold) {bw['restore'] / 1e9:.2f} GB/s, "
          f"torch.save+fsync {bw['torch_save'] / 1e9:.2f} GB/s, torch.load (cold) {bw['torch_load'] / 1e9:.2f} GB/s\n")
    print("| model (projected) | state | params | state bytes | blocked at memcpy GB/s (floor) "
          "| blocked at ckptstage GB/s | persist | restore | torch.save+fsync | torch.load |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p in proj:
        print(f"| {p.model} | {p.variant} | {p.params / 1e9:.3f} B | {gb(p.state_bytes)} | {s3(p.blocked_memcpy_s)} "
              f"| {s3(p.blocked_s)} | {s3(p.persist_s)} | {s3(p.restore_s)} | {s3(p.torch_save_s)} "
              f"| {s3(p.torch_load_s)} |")
    print("\ntargets:")
    for v in verdicts:
        print(f"  {v['line']}")
    return verdicts


def plot(ms: list[Measured], proj: list[Projected], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    labels, vals, peers, measured = [], [], [], []
    for m in ms:
        labels.append(f"{m.model}\n{gb(m.state_bytes)}")
        vals.append((m.med("blocked_s"), m.med("persist_s"), m.med("restore_cold_s")))
        peers.append((m.memcpy_s, m.med("torch_save_s"), m.med("torch_load_cold_s")))
        measured.append(True)
    for p in proj:
        short = "fp32" if p.variant.startswith("fp32") else "mixed bf16"
        labels.append(f"{p.model} {short}\n{gb(p.state_bytes)}\n(projected)")
        vals.append((p.blocked_s, p.persist_s, p.restore_s))
        peers.append((p.blocked_memcpy_s, p.torch_save_s, p.torch_load_s))
        measured.append(False)
    metrics = ("blocked", "persist (to local)", "restore (cold)")
    colors = ("#1f77b4", "#ff7f0e", "#2ca02c")
    peer_names = ("warm memcpy", "torch.save+fsync", "torch.load")
    peer_markers = ("_", "x", "o")
    width = 0.26
    fig, ax = plt.subplots(figsize=(max(10, 1.45 * len(labels)), 6.2))
    for j, (metric, color) in enumerate(zip(metrics, colors)):
        for i, (v, meas) in enumerate(zip(vals, measured)):
            x = i + (j - 1) * width
            ax.bar(x, v[j], width, color=color if meas else "white", edgecolor=color,
                   hatch=None if meas else "///", linewidth=1.2)
            ax.plot(x, peers[i][j], marker=peer_markers[j], color="black", markersize=9 if j == 0 else 6,
                    markeredgewidth=1.5, fillstyle="none", linestyle="none")
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("seconds per checkpoint (log scale)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", which="both", alpha=0.3)
    n_meas = sum(measured)
    if 0 < n_meas < len(labels):
        ax.axvline(n_meas - 0.5, color="grey", linestyle="--", linewidth=1)
    handles: list[Any] = [Patch(facecolor=c, edgecolor=c, label=f"ckptstage {m} (measured)")
                          for m, c in zip(metrics, colors)]
    handles += [Patch(facecolor="white", edgecolor="grey", hatch="///", label="projected from measured GB/s")]
    handles += [plt.Line2D([], [], marker=mk, color="black", linestyle="none", fillstyle="none", label=f"peer: {pn}")
                for mk, pn in zip(peer_markers, peer_names)]
    ax.legend(handles=handles, fontsize=8, loc="upper left", ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MEASURED), help=f"measured subset of {','.join(MEASURED)}")
    p.add_argument("--repeats", type=int, default=2,
                   help="timed saves and loads per model, after one untimed save (default 2)")
    p.add_argument("--dir", type=Path, default=None, help="local tier and torch.save directory (default: under /tmp)")
    p.add_argument("--settle", type=float, default=1.5,
                   help="idle seconds before each save and each restore of a state >= 64 MiB (default 1.5)")
    p.add_argument("--png", type=Path, default=REPO / "bench" / "out" / "shapes.png")
    p.add_argument("--docs-png", default=str(REPO / "docs" / "shapes.png"),
                   help="a copy of the plot for the docs ('' = none)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    a.models = [m for m in MEASURED if m in {x.strip() for x in a.models.split(",")}]
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    with h.bench_dirs(args.dir, "shapes") as (work, droot, info):
        largest = max(12 * numel(gpt2_shapes(*GPT2[m])) for m in args.models if m.startswith("gpt2")) \
            if any(m.startswith("gpt2") for m in args.models) else 512 * h.MiB
        chunk = 64 * h.MiB
        arena_budget = -(-(largest + 4 * h.MiB) // chunk) * chunk + 2 * chunk
        settings: dict[str, Any] = {"arena.max_bytes": arena_budget}
        daemon = h.Daemon(droot, work / "local", None, False, **settings).start()
        try:
            ms = [measure(m, daemon, work, args) for m in args.models]
        finally:
            daemon.stop()
    full = [m for m in ms if m.model.startswith("gpt2")]
    ref = max(full, key=lambda m: m.state_bytes) if full else max(ms, key=lambda m: m.state_bytes)
    proj, bw = project(ref)
    verdicts = print_tables(ms, proj, bw, ref.model)
    title = (f"ckptstage per checkpoint: bars measured (solid) / projected from {ref.model}'s GB/s (hatched); "
             f"markers = peers\n{info['cpu']}, {info['cpus']} CPUs, {info['mem_gib']} GiB, torch {info['torch']}, "
             f"load {h.load()[0]}, {time.strftime('%Y-%m-%d')}")
    plot(ms, proj, args.png, title)
    print(f"\nplot: {args.png}")
    if args.docs_png:
        Path(args.docs_png).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(args.png, args.docs_png)
        print(f"plot copied to {args.docs_png}")
    elapsed = time.perf_counter() - started
    print(f"\ndone in {elapsed:.0f} s, load {h.load()}")
    h.write_json(args.json, {"bench": "shapes", "machine": info, "argv": sys.argv, "elapsed_s": elapsed,
                             "measured": [asdict(m) for m in ms], "projected": [asdict(p) for p in proj],
                             "bandwidths": bw, "reference": ref.model, "verdicts": verdicts})
    return 0


if __name__ == "__main__":
    sys.exit(main())
