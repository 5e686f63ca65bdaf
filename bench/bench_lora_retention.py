"""What a long LoRA fine-tune holds on each tier with incremental checkpoints and retention, next to whole parts.

    .venv/bin/python bench/bench_lora_retention.py                 # 100 saved steps, keep_last 5, ~6 min
    .venv/bin/python bench/bench_lora_retention.py --steps 30 --json out.json

Two real ``ckptstaged``, each with a local and a shared tier in ``--dir``,
both keeping the last ``--keep`` steps per tier: ``incremental``
(``persist.incremental = true``: a step stores only the chunks its tier
lacks, in one pack per part; retention removes whole packs, after repacking
one that is mostly dead) and ``whole`` (one data file per part). The chunk
grace is 5 s instead of 600 s, so that sweeps and repacks happen within the
run. The trainer is bench_incremental's LoRA fine-tune (GPT-2 124M from its
config, nothing downloaded, rank-8 adapters on every ``attn.c_attn``, the base
frozen, AdamW over the adapters), one optimizer step between saves, the same
state saved to both daemons and drained (``wait("shared")``) every step.

Every ``--every`` steps it prints each tier's bytes (every file under the
job's directory: packs, their indexes, manifests, commit records) and the
packs held. At the end, once a sweep has had its grace, the figure the
target is about: bytes held / (full + keep x delta), where full is the first
step's stored bytes and delta the median bytes a later step added on that
tier (the files it created: its pack, the pack's index, its part's manifest). Target: at most 1.1x on each tier. A whole-part daemon holds keep x
full; ``torch.save`` of the same kept steps would too.
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

TARGET_HELD_X = 1.10
GRACE_S = 5.0
JOB = "lora"


def mib(n: float) -> str:
    return f"{n / h.MiB:.1f}"


def held(tier: Path) -> tuple[int, int]:
    """(bytes of every file under the job's directory on ``tier``, packs in its store)."""
    from ckptstage.protos import chunks, packs

    files = files_under(tier / JOB)
    pack_dir = packs.packs_dir(chunks.store_dir(tier, JOB))
    return sum(files.values()), sum(1 for p in files if p.parent == pack_dir and p.suffix == packs.PACK_SUFFIX)


def main(argv: list[str] | None = None) -> int:
    p = h.run_args(__doc__ or "", "bench_lora_retention")
    p.add_argument("--steps", type=int, default=100, help="saved steps")
    p.add_argument("--keep", type=int, default=5, help="[local] and [shared] keep_last")
    p.add_argument("--every", type=int, default=10, help="print the tiers every this many steps")
    args = p.parse_args(argv)
    started = time.perf_counter()
    with h.workdir(args.dir, "ckptbench-lora-retention-") as work:
        info = h.machine_info(work)
        h.print_machine(info)
        peers = {name: Ckpt(name, work, work / "daemons", args.keep, **settings) for name, settings in (
            ("incremental", {"persist.incremental": True, "persist.chunk_grace_s": GRACE_S}),
            ("whole", {}))}
        trainer = Trainer(lora=True, batch=2, seq=64)
        print(f"\n{trainer.note}; keep_last {args.keep} on both tiers, chunk grace {GRACE_S:.0f} s")
        added: dict[str, list[int]] = {"local": [], "shared": []}
        rows = []
        try:
            for step in range(1, args.steps + 1):
                trainer.train(1)
                state = trainer.state()
                tiers = {"local": peers["incremental"].local, "shared": peers["incremental"].shared}
                before = {t: files_under(d / JOB) for t, d in tiers.items()}
                for peer in peers.values():
                    peer.client(JOB).save(step, state).wait("shared", timeout=600)
                for t, d in tiers.items():  # the files this step added (its pack, index and part), whatever went
                    added[t].append(sum(n for f, n in files_under(d / JOB).items() if f not in before[t]))
                del state
                if step % args.every == 0 or step == 1:
                    row = {"step": step, **{f"{n} {t}": held(getattr(peer, t))
                                            for n, peer in peers.items() for t in ("local", "shared")}}
                    rows.append(row)
                    print(f"  step {step:4d}: " + ", ".join(
                        f"{k} {mib(v[0])} MiB ({v[1]} packs)" if k.startswith("incr") else f"{k} {mib(v[0])} MiB"
                        for k, v in row.items() if k != "step") + f", load {h.load()}", flush=True)
            time.sleep(GRACE_S + 1)
            for peer in peers.values():  # a save after the grace: its retention pass sweeps what the grace kept
                peer.client(JOB).save(args.steps + 1, trainer.state()).wait("shared", timeout=600)
            time.sleep(2)
            final = {f"{n} {t}": held(getattr(peer, t)) for n, peer in peers.items() for t in ("local", "shared")}
        finally:
            for peer in peers.values():
                peer.stop()
            del trainer
            gc.collect()
        print("\nheld at the end (after one more save past the grace):")
        results: dict[str, Any] = {}
        verdicts = []
        for tier in ("local", "shared"):
            full = added[tier][0]
            delta = h.median(added[tier][1:])
            ideal = full + args.keep * delta
            got, n_packs = final[f"incremental {tier}"]
            whole = final[f"whole {tier}"][0]
            results[tier] = {"full": full, "delta": delta, "ideal": ideal, "held": got, "packs": n_packs,
                             "whole": whole, "x": got / ideal}
            print(f"  {tier:6s}: incremental {mib(got)} MiB in {n_packs} packs = {got / ideal:.3f}x of full "
                  f"{mib(full)} + {args.keep} x delta {mib(delta)} MiB; whole {mib(whole)} MiB "
                  f"= {whole / got:.1f}x incremental")
            verdicts.append(h.verdict(f"{tier} tier: held / (full + {args.keep} x delta)", got / ideal, "<=",
                                      TARGET_HELD_X, "x"))
        print("\ntargets:")
        for line, _ in verdicts:
            print(line)
        elapsed = time.perf_counter() - started
        print(f"\ndone in {elapsed:.0f} s, load {h.load()}")
        h.write_json(args.json, {"bench": "lora_retention", "machine": info, "argv": sys.argv, "elapsed_s": elapsed,
                                 "rows": rows, "added": added, "results": results,
                                 "verdicts": [{"line": v, "pass": ok} for v, ok in verdicts]})
    return 1 if args.strict and not all(ok for _, ok in verdicts) else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
