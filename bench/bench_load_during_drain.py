"""A restore beside a drain: ``Client.load()`` of a step just made durable, while the drain copies it to the
shared tier on the same disk, against the same load on an idle disk.

    .venv/bin/python bench/bench_load_during_drain.py                  # 1 GiB, 3 rounds, files under /tmp
    .venv/bin/python bench/bench_load_during_drain.py --gib 2 --rounds 5 --dir /local_ssd/x

This is what a trainer restarted right after a crash meets: its last step
is on the local SSD and the drain has just begun copying it off. Two real
daemons, each with its local and shared tier in ``--dir`` (one disk):

* ``yield``     the default (``[persist] yield_to_loads_s = 60``): drains wait while a load is in flight;
* ``no-yield``  ``yield_to_loads_s = 0``: the drain reads and writes beside the load.

Each round, per daemon: a fresh step is saved and waited for on the local
tier only, its files are evicted from the page cache, and the load starts at
once (the drain has begun: the step is not on the shared tier, which is
checked); the drain is waited for afterwards. Then, the disk idle: the same
step's cold load (``idle``), ``torch.load`` of the same state saved beside
it (cold), and ``dd iflag=direct`` of the data file. The order of the
daemons alternates each round.

Target: the load beside a drain takes at most 1.2x the idle disk's load
(median of the rounds' ratios). Not a test: exit 0 unless ``--strict`` and
the target is missed.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any

import _harness as h

TARGET_X_IDLE = 1.2
JOB = "restart"


class Side:
    """One daemon and the steps it saved."""

    def __init__(self, name: str, root: Path, work: Path, yield_s: float) -> None:
        self.name = name
        self.local, self.shared = work / f"local-{name}", work / f"shared-{name}"
        self.daemon = h.Daemon(root / name, self.local, self.shared, **{
            "arena.max_bytes": "3GiB", "memory.enabled": False, "persist.yield_to_loads_s": yield_s,
            "local.keep_last": 2, "shared.keep_last": 2}).start()
        self.step = 0

    def data_file(self, step: int) -> Path:
        from ckptstage.protos import layout
        return layout.part_dir(self.local, JOB, step, 0) / layout.DATA_FILE

    def on_shared(self, step: int) -> bool:
        from ckptstage.protos import layout
        return layout.commit_path(self.shared, JOB, step).exists()

    def load_beside_drain(self, state: Any, settle_s: float) -> tuple[float, bool]:
        """Seconds of a cold load started as the drain starts; whether the drain was still running at its end."""
        from ckptstage.client import Client

        self.step += 1
        h.settle(settle_s)
        with Client(JOB, socket=self.daemon.socket) as c:
            c.save(self.step, state).wait("local", timeout=600)
            h.drop_page_cache(self.local / JOB)
            if self.on_shared(self.step):
                raise RuntimeError(f"{self.name}: step {self.step} drained before the load began")
            gc.collect()
            with h.Timer() as t:
                out = c.load(self.step)
            del out
            overlapped = not self.on_shared(self.step)
            if c.last_load_tier != "local":
                raise RuntimeError(f"{self.name}: load() read the {c.last_load_tier!r} tier")
            c.wait_step(self.step, "shared", timeout=600)
        return t.s, overlapped

    def load_idle(self, settle_s: float) -> float:
        from ckptstage.client import Client

        h.drop_page_cache(self.local / JOB)
        h.settle(settle_s)
        gc.collect()
        with Client(JOB, socket=self.daemon.socket) as c, h.Timer() as t:
            out = c.load(self.step)
        del out
        return t.s

    def stop(self) -> None:
        self.daemon.stop()


def torch_load_cold(pt: Path, settle_s: float) -> float:
    import torch

    h.drop_page_cache(pt)
    h.settle(settle_s)
    gc.collect()
    with h.Timer() as t:
        out = torch.load(pt, weights_only=True)
    del out
    return t.s


def dd_cold(path: Path) -> float:
    import subprocess

    with h.Timer() as t:
        subprocess.run(["dd", f"if={path}", "iflag=direct", "bs=1M", "of=/dev/null"], check=True,
                       capture_output=True)
    return t.s


def main(argv: list[str] | None = None) -> int:
    p = h.run_args(__doc__ or "", "both daemons' tiers and the torch file go")
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    import torch

    runs: dict[str, list[float]] = {}
    overlaps: dict[str, list[bool]] = {}
    loads: list[tuple[float, float, float]] = []

    def add(key: str, s: float) -> None:
        runs.setdefault(key, []).append(s)

    with h.bench_dirs(args.dir, "loaddrain") as (work, daemon_root, info):
        state = h.make_state(int(args.gib * (1 << 30)))
        nbytes = h.state_bytes(state)
        pt = work / "state.pt"
        torch.save(state, pt)
        os.sync()
        sides = [Side("yield", daemon_root, work, 60.0), Side("no-yield", daemon_root, work, 0.0)]
        try:
            print(f"\n=== state {nbytes / (1 << 30):.3f} GiB, {args.rounds} rounds, load {h.load()}")
            for r in range(args.rounds):
                order = sides if r % 2 == 0 else sides[::-1]
                print(f"  round {r + 1}/{args.rounds}: {' -> '.join(s.name for s in order)}  (load {h.load()})",
                      flush=True)
                for side in order:
                    s, overlapped = side.load_beside_drain(state, args.settle)
                    add(f"{side.name}/beside-drain", s)
                    overlaps.setdefault(side.name, []).append(overlapped)
                    print(f"    {side.name}: beside the drain {s:.3f} s (drain still running at the end: "
                          f"{overlapped})", flush=True)
                idle = sides[0].load_idle(args.settle)
                add("idle", idle)
                add("torch.load", torch_load_cold(pt, args.settle))
                add("dd", dd_cold(sides[0].data_file(sides[0].step)))
                print(f"    idle {idle:.3f} s, torch.load {runs['torch.load'][-1]:.3f} s, dd {runs['dd'][-1]:.3f} s",
                      flush=True)
                loads.append(h.load())
        finally:
            for side in sides:
                side.stop()
        ratios = [b / i for b, i in zip(runs["yield/beside-drain"], runs["idle"])]
        ratios_off = [b / i for b, i in zip(runs["no-yield/beside-drain"], runs["idle"])]
        idle_m = h.median(runs["idle"])
        rows = [h.Row(k, h.median(v), nbytes, runs=v) for k, v in runs.items()]
        h.print_table(f"cold load of {nbytes / (1 << 30):.2f} GiB (medians of {args.rounds})", rows, ref="idle")
        print(f"  beside a drain, yielding: {h.median(ratios):.2f}x idle (rounds: "
              f"{', '.join(f'{x:.2f}' for x in ratios)}); not yielding: {h.median(ratios_off):.2f}x "
              f"({', '.join(f'{x:.2f}' for x in ratios_off)}); torch.load {h.median(runs['torch.load']) / idle_m:.2f}x")
        line, ok = h.verdict("load beside a drain / idle disk", h.median(ratios), "<=", TARGET_X_IDLE, "x")
        print(line)
        h.write_json(args.json, {"machine": info, "bytes": nbytes, "runs": runs, "overlaps": overlaps,
                                 "ratios": ratios, "ratios_no_yield": ratios_off, "loads": loads})
    return 1 if args.strict and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
