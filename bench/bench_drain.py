"""Drain benchmark: local tier -> shared tier, next to ``cp -r`` + ``sync`` of the same files, in one run.

    .venv/bin/python bench/bench_drain.py                       # 1 GiB, 3 rounds, cap run at 200MiB/s
    .venv/bin/python bench/bench_drain.py --dir /scratch/bench     # both tiers and the cp target under DIR
    .venv/bin/python bench/bench_drain.py --cap 0                # skip the capped run

Uncapped (one daemon, metrics on): each round commits a new step locally and
waits for it on the shared tier. Drain time is measured two ways:

* ``drain (client)``  ``wait("local")`` return -> ``wait("shared")`` return;
* ``drain (daemon)``  the ``ckptstage_drain_duration_seconds`` sum for that part
                      (read, verify every chunk, write, fsync, commit).

Right after, the same part directory is copied with ``cp -r`` and made
durable with ``sync FILES DIR`` (coreutils' per-file fsync, as the drainer
does, rather than a machine-wide ``sync`` that would also flush other users'
data), to a directory on the same file system as the shared tier. Both read
a source that is not in the page cache: the persister writes the local tier
with O_DIRECT, and the part is evicted (``POSIX_FADV_DONTNEED``) before cp.
``dd conv=fsync`` on the same file system is shown for reference.

Capped (a second daemon with ``[shared] max_bandwidth``): one checkpoint of
``--cap-gib``; the achieved rate must be within 10% of the cap.

Target: uncapped drain bandwidth >= 80% of cp + sync.
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

TARGET_OF_CP = 0.80
CAP_TOLERANCE = 0.10
JOB = "drainbench"
DRAIN_SUM = "ckptstage_drain_duration_seconds_sum"


def cp_sync(src: Path, dst: Path) -> float:
    """``cp -r src dst`` then ``sync`` of every copied file and of ``dst``; seconds; ``dst`` removed."""
    with h.Timer() as t:
        subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
        files = [str(p) for p in dst.rglob("*") if p.is_file()]
        subprocess.run(["sync", *files, str(dst)], check=True)
    h.drop_tree(dst)
    return t.s


class Drained:
    """A daemon with a shared tier and a client; :meth:`save` commits one step and times its drain."""

    def __init__(self, state: Any, root: Path, local: Path, shared: Path, nbytes: int, **settings: Any) -> None:
        from ckptstage.client import Client

        settings.setdefault("arena.max_bytes", max(2 * nbytes, 256 * h.MiB) // h.MiB * h.MiB)
        self.local, self.shared = local, shared
        self.daemon = h.Daemon(root, local, shared, metrics=True, **settings).start()
        self.client = Client(JOB, socket=self.daemon.socket)
        self.state = state
        self.step = -1

    def save(self) -> dict[str, float]:
        """Commits the next step; returns its timings and bytes."""
        self.step += 1
        before = self.daemon.scrape().get(DRAIN_SUM, 0.0)
        t0 = time.perf_counter()
        handle = self.client.save(self.step, self.state)
        handle.wait("local")
        t_local = time.perf_counter() - t0
        handle.wait("shared")
        t_shared = time.perf_counter() - t0
        after = self.daemon.scrape().get(DRAIN_SUM, 0.0)
        nbytes = next(c.bytes for c in self.client.list() if c.step == self.step)
        return {"local_s": t_local, "client_s": t_shared - t_local, "daemon_s": after - before,
                "bytes": nbytes}

    def part(self, step: int) -> Path:
        from ckptstage.protos import layout

        return layout.part_dir(self.local, JOB, step, 0)

    def recycle(self) -> None:
        """Evicts both tiers' committed files from the page cache (see ``_harness.drop_page_cache``)."""
        h.drop_page_cache(self.local)
        h.drop_page_cache(self.shared)

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            self.daemon.stop()


def bench_uncapped(state: Any, nbytes: int, work: Path, droot: Path, args: argparse.Namespace,
                   out: Callable[[str], None]) -> dict[str, Any]:
    shared = work / "shared"
    d = Drained(state, droot / "uncapped", work / "local", shared, nbytes)
    runs: dict[str, list[float]] = {}
    loads: list[tuple[float, float, float]] = []

    def add(key: str, v: float) -> None:
        runs.setdefault(key, []).append(v)

    try:
        d.save()  # untimed: arena, first drain, imports
        d.recycle()
        part_bytes = 0
        for r in range(args.repeats):
            h.settle(args.settle)
            m = d.save()
            part_bytes = int(m["bytes"])
            add("drain.client", m["client_s"])
            add("drain.daemon", m["daemon_s"])
            # The drain read a source the O_DIRECT persister left uncached; cp must too, not
            # the copy the drain just pulled into the page cache.
            h.drop_page_cache(d.part(d.step))
            h.settle(args.settle)
            add("cp", cp_sync(d.part(d.step), work / "cp-target"))
            h.settle(args.settle)
            add("dd", h.dd_fsync(work, part_bytes).seconds)
            d.recycle()
            loads.append(h.load())
            out(f"  round {r + 1}/{args.repeats}: drain {m['client_s']:.2f} s (daemon {m['daemon_s']:.2f} s), "
                f"cp+sync {runs['cp'][-1]:.2f} s, dd {runs['dd'][-1]:.2f} s  (load {loads[-1]})")
    finally:
        d.close()
    rows = [
        h.Row("drain (client)", h.median(runs["drain.client"]), part_bytes, runs["drain.client"], loads,
              "wait('local') -> wait('shared')"),
        h.Row("drain (daemon)", h.median(runs["drain.daemon"]), part_bytes, runs["drain.daemon"], loads,
              "ckptstage_drain_duration_seconds"),
        h.Row("cp -r + sync", h.median(runs["cp"]), part_bytes, runs["cp"], loads, "same files, same fs"),
        h.Row("dd conv=fsync", h.median(runs["dd"]), part_bytes, runs["dd"], loads, "same fs as the shared tier"),
    ]
    h.print_table(f"[{part_bytes / h.GiB:.3f} GiB part] uncapped drain vs a plain copy (median of rounds)",
                  rows, "drain (client)", out)
    verdicts = [
        h.verdict("drain bw (client) / cp+sync bw", rows[2].seconds / rows[0].seconds * 100, ">=",
                  TARGET_OF_CP * 100, "%"),
        h.verdict("drain bw (daemon) / cp+sync bw", rows[2].seconds / rows[1].seconds * 100, ">=",
                  TARGET_OF_CP * 100, "%"),
    ]
    return {"rows": rows, "runs": runs, "verdicts": verdicts}


def bench_capped(cap: str, gib: float, work: Path, droot: Path, settle: float, out: Callable[[str], None]) -> dict[str, Any]:
    from ckptstage.daemon.configvalues import parse_rate

    rate = parse_rate(cap, "--cap")
    state = h.make_state(int(gib * h.GiB))
    nbytes = h.state_bytes(state)
    d = Drained(state, droot / "capped", work / "local-capped", work / "shared-capped", nbytes,
                **{"shared.max_bandwidth": cap})
    try:
        h.settle(settle)
        m = d.save()
    finally:
        d.close()
    achieved = m["bytes"] / m["daemon_s"]
    achieved_client = m["bytes"] / m["client_s"]
    out(f"\n[{m['bytes'] / h.GiB:.3f} GiB part] drain capped at {cap} ({rate / h.MiB:.0f} MiB/s), load {h.load()}")
    out(f"  achieved {achieved / h.MiB:.0f} MiB/s over {m['daemon_s']:.2f} s (daemon metric); "
        f"{achieved_client / h.MiB:.0f} MiB/s as the client sees it ({m['client_s']:.2f} s)")
    dev = abs(achieved / rate - 1)
    verdicts = [h.verdict(f"|achieved / cap - 1| at {cap}", dev * 100, "<=", CAP_TOLERANCE * 100, "%")]
    return {"cap": cap, "cap_bytes_s": rate, "measured": m, "achieved_bytes_s": achieved, "verdicts": verdicts}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = h.run_args(__doc__ or "", "local tier, shared tier and the cp target live")
    p.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="uncapped rounds (default 3)")
    p.add_argument("--cap", default="200MiB/s", help='shared.max_bandwidth for the capped run; "0" skips it')
    p.add_argument("--cap-gib", type=float, default=None, help="checkpoint size of the capped run (default --gib)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    result: dict[str, Any] = {"bench": "drain", "argv": sys.argv}
    with h.bench_dirs(args.dir, "drain") as (work, droot, info):
        result["machine"] = info
        state = h.make_state(int(args.gib * h.GiB))
        nbytes = h.state_bytes(state)
        print(f"\n=== state {nbytes / h.GiB:.3f} GiB, {args.repeats} rounds, load {h.load()}")
        result["uncapped"] = bench_uncapped(state, nbytes, work, droot, args, print)
        del state
        if args.cap not in ("0", "", "none"):
            result["capped"] = bench_capped(args.cap, args.cap_gib or args.gib, work, droot, args.settle, print)
    verdicts = result["uncapped"]["verdicts"] + result.get("capped", {}).get("verdicts", [])
    print("\n  targets:")
    for line, _ in verdicts:
        print(line)
    result["elapsed_s"] = elapsed = time.perf_counter() - started
    print(f"\ndone in {elapsed:.0f} s, load {h.load()}")
    for part in ("uncapped", "capped"):
        if part in result:
            result[part]["verdicts"] = [{"line": line.strip(), "pass": ok} for line, ok in result[part]["verdicts"]]
    h.write_json(args.json, result)
    missed = any(not ok for _, ok in verdicts)
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
