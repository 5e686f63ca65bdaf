"""Requests an object store is asked for per drained step: incremental parts (packs) next to whole parts and
``aws s3 cp``'s engine uploading the same data file, for a full fine-tune and a LoRA one, in one run.

    .venv/bin/python bench/bench_s3_requests.py              # GPT-2 124M, full and LoRA, 3 rounds, ~5 min
    .venv/bin/python bench/bench_s3_requests.py --workloads lora --rounds 5

What an object store bills and rate-limits is requests. One SeaweedFS on
loopback whose S3 gateway counts every request it answers (by type: GET,
PUT, LIST, POST, DELETE, ...; ``_scale_s3.py``: a HEAD is filed as a GET,
each piece of a multipart upload as a PUT). Per workload two daemons, each
its own local tier and prefix: ``incremental`` (``[persist] incremental``:
a part's new chunks uploaded as packs) and ``whole`` (a part uploaded as
its data file and manifest). The state: GPT-2 124M built from
``GPT2Config()`` with AdamW; ``full`` trains every parameter (every chunk
changes each step), ``lora`` trains rank-8 adapters over a frozen base (the
base's chunks never change). Each round trains one step, then each daemon
saves it in turn, and the server's requests from ``wait("local")`` to one
second after ``wait("shared")`` are counted (the daemons' alone: this
process's own polling is taken off), with the drain's time. Beside them, in
the same round: s3transfer's ``upload_file`` of the whole part's data file
(``aws s3 cp``'s engine, its defaults: 8 MiB pieces), counted the same way;
and the new chunks of the incremental part (what a layout keeping a chunk
per object would PUT, each after a failed touch).

The first round (every chunk new) is reported apart from the later ones.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import _harness as h
import _scale_s3
from bench_s3 import arena_bytes

JOB = "requests"
MODES = ("incremental", "whole")


def new_chunks(local: Path, step: int) -> int:
    """How many chunks step ``step``'s part names that step ``step - 1``'s did not."""
    from ckptstage.protos import chunks, layout

    def named(s: int) -> set[str]:
        part = layout.part_dir(local, JOB, s, 0)
        return chunks.referenced(layout.read_manifest(part)) if part.is_dir() else set()

    return len(named(step) - named(step - 1))


def bench(args: argparse.Namespace, work: Path, droot: Path, out: Any) -> dict[str, Any]:
    from _finetune import Trainer
    from ckptstage.client import Client

    server = _scale_s3.Server(work / "seaweedfs")
    out(f"SeaweedFS at {server.endpoint} (requests counted by its S3 gateway)")
    rows: dict[str, dict[str, list[float]]] = {}
    try:
        for workload in args.workloads:
            trainer = Trainer(lora=workload == "lora", batch=1, seq=64)
            nbytes = h.state_bytes(trainer.state())
            out(f"{workload}: {trainer.note}; state {nbytes / h.MiB:.0f} MiB")
            nodes = {m: _daemon(droot / f"{workload}-{m}", server, f"{workload}-{m}", arena_bytes(nbytes),
                                incremental=m == "incremental") for m in MODES}
            for d in nodes.values():
                d.start()
            clients = {m: Client(JOB, socket=d.socket) for m, d in nodes.items()}
            try:
                for r in range(args.rounds + 1):
                    trainer.train(1)
                    state = trainer.state()
                    phase = "first" if r == 0 else "later"
                    for m in MODES[r % 2:] + MODES[:r % 2]:
                        handle = clients[m].save(r + 1, state)
                        handle.wait("local")
                        window = server.window()
                        t0 = time.perf_counter()
                        handle.wait("shared", timeout=600)
                        took = time.perf_counter() - t0
                        time.sleep(1.0)  # the drain's last requests (the step index, the retention pass)
                        got, _ = window.stop()
                        row = rows.setdefault(f"{workload} {phase} {m}", {})
                        for k, v in (("requests", sum(got.requests.values())), ("put", got.requests["PUT"]),
                                     ("drain_s", took)):
                            row.setdefault(k, []).append(v)
                        out(f"  {workload} round {r}: {m:11} {sum(got.requests.values()):6d} requests "
                            f"({dict(sorted(got.requests.items()))}), drain {took:.2f} s")
                    rows.setdefault(f"{workload} {phase} chunks new", {}).setdefault("requests", []).append(
                        new_chunks(nodes["incremental"].local, r + 1))
                    rows.setdefault(f"{workload} {phase} upload_file", {}).setdefault("requests", []).append(
                        _upload_file(server, nodes["whole"].local, r + 1))
            finally:
                for c in clients.values():
                    c.close()
                for d in nodes.values():
                    d.stop()
    finally:
        server.stop()
    return rows


def _daemon(root: Path, server: Any, prefix: str, arena: int, incremental: bool) -> h.Daemon:
    d = h.Daemon(root, root / "local", None, **{
        "shared.url": f"s3://{server.bucket}/{prefix}", "shared.endpoint": server.endpoint,
        "shared.region": server.region, "persist.incremental": incremental, "shared.compression": "none",
        "arena.max_bytes": arena, "local.keep_last": 2, "shared.keep_last": 100, "memory.enabled": False})
    d.env.update(server.env())
    return d


def _upload_file(server: Any, local: Path, step: int) -> int:
    """Requests of s3transfer's ``upload_file`` (aws s3 cp's defaults) of the whole part's data file."""
    from ckptstage.protos import layout

    data = layout.part_dir(local, JOB, step, 0) / layout.DATA_FILE
    before = sum(server.own.values())
    key = f"peers/{time.monotonic_ns()}"
    server.client.upload_file(str(data), server.bucket, key)
    took = sum(server.own.values()) - before
    server.client.delete_object(Bucket=server.bucket, Key=key)
    return took


def report(rows: dict[str, dict[str, list[float]]], out: Any) -> None:
    out(f"\n{'':34} {'requests':>9} {'of which PUT':>13} {'drain (s)':>10} {'x whole':>8} {'x upload_file':>14}")
    for key in dict.fromkeys(" ".join(k.split(" ")[:2]) for k in rows):  # "<workload> <first|later>"
        whole = h.median(rows[f"{key} whole"]["requests"])
        peer = h.median(rows[f"{key} upload_file"]["requests"])
        for name in ("incremental", "whole", "upload_file", "chunks new"):
            r = rows.get(f"{key} {name}")
            if r is None:
                continue
            n = h.median(r["requests"])
            put = f"{h.median(r['put']):.0f}" if "put" in r else ""
            drain = f"{h.median(r['drain_s']):.2f}" if "drain_s" in r else ""
            out(f"{key + ' ' + name:34} {n:9.0f} {put:>13} {drain:>10} {n / whole:8.2f} {n / peer:14.2f}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = h.run_args(__doc__ or "", "the local tiers and SeaweedFS's data live")
    p.add_argument("--rounds", type=int, default=3, help="rounds after the first save (default 3)")
    p.add_argument("--workloads", nargs="+", default=["full", "lora"], choices=["full", "lora"],
                   help="full: every parameter trained; lora: rank-8 adapters over a frozen base")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {"bench": "s3_requests", "argv": sys.argv}
    with h.bench_dirs(args.dir, "s3-requests") as (work, droot, info):
        result["machine"] = info
        rows = bench(args, work, droot, print)
    result["rows"] = rows
    h.write_json(args.json, result)
    report(rows, print)
    return 0


if __name__ == "__main__":
    sys.exit(main())
