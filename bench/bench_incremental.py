"""Incremental checkpoints benchmark: what a step stores and drains with ``[persist] incremental``, next to its peers.

    .venv/bin/python bench/bench_incremental.py                   # LoRA 6 steps, full fine-tune 4 steps, ~3.5 min
    .venv/bin/python bench/bench_incremental.py --steps 4 --full-steps 3 --rounds 3
    .venv/bin/python bench/bench_incremental.py --states lora --json out.json

Two real ``ckptstaged``, each with a local and a shared tier in ``--dir``:
``incremental`` (``persist.incremental = true``: a part is content-addressed
chunks in ``<tier>/<job>/chunks``, a step stores and drains only the chunks
its tier lacks) and ``whole`` (the default: one data file per part). Both
keep the last 2 steps per tier (retention runs, and the incremental daemon's
sweeps remove the chunks no kept step refers to, with a 5 s grace instead of
600 s so that they do within the run); the memory tier is off, so every load
reads the disk. The trainer saves the same state to each, every step, after
real training steps (batch 2 x 64 random tokens):

* ``lora``  GPT-2 124M from ``GPT2Config()`` (nothing downloaded), fp32, the
            base frozen, rank-8 LoRA adapters (A, B) on every block's
            ``attn.c_attn`` applied by a forward hook, AdamW over the adapters
            only; the state a trainer saves,
            ``{"model": model.state_dict(), "optim": opt.state_dict(), "step": n}``.
* ``full``  the same model with every parameter trained by AdamW.

Per step, peers in an order that rotates each step, each after ``--settle``
seconds idle (``_harness.settle``), committed ckptstage files then evicted
from the page cache:

* ``incremental`` / ``whole``: ``save()`` -> ``wait("local")`` (persist time)
  -> ``wait("shared")`` (drain time). Bytes stored per step on each tier: the
  chunk files new in the job's store plus the step's part directory (its
  manifest; the whole daemon's data file too). The daemon's
  ``ckptstage_chunk_bytes_reused_total{tier}`` is shown beside it: logical
  size - reused = what it says it wrote.
* ``torch.save`` (+ fsync) of the same state: bytes and time.
* ``dcp.save`` (``torch.distributed.checkpoint``, one process,
  ``FileSystemWriter``, which fsyncs): bytes and time. It stores GPT-2's tied
  ``lm_head.weight`` beside ``wte.weight``; ckptstage and ``torch.save`` store it once.

Then (lora) cold ``Client.load(step)`` of the last step from each daemon
(every file of the job evicted, ``--settle`` idle), ``--rounds`` rounds, order
alternating (5 by default), the first two checked against the state saved.

Targets: LoRA, each additional step stores at most 1% of the part's logical
size on the local tier and drains at most 1% to the shared tier (medians);
full fine-tune, incremental bytes per step <= 1.01x the whole part, persist
time (median of the steps after the first, which also creates the arena)
<= 1.10x the whole daemon's as the client's ``wait("local")`` sees it, and
the daemon's own persist (``ckptstage_persist_duration_seconds``) <= 1.05x and
drain (``ckptstage_drain_duration_seconds``) <= 1.0x: the bar for incremental
parts to be on by default; cold restore of the incremental step <= 1.10x the
whole one's. Every step is printed with the load average. Not a test: exit 0
unless ``--strict`` and a target is missed.
"""

from __future__ import annotations

import gc
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import _harness as h
from _finetune import Ckpt, Trainer, chunk_files, files_under

TARGET_LORA_FRACTION = 0.01    # of the part's logical size, per additional step, on each tier
TARGET_FULL_BYTES_X = 1.01     # incremental bytes per step / the whole part's
TARGET_FULL_PERSIST_X = 1.10   # incremental persist time / whole, as the client's wait("local") sees it
TARGET_DAEMON_PERSIST_X = 1.05  # the daemon's own persist time, incremental / whole: incremental by default only so
TARGET_DAEMON_DRAIN_X = 1.0     # the daemon's own drain time, incremental / whole: likewise
TARGET_RESTORE_X = 1.10        # cold load of the incremental step / the whole one
KEEP_LAST = 2
GRACE_S = 5.0
PEERS = ("incremental", "whole", "torch.save", "dcp.save")


@dataclass
class Saved:
    """One ckptstage save: times, and what each tier gained."""

    local_s: float
    drain_s: float
    persist_s: float          # the daemon's own ckptstage_persist_duration_seconds
    daemon_drain_s: float     # the daemon's own ckptstage_drain_duration_seconds
    logical: int              # the part's data file as its manifest describes it
    local_added: int          # new chunk files + the part directory
    shared_added: int
    local_written: float      # the daemon's word: logical - ckptstage_chunk_bytes_reused_total (incremental only)
    shared_written: float
    chunk_files: int          # new chunk files on the local tier
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)


def ckpt_save(peer: Ckpt, job: str, step: int, state: Any) -> Saved:
    from ckptstage.protos import layout

    client = peer.client(job)
    before = {t: chunk_files(d, job) for t, d in (("local", peer.local), ("shared", peer.shared))}
    m0 = peer.daemon.scrape()
    t0 = time.perf_counter()
    handle = client.save(step, state)
    handle.wait("local", timeout=600)
    t_local = time.perf_counter() - t0
    handle.wait("shared", timeout=600)
    t_shared = time.perf_counter() - t0
    m1 = peer.daemon.scrape()
    added: dict[str, int] = {}
    new_local = 0
    for tier, tier_dir in (("local", peer.local), ("shared", peer.shared)):
        now = chunk_files(tier_dir, job)
        new = [n for n in now if n not in before[tier]]
        new_local = len(new) if tier == "local" else new_local
        added[tier] = sum(now[n] for n in new) + sum(files_under(layout.part_dir(tier_dir, job, step, 0)).values())
    manifest = layout.read_manifest(layout.part_dir(peer.local, job, step, 0))
    logical = layout.manifest_files(manifest)[layout.DATA_FILE].size
    reused = {t: peer.metric(m1, "ckptstage_chunk_bytes_reused_total", t)
              - peer.metric(m0, "ckptstage_chunk_bytes_reused_total", t) for t in ("local", "shared")}
    incremental = "chunks" in manifest
    persist, drain = (peer.metric(m1, f"ckptstage_{what}_duration_seconds_sum")
                      - peer.metric(m0, f"ckptstage_{what}_duration_seconds_sum") for what in ("persist", "drain"))
    for d in (peer.local, peer.shared):
        h.drop_page_cache(d / job)  # as the peers delete their files
    return Saved(t_local, t_shared - t_local, persist, drain, logical, added["local"], added["shared"],
                 logical - reused["local"] if incremental else math.nan,
                 logical - reused["shared"] if incremental else math.nan, new_local, h.load())


def torch_save(state: Any, path: Path) -> tuple[float, int]:
    """``torch.save`` + fsync: (seconds, file bytes); the file is removed."""
    import torch

    with h.Timer() as t, open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    size = path.stat().st_size
    path.unlink()
    return t.s, size


def dcp_save(state: Any, path: Path) -> tuple[float, int]:
    """``dcp.save`` with a ``FileSystemWriter`` (fsyncs its files), one process: (seconds, bytes); removed."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings(), h.Timer() as t:
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, as asked
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    size = h.du_bytes(path)
    shutil.rmtree(path)
    return t.s, size


# ------------------------------------------------------------------ one phase


@dataclass
class Phase:
    """Every step of one trainer: each peer's per-step records."""

    name: str
    note: str = ""
    saved: dict[str, list[Saved]] = field(default_factory=dict)          # incremental, whole
    files: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # torch.save, dcp.save: (s, bytes)
    loads: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)
    train_s: list[float] = field(default_factory=list)
    changed: list[int] = field(default_factory=list)                      # bytes of tensors that changed
    held: dict[str, dict[str, int]] = field(default_factory=dict)        # bytes on each tier at the end
    swept: dict[str, float] = field(default_factory=dict)


def tensor_digests(state: Any) -> list[str]:
    """xxh3-64 of each distinct tensor's bytes, in a stable order (to count what a step changed)."""
    import torch
    import xxhash

    return [xxhash.xxh3_64_hexdigest(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            for t in h.distinct_tensors(state)]


def changed_bytes(state: Any, before: list[str] | None, now: list[str]) -> int:
    """The bytes of the tensors whose bytes differ from the previous step's (all of them at the first):
    the floor for what any store of this state can write per step."""
    sizes = [t.numel() * t.element_size() for t in h.distinct_tensors(state)]
    if before is None or len(before) != len(now):
        return sum(sizes)
    return sum(n for n, a, b in zip(sizes, before, now) if a != b)


def run_phase(name: str, trainer: Trainer, steps: int, peers: dict[str, Ckpt], work: Path,
              settle_s: float) -> Phase:
    ph = Phase(name, trainer.note)
    print(f"\n{name}: {trainer.note}; {steps} saved steps, 1 training step before each", flush=True)
    order = list(PEERS)
    digests: list[str] | None = None
    for i in range(steps):
        ph.train_s.append(trainer.train(1))
        state = trainer.state()
        step = trainer.step
        now = tensor_digests(state)
        ph.changed.append(changed_bytes(state, digests, now))
        digests = now
        print(f"  step {step} (trained in {ph.train_s[-1]:.1f} s, {changed_bytes_note(ph.changed[-1])}):", flush=True)
        for peer in order[i % len(order):] + order[:i % len(order)]:
            gc.collect()
            h.settle(settle_s)
            if peer in peers:
                saved = ckpt_save(peers[peer], name, step, state)
                ph.saved.setdefault(peer, []).append(saved)
                what = (f"{saved.local_added / h.MiB:.1f} / {saved.shared_added / h.MiB:.1f} MiB stored local / "
                        f"shared, persist {saved.local_s:.2f} s, drain {saved.drain_s:.2f} s")
            else:
                save = torch_save if peer == "torch.save" else dcp_save
                seconds, nbytes = save(state, work / f"{name}-{peer}")
                ph.files.setdefault(peer, []).append((seconds, nbytes))
                what = f"{nbytes / h.MiB:.1f} MiB in {seconds:.2f} s"
            ph.loads.setdefault(peer, []).append(h.load())
            print(f"    {peer:<12} {what}, load {ph.loads[peer][-1]}", flush=True)
    del state
    for peer_name, ckpt in peers.items():
        ph.held[peer_name] = {t: sum(files_under(d / name).values())
                              for t, d in (("local", ckpt.local), ("shared", ckpt.shared))}
        scraped = ckpt.daemon.scrape()
        ph.swept[peer_name] = sum(ckpt.metric(scraped, "ckptstage_chunks_swept_total", t) for t in ("local", "shared"))
    return ph


def changed_bytes_note(n: int) -> str:
    return f"{n / h.MiB:.1f} MiB of tensors changed"


# ------------------------------------------------------------------ restore


Runs = dict[str, list[tuple[float, tuple[float, float, float]]]]


def restore(peers: dict[str, Ckpt], job: str, step: int, want: Any, rounds: int,
            settle_s: float) -> tuple[Runs, dict[str, str]]:
    """Cold ``Client.load(step)`` from each daemon, ``rounds`` rounds, order alternating; the first two
    rounds' states compared with the one saved. Returns (seconds and load per run, errors by daemon)."""
    import torch

    runs: Runs = {}
    errors: dict[str, str] = {}
    names = list(peers)
    want_tensors = h.tensors_of(want)
    for r in range(rounds):
        for name in names[r % 2:] + names[:r % 2]:
            if name in errors:
                continue
            peer = peers[name]
            client = peer.client(job)
            for d in (peer.local, peer.shared):
                h.drop_page_cache(d / job)
            gc.collect()
            h.settle(settle_s)
            try:
                with h.Timer() as t:
                    got = client.load(step)
            except Exception as e:  # noqa: BLE001 - the read side may not be finished: reported, the rest goes on
                errors[name] = f"{type(e).__name__}: {e}"
                print(f"    {name}: load({step}) failed: {errors[name]}", flush=True)
                continue
            runs.setdefault(name, []).append((t.s, h.load()))
            if r < 2:
                same = len(h.tensors_of(got)) == len(want_tensors) and all(
                    torch.equal(a, b) for a, b in zip(h.tensors_of(got), want_tensors))
                if not same or got.get("step") != want["step"]:
                    errors[name] = "the state loaded differs from the state saved"
                    print(f"    {name}: {errors[name]}", flush=True)
            del got
            print(f"    {name}: {t.s:.3f} s from {client.last_load_tier}{read_modes()}, load {h.load()}", flush=True)
    return runs, errors


def read_modes() -> str:
    """How the last load read its part (the client's read-mode policy), as bench_restore prints it."""
    from ckptstage.client import restore as reader

    stats = getattr(reader, "last_stats", None)
    if stats is None or not getattr(stats, "chosen", ""):
        return ""
    trial = ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in getattr(stats, "trial", {}).items())
    return f", read {stats.chosen}" + (f" after comparing {trial}" if trial else "")


# ------------------------------------------------------------------ report


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 100:.2f}%"


def _mib(x: float) -> str:
    return "-" if math.isnan(x) else f"{x / h.MiB:.1f}"


def rest(xs: Sequence[float]) -> float:
    """The median of the steps after the first (the first also creates the arena, and stores everything)."""
    return h.median(list(xs[1:])) if len(xs) > 1 else math.nan


def report_bytes(ph: Phase) -> dict[str, float]:
    """Per-step bytes of every peer, and the medians of the steps after the first."""
    inc, whole = ph.saved["incremental"], ph.saved["whole"]
    print(f"\n{ph.name}: bytes stored per step (MiB; % = of the part's logical size; changed = the tensors whose "
          f"bytes changed since the previous step, the floor)")
    print(f"  {'step':>4}  {'logical':>8}  {'changed':>8}  {'incr local':>16}  {'incr shared':>16}  "
          f"{'daemon: written l/s':>20}  {'new chunks':>10}  {'whole':>8}  {'torch.save':>10}  {'dcp.save':>9}  load")
    for k, (a, b) in enumerate(zip(inc, whole)):
        ts = ph.files["torch.save"][k][1]
        dc = ph.files["dcp.save"][k][1]
        print(f"  {k + 1:>4}  {_mib(a.logical):>8}  {_mib(ph.changed[k]):>8}  "
              f"{_mib(a.local_added):>7} {_pct(a.local_added / a.logical):>8}  "
              f"{_mib(a.shared_added):>7} {_pct(a.shared_added / a.logical):>8}  "
              f"{_mib(a.local_written):>9} {_mib(a.shared_written):>9}  {a.chunk_files:>10}  "
              f"{_mib(b.local_added):>8}  {_mib(ts):>10}  {_mib(dc):>9}  {a.load}")
    out = {
        "logical": rest([a.logical for a in inc]),
        "changed": rest(ph.changed),
        "local_frac": rest([a.local_added / a.logical for a in inc]),
        "shared_frac": rest([a.shared_added / a.logical for a in inc]),
        "first_local_frac": inc[0].local_added / inc[0].logical,
        "first_shared_frac": inc[0].shared_added / inc[0].logical,
        "incremental": rest([a.local_added for a in inc]),
        "incremental_shared": rest([a.shared_added for a in inc]),
        "whole": rest([b.local_added for b in whole]),
        "whole_shared": rest([b.shared_added for b in whole]),
        "torch.save": rest([x[1] for x in ph.files["torch.save"]]),
        "dcp.save": rest([x[1] for x in ph.files["dcp.save"]]),
    }
    print(f"  first step: incremental local {_pct(out['first_local_frac'])}, shared {_pct(out['first_shared_frac'])} "
          f"of the part; each additional step (median of {len(inc) - 1}): local {_mib(out['incremental'])} MiB "
          f"({_pct(out['local_frac'])}), shared {_mib(out['incremental_shared'])} MiB ({_pct(out['shared_frac'])})")
    for peer in ("whole", "torch.save", "dcp.save"):
        print(f"  incremental / {peer:<10} bytes per additional step: "
              f"{out['incremental'] / out[peer]:.4f}x ({_mib(out['incremental'])} / {_mib(out[peer])} MiB)")
    print(f"  held at the end (last {KEEP_LAST} steps): "
          + ", ".join(f"{p} local {_mib(v['local'])} MiB shared {_mib(v['shared'])} MiB" for p, v in ph.held.items())
          + f"; chunks swept by retention: {ph.swept.get('incremental', 0):.0f}")
    return out


def report_times(ph: Phase) -> dict[str, float]:
    inc, whole = ph.saved["incremental"], ph.saved["whole"]
    n = len(inc) - 1
    logical = int(rest([a.logical for a in inc]) if n else inc[0].logical)

    def row(name: str, xs: list[float], loads: list[tuple[float, float, float]], note: str = "") -> h.Row:
        return h.Row(name, rest(xs), logical, xs, loads, note)

    daemon_note = "daemon {:.2f} s; first step {:.2f} s"
    rows = [row("incremental", [a.local_s for a in inc], [a.load for a in inc],
                daemon_note.format(rest([a.persist_s for a in inc]), inc[0].local_s)),
            row("whole", [b.local_s for b in whole], [b.load for b in whole],
                daemon_note.format(rest([b.persist_s for b in whole]), whole[0].local_s)),
            row("torch.save", [x[0] for x in ph.files["torch.save"]], ph.loads["torch.save"], "+ fsync"),
            row("dcp.save", [x[0] for x in ph.files["dcp.save"]], ph.loads["dcp.save"], "FileSystemWriter")]
    loads = [a.load for a in inc]
    h.print_table(f"{ph.name}: time to durable on local disk, median of the {n} steps after the first "
                  f"(GiB/s of the logical size; x = peer / incremental; loads {loads[0]} .. {loads[-1]})",
                  rows, "incremental")
    drain_note = "wait('shared') - wait('local'); daemon {:.2f} s"
    drains = [row("incremental", [a.drain_s for a in inc], [a.load for a in inc],
                  drain_note.format(rest([a.daemon_drain_s for a in inc]))),
              row("whole", [b.drain_s for b in whole], [b.load for b in whole],
                  drain_note.format(rest([b.daemon_drain_s for b in whole])))]
    h.print_table(f"{ph.name}: drain to the shared tier, median of the {n} steps after the first", drains,
                  "incremental")
    daemon_x = rest([a.persist_s for a in inc]) / rest([b.persist_s for b in whole])
    return {"persist_x": rows[0].seconds / rows[1].seconds, "drain_x": drains[0].seconds / drains[1].seconds,
            "daemon_persist_x": daemon_x,
            "daemon_drain_x": rest([a.daemon_drain_s for a in inc]) / rest([b.daemon_drain_s for b in whole]),
            "incremental_s": rows[0].seconds, "whole_s": rows[1].seconds}


def report_restore(runs: Runs, errors: dict[str, str], nbytes: int) -> float:
    """The cold loads' table; incremental / whole (NaN when either failed)."""
    rows = [h.Row(name, h.median([s for s, _ in runs[name]]), nbytes, [s for s, _ in runs[name]],
                  [ld for _, ld in runs[name]], f"FAILED: {errors[name]}" if name in errors else "")
            for name in ("incremental", "whole") if runs.get(name)]
    if rows:
        h.print_table("lora: cold Client.load() of the last step, medians (x = peer / incremental)", rows,
                      "incremental")
    for name, err in errors.items():
        print(f"  {name}: {err}")
    if errors or len(rows) < 2:
        return math.nan
    return rows[0].seconds / rows[1].seconds


def parse_args(argv: list[str] | None) -> Any:
    p = h.state_args(__doc__ or "", ["lora", "full"], rounds=5)
    p.add_argument("--steps", type=int, default=6, help="saved steps of the LoRA fine-tune")
    p.add_argument("--full-steps", type=int, default=4, help="saved steps of the full fine-tune (1.5 GB each)")
    p.add_argument("--settle", type=float, default=1.5, help="idle seconds before each measurement")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    args = p.parse_args(argv)
    if args.steps < 2 or args.full_steps < 2:
        p.error("--steps and --full-steps need at least 2: the first step and one additional one")
    return args


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    started = time.perf_counter()
    verdicts: list[dict[str, Any]] = []
    results: dict[str, Any] = {}

    def check(label: str, value: float, op: str, target: float, unit: str = "") -> None:
        if math.isnan(value):
            print(f"  ----  {label}: not measured")
            verdicts.append({"label": label, "value": None, "target": target, "pass": False})
            return
        line, ok = h.verdict(label, value, op, target, unit)
        print(line)
        verdicts.append({"label": label, "value": value, "target": target, "pass": ok})

    with h.bench_dirs(args.dir, "incremental") as (work, daemon_root, info):
        print(f"torch threads: {torch.get_num_threads()}")
        peers: dict[str, Ckpt] = {}
        phases: dict[str, Phase] = {}
        try:
            peers["incremental"] = Ckpt("incremental", work, daemon_root, KEEP_LAST,
                                        **{"persist.incremental": True, "persist.chunk_grace_s": GRACE_S})
            peers["whole"] = Ckpt("whole", work, daemon_root, KEEP_LAST)
            tiny = {"w": torch.randn(64, 64)}  # the peers' one-time costs (imports, thread pools), untimed
            torch_save(tiny, work / "warm.pt")
            dcp_save(tiny, work / "warm-dcp")
            if "lora" in args.states:
                trainer = Trainer(True, args.batch, args.seq)
                phases["lora"] = run_phase("lora", trainer, args.steps, peers, work, args.settle)
                print(f"\nlora: cold restore of step {trainer.step}, {args.rounds} rounds", flush=True)
                runs, errors = restore(peers, "lora", trainer.step, trainer.state(), args.rounds, args.settle)
                results["restore"] = {"runs": runs, "errors": errors}
                results["restore_x"] = report_restore(runs, errors, phases["lora"].saved["incremental"][-1].logical)
                for peer in peers.values():
                    peer.close_client("lora")
                del trainer
                gc.collect()
            if "full" in args.states:
                trainer = Trainer(False, args.batch, args.seq)
                phases["full"] = run_phase("full", trainer, args.full_steps, peers, work, args.settle)
                for peer in peers.values():
                    peer.close_client("full")
                del trainer
                gc.collect()
            for name, ph in phases.items():
                results[name] = {"bytes": report_bytes(ph), "times": report_times(ph)}
        finally:
            for peer in peers.values():
                peer.stop()
        print("\ntargets:")
        if "lora" in results:
            b = results["lora"]["bytes"]
            check("lora, local tier: bytes stored per additional step, % of a full checkpoint",
                  b["local_frac"] * 100, "<=", TARGET_LORA_FRACTION * 100, "%")
            check("lora, shared tier: bytes drained per additional step, % of a full checkpoint",
                  b["shared_frac"] * 100, "<=", TARGET_LORA_FRACTION * 100, "%")
            check("lora: cold restore, incremental / whole time", results["restore_x"], "<=", TARGET_RESTORE_X, "x")
        if "full" in results:
            b, t = results["full"]["bytes"], results["full"]["times"]
            check("full fine-tune: bytes per step, incremental / whole", b["incremental"] / b["whole"], "<=",
                  TARGET_FULL_BYTES_X, "x")
            check("full fine-tune: persist time, incremental / whole", t["persist_x"], "<=", TARGET_FULL_PERSIST_X,
                  "x")
            check("full fine-tune: the daemon's own persist time, incremental / whole", t["daemon_persist_x"], "<=",
                  TARGET_DAEMON_PERSIST_X, "x")
            check("full fine-tune: the daemon's own drain time, incremental / whole", t["daemon_drain_x"], "<=",
                  TARGET_DAEMON_DRAIN_X, "x")
            print(f"  (the client's wait('shared') - wait('local'), incremental / whole: {t['drain_x']:.2f}x: a "
                  "drain begins at the commit, before the client's wait('local') returns)")
    elapsed = time.perf_counter() - started
    print(f"\ndone in {elapsed:.0f} s, load {h.load()}")
    record = {n: {"note": p.note, "files": p.files, "loads": p.loads, "train_s": p.train_s, "held": p.held,
                  "changed": p.changed, "saved": {k: [asdict(s) for s in v] for k, v in p.saved.items()}}
              for n, p in phases.items()}
    h.write_json(args.json, {"bench": "incremental", "machine": info, "argv": sys.argv, "elapsed_s": elapsed,
                             "phases": record, "results": results, "verdicts": verdicts})
    return 1 if args.strict and any(not v["pass"] for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
