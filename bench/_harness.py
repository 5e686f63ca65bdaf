"""Shared helpers for the benchmarks in ``bench/``: a real daemon, states, peers, tables.

Standalone on purpose (never imports ``tests/``): a benchmark must run on a
machine where only the package and ``bench/`` are present. Everything here is
measurement plumbing; what each benchmark compares lives in its own script.

Noise: the load average is recorded with every measurement (:func:`load`),
because on a shared development machine the numbers move with it.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import platform
import re
import shutil
import socket as socketlib
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckptstage.daemon.launcher import MODULE, DaemonProcess  # no torch in the daemon package

MiB = 1 << 20
GiB = 1 << 30


# ----------------------------------------------------------------- time, load


def load() -> tuple[float, float, float]:
    """``os.getloadavg()``, rounded: recorded next to every number."""
    return tuple(round(x, 2) for x in os.getloadavg())  # type: ignore[return-value]


class Timer:
    """``with Timer() as t: ...`` then ``t.s`` (seconds, perf_counter)."""

    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        self.s = math.nan
        return self

    def __exit__(self, *exc: object) -> None:
        self.s = time.perf_counter() - self.t0


def timed(fn: Callable[[], Any]) -> float:
    with Timer() as t:
        fn()
    return t.s


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


# ------------------------------------------------------------------ the daemon


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (for the metrics endpoint)."""
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daemon(DaemonProcess):
    """A real ``ckptstaged`` subprocess (:class:`~ckptstage.daemon.launcher.DaemonProcess`): own socket,
    tiers, config file and log under ``root``; ``start()`` returns once it is ready.

    ``settings`` are dotted config keys (``{"shared.max_bandwidth": "200MiB/s"}``)
    applied over the benchmark defaults below, then validated and written as
    TOML by the daemon's own ``load_config``/``dump_config``. ``metrics=True``
    serves Prometheus on a free port (see :meth:`scrape`). A/B runs of a
    modified daemon: ``CKPTBENCH_DAEMON_MODULE=my_patched_main`` (on PYTHONPATH).
    """

    def __init__(self, root: Path, local: Path, shared: Path | None = None, metrics: bool = False,
                 **settings: Any) -> None:
        defaults: dict[str, Any] = {"local.dir": str(local), "shared.dir": str(shared) if shared else "",
                                    # benchmarks keep what they write: no eviction under a timed save
                                    "local.keep_last": 100, "shared.keep_last": 100,
                                    # whole parts unless a benchmark says otherwise (or CKPTBENCH_INCREMENTAL=1
                                    # for any of them): the figures in docs/BENCHMARKS.md outside its
                                    # incremental sections are of whole parts
                                    "persist.incremental": os.environ.get("CKPTBENCH_INCREMENTAL") == "1"}
        if metrics:
            defaults["metrics.listen"] = f"127.0.0.1:{free_port()}"
        super().__init__(root, settings, defaults=defaults, log_level="INFO", ready_timeout=60.0,
                         module=os.environ.get("CKPTBENCH_DAEMON_MODULE", MODULE))

    def scrape(self) -> dict[str, float]:
        """The metrics endpoint as ``{'name{label="v"}': value}`` (empty without metrics)."""
        if not self.metrics_url:
            return {}
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.metrics_url, timeout=10) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out


# ------------------------------------------------------------------- the state


def make_state(total_bytes: int, width: int = 4096, layers: int = 8, seed: int = 0) -> dict[str, Any]:
    """A training-like state of about ``total_bytes``: fp32 weights plus AdamW moments.

    ``layers`` linear weights of ``rows x width`` (ARCHITECTURE's example is
    8 x 4096x4096 = 1.5 GiB with both moments), and an optimizer state dict
    shaped like ``torch.optim.AdamW.state_dict()`` (int keys, 0-d ``step``
    tensors, ``exp_avg``/``exp_avg_sq``). ``rows`` is chosen so the total is
    the largest such state not above ``total_bytes``; see :func:`state_bytes`
    for the exact size. Every page is written (random values), so no copy
    reads the kernel's shared zero page.
    """
    import torch

    rows = max(1, total_bytes // (3 * layers * width * 4))
    g = torch.Generator().manual_seed(seed)
    model: dict[str, Any] = {}
    opt_state: dict[int, Any] = {}
    for i in range(layers):
        w = torch.empty(rows, width).uniform_(-0.02, 0.02, generator=g)
        model[f"layers.{i}.weight"] = w
        opt_state[i] = {"step": torch.tensor(100.0),
                        "exp_avg": torch.empty_like(w).uniform_(-1e-3, 1e-3, generator=g),
                        "exp_avg_sq": torch.empty_like(w).uniform_(0, 1e-6, generator=g)}
    groups = [{"lr": 3e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
               "foreach": None, "maximize": False, "capturable": False, "differentiable": False,
               "fused": None, "params": list(range(layers))}]
    return {"model": model, "optim": {"state": opt_state, "param_groups": groups}, "step": 100}


def tensors_of(state: Any) -> list[Any]:
    """Every tensor in a nested state, in a stable order."""
    import torch

    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for k in state for t in tensors_of(state[k])]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in tensors_of(v)]
    return []


def state_bytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


def distinct_tensors(state: Any) -> list[Any]:
    """:func:`tensors_of`, each tensor once: one reachable twice (tied weights, GPT-2's ``lm_head.weight``
    is ``wte.weight``) is one set of bytes, as a checkpoint stores it and as a copy of the state should count it."""
    seen: set[tuple[Any, ...]] = set()
    out = []
    for t in tensors_of(state):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


# ------------------------------------------------------------ memory-speed peers


class WarmCopy:
    """Copies of every tensor of ``state`` into destinations allocated and pre-faulted once.

    :meth:`best_s` times whole-state copies and keeps the best: the floor for
    the trainer's blocked time (ckptstage's copy goes into pre-faulted memory too).
    """

    def __init__(self, state: Any) -> None:
        import torch

        self.src = tensors_of(state)
        self.dst = [torch.empty_like(t) for t in self.src]
        self.copy()  # pre-fault: first-touch pages cost ~25x a warm copy here

    def copy(self) -> None:
        for d, s in zip(self.dst, self.src):
            d.copy_(s)

    def best_s(self, repeats: int = 5) -> float:
        return min(timed(self.copy) for _ in range(repeats))


def warm_memcpy_s(state: Any, repeats: int = 5) -> float:
    """Best time to copy every tensor into preallocated, pre-faulted tensors (the blocked-time floor)."""
    return WarmCopy(state).best_s(repeats)


class ShmCopy(WarmCopy):
    """Like :class:`WarmCopy`, but into one pre-faulted ``/dev/shm`` mapping: the arena's kind of memory.

    Shows what that memory costs versus the trainer's own heap (e.g.
    transparent huge pages may apply to one and not the other).
    """

    def __init__(self, state: Any) -> None:
        import torch

        self.src = tensors_of(state)
        total = sum(t.numel() * t.element_size() for t in self.src)
        fd, path = tempfile.mkstemp(prefix="ckptbench-", dir="/dev/shm")
        try:
            os.ftruncate(fd, total)
            os.posix_fallocate(fd, 0, total)  # allocate every tmpfs page now, as the daemon's arena does
            self._map = mmap.mmap(fd, total, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
            os.unlink(path)
        u8 = torch.frombuffer(self._map, dtype=torch.uint8)
        self.dst, off = [], 0
        for t in self.src:
            n = t.numel() * t.element_size()
            self.dst.append(u8[off:off + n].view(t.dtype).view(t.shape))
            off += n
        self.copy()

    def close(self) -> None:
        self.dst = []
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still referenced; the mapping goes with it


def warm_shm_memcpy_s(state: Any, repeats: int = 5) -> float:
    c = ShmCopy(state)
    try:
        return c.best_s(repeats)
    finally:
        c.close()


# --------------------------------------------------------------- disk peers


_DD_RE = re.compile(r"^(\d+) bytes .* copied, ([0-9.]+) s", re.MULTILINE)


@dataclass
class DdResult:
    nbytes: int
    seconds: float      # as dd reports it (open to close, fsync included with conv=fsync)
    wall_s: float       # process start to exit, as measured here

    @property
    def bandwidth(self) -> float:
        return self.nbytes / self.seconds


def dd_fsync(directory: Path, nbytes: int, direct: bool = False, bs: int = 64 * MiB) -> DdResult:
    """``dd if=/dev/zero of=DIR/... bs=64M count=N conv=fsync`` (``oflag=direct`` too if asked); file dropped.

    N is ``nbytes`` rounded up to whole blocks; the bandwidth uses the bytes
    dd reports.
    """
    count = max(1, -(-nbytes // bs))
    target = Path(directory) / f".ckptbench-dd-{os.getpid()}"
    cmd = ["dd", "if=/dev/zero", f"of={target}", f"bs={bs}", f"count={count}", "conv=fsync"]
    if direct:
        cmd.append("oflag=direct")
    try:
        with Timer() as t:
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    finally:
        target.unlink(missing_ok=True)
    m = _DD_RE.search(out.stderr)
    if m is None:
        return DdResult(count * bs, t.s, t.s)
    return DdResult(int(m.group(1)), float(m.group(2)), t.s)


def du_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (their sizes, not blocks)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def drop_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def settle(seconds: float) -> None:
    """Idles before a disk-writing measurement, so every writer meets memory in the same state.

    Why: on this VM (virtio-balloon free page reporting) memory the guest
    freed less than ~1 s ago is still backed by the host, and a buffered
    write into it runs at ~4 GB/s; after that it has been handed back, and
    the same write pays a host page fault per page (~0.5 GB/s). Without a
    pause, whichever peer runs right after another one deleted its files
    wins. Sleeping puts every peer in the cold state, which is also what a
    job checkpointing every few minutes meets; 0 turns it off.
    """
    if seconds > 0:
        time.sleep(seconds)


def drop_page_cache(path: Path) -> None:
    """Evicts the (clean, fsynced) files under ``path`` from the page cache: ``POSIX_FADV_DONTNEED``.

    Peers delete their files after each run; a committed ckptstage
    checkpoint stays, so without this the page cache would grow by one
    checkpoint per round and memory would not be returned alike for every
    peer (see :func:`settle`). Files and directories that retention removes during the walk are
    skipped (a daemon deletes old steps and sweeps chunks in the background).
    """
    paths = [Path(path)] if Path(path).is_file() else [
        Path(parent, n) for parent, _, names in os.walk(path) for n in names]  # os.walk skips what vanished
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cache_files(path: Path) -> None:
    """Reads the files under ``path`` through the page cache, so the next reader finds them cached.

    A "warm" restore must not rely on the previous read having cached the
    file: ckptstage reads cold data with O_DIRECT, which leaves nothing in
    the cache, so both peers' files are cached this way before a warm run.
    """
    paths = [path] if Path(path).is_file() else [p for p in Path(path).rglob("*") if p.is_file()]
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass


# ------------------------------------------------------------ reporting


@dataclass
class Row:
    """One peer's measurement: ``seconds`` for ``nbytes``; ``runs`` are all the repeats."""

    name: str
    seconds: float
    nbytes: int
    runs: list[float] = field(default_factory=list)
    loads: list[tuple[float, float, float]] = field(default_factory=list)
    note: str = ""

    @property
    def gib_s(self) -> float:
        return self.nbytes / GiB / self.seconds if self.seconds and self.seconds > 0 else math.nan


def fmt_s(s: float) -> str:
    if math.isnan(s):
        return "-"
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


def print_table(title: str, rows: Iterable[Row], ref: str, out: Callable[[str], None] = print) -> None:
    """Each row's time, bandwidth and time ratio against row ``ref`` (ckptstage): >1 = ckptstage faster."""
    rows = list(rows)
    ref_s = next((r.seconds for r in rows if r.name == ref), math.nan)
    width = max([len(r.name) for r in rows] + [10])
    out(f"\n{title}")
    out(f"  {'':{width}}  {'time':>9}  {'GiB/s':>6}  {'x ' + ref:>14}  runs (s)                    note")
    for r in rows:
        ratio = r.seconds / ref_s if ref_s and not math.isnan(ref_s) else math.nan
        runs = " ".join(f"{x:.3f}" for x in r.runs)
        out(f"  {r.name:{width}}  {fmt_s(r.seconds):>9}  {r.gib_s:6.2f}  {ratio:13.2f}x  {runs:26}  {r.note}")


def verdict(label: str, value: float, op: str, target: float, unit: str = "") -> tuple[str, bool]:
    """``"PASS label: value <= target"`` (op is "<=" or ">="); the bool says whether it passed."""
    ok = value <= target if op == "<=" else value >= target
    word = "PASS" if ok else "MISS"
    return f"  {word}  {label}: {value:.2f}{unit} (target {op} {target:g}{unit})", ok


# ------------------------------------------------------------ the machine


def machine_info(directory: Path) -> dict[str, Any]:
    """What the numbers were measured on: CPU, memory, kernel, the file system under test, load."""

    def run(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    lscpu = dict(line.split(":", 1) for line in run("lscpu").splitlines() if ":" in line)
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    df = run("df", "-hT", str(directory)).splitlines()
    thp = Path("/sys/kernel/mm/transparent_hugepage")
    return {
        "cpu": lscpu.get("Model name", platform.processor()).strip(),
        "cpus": os.cpu_count(),
        "mem_gib": round(mem_gib, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": _torch_version(),
        "dir": str(directory),
        "df": df[-1] if df else "",
        "thp": _read(thp / "enabled"),
        "thp_shmem": _read(thp / "shmem_enabled"),
        "git": _git_state(),
        "loadavg": load(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def _git_state() -> str:
    """The commit measured, and the files changed on top of it (the tree is often mid-edit)."""
    repo = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                                  timeout=10, check=False).stdout.rstrip("\n")
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "--short", "HEAD").strip()
    dirty = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    return f"{head} + uncommitted changes to {', '.join(dirty)}" if dirty else head


def mem_available() -> int:
    """``MemAvailable`` from ``/proc/meminfo``, in bytes (0 when it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def print_machine(info: dict[str, Any], out: Callable[[str], None] = print) -> None:
    out(f"machine: {info['cpu']}, {info['cpus']} CPUs, {info['mem_gib']} GiB RAM, kernel {info['kernel']}, "
        f"python {info['python']}, torch {info['torch']}")
    out(f"dir:     {info['df']}")
    out(f"THP:     anon {info['thp']!r}, shmem {info['thp_shmem']!r}")
    out(f"code:    {info['git']}")
    out(f"load:    {info['loadavg']} at {info['when']}")


def _read(p: Path) -> str:
    try:
        return p.read_text().strip()
    except OSError:
        return ""


def _torch_version() -> str:
    try:
        import torch

        return str(torch.__version__)
    except ImportError:
        return ""


def write_json(path: Path | None, payload: dict[str, Any]) -> None:
    """Saves the run (machine, rows, verdicts) for docs/BENCHMARKS.md; ``None`` = don't."""
    if path is None:
        return

    def default(o: Any) -> Any:
        if isinstance(o, Row):
            return {**asdict(o), "gib_s": o.gib_s}
        if isinstance(o, Path):
            return str(o)
        raise TypeError(type(o).__name__)

    path.write_text(json.dumps(payload, indent=2, default=default))


@contextmanager
def workdir(base: Path | None, prefix: str) -> Iterator[Path]:
    """A fresh directory under ``base`` (default /tmp), removed afterwards."""
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    try:
        yield d
    finally:
        drop_tree(d)



def state_args(doc: str, states: Sequence[str], rounds: int = 5) -> argparse.ArgumentParser:
    """The options every state benchmark takes: ``--dir``, ``--rounds``, ``--states``, ``--json``, ``--strict``."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--dir", type=Path, default=None, help="where the tiers and torch files go (default /tmp)")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--states", nargs="+", default=list(states), choices=list(states))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    return p

def run_args(doc: str, where: str) -> argparse.ArgumentParser:
    """The options every run benchmark takes: ``--dir`` (``where``: what lives there), ``--settle``, ``--json``
    and ``--strict``; the caller adds its own."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=None, help=f"where {where} (default: a temp dir under /tmp)")
    p.add_argument("--settle", type=float, default=2.0,
                   help="idle seconds before each disk-writing measurement (default 2; see settle)")
    p.add_argument("--json", type=Path, default=None, help="also write every run here")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    return p


@contextmanager
def bench_dirs(base: Path | None, name: str) -> Iterator[tuple[Path, Path, dict[str, Any]]]:
    """A benchmark's run: (work dir under ``base``, a daemon root under /tmp, the machine), both removed
    afterwards; prints the machine and the command line first, as every benchmark's record begins."""
    with workdir(base, f"ckptbench-{name}-") as work, workdir(None, "ckptd-") as daemon_root:
        info = machine_info(work)
        print_machine(info)
        print(f"command: {' '.join([os.path.relpath(sys.executable), *sys.argv])}")
        yield work, daemon_root, info

