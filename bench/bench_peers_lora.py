"""A LoRA fine-tune's replicas on another node: what each step sends, and how long, incremental against whole parts.

    .venv/bin/python bench/bench_peers_lora.py               # 5 saved steps, ~1.5 min
    .venv/bin/python bench/bench_peers_lora.py --steps 8 --json out.json

Two pairs of real ``ckptstaged`` stand for two nodes each (``[peers]`` on
loopback ports, one token, no shared tier): one pair writes incremental
parts (the default), the other whole ones (``incremental = false``). A job
of two ranks runs on each pair, rank 0 on node A and rank 1 on node B, each
saving the LoRA fine-tune of bench_incremental (GPT-2 124M from its config,
rank-8 adapters, the base frozen) after one optimizer step, and waiting for
its replica (``wait("peer")``). B's trainer takes B's whole arena budget,
so B keeps A's replicas on its SSD, as a node whose memory its own trainer
needs does: there an incremental replica is chunks of B's replica store, and
A sends a step as the chunks B lacks (its adapters); a whole part goes whole.

Per step after the first: the bytes A sent (``ckptstage_peer_sent_bytes_total``)
and the send's time (A's log, commit to the peer's commit), next to the part's
size and a plain TCP copy of that many bytes over loopback (the wire alone).
"""

from __future__ import annotations

import gc
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import _harness as h
from _finetune import Trainer
from bench_peers import tcp_copy_s

TOKEN = "0123456789abcdef0123456789abcdef"
JOB = "lora-peers"
SENT = "ckptstage_peer_sent_bytes_total"


def pair(root: Path, name: str, incremental: bool, budget: int) -> list[h.Daemon]:
    token = root / "peer.token"
    if not token.exists():
        token.write_text(TOKEN)
        token.chmod(0o600)
    out = []
    for node in "AB":
        port = h.free_port()
        d = h.Daemon(root / f"{name}-{node}", root / f"{name}-{node}" / "local", None, metrics=True,
                     **{"persist.incremental": incremental, "arena.max_bytes": budget, "peers.keep": 2,
                        "peers.listen": f"127.0.0.1:{port}", "peers.advertise": f"127.0.0.1:{port}",
                        "peers.token_file": str(token), "memory.enabled": False})
        d.peer = f"127.0.0.1:{port}"
        out.append(d.start())
    return out


def send_seconds(log: Path) -> list[float]:
    pattern = re.compile(rf"replicated {JOB} step \d+ rank 0 to \S+: \d+ bytes in ([\d.]+)s")
    return [float(m[1]) for m in pattern.finditer(log.read_text())]


def main(argv: list[str] | None = None) -> int:
    from ckptstage.client import Client

    p = h.run_args(__doc__ or "", "bench_peers_lora")
    p.add_argument("--steps", type=int, default=5, help="saved steps (the first sends everything)")
    args = p.parse_args(argv)
    started = time.perf_counter()
    with h.workdir(args.dir, "ckptbench-peers-lora-") as work:
        info = h.machine_info(work)
        h.print_machine(info)
        trainer = Trainer(lora=True, batch=2, seq=64)
        tensors = h.state_bytes(trainer.state())  # GPT-2's tied lm_head counted twice: a part holds it once
        budget = (2 * tensors // h.MiB + 64) * h.MiB  # a trainer's arena of two copies: nothing left for replicas
        pairs = {"incremental": pair(work, "inc", True, budget), "whole": pair(work, "whole", False, budget)}
        print(f"\n{trainer.note}; replicas on B's disk")
        clients: dict[str, list[Any]] = {}
        sent: dict[str, list[float]] = {name: [] for name in pairs}
        try:
            for name, (a, b) in pairs.items():
                clients[name] = [Client(JOB, socket=d.socket, rank=r, world_size=2, attempt="run",
                                        arena_bytes=budget if r == 1 else None)
                                 for r, d in enumerate((a, b))]
                for c in clients[name]:
                    c._session.join_peers(sorted({a.peer, b.peer}))
            for step in range(1, args.steps + 1):
                trainer.train(1)
                state = trainer.state()
                for name, (a, _) in pairs.items():
                    before = a.scrape().get(SENT, 0.0)
                    handles = [c.save(step, state) for c in clients[name]]
                    for handle in handles:
                        handle.wait("peer", timeout=600)
                    sent[name].append(a.scrape().get(SENT, 0.0) - before)
                print(f"  step {step}: sent " + ", ".join(f"{n} {sent[n][-1] / h.MiB:.1f} MiB" for n in pairs),
                      flush=True)
                del state
            seconds = {name: send_seconds(a.log) for name, (a, _) in pairs.items()}
            part = int(sent["whole"][0])  # the whole part's size, as its send counted it
        finally:
            for cs in clients.values():
                for c in cs:
                    c.close()
            for ds in pairs.values():
                for d in ds:
                    d.stop()
            del trainer
            gc.collect()
        tcp = h.median([tcp_copy_s(part) for _ in range(3)])
        later = slice(1, None)
        print(f"\nper step after the first (median of {args.steps - 1}), A to B:")
        results: dict[str, Any] = {}
        for name in pairs:
            b = h.median(sent[name][later])
            s = h.median(seconds[name][later]) if seconds[name][later] else float("nan")
            results[name] = {"sent": sent[name], "seconds": seconds[name]}
            print(f"  {name:11s}: {b / h.MiB:7.1f} MiB sent = {b / part:.4f}x of the part, in {s:.2f} s")
        print(f"  a TCP copy of the part over loopback: {tcp:.2f} s")
        ratio = h.median(sent["incremental"][later]) / part
        verdicts = [h.verdict("incremental: bytes sent per LoRA step / part", 100 * ratio, "<=", 1.0, "%")]
        print("\ntargets:")
        for line, _ in verdicts:
            print(line)
        elapsed = time.perf_counter() - started
        print(f"\ndone in {elapsed:.0f} s, load {h.load()}")
        h.write_json(args.json, {"bench": "peers_lora", "machine": info, "argv": sys.argv, "elapsed_s": elapsed,
                                 "part": part, "results": results,
                                 "verdicts": [{"line": v, "pass": ok} for v, ok in verdicts]})
    return 1 if args.strict and not all(ok for _, ok in verdicts) else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
