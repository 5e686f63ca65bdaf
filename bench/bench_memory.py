"""Restore from memory: a restarted trainer's ``Client.load()`` from the daemon's memory tier, next to memcpy and disk.

    .venv/bin/python bench/bench_memory.py                     # big and gpt2, 5 rounds, ~5 min
    .venv/bin/python bench/bench_memory.py --rounds 3 --states big --json out.json

States (as in ``bench_restore.py``): ``big``, 1 GiB of large fp32 tensors
(``_harness.make_state``: 8 layers + AdamW moments); ``gpt2``, GPT-2 124M
built from its config (no download) with AdamW state after one step.

Per state, two real ``ckptstaged``: one with the memory tier on (``[memory]
enabled``, ``[arena] max_bytes`` 3x the state), one with it off, on
directories of the same disk. Every round, a *trainer* (a subprocess: it
``torch.load``\\ s the state, saves it as a new step, waits for "local", and
is SIGKILLed) leaves its arena to the first daemon; once the daemon's
``ListCheckpoints`` shows that step held in memory, this process plays the
restarted trainer:

* ``memory first``   the first ``load()`` after the copy was kept (its pages mapped
                     for the first time); ``restart`` = ``Client(...)`` + that load;
* ``memory repeat``  another ``load()`` of the same copy;
* ``memory into=``   ``load(into=...)`` into existing, touched tensors of the same shapes;

and its peers, on the same bytes (a tied tensor counted once, as stored):

* ``memcpy warm``    ``copy_`` of every tensor into pre-faulted tensors, best of 3 per
                     round (``_harness.WarmCopy``): the yardstick;
* ``memcpy fresh``   ``torch.empty_like`` + ``copy_``: what any copy-out costs;
* ``disk warm/cold`` ``load()`` from the second daemon (memory tier off): its local copy
                     in the page cache (read into it first), or evicted from it;
* ``torch.load warm/cold`` of the same state saved by ``torch.save`` on the same disk.

Every load is checked: from memory ``last_load_tier`` must be "memory" (and
the first round's tensors equal to the state), from the second daemon
"local"; the script stops otherwise. After each load into fresh tensors one
*write pass* (every floating tensor ``mul_(1)``: what an optimizer step does
to its state) is timed too: tensors built on the memory tier's private
mapping pay for their copy-on-write there, the others own their pages
already. Before every measurement the script idles ``--settle`` seconds
(``_harness.settle``: on this VM memory freed just before is faster to take
again, and the release of a freed GiB slows whatever runs beside it). The
first load follows the copy's keeping; the other peers' order rotates each
round. Medians of the rounds; every measurement is
printed with the load average.

Target: a load from memory takes at most 2x a warm memcpy of the same bytes
(median of the per-round ratios). Speed-ups against the disk and
``torch.load`` are reported beside it. Not a test: exit 0 unless
``--strict`` and a target is missed.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402
from bench_restore import empty_like_state, gpt2_state  # noqa: E402

from ckptstage.daemon.fsutil import fsync_file  # noqa: E402

TARGET_X_MEMCPY = 2.0
STATES = ("big", "gpt2")

# The trainer that dies: loads the state, saves it as step N, waits until it is durable, says so, then waits
# to be killed (the memory tier is about a process that goes away without a goodbye).
TRAINER = r"""
import sys, time
import torch
from ckptstage.client import Client

socket, job, step, pt = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
state = torch.load(pt)
client = Client(job, socket=socket)
client.save(step, state).wait("local", timeout=600)
print("SAVED", flush=True)
time.sleep(3600)
"""


def write_pass(state: Any) -> float:
    """Seconds to write every floating tensor of ``state`` once, in place (an optimizer step's writes)."""
    import torch

    with torch.no_grad(), h.Timer() as t:
        for x in h.distinct_tensors(state):
            if x.is_floating_point():
                x.mul_(1.0)
    return t.s


def fresh_copy(tensors: list[Any]) -> list[Any]:
    import torch

    return [torch.empty_like(t).copy_(t) for t in tensors]


class Run:
    """Every measurement of one state, with the load average taken right after it."""

    def __init__(self) -> None:
        self.runs: dict[str, list[float]] = {}
        self.loads: dict[str, list[tuple[float, float, float]]] = {}

    def add(self, key: str, seconds: float, rnd: int) -> None:
        self.runs.setdefault(key, []).append(seconds)
        self.loads.setdefault(key, []).append(h.load())
        print(f"    round {rnd + 1} {key:28} {h.fmt_s(seconds):>8}  load {self.loads[key][-1]}", flush=True)

    def median(self, key: str) -> float:
        return h.median(self.runs.get(key, []))


class StateBench:
    """One state: the two daemons, the saved copies, the peers."""

    def __init__(self, name: str, state: Any, work: Path, daemon_root: Path, settle_s: float) -> None:
        import torch
        from ckptstage.client import Client
        from ckptstage.protos import layout

        self.name = name
        self.state = state
        self.settle_s = settle_s
        self.tensors = h.distinct_tensors(state)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors)
        budget = f"{math.ceil(3 * self.nbytes / h.GiB)}GiB"
        # 3x the state: the kept copy, the next trainer's arena, and room. keep_last 2 bounds the disk the
        # rounds' steps take.
        with_memory: dict[str, Any] = {"arena.max_bytes": budget, "memory.enabled": True, "local.keep_last": 2}
        without: dict[str, Any] = {"arena.max_bytes": budget, "memory.enabled": False}
        self.memory_d = h.Daemon(daemon_root / f"{name}-memory", work / f"{name}-local-memory", **with_memory)
        self.disk_d = h.Daemon(daemon_root / f"{name}-disk", work / f"{name}-local-disk", **without)
        self.pt = work / f"{name}.pt"
        try:
            self.memory_d.start()
            self.disk_d.start()
            torch.save(state, self.pt)
            fsync_file(self.pt)
            with Client(name, socket=self.disk_d.socket) as c:
                c.save(1, state).wait("local", timeout=600)
            self.disk_client = Client(name, socket=self.disk_d.socket)
        except BaseException:
            self.memory_d.stop()
            self.disk_d.stop()
            raise
        self.disk_data = layout.part_dir(work / f"{name}-local-disk", name, 1, 0) / layout.DATA_FILE
        self.file_bytes = self.disk_data.stat().st_size
        self.warm = h.WarmCopy(self.tensors)
        self.into = empty_like_state(state)
        self.run = Run()

    def close(self) -> None:
        self.disk_client.close()
        self.memory_d.stop()
        self.disk_d.stop()
        self.warm.dst = []
        self.into = None
        self.pt.unlink(missing_ok=True)
        gc.collect()

    # --- the trainer that dies, and its copy kept ------------------------------------------------

    def kill_a_trainer(self, step: int) -> None:
        """A trainer process saves ``step`` and is SIGKILLed; returns once the daemon holds it in memory."""
        proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(self.memory_d.socket), self.name, str(step),
                                 str(self.pt)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = ""
        try:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], 600)
            line = proc.stdout.readline().decode().strip() if ready else ""
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            _, err = proc.communicate(timeout=60)
        if line != "SAVED":
            raise RuntimeError(f"the trainer did not save step {step}: {err.decode()[-3000:]}")
        self.wait_kept(step)

    def wait_kept(self, step: int, timeout: float = 120.0) -> None:
        from ckptstage.client.rpc import Connection
        from ckptstage.protos.v1 import ckptstage_pb2 as pb

        deadline = time.monotonic() + timeout
        with Connection(self.memory_d.socket) as conn:
            while time.monotonic() < deadline:
                infos = conn.call("ListCheckpoints", pb.ListRequest(job=self.name)).checkpoints
                if any(i.step == step and 0 in i.ranks_memory for i in infos) and conn.status().memory_parts >= 1:
                    return
                time.sleep(0.02)
        raise RuntimeError(f"{self.name} step {step} not kept in memory after {timeout:.0f} s:\n"
                           f"{self.memory_d.log_tail()}")

    # --- one round ------------------------------------------------------------------------------

    def round(self, rnd: int) -> None:
        from ckptstage.client import Client

        step = rnd + 1
        with h.Timer() as trainer:
            self.kill_a_trainer(step)
        print(f"    round {rnd + 1} a trainer saved step {step}, was killed, the copy is kept: {trainer.s:.1f} s",
              flush=True)
        self.idle()
        with h.Timer() as made:
            client = Client(self.name, socket=self.memory_d.socket)
        try:
            with h.Timer() as t:
                out = client.load()
            _expect(client, "memory")
            self.run.add("memory first", t.s, rnd)
            self.run.add("restart: Client() + load()", made.s + t.s, rnd)
            if rnd == 0:
                _check_equal(out, self.state)
            self.run.add("memory first/write", write_pass(out), rnd)
            del out
            peers = self.peers(client)
            for key, fn in peers[rnd % len(peers):] + peers[:rnd % len(peers)]:
                fn(key, rnd)
        finally:
            client.close()

    def peers(self, client: Any) -> list[tuple[str, Callable[[str, int], None]]]:
        import torch

        def memory_repeat(key: str, rnd: int) -> None:
            self.idle()
            with h.Timer() as t:
                out = client.load()
            _expect(client, "memory")
            self.run.add(key, t.s, rnd)
            del out

        def memory_into(key: str, rnd: int) -> None:
            self.idle()
            with h.Timer() as t:
                out = client.load(into=self.into)
            _expect(client, "memory")
            self.run.add(key, t.s, rnd)
            del out

        def memcpy_warm(key: str, rnd: int) -> None:
            self.idle()
            self.run.add(key, self.warm.best_s(3), rnd)

        def memcpy_fresh(key: str, rnd: int) -> None:
            self.idle()
            with h.Timer() as t:
                out = fresh_copy(self.tensors)
            self.run.add(key, t.s, rnd)
            self.run.add(f"{key}/write", write_pass(out), rnd)
            del out

        def disk(warm: bool) -> Callable[[str, int], None]:
            def peer(key: str, rnd: int) -> None:
                self.cache(self.disk_data, warm)
                with h.Timer() as t:
                    out = self.disk_client.load()
                _expect(self.disk_client, "local")
                self.run.add(key, t.s, rnd)
                self.run.add(f"{key}/write", write_pass(out), rnd)
                del out
            return peer

        def torch_load(warm: bool) -> Callable[[str, int], None]:
            def peer(key: str, rnd: int) -> None:
                self.cache(self.pt, warm)
                with h.Timer() as t:
                    out = torch.load(self.pt)
                self.run.add(key, t.s, rnd)
                self.run.add(f"{key}/write", write_pass(out), rnd)
                del out
            return peer

        return [("memory repeat", memory_repeat), ("memory into=", memory_into), ("memcpy warm", memcpy_warm),
                ("memcpy fresh", memcpy_fresh), ("disk warm", disk(True)), ("disk cold", disk(False)),
                ("torch.load warm", torch_load(True)), ("torch.load cold", torch_load(False))]

    def cache(self, path: Path, warm: bool) -> None:
        """Puts ``path`` in the page cache (warm) or evicts it (cold), then lets freed memory settle."""
        if warm:
            h.cache_files(path)
        else:
            h.drop_page_cache(path)
        self.idle()

    def idle(self) -> None:
        """Before every measurement: what the previous one freed goes back to the host, alike for every peer."""
        gc.collect()
        h.settle(self.settle_s)


def _expect(client: Any, tier: str) -> None:
    if client.last_load_tier != tier:
        raise RuntimeError(f"load() read the {client.last_load_tier!r} tier, expected {tier!r}")


def _check_equal(got: Any, want: Any) -> None:
    import torch

    a, b = h.tensors_of(got), h.tensors_of(want)
    if len(a) != len(b) or not all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True)):
        raise RuntimeError("the state loaded from memory differs from the state saved")


ROWS = [("memory first", "load() from memory, first after the copy was kept"),
        ("memory repeat", "load() from memory, again"),
        ("memory into=", "load(into=) from memory, touched tensors"),
        ("restart: Client() + load()", "restart: Client() + first load()"),
        ("memcpy warm", "memcpy warm (best of 3)"),
        ("memcpy fresh", "memcpy into fresh tensors"),
        ("disk warm", "load() from local disk, page cache warm"),
        ("disk cold", "load() from local disk, cold"),
        ("torch.load warm", "torch.load, warm"),
        ("torch.load cold", "torch.load, cold")]


def report(name: str, run: Run, nbytes: int, file_bytes: int) -> list[dict[str, Any]]:
    rows = []
    for key, label in ROWS:
        if key not in run.runs:
            continue
        loads = run.loads[key]
        write = run.median(f"{key}/write")
        note = f"then a write pass {h.fmt_s(write)};" if not math.isnan(write) else ""
        rows.append(h.Row(label, run.median(key), nbytes, run.runs[key], loads,
                          f"{note} load {min(x[0] for x in loads)}..{max(x[0] for x in loads)}"))
    h.print_table(f"{name}: {nbytes / h.GiB:.2f} GiB of tensors ({file_bytes / h.GiB:.2f} GiB data file), medians of "
                  f"{len(run.runs['memory first'])} rounds (x = time / memcpy warm's)", rows, "memcpy warm (best of 3)")

    def per_round(key: str, ref: str) -> float:
        return h.median([a / b for a, b in zip(run.runs[key], run.runs[ref], strict=True)])

    verdicts = []
    for key in ("memory first", "memory repeat", "memory into="):
        value = per_round(key, "memcpy warm")
        line, ok = h.verdict(f"{name}: {key} / memcpy warm (median of per-round ratios)", value, "<=",
                             TARGET_X_MEMCPY, "x")
        rounds = " ".join(f"{a / b:.2f}" for a, b in zip(run.runs[key], run.runs["memcpy warm"], strict=True))
        print(f"{line}; rounds {rounds}")
        verdicts.append({"state": name, "label": f"{key} / memcpy warm", "value": value,
                         "target": TARGET_X_MEMCPY, "pass": ok})
    first = run.median("memory first")
    print(f"  info  {name}: memory first vs repeat: {first / run.median('memory repeat'):.2f}x")
    for peer in ("disk cold", "disk warm", "torch.load cold", "torch.load warm", "memcpy fresh"):
        print(f"  info  {name}: {peer} / memory first: {per_round(peer, 'memory first'):.1f}x "
              f"(medians {h.fmt_s(run.median(peer))} / {h.fmt_s(first)})")
    with_write = {k: run.median(k) + run.median(f"{k}/write")
                  for k in ("memory first", "memcpy fresh", "disk cold", "disk warm", "torch.load cold")}
    print(f"  info  {name}: load + one write pass: " + ", ".join(f"{k} {h.fmt_s(v)}" for k, v in with_write.items()))
    return verdicts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = h.state_args(__doc__ or "", STATES)
    p.add_argument("--settle", type=float, default=1.5, help="idle seconds before every measurement "
                   "(default 1.5)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    verdicts: list[dict[str, Any]] = []
    results: dict[str, Any] = {}
    with h.bench_dirs(args.dir, "memory") as (work, daemon_root, info):
        print(f"memory:  {h.mem_available() / h.GiB:.1f} GiB available (a state needs about 8x its size "
              "at the peak: the state, its copies, the arena, the kept copy, the page cache)")
        for name in args.states:
            state = h.make_state(h.GiB) if name == "big" else gpt2_state()
            print(f"\n  state {name}: {h.state_bytes(state) / h.GiB:.2f} GiB, load {h.load()}", flush=True)
            b = StateBench(name, state, work, daemon_root, args.settle)
            try:
                for rnd in range(args.rounds):
                    b.round(rnd)
                    print(f"  {name} round {rnd + 1}/{args.rounds} done, load {h.load()}", flush=True)
            finally:
                b.close()
            verdicts += report(name, b.run, b.nbytes, b.file_bytes)
            results[name] = {"state_bytes": b.nbytes, "file_bytes": b.file_bytes, "runs": b.run.runs,
                             "loads": b.run.loads}
            del b, state
            gc.collect()
    elapsed = time.perf_counter() - started
    print(f"\ndone in {elapsed:.0f} s, load {h.load()}")
    h.write_json(args.json, {"bench": "memory", "machine": info, "argv": sys.argv, "elapsed_s": elapsed,
                             "states": results, "verdicts": verdicts})
    return 1 if args.strict and any(not v["pass"] for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
