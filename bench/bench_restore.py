"""Restore benchmark: ``Client.load()`` cold and warm, next to ``torch.load`` and the disk itself, in one run.

    .venv/bin/python bench/bench_restore.py                  # all states, 5 rounds, files under /tmp
    .venv/bin/python bench/bench_restore.py --rounds 3 --states big
    .venv/bin/python bench/bench_restore.py --dir /local_ssd/x --json out.json
    .venv/bin/python bench/bench_restore.py --chunked --states big gpt2   # + incremental copies
    .venv/bin/python bench/bench_restore.py --chunked --read-mode buffered  # cold reads one way only
    .venv/bin/python bench/bench_restore.py --chunked --peers ckptstage chunked --cold-only --rounds 15

States, each saved once through a real ``ckptstaged`` (local and shared tier
in ``--dir``) and with ``torch.save`` beside it:

* ``big``    1 GiB of large fp32 tensors (``_harness.make_state``: 8 layers + AdamW moments);
* ``gpt2``   GPT-2 124M built from its config (no download) with AdamW state after one step;
* ``into``   the gpt2 checkpoint loaded with ``load(into=...)`` into existing tensors of the same
             shapes (its torch peer: ``torch.load`` then ``copy_`` into the same tensors);
* ``shared`` the big checkpoint read from the shared tier only: a second daemon with its own empty
             local directory and the same shared directory.

Peers per state, measured round-robin (their order rotates each round), every
one cold (its files evicted from the page cache, then 1.5 s idle so freed
memory has gone back to the host for every peer alike: ``_harness.settle``)
and the load peers also warm (files read into the cache first):

* ``ckptstage``   ``client.load()`` (Locate RPC, manifest, reads, verification, unflatten);
* ``torch.load``  of the same state saved by ``torch.save`` to the same directory;
* ``dd``          ``dd if=<data file> iflag=direct bs=1M of=/dev/null`` (the disk, no allocation);
* ``cat``         ``cat <data file> > /dev/null`` (the page-cache path; the reference for the shared tier).
* ``chunked``     with ``--chunked``: ``client.load()`` of the same state saved under another job and
                  rewritten as an incremental part (``_chunked.to_chunks``: the data file in content-addressed
                  chunks cut as the daemon cuts them, on each tier), so whole and chunked reads share rounds.

The daemons keep no memory tier (``memory.enabled = false``): every load
reads the disk, and each is checked to have read the tier it should. Cold
data is read the way the adaptive policy finds faster per device (and kind of
part), unless ``--read-mode direct|buffered`` fixes it for every load.

Targets (cold): ckptstage's bandwidth >= 0.8x dd's on the same file; >= 1.5x
faster than ``torch.load``; from the shared tier >= 0.8x ``cat``; a chunked
part <= 1.1x the whole one's time (the median of the rounds' ratios). Medians
of the rounds; every run printed with the load average. Not a test: exit 0
unless ``--strict`` and a target is missed.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness as h
from _chunked import to_chunks

TARGET_X_DD = 0.8
TARGET_X_TORCH = 1.5
TARGET_X_CAT = 0.8
TARGET_CHUNKED_X = 1.1  # chunked cold time / whole cold time
SETTLE_S = 1.5


def gpt2_state() -> dict[str, Any]:
    """GPT-2 124M from its config (random weights, nothing downloaded) and AdamW after one step."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (1, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}


def empty_like_state(state: Any, memo: dict[Any, Any] | None = None) -> Any:
    """The same structure with fresh, pre-faulted tensors of the same shapes (the ``into=`` target).

    Tied tensors (GPT-2's ``lm_head.weight`` is ``wte.weight``) stay tied, as the checkpoint stores them once.
    """
    import torch

    memo = {} if memo is None else memo
    if isinstance(state, torch.Tensor):
        key = (state.untyped_storage().data_ptr(), state.storage_offset(), tuple(state.shape), state.dtype)
        if key not in memo:
            memo[key] = torch.zeros_like(state)
        return memo[key]
    if isinstance(state, dict):
        return {k: empty_like_state(v, memo) for k, v in state.items()}
    if isinstance(state, list):
        return [empty_like_state(v, memo) for v in state]
    if isinstance(state, tuple):
        return tuple(empty_like_state(v, memo) for v in state)
    return state


def load_into(pt: Path, into: Any) -> None:
    """``torch.load``, then a copy into existing tensors: what ``model.load_state_dict(torch.load(f))`` does."""
    import torch

    for d, s in zip(h.tensors_of(into), h.tensors_of(torch.load(pt))):
        d.copy_(s)


class Bench:
    """One daemon (and a second one for the shared tier), the saved states, and every run."""

    def __init__(self, work: Path, daemon_root: Path) -> None:
        self.work = work
        self.shared = work / "shared"
        # No memory tier: a load after the saving session closed would map the arena it kept, not read the disk.
        big: dict[str, Any] = {"arena.max_bytes": "3GiB", "memory.enabled": False}
        small: dict[str, Any] = {"arena.max_bytes": "256MiB", "memory.enabled": False}
        self.daemon = h.Daemon(daemon_root / "a", work / "local", self.shared, **big).start()
        # Its own empty local tier, the same shared tier: everything it restores comes from there.
        self.reader = h.Daemon(daemon_root / "b", work / "local-b", self.shared, **small)
        self.runs: dict[str, list[float]] = {}
        self.loads: dict[str, list[tuple[float, float, float]]] = {}

    def save(self, job: str, state: Any) -> tuple[Path, Path]:
        """(the checkpoint's data file on the local tier, the torch.save file)."""
        import torch
        from ckptstage.client import Client
        from ckptstage.protos import layout

        with Client(job, socket=self.daemon.socket) as c:
            c.save(1, state).wait("shared", timeout=600)
        pt = self.work / f"{job}.pt"
        torch.save(state, pt)
        fd = os.open(pt, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return layout.part_dir(self.work / "local", job, 1, 0) / layout.DATA_FILE, pt

    def save_chunked(self, job: str, state: Any) -> tuple[Path, Path]:
        """Saves ``state`` as step 1 of ``job``, then rewrites both tiers' copies as incremental parts;
        (the local chunk store, the shared one)."""
        from ckptstage.client import Client
        from ckptstage.protos import layout

        with Client(job, socket=self.daemon.socket) as c:
            c.save(1, state).wait("shared", timeout=600)
        with h.Timer() as t:
            stores = [to_chunks(layout.part_dir(tier, job, 1, 0)) for tier in (self.work / "local", self.shared)]
            self.daemon.restart()  # it indexed the step by its old manifests
        chunks = sum(1 for p in stores[0].rglob("*") if p.is_file())
        print(f"  {job}: rewritten as an incremental part ({chunks} files in its store per tier: packs and their "
              f"indexes) in {t.s:.1f} s", flush=True)
        return stores[0], stores[1]

    def add(self, key: str, seconds: float) -> None:
        self.runs.setdefault(key, []).append(seconds)
        self.loads.setdefault(key, []).append(h.load())

    def median(self, key: str) -> float:
        return h.median(self.runs.get(key, []))

    def time(self, key: str, files: list[Path], fn: Callable[[], Any], warm: bool) -> None:
        for f in files:
            if warm:
                h.cache_files(f)
            else:
                h.drop_page_cache(f)
        if not warm:
            h.settle(SETTLE_S)
        gc.collect()
        with h.Timer() as t:
            out = fn()
        del out
        self.add(key, t.s)


def dd_direct(path: Path) -> None:
    subprocess.run(["dd", f"if={path}", "iflag=direct", "bs=1M", "of=/dev/null"], check=True, capture_output=True)


def call(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    """``fn(*args)`` later (a loop's lambdas would all see its last values)."""
    return lambda: fn(*args)


def cat(path: Path) -> None:
    with open(os.devnull, "wb") as null:
        subprocess.run(["cat", str(path)], check=True, stdout=null)


def loader(client: Any, tier: str, into: Any = None) -> Callable[[], Any]:
    """``client.load(into=into)``, failing unless it read ``tier`` (a memory-tier or fallback read is no disk read)."""
    def load() -> Any:
        out = client.load(into=into)
        if client.last_load_tier != tier:
            raise RuntimeError(f"{client.job}: load() read the {client.last_load_tier!r} tier, not {tier!r}")
        return out

    return load


def run_rounds(b: Bench, rounds: int, states: list[str], chunked: bool = False, only: list[str] | None = None,
               cold_only: bool = False) -> dict[str, int]:
    import torch
    from ckptstage.client import Client, restore

    sizes: dict[str, int] = {}
    peers: list[tuple[str, list[Path], Callable[[], Any], bool]] = []
    client = Client("big", socket=b.daemon.socket)
    if "big" in states or "shared" in states:
        state = h.make_state(h.GiB)
        data, pt = b.save("big", state)
        stores = b.save_chunked("big-chunks", state) if chunked else None
        sizes["big"] = sizes["shared"] = data.stat().st_size
        del state
        if "big" in states:
            for warm in (False, True):
                w = "warm" if warm else "cold"
                peers += [(f"big/ckptstage/{w}", [data], loader(client, "local"), warm),
                          (f"big/torch.load/{w}", [pt], call(torch.load, pt), warm)]
                if stores:
                    peers.append((f"big/chunked/{w}", [stores[0]],
                                  loader(Client("big-chunks", socket=b.daemon.socket), "local"), warm))
            peers.append(("big/dd/cold", [data], call(dd_direct, data), False))
        if "shared" in states:
            from ckptstage.protos import layout

            b.reader.start()
            shared_client = Client("big", socket=b.reader.socket)
            shared_data = layout.part_dir(b.shared, "big", 1, 0) / layout.DATA_FILE
            peers += [("shared/ckptstage/cold", [shared_data], loader(shared_client, "shared"), False),
                      ("shared/cat/cold", [shared_data], lambda: cat(shared_data), False),
                      ("shared/dd/cold", [shared_data], lambda: dd_direct(shared_data), False)]
            if stores:
                peers.append(("shared/chunked/cold", [stores[1]],
                              loader(Client("big-chunks", socket=b.reader.socket), "shared"), False))
    if "gpt2" in states or "into" in states:
        state = gpt2_state()
        data, pt = b.save("gpt2", state)
        stores = b.save_chunked("gpt2-chunks", state) if chunked else None
        sizes["gpt2"] = sizes["into"] = data.stat().st_size  # a tied tensor once, as stored
        gpt2 = Client("gpt2", socket=b.daemon.socket)
        gpt2c = Client("gpt2-chunks", socket=b.daemon.socket)
        into = empty_like_state(state)
        del state
        for warm in (False, True):
            w = "warm" if warm else "cold"
            if "gpt2" in states:
                peers += [(f"gpt2/ckptstage/{w}", [data], loader(gpt2, "local"), warm),
                          (f"gpt2/torch.load/{w}", [pt], call(torch.load, pt), warm)]
                if stores:
                    peers.append((f"gpt2/chunked/{w}", [stores[0]], loader(gpt2c, "local"), warm))
            if "into" in states:
                peers += [(f"into/ckptstage/{w}", [data], loader(gpt2, "local", into), warm),
                          (f"into/torch.load/{w}", [pt], call(load_into, pt, into), warm)]
                if stores:
                    peers.append((f"into/chunked/{w}", [stores[0]], loader(gpt2c, "local", into), warm))
        peers += [(f"{s}/dd/cold", [data], call(dd_direct, data), False)
                  for s in ("gpt2", "into") if s in states]
    # --peers / --cold-only: fewer peers per round, so the ones compared run closer together.
    peers = [p for p in peers if (only is None or p[0].split("/")[1] in only) and not (cold_only and p[3])]
    for r in range(rounds):
        order = peers[r % len(peers):] + peers[:r % len(peers)]
        for key, files, fn, warm in order:
            b.time(key, files, fn, warm)
            if key.endswith("/cold") and key.split("/")[1] in ("ckptstage", "chunked") and restore.last_stats.chosen:
                print(f"    {key}: {b.runs[key][-1]:.3f} s, read {restore.last_stats.chosen}"
                      f"{' after comparing ' + _rates(restore.last_stats.trial) if restore.last_stats.trial else ''}")
        print(f"  round {r + 1}/{rounds} done, load {h.load()}", flush=True)
    return sizes


def _rates(trial: dict[str, float]) -> str:
    return ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in trial.items())


def report(b: Bench, sizes: dict[str, int]) -> list[dict[str, Any]]:
    verdicts: list[dict[str, Any]] = []
    for state, nbytes in sizes.items():
        rows = [h.Row(f"{peer} {w}", b.median(f"{state}/{peer}/{w}"), nbytes, b.runs[f"{state}/{peer}/{w}"],
                      b.loads[f"{state}/{peer}/{w}"])
                for peer in ("ckptstage", "chunked", "torch.load", "dd", "cat") for w in ("cold", "warm")
                if f"{state}/{peer}/{w}" in b.runs]
        if not rows:
            continue
        h.print_table(f"{state}: {nbytes / h.GiB:.2f} GiB, medians of {len(rows[0].runs)} rounds "
                      f"(x = the peer's time / ckptstage cold's; loads {rows[0].loads[0]} .. {rows[0].loads[-1]})",
                      rows, "ckptstage cold")
        ours = b.median(f"{state}/ckptstage/cold")
        for w in ("cold", "warm"):
            pairs = list(zip(b.runs.get(f"{state}/chunked/{w}", []), b.runs.get(f"{state}/ckptstage/{w}", [])))
            if not pairs:
                continue
            per_round = h.median([c / x for c, x in pairs])
            of_medians = b.median(f"{state}/chunked/{w}") / b.median(f"{state}/ckptstage/{w}")
            print(f"  {state} {w}: chunked / whole, per round: {' '.join(f'{c / x:.2f}' for c, x in pairs)}; "
                  f"median {per_round:.3f}, ratio of medians {of_medians:.3f}")
            if w == "cold":
                line, ok = h.verdict(f"{state} cold, chunked / whole time", per_round, "<=", TARGET_CHUNKED_X, "x")
                print(line)
                verdicts.append({"state": state, "label": "chunked / whole", "value": per_round,
                                 "target": TARGET_CHUNKED_X, "pass": ok})
        checks = [("x dd bandwidth", "dd", TARGET_X_DD)]
        checks += [("x cat bandwidth", "cat", TARGET_X_CAT)] if state == "shared" else \
            [("x faster than torch.load", "torch.load", TARGET_X_TORCH)]
        for label, peer, target in checks:
            theirs = b.median(f"{state}/{peer}/cold")
            if math.isnan(theirs):
                continue
            line, ok = h.verdict(f"{state} cold, {label}", theirs / ours, ">=", target, "x")
            print(line)
            verdicts.append({"state": state, "label": label, "value": theirs / ours, "target": target, "pass": ok})
    return verdicts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = h.state_args(__doc__ or "", ["big", "gpt2", "into", "shared"])
    p.add_argument("--chunked", action="store_true", help="also load each state stored as an incremental part")
    p.add_argument("--read-mode", choices=["adaptive", "direct", "buffered"], default="adaptive",
                   help="how ckptstage reads cold data (default: as the adaptive policy finds faster)")
    p.add_argument("--peers", nargs="+", choices=["ckptstage", "chunked", "torch.load", "dd", "cat"], default=None,
                   help="only these peers (default: all)")
    p.add_argument("--cold-only", action="store_true", help="no warm runs")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.read_mode != "adaptive":
        from ckptstage.client import readmodes, restore

        restore.POLICY = readmodes.Fixed(readmodes.DIRECT if args.read_mode == "direct" else readmodes.BUFFERED)
    started = time.perf_counter()
    with h.bench_dirs(args.dir, "restore") as (work, daemon_root, info):
        b = Bench(work, daemon_root)
        try:
            sizes = run_rounds(b, args.rounds, args.states, args.chunked, args.peers, args.cold_only)
            verdicts = report(b, sizes)
        finally:
            b.reader.stop()
            b.daemon.stop()
    elapsed = time.perf_counter() - started
    print(f"\ndone in {elapsed:.0f} s, load {h.load()}")
    h.write_json(args.json, {"bench": "restore", "machine": info, "argv": sys.argv, "elapsed_s": elapsed,
                             "runs": b.runs, "loads": b.loads, "verdicts": verdicts})
    return 1 if args.strict and any(not v["pass"] for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
