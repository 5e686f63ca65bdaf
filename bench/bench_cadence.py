"""Saves under a training cadence: every save's blocked time against a warm memcpy taken right before it.

    .venv/bin/python bench/bench_cadence.py                 # 1 GiB, 20 saves per session, ~4 min
    .venv/bin/python bench/bench_cadence.py --gib 0.5 --saves 10 --json out.json

A state of large fp32 tensors (``_harness.make_state``: weights and AdamW
moments) is saved ``--saves`` times per *session*, with ``--compute``
seconds of work between saves (matrix products on the trainer's threads, and
every tensor of the state scaled in place, so each save holds new bytes).
Right before each save a warm memcpy of the whole state into pre-faulted
memory is timed: that save's floor. One ``ckptstaged``, local tier only,
``keep_last`` 2. Sessions, each a new ``Client`` (a new trainer process, as
far as the daemon can tell):

* ``resumed``  the job has a checkpoint of this rank on the node (a restarted
  trainer): ``client.prepare()`` with no argument (what ``protect()`` does)
  prepares the arena for that size in the background;
* ``prepare``  a job never seen here; ``client.prepare(state)`` right after
  the client is made;
* ``cold``     a job never seen here, no hint: the first save creates the
  arena on the trainer's path (what every first save did before);
* ``dcp``      ``torch.distributed.checkpoint.async_save`` of the same state
  (``FileSystemWriter`` in the same directory tree). Blocked = the call,
  plus waiting for the previous save's upload when it is not done (a trainer
  must, before it may start the next one).

ckptstage's blocked time is ``save()`` to ``wait_snapshot()``: from then on
the trainer may change its tensors. Ratios are per save (blocked / that
save's memcpy), then summarized: median, worst, first.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402

SESSIONS = ("resumed", "prepare", "cold", "dcp")


def compute(seconds: float, state: Any, work: Any) -> None:
    """``seconds`` of trainer work: matrix products, then a pass over the state that changes every byte."""
    import torch

    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        torch.mm(work, work, out=work).clamp_(-1, 1)
    with torch.no_grad():
        for t in h.tensors_of(state):
            if t.is_floating_point():
                t.mul_(1.0000001)


def ckptstage_session(name: str, d: h.Daemon, state: Any, args: argparse.Namespace, floor: h.WarmCopy,
                      work: Any) -> list[tuple[float, float]]:
    """(blocked, memcpy) per save of one session."""
    from ckptstage.client import Client

    job = f"cadence-{name}"
    if name == "resumed":  # an earlier run of the job saved here: the daemon knows what rank 0 saves
        with Client(job, socket=d.socket) as c:
            c.save(0, state).wait("local", timeout=600)
    out = []
    with Client(job, socket=d.socket) as c:
        if name == "prepare":
            c.prepare(state)
        elif name == "resumed":
            c.prepare()
        for step in range(1, args.saves + 1):
            compute(args.compute, state, work)
            memcpy = floor.best_s(1)
            t0 = time.perf_counter()
            c.save(step, state).wait_snapshot()
            out.append((time.perf_counter() - t0, memcpy))
            print(f"    {name:8} save {step:2}: {h.fmt_s(out[-1][0]):>7}  memcpy {h.fmt_s(memcpy):>7}  "
                  f"{out[-1][0] / memcpy:5.2f}x  load {h.load()}", flush=True)
        c.wait_step(args.saves, "local", timeout=600)
    return out


def dcp_session(root: Path, state: Any, args: argparse.Namespace, floor: h.WarmCopy,
                work: Any) -> list[tuple[float, float]]:
    import torch.distributed.checkpoint as dcp

    out: list[tuple[float, float]] = []
    previous: Any = None
    kept: list[Path] = []
    for step in range(1, args.saves + 1):
        compute(args.compute, state, work)
        memcpy = floor.best_s(1)
        t0 = time.perf_counter()
        if previous is not None:
            previous.result()  # the trainer may not start a save before the last one is uploaded
        resp = dcp.async_save(state, checkpoint_id=str(root / f"step-{step}"), no_dist=True)
        out.append((time.perf_counter() - t0, memcpy))
        previous = getattr(resp, "upload_completion", resp)
        kept.append(root / f"step-{step}")
        while len(kept) > 3:  # bounded disk, like keep_last 2 (the newest is still being written)
            shutil.rmtree(kept.pop(0), ignore_errors=True)
        print(f"    {'dcp':8} save {step:2}: {h.fmt_s(out[-1][0]):>7}  memcpy {h.fmt_s(memcpy):>7}  "
              f"{out[-1][0] / memcpy:5.2f}x  load {h.load()}", flush=True)
    if previous is not None:
        previous.result()
    return out


def summarize(name: str, runs: list[tuple[float, float]]) -> dict[str, Any]:
    ratios = [b / m for b, m in runs]
    blocked = [b for b, _ in runs]
    return {"session": name, "blocked_s": blocked, "memcpy_s": [m for _, m in runs], "ratios": ratios,
            "median_s": statistics.median(blocked), "median_x": statistics.median(ratios),
            "worst_x": max(ratios), "first_x": ratios[0],
            "first_vs_rest": blocked[0] / statistics.median(blocked[1:]) if len(blocked) > 1 else float("nan")}


def report(rows: list[dict[str, Any]], nbytes: int) -> list[tuple[str, bool]]:
    by = {r["session"]: r for r in rows}
    print(f"\nblocked per save, {nbytes / h.GiB:.2f} GiB, against a warm memcpy right before each save")
    print(f"  {'session':9} {'median':>8} {'x memcpy':>9} {'worst x':>8} {'first x':>8} {'first/rest':>11}"
          f" {'x ckptstage':>12}")
    ref = by.get("resumed", {}).get("median_s", float("nan"))
    for r in rows:
        print(f"  {r['session']:9} {h.fmt_s(r['median_s']):>8} {r['median_x']:8.2f}x {r['worst_x']:7.2f}x "
              f"{r['first_x']:7.2f}x {r['first_vs_rest']:10.2f}x {r['median_s'] / ref:11.2f}x")
    verdicts = []
    for name in ("resumed", "prepare"):
        if name in by:
            r = by[name]
            verdicts += [h.verdict(f"{name}: median blocked / memcpy", r["median_x"], "<=", 1.3, "x"),
                         h.verdict(f"{name}: worst blocked / memcpy", r["worst_x"], "<=", 2.0, "x"),
                         h.verdict(f"{name}: first save / median of the others", r["first_vs_rest"], "<=", 1.3, "x")]
    if "dcp" in by and "resumed" in by:
        verdicts.append(h.verdict("dcp.async_save median blocked / ckptstage's", by["dcp"]["median_s"] / ref,
                                  ">=", 3.0, "x"))
    print("\nverdicts")
    for line, _ in verdicts:
        print(line)
    return verdicts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
    p.add_argument("--saves", type=int, default=20, help="saves per session (default 20)")
    p.add_argument("--compute", type=float, default=1.0, help="seconds of work between saves (default 1)")
    p.add_argument("--sessions", default=",".join(SESSIONS), help=f"subset of {','.join(SESSIONS)}")
    p.add_argument("--dir", type=Path, default=None, help="where the local tier and DCP write (default /tmp)")
    p.add_argument("--json", type=Path, default=None, help="also write every save here")
    args = p.parse_args(argv)
    args.sessions = [s for s in SESSIONS if s in {x.strip() for x in args.sessions.split(",")}]
    return args


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    started = time.perf_counter()
    with h.bench_dirs(args.dir, "cadence") as (work_dir, daemon_root, info):
        state = h.make_state(int(args.gib * h.GiB))
        nbytes = h.state_bytes(state)
        floor = h.WarmCopy(state)
        work = torch.randn(512, 512)
        rows = []
        settings: dict[str, Any] = {"local.keep_last": 2}
        with h.Daemon(daemon_root, work_dir / "local", **settings) as d:
            for name in args.sessions:
                print(f"\n  session {name} (load {h.load()})", flush=True)
                h.settle(2.0)
                runs = dcp_session(work_dir / "dcp", state, args, floor, work) if name == "dcp" else \
                    ckptstage_session(name, d, state, args, floor, work)
                rows.append(summarize(name, runs))
        verdicts = report(rows, nbytes)
    elapsed = time.perf_counter() - started
    print(f"\ndone in {elapsed:.0f} s, load {h.load()}")
    h.write_json(args.json, {"bench": "cadence", "machine": info, "argv": sys.argv, "elapsed_s": elapsed,
                             "state_bytes": nbytes, "sessions": rows,
                             "verdicts": [{"line": v, "pass": ok} for v, ok in verdicts]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
