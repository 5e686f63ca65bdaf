"""The scale simulator's figures: one record per configuration, slopes fitted in W and N, tables, verdicts.

For ``bench_scale.py``: :class:`Figures` holds what one configuration (W
ranks, N daemons) measured, on a shared directory (strace's counts) or on an
object store (the server's request counters); :func:`fit` fits a figure as
``a * W^b * N^c`` by least squares on logs; :func:`print_figures` prints every
figure with its exponents, ``n/a`` (with the reason) where the mode cannot
have it; :func:`print_restores` prints the per-node bytes of the restore at
another world size; :func:`targets` gives the verdicts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import _harness as h

TARGETS = {"meta_exp_w": 1.1, "latest_ms": 50.0, "reshard_x": 1.5, "ready_s": 1.0, "first_latest_ms": 100.0,
           "restore_ratio": 1.0}
S3_NA = {
    "meta/step own": "the server counts requests by type, not by key",
    "meta/step max node": "the server cannot tell which daemon asked",
}


@dataclass
class Figures:
    """One configuration's figures (times in seconds, counts per step unless named otherwise)."""

    world: int
    nodes: int
    tier: str = "dir"              # "dir": a shared directory; "s3": an object store (SeaweedFS)
    blocked_s: float = math.nan
    blocked_p99_s: float = math.nan
    local_s: float = math.nan
    shared_s: float = math.nan
    latest_s: float = math.nan
    reshard_plan_s: float = math.nan
    reshard_read_s: float = math.nan
    reshard_files: int = 0
    reshard_manifests: int = 0
    rpc_floor_s: float = math.nan  # a plain Locate of one rank's part on the same daemon then (the RPC itself)
    meta_step: float = 0.0         # per traced step (their mean); on an object store: requests per step
    meta_step_net: float = math.nan
    meta_step_max_node: float = 0.0
    meta_step_own: float = math.nan  # calls on the step's own directory and the temporaries only
    idle_per_s_node: float = math.nan  # on an object store: requests per second per daemon
    latest_ops: float = math.nan   # on an object store: requests (every daemon's) per latest() call
    latest_stale: int = 0
    late_answers: int = 0          # WaitSave calls a daemon answered after its own deadline (timed rounds)
    late_answers_traced: int = 0   # the same in the steps under strace
    visible_wait_s: float = math.nan  # after the latest() calls, until node 0 located the step's every part
    step_kinds: dict[str, int] = field(default_factory=dict)  # on an object store: requests by type
    idle_kinds: dict[str, float] = field(default_factory=dict)  # object store: requests/s/daemon by type
    step_sent_bytes: float = math.nan      # object store: bytes the server sent / received per step
    step_received_bytes: float = math.nan
    reshard_requests: dict[str, int] = field(default_factory=dict)  # object store: rank W/2's reshard
    reshard_fetched_bytes: float = math.nan
    syncs_step: float = 0.0
    traced_window_s: float = math.nan
    restore: dict[str, Any] = field(default_factory=dict)  # _scale_restore.summary
    loads: list[tuple[float, float, float]] = field(default_factory=list)  # at the start and the end

    @property
    def reshard_s(self) -> float:
        return self.reshard_plan_s + self.reshard_read_s

    @property
    def reshard_beyond_rpc_s(self) -> float:
        """The resharding read less its two Locate calls' floor: what the reader itself spends."""
        return self.reshard_s - 2 * self.rpc_floor_s

    def restore_ratio(self, phase: str) -> float:
        return float(self.restore.get(phase, {}).get("max_ratio", math.nan))

    def record(self) -> dict[str, Any]:
        return vars(self) | {"reshard_s": self.reshard_s, "reshard_beyond_rpc_s": self.reshard_beyond_rpc_s}


def fit(figs: Sequence[Figures], value: Callable[[Figures], float]) -> tuple[float, float]:
    """Exponents (in W, in N) of ``value`` by log-log least squares; NaN where the grid has one value of it."""
    import numpy as np

    pts = [(f.world, f.nodes, value(f)) for f in figs if value(f) > 0 and math.isfinite(value(f))]
    if len(pts) < 2:
        return math.nan, math.nan
    ws, ns = {p[0] for p in pts}, {p[1] for p in pts}
    cols: list[list[float]] = [[1.0] * len(pts)]
    if len(ws) > 1:
        cols.append([math.log(p[0]) for p in pts])
    if len(ns) > 1:
        cols.append([math.log(p[1]) for p in pts])
    a = np.array(cols).T
    if np.linalg.matrix_rank(a) < a.shape[1]:  # W and N moved together: only the slope in W is told
        a, ns = a[:, :2], {0}
    coef = np.linalg.lstsq(a, np.array([math.log(p[2]) for p in pts]), rcond=None)[0]
    b = float(coef[1]) if len(ws) > 1 else math.nan
    c = float(coef[-1]) if len(ns) > 1 else math.nan
    return b, c


Column = tuple[str, str, Callable[[Figures], float]]

TIMES: list[Column] = [
    ("blocked", "ms", lambda f: f.blocked_s * 1e3),
    ("blocked p99", "ms", lambda f: f.blocked_p99_s * 1e3),
    ("local", "s", lambda f: f.local_s),
    ("shared", "s", lambda f: f.shared_s),
]
TAIL: list[Column] = [
    ("latest()", "ms", lambda f: f.latest_s * 1e3),
    ("latest() stale answers", "", lambda f: f.latest_stale),
    ("WaitSave late", "", lambda f: f.late_answers),
    ("WaitSave late traced", "", lambda f: f.late_answers_traced),
    ("node 0 sees the step", "ms", lambda f: f.visible_wait_s * 1e3),
    ("reshard plan", "ms", lambda f: f.reshard_plan_s * 1e3),
    ("reshard read", "ms", lambda f: f.reshard_read_s * 1e3),
    ("Locate RPC floor", "ms", lambda f: f.rpc_floor_s * 1e3),
    ("reshard less 2 RPCs", "ms", lambda f: f.reshard_beyond_rpc_s * 1e3),
    ("reshard files", "", lambda f: f.reshard_files),
    ("reshard manifests", "", lambda f: f.reshard_manifests),
    ("restore plain x", "", lambda f: f.restore_ratio("plain")),
    ("restore box x", "", lambda f: f.restore_ratio("box")),
]
COLUMNS: list[Column] = [*TIMES,
    ("meta/step", "ops", lambda f: f.meta_step),
    ("meta/step net", "ops", lambda f: f.meta_step_net),
    ("meta/step max node", "ops", lambda f: f.meta_step_max_node),
    ("meta/step own", "ops", lambda f: f.meta_step_own),
    ("idle/s/node", "ops", lambda f: f.idle_per_s_node),
    ("latest() ops/call", "ops", lambda f: f.latest_ops),
    *TAIL,
]


def s3_columns(figs: Sequence[Figures]) -> list[Column]:
    """The object store's columns: requests per step (all, net, by type), per idle second per daemon (all,
    by type), per ``latest()`` call; bytes per step; the reshard's requests and fetched bytes."""
    kinds = sorted({k for f in figs for k in (*f.step_kinds, *f.idle_kinds)})
    return [*TIMES,
            ("req/step", "", lambda f: f.meta_step),
            ("req/step net", "", lambda f: f.meta_step_net),
            *[(f"req/step {k}", "", lambda f, k=k: f.step_kinds.get(k, 0)) for k in kinds],
            ("meta/step max node", "", lambda f: math.nan),
            ("meta/step own", "", lambda f: math.nan),
            ("MB sent/step", "", lambda f: f.step_sent_bytes / 1e6),
            ("MB received/step", "", lambda f: f.step_received_bytes / 1e6),
            ("idle req/s/daemon", "", lambda f: f.idle_per_s_node),
            *[(f"idle {k}/s/daemon", "", lambda f, k=k: f.idle_kinds.get(k, 0.0)) for k in kinds],
            ("latest() req/call", "", lambda f: f.latest_ops),
            ("reshard requests", "", lambda f: sum(f.reshard_requests.values())),
            ("reshard fetched", "KiB", lambda f: f.reshard_fetched_bytes / 1024),
            *TAIL]


def print_figures(figs: Sequence[Figures]) -> dict[str, tuple[float, float]]:
    """Every figure per configuration, then its fitted exponents in W and N; returns the exponents."""
    s3 = any(f.tier == "s3" for f in figs)
    head = "".join(f"{'W=' + str(f.world) + ' N=' + str(f.nodes):>16}" for f in figs)
    print(f"\n{'figure':26}{head}{'exp W':>8}{'exp N':>8}")
    slopes = {}
    for name, unit, value in (s3_columns(figs) if s3 else COLUMNS):
        label = name + (' (' + unit + ')' if unit else '')
        if s3 and name in S3_NA:
            print(f"{label:26}n/a: {S3_NA[name]}")
            continue
        b, c = fit(figs, value)
        slopes[name] = (b, c)
        cells = "".join(f"{value(f):16.4g}" for f in figs)
        print(f"{label:26}{cells}{_exp(b):>8}{_exp(c):>8}")
    if s3:
        print("\nobject-store requests in the step window, by type (all daemons, per step; the server files a HEAD "
              "under GET and multipart pieces under PUT):")
    else:
        print("\nshared-tier calls in the step window, by kind (all daemons):")
    for f in figs:
        print(f"  W={f.world:<5} N={f.nodes:<4} " + " ".join(f"{k}={v}" for k, v in f.step_kinds.items())
              + f"  (window {f.traced_window_s:.1f} s{'' if s3 else ' traced'})")
    return slopes


def print_restores(figs: Sequence[Figures]) -> None:
    """Per configuration, per load, per node: bytes read from the shared tier against the unique bytes needed."""
    print("\nrestore at world size 2W, per node: shared KiB read / KiB needed = ratio (target <= 1.0); "
          "directory: data files (distinct bytes of them; manifests, indexes, records); object store: bytes the "
          "server sent (the daemon's fetched bytes; requests); where the loads read")
    for f in figs:
        for phase, got in f.restore.items():
            cells = []
            for n in got["nodes"]:
                extra = (f" (distinct {n['unique_data'] / 1024:.0f}; meta {n['read_meta'] / 1024:.1f},"
                         f" distinct {n['unique_meta'] / 1024:.1f})" if f.tier == "dir" else
                         f" (fetched {n['read_data'] / 1024:.0f}; requests {_kinds(n['requests'])})")
                got_kib = (n["read"] if f.tier == "s3" else n["read_data"]) / 1024
                cells.append(f"n{n['node']}: {got_kib:.0f}/{n['need'] / 1024:.0f} = {_ratio(n['ratio'])}{extra}"
                             f" {n['tiers'] or ''}{'' if n['ok'] else ' WRONG VALUES'}")
            idle = f", {got['needless_nodes']} node(s) needing none read" if got.get("needless_nodes") else ""
            print(f"  W={f.world:<4} N={f.nodes:<3} {phase:5} max {_ratio(got['max_ratio'])}{idle}: " + "; ".join(cells))


def _kinds(requests: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(requests.items())) or "none"


def _ratio(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2f}"


def _exp(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


def targets(figs: Sequence[Figures], slopes: dict[str, tuple[float, float]],
            big: dict[str, float]) -> list[tuple[str, bool]]:
    out = []
    meta = "req/step" if any(f.tier == "s3" for f in figs) else "meta/step"
    if meta in slopes and not math.isnan(slopes[meta][0]):
        out.append(h.verdict(f"shared-tier {'requests' if meta == 'req/step' else 'metadata'} per step, exponent "
                             "in W", slopes[meta][0], "<=", TARGETS["meta_exp_w"]))
    if figs:
        out.append(h.verdict(f"latest() at W={max(f.world for f in figs)}, ms",
                             max(f.latest_s for f in figs if f.world == max(g.world for g in figs)) * 1e3, "<=",
                             TARGETS["latest_ms"]))
        small = min(figs, key=lambda f: (f.world, f.nodes))
        large = max(figs, key=lambda f: (f.world, -f.nodes))
        if large.world > small.world:
            out.append(h.verdict(f"reshard load per rank, W={large.world} x W={small.world}",
                                 large.reshard_s / small.reshard_s, "<=", TARGETS["reshard_x"]))
            out.append(h.verdict("  the same less its two Locate RPCs' floor (the reader's own work)",
                                 large.reshard_beyond_rpc_s / small.reshard_beyond_rpc_s, "<=", TARGETS["reshard_x"]))
        for phase in ("plain", "box"):
            ratios = [f.restore_ratio(phase) for f in figs if not math.isnan(f.restore_ratio(phase))]
            if ratios:
                out.append(h.verdict(f"restore at 2W ({phase}): shared bytes read per node / needed, worst",
                                     max(ratios), "<=", TARGETS["restore_ratio"]))
            idle = sum(f.restore.get(phase, {}).get("needless_nodes", 0) for f in figs)
            if idle:
                out.append((f"  MISS  restore at 2W ({phase}): {idle} node(s) whose ranks need nothing from the "
                            "shared tier read from it", False))
    if big:
        out.append(h.verdict(f"READY against {big['steps']:.0f} steps, s", big["ready_s"], "<=", TARGETS["ready_s"]))
        out.append(h.verdict("first latest() there, ms", big["first_latest_s"] * 1e3, "<=",
                             TARGETS["first_latest_ms"]))
    return out
