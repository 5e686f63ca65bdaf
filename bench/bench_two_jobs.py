"""Two fine-tunes of one base model: what the second job's first checkpoint costs on each tier.

    .venv/bin/python bench/bench_two_jobs.py               # GPT-2 124M, two LoRA jobs, ~2 min
    .venv/bin/python bench/bench_two_jobs.py --json out.json

Three real ``ckptstaged``, each with a local and a shared tier in ``--dir``:
``user`` (incremental, ``[persist] dedup = "user"``: one chunk store per
tier for every job of the user), ``job`` (incremental, each job its own
store: the default) and ``whole`` (one data file per part). Two jobs,
``ft-a`` and ``ft-b``, fine-tune the same GPT-2 124M base (built from its
config, nothing downloaded) with rank-8 LoRA adapters of their own (the
trainer of bench_incremental); each saves its first step to every daemon
and waits for the drain. Printed per tier and daemon: the bytes ``ft-b``'s
first step added (every file it created there), next to ``torch.save`` of
the same state. Target: with ``dedup = "user"`` at most 2% of a full
checkpoint on each tier.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

import _harness as h
from _finetune import Ckpt, Trainer, files_under

TARGET_PCT = 2.0
DAEMONS = {"user": {"persist.incremental": True, "persist.dedup": "user"},
           "job": {"persist.incremental": True},
           "whole": {}}


def held(tier: Path) -> dict[Path, int]:
    """Every file of the tier's checkpoints and chunk stores (not the daemon's own state or temporaries)."""
    return {p: n for p, n in files_under(tier).items() if p.relative_to(tier).parts[0] not in (".state", ".tmp")}


def mib(n: float) -> str:
    return f"{n / h.MiB:.1f}"


def main(argv: list[str] | None = None) -> int:
    import torch

    p = h.run_args(__doc__ or "", "bench_two_jobs")
    args = p.parse_args(argv)
    started = time.perf_counter()
    with h.workdir(args.dir, "ckptbench-two-jobs-") as work:
        info = h.machine_info(work)
        h.print_machine(info)
        peers = {name: Ckpt(name, work, work / "daemons", 5, **settings) for name, settings in DAEMONS.items()}
        trainers = {}
        for job, seed in (("ft-a", 1), ("ft-b", 2)):
            trainers[job] = Trainer(lora=True, batch=2, seq=64)  # the same base (seeded 0), adapters trained apart
            torch.manual_seed(seed)
            trainers[job].train(1)
        print(f"\n{trainers['ft-a'].note}; two jobs, one base")
        added: dict[str, dict[str, int]] = {}
        waited: dict[str, float] = {}
        try:
            for job in ("ft-a", "ft-b"):
                state = trainers[job].state()
                for name, peer in peers.items():
                    before = {t: held(getattr(peer, t)) for t in ("local", "shared")}
                    with h.Timer() as t:
                        peer.client(job).save(1, state).wait("shared", timeout=600)
                    if job == "ft-b":
                        waited[name] = t.s
                        added[name] = {tier: sum(n for f, n in held(getattr(peer, tier)).items()
                                                 if f not in before[tier]) for tier in ("local", "shared")}
            saved = work / "torch-save.pt"
            with h.Timer() as t:
                torch.save(trainers["ft-b"].state(), saved)
                with open(saved, "rb+") as f:
                    os.fsync(f.fileno())
            full, torch_save_s = saved.stat().st_size, t.s
            saved.unlink()
        finally:
            for peer in peers.values():
                peer.stop()
            del trainers
            gc.collect()
        print(f"\nft-b's first step, added on each tier (full checkpoint: torch.save {mib(full)} MiB, "
              f"{torch_save_s:.2f} s to write and fsync):")
        for name in DAEMONS:
            print(f"  {name:5s}: " + ", ".join(f"{tier} {mib(n)} MiB = {n / full:.4f}x" for tier, n in
                                              added[name].items()) + f"; save + drain {waited[name]:.2f} s")
        verdicts = [h.verdict(f"dedup = user, {tier} tier: ft-b's first step / full",
                              100 * added["user"][tier] / full, "<=", TARGET_PCT, "%") for tier in ("local", "shared")]
        print("\ntargets:")
        for line, _ in verdicts:
            print(line)
        elapsed = time.perf_counter() - started
        print(f"\ndone in {elapsed:.0f} s, load {h.load()}")
        h.write_json(args.json, {"bench": "two_jobs", "machine": info, "argv": sys.argv, "elapsed_s": elapsed,
                                 "full": full, "torch_save_s": torch_save_s, "added": added, "waited_s": waited,
                                 "verdicts": [{"line": v, "pass": ok} for v, ok in verdicts]})
    return 1 if args.strict and not all(ok for _, ok in verdicts) else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
