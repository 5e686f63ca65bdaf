"""Compressed chunks on the shared tier: bytes sent and drain time per ``[shared] compression``, next to
``zstd -1`` of the same files, on a tier as fast as it goes and on one capped to 200 MB/s; then a restore.
The shared tier is a directory (``--tiers fs``) or an object store (``--tiers s3``), or each in turn.

    .venv/bin/python bench/bench_shared_compression.py                  # GPT-2 124M, fp32, both tiers, ~12 min
    .venv/bin/python bench/bench_shared_compression.py --tiers fs       # a shared directory only
    .venv/bin/python bench/bench_shared_compression.py --bf16           # the same state cast to bf16
    .venv/bin/python bench/bench_shared_compression.py --caps 200MB/s --rounds 1

The object store: one SeaweedFS on loopback (``tests/s3server.py``, as
``bench_s3.py`` starts it), a prefix per daemon. The directory: one per
daemon on the bench's disk (the same disk as the local tiers, as on a node
whose shared file system is its own SSD: uncapped, it measures the codec
against a fast disk). Per cap ("none", or ``[shared] max_bandwidth``, which
counts the bytes a chunk is stored as), one daemon per mode: ``none``,
``bg-zstd`` (byte-grouped zstd -1 on every chunk that shrinks by 5%) and
``auto`` (when the codec outruns the write, from what the tier measured),
incremental parts, each its own local tier and shared place. The state: GPT-2 124M built from
``GPT2Config()`` with AdamW (weights and both moments, 1.4 GiB fp32), one
training step before each round, so every chunk changes. Each round every
daemon saves the step in turn (rotating order) and is timed from
``wait("local")`` to ``wait("shared")``; the bytes the step added to the
store are summed from the indexes of its new packs (what each chunk holds
decoded, and what it takes). Beside them, in the same
round: ``zstd -1`` (the CLI, one thread) of the step's new pack files on
the ``none`` daemon's local tier, timed, its output counted. At the end a
daemon that never saw the job loads the last step from each mode's shared
place, timed cold (an object store's chunks fetched onto its own local tier
and decoded; a directory's read in place, its files out of the page cache
first, and decoded by the trainer), the modes in order and then in reverse
(median of the two).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness as h
from bench_s3 import arena_bytes, s3server
from ckptstage.protos import packs

JOB = "squeeze"
MODES = ("none", "bg-zstd", "auto")


class Place:
    """Where one daemon's shared tier is: a prefix of the object store, or a directory."""

    def __init__(self, tier: str, tag: str, server: Any, droot: Path) -> None:
        self.tier, self.tag, self.server = tier, tag, server
        self.dir = droot / f"shared-{tag}"

    def settings(self) -> dict[str, Any]:
        if self.tier == "fs":
            return {"shared.dir": str(self.dir)}
        s3 = s3server()
        return {"shared.url": f"s3://{s3.BUCKET}/{self.tag}", "shared.endpoint": self.server.endpoint,
                "shared.region": s3.REGION}

    def indexes(self) -> dict[str, Callable[[], bytes]]:
        """Each pack index of the job's store: its key, and how to read it."""
        if self.tier == "fs":
            where = self.dir / JOB / "chunks" / "packs"
            return {str(p): p.read_bytes for p in where.glob(f"*{packs.INDEX_SUFFIX}")}
        s3 = s3server()
        client = self.server.client()
        out: dict[str, Callable[[], bytes]] = {}
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=s3.BUCKET, Prefix=f"{self.tag}/{JOB}/chunks/packs/", Delimiter="/")
        for key in [o["Key"] for page in pages for o in page.get("Contents", [])]:
            if key.endswith(packs.INDEX_SUFFIX):
                out[key] = lambda key=key: client.get_object(Bucket=s3.BUCKET, Key=key)["Body"].read()
        return out

    def cold(self) -> None:
        """Out of the page cache (a directory's files; an object store's are the server's business)."""
        if self.tier == "fs":
            h.drop_page_cache(self.dir)


def daemon(root: Path, place: Place, arena: int, **settings: Any) -> h.Daemon:
    d = h.Daemon(root, root / "local", None, metrics=True, **{
        **place.settings(), "persist.incremental": True, "arena.max_bytes": arena, "local.keep_last": 2,
        "shared.keep_last": 100, "memory.enabled": False, **settings})
    if place.server is not None:
        d.env.update(place.server.env())
    return d


def stored(place: Place, before: set[str]) -> tuple[set[str], int, int]:
    """The pack indexes of ``place`` now, and the decoded and stored bytes of the chunks of those not in
    ``before`` (read from the indexes: a compressed chunk's entry gives its decoded size)."""
    found = place.indexes()
    logical = sent = 0
    for key, read in found.items():
        if key not in before:
            for e in packs.decode_index(read(), Path(key)):
                logical += e.size or e.length
                sent += e.length
    return set(found), logical, sent


def figures(d: h.Daemon) -> str:
    """What "auto" decides from, as the daemon's metrics say: one stream's speed, the codec's, the share kept."""
    got = d.scrape()

    def value(name: str) -> float:
        return got.get(f'ckptstage_compression_{name}{{tier="shared"}}', 0.0)

    return (f"; auto: stream {value('stream_bytes_per_second') / 1e6:.0f} MB/s, codec "
            f"{value('codec_bytes_per_second') / 1e6:.0f} MB/s x saved {1 - value('stored_share'):.2f}")


def zstd_cli(files: list[Path]) -> tuple[float, int]:
    """``zstd -1`` (one thread) of ``files``: seconds, compressed bytes."""
    out = 0
    with h.Timer() as t:
        for f in files:
            got = subprocess.run(["zstd", "-1", "-T1", "-q", "-c", str(f)], check=True, capture_output=True)
            out += len(got.stdout)
    return t.s, out


def packs_of(local: Path) -> dict[Path, float]:
    return {p: p.stat().st_mtime for p in (local / JOB / "chunks" / "packs").glob("*.pack")}


def bench(args: argparse.Namespace, work: Path, droot: Path, out: Any) -> dict[str, Any]:
    from _finetune import Trainer

    server = None
    if "s3" in args.tiers:
        server = s3server().start(work / "seaweedfs")
        out(f"SeaweedFS at {server.endpoint}, serving after {server.start_s:.1f} s")
    trainer = Trainer(lora=False, batch=1, seq=64)
    trainer.train(1)

    def state() -> dict[str, Any]:
        import torch

        s = trainer.state()
        return {k: _cast(v, torch.bfloat16) for k, v in s.items()} if args.bf16 else s

    nbytes = h.state_bytes(state())
    out(f"{trainer.note}; {'bf16' if args.bf16 else 'fp32'} state {nbytes / h.MiB:.0f} MiB")
    rows: dict[str, dict[str, list[float]]] = {}
    step = 0
    try:
        for tier in args.tiers:
            for cap in args.caps:
                step = run_cap(args, tier, cap, server, droot, trainer, state, nbytes, step, rows, out)
    finally:
        if server is not None:
            server.stop()
    return rows


def run_cap(args: argparse.Namespace, tier: str, cap: str, server: Any, droot: Path, trainer: Any,
            state: Callable[[], dict[str, Any]], nbytes: int, step: int, rows: dict[str, dict[str, list[float]]],
            out: Any) -> int:
    """The rounds of one tier and cap (each mode's daemon saving every step), then the restores; the last step."""
    from ckptstage.client import Client

    label = f"{tier} {cap}"
    places = {m: Place(tier, f"{tier}-{cap.replace('/', '')}-{m}", server, droot) for m in MODES}
    extra = {} if cap == "none" else {"shared.max_bandwidth": cap}
    nodes = {m: daemon(droot / places[m].tag, places[m], arena_bytes(nbytes), **{"shared.compression": m, **extra})
             for m in MODES}
    for d in nodes.values():
        d.start()
    clients = {m: Client(JOB, socket=d.socket) for m, d in nodes.items()}
    seen = {m: set[str]() for m in MODES}
    try:
        for r in range(args.rounds + 1):  # round 0 untimed: connections, imports, the first probe
            step += 1
            trainer.train(1)
            s = state()
            for m in MODES[r % 3:] + MODES[:r % 3]:
                before = packs_of(nodes[m].local)
                h.settle(args.settle)
                handle = clients[m].save(step, s)
                handle.wait("local")
                t0 = time.perf_counter()
                handle.wait("shared", timeout=600)
                took = time.perf_counter() - t0
                seen[m], logical, sent = stored(places[m], seen[m])
                if r == 0:
                    continue
                row = rows.setdefault(f"{label} {m}", {})
                for k, v in (("drain_s", took), ("logical", logical), ("sent", sent)):
                    row.setdefault(k, []).append(v)
                if m == "none":
                    new = [p for p, t in packs_of(nodes[m].local).items() if before.get(p) != t]
                    z_s, z_bytes = zstd_cli(new)
                    cli = rows.setdefault(f"{label} zstd -1 CLI", {})
                    for k, v in (("drain_s", z_s), ("logical", logical), ("sent", z_bytes)):
                        cli.setdefault(k, []).append(v)
                out(f"  {label:>11} round {r}: {m:8} drain {took:6.2f} s, sent {sent / h.MiB:7.1f} of "
                    f"{logical / h.MiB:7.1f} MiB  (load {h.load()}){figures(nodes[m]) if m == 'auto' else ''}")
    finally:
        for c in clients.values():
            c.close()
        for d in nodes.values():
            d.stop()
    for m, got in restore(places, droot, nbytes, step).items():
        rows.setdefault(f"{label} {m}", {}).update(got)
    return step


def restore(places: dict[str, Place], droot: Path, nbytes: int, step: int) -> dict[str, dict[str, list[float]]]:
    """A daemon that never saw the job loads ``step`` from each mode's place, cold: seconds per mode; the modes
    in order, then in reverse (a later restore in a run measured slower here, whatever its mode)."""
    from ckptstage.client import Client

    out: dict[str, dict[str, list[float]]] = {}
    for i, m in enumerate([*MODES, *reversed(MODES)]):
        d = daemon(droot / f"reader{i}-{places[m].tag}", places[m], arena_bytes(nbytes)).start()
        try:
            with Client(JOB, socket=d.socket) as c:
                deadline = time.monotonic() + 60
                while step not in [i.step for i in c.list() if i.complete] and time.monotonic() < deadline:
                    time.sleep(0.2)
                places[m].cold()
                with h.Timer() as t:
                    c.load(step=step)
            out.setdefault(m, {"restore_s": []})["restore_s"].append(t.s)
        finally:
            d.stop()
    return out


def _cast(value: Any, dtype: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    if isinstance(value, list):
        return [_cast(v, dtype) for v in value]
    return value


def report(rows: dict[str, dict[str, list[float]]], out: Any) -> None:
    out(f"\n{'':28} {'drain (s)':>10} {'MB/s of state':>14} {'sent / logical':>15} {'restore (s)':>12}")
    for label in dict.fromkeys(" ".join(k.split(" ")[:2]) for k in rows):  # "<tier> <cap>"
        base = h.median(rows[f"{label} none"]["drain_s"])
        for name in [f"{label} {m}" for m in MODES] + [f"{label} zstd -1 CLI"]:
            r = rows.get(name)
            if r is None or "drain_s" not in r:
                continue
            drain, logical, sent = h.median(r["drain_s"]), h.median(r["logical"]), h.median(r["sent"])
            restore_s = rows.get(name, {}).get("restore_s")
            out(f"{name:28} {drain:10.2f} {logical / drain / 1e6:14.0f} {sent / logical:15.3f} "
                f"{'' if not restore_s else f'{h.median(restore_s):.2f}':>12}   x{drain / base:.2f} of none's drain"
                + (f"; restores {' '.join(f'{s:.2f}' for s in restore_s)}" if restore_s else ""))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = h.run_args(__doc__ or "", "the local tiers, the shared directories and SeaweedFS's data live")
    p.add_argument("--tiers", nargs="+", choices=("fs", "s3"), default=["fs", "s3"],
                   help="the shared tier: a directory, an object store, or each in turn (default: fs s3)")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds per cap (default 2)")
    p.add_argument("--caps", nargs="+", default=["none", "200MB/s"], help="[shared] max_bandwidth per run "
                   "(none: uncapped; default: none 200MB/s)")
    p.add_argument("--bf16", action="store_true", help="the state cast to bf16")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {"bench": "shared_compression", "argv": sys.argv}
    with h.bench_dirs(args.dir, "shared-compression") as (work, droot, info):
        result["machine"] = info
        rows = bench(args, work, droot, print)
    report(rows, print)
    result["rows"] = rows
    h.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
