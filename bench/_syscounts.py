"""Counting what a process asks of a directory: file-system calls traced with strace, files opened in-process.

For the scale simulator (``bench_scale.py``): a call counts when a path argument,
or a descriptor's path (``strace -y``), lies under the directory watched, and is
filed as create, open, stat, list (``getdents64`` calls), rename, remove, sync
or other; the files this process opens are counted by an audit hook.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CATEGORIES = ("create", "open", "stat", "list", "rename", "remove", "other")
TRACED = ("%file,fstat,fstatfs,getdents64,getdents,fsync,fdatasync,fgetxattr,flistxattr,ftruncate,"
          "fchmod,fchown")
_KIND = {"mkdir": "create", "mkdirat": "create", "link": "create", "linkat": "create", "symlink": "create",
         "symlinkat": "create", "creat": "create", "open": "open", "openat": "open", "openat2": "open",
         "getdents": "list", "getdents64": "list", "rename": "rename", "renameat": "rename",
         "renameat2": "rename", "unlink": "remove", "unlinkat": "remove", "rmdir": "remove",
         "fsync": "sync", "fdatasync": "sync"}
_STATS = {"stat", "lstat", "fstat", "newfstatat", "statx", "access", "faccessat", "faccessat2", "readlink",
          "readlinkat", "statfs", "fstatfs", "getxattr", "lgetxattr", "fgetxattr", "listxattr", "llistxattr",
          "flistxattr"}
_LINE = re.compile(r"^(?:\d+\s+)?(\d+\.\d+)\s+(\w+)\((.*)$")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_FD_PATH = re.compile(r"<(/[^>]*)>")


def kind_of(call: str, args: str) -> str:
    """The metadata category of one traced call (``sync`` and ``other`` included)."""
    if call in _STATS:
        return "stat"
    kind = _KIND.get(call, "other")
    if kind == "open" and "O_CREAT" in args:
        return "create"
    return kind


def count_trace(path: Path, under: Path, windows: dict[str, tuple[float, float]]) -> dict[str, Counter[str]]:
    """Calls of an ``strace -ttt -y -s 1024`` log on paths under ``under``, per window (unix seconds) and kind.

    A call belongs to ``under`` when a quoted path argument or a descriptor's
    path (``-y``) lies there; a call split by another thread is counted once,
    at its start (the ``resumed`` half is skipped).
    """
    root = str(under)
    counts = {name: Counter[str]() for name in windows}
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return counts
    for line in lines:
        m = _LINE.match(line)
        if m is None:
            continue
        ts, call, rest = float(m.group(1)), m.group(2), m.group(3)
        args = rest.split(") = ", 1)[0] if ") = " in rest else rest.replace("<unfinished ...>", "")
        paths = _QUOTED.findall(args) + _FD_PATH.findall(args)
        if not any(p == root or p.startswith(root + "/") for p in paths):
            continue
        for name, (lo, hi) in windows.items():
            if lo <= ts <= hi:
                counts[name][kind_of(call, args)] += 1
    return counts


def metadata(c: Counter[str]) -> int:
    return sum(c[k] for k in CATEGORIES)


class Tracer:
    """``strace -f`` attached to running processes, one log each, until :meth:`stop` (times are never taken
    under it: ptrace stops every traced call)."""

    def __init__(self, pids: Sequence[int], logs: Path) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = [logs / f"{pid}.strace" for pid in pids]
        self.procs = [subprocess.Popen(["strace", "-f", "-qq", "-ttt", "-y", "-s", "1024", "-e", f"trace={TRACED}",
                                        "-o", str(log), "-p", str(pid)], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL) for pid, log in zip(pids, self.logs)]
        self.pids = list(pids)
        self._wait_attached(60.0)

    def _wait_attached(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(_traced(pid) for pid in self.pids):
                time.sleep(0.2)  # strace's first calls settle
                return
            time.sleep(0.05)
        raise RuntimeError("strace did not attach to every daemon thread in time (is ptrace allowed here?)")

    def stop(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGINT)  # detaches, the daemon runs on
        for p in self.procs:
            p.wait(60)


def _traced(pid: int) -> bool:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True  # gone: nothing left to wait for
    for tid in tasks:
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue
        if re.search(r"^TracerPid:\s+0$", status, re.MULTILINE):
            return False
    return True


class OpenCounter:
    """Files this process opens under some directories while ``active`` (a ``sys.addaudithook`` hook, which
    cannot be removed: it stays, idle, for the life of the process)."""

    _instance: OpenCounter | None = None

    def __init__(self) -> None:
        self.roots: tuple[str, ...] = ()
        self.opened: list[str] = []
        self._lock = threading.Lock()
        sys.addaudithook(self._hook)

    @classmethod
    def get(cls) -> OpenCounter:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        if event != "open" or not self.roots or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        p = os.fsdecode(args[0])
        if p.startswith(self.roots):
            with self._lock:
                self.opened.append(p)

    @contextmanager
    def counting(self, roots: Sequence[Path]) -> Iterator[list[str]]:
        self.opened = []
        self.roots = tuple(str(r) + "/" for r in roots)
        try:
            yield self.opened
        finally:
            self.roots = ()
