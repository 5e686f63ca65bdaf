"""Counting what a process asks of a directory: file-system calls traced with strace, files opened in-process.

For the scale simulator (``bench_scale.py``): a call counts when a path argument,
or a descriptor's path (``strace -y``), lies under the directory watched, and is
filed as create, open, stat, list (``getdents64`` calls), rename, remove, sync
or other; the files this process opens are counted by an audit hook. The bytes
read from files under a directory (:data:`READS`, :func:`count_reads`) are
summed per file, with the byte ranges they cover (a file's position is
followed through ``openat``, ``lseek`` and the reads themselves).
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
from dataclasses import dataclass, field
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
READS = "read,readv,pread64,preadv,preadv2,lseek,openat,sendfile,copy_file_range"
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


# ------------------------------------------------------------------ bytes read


@dataclass
class FileReads:
    """What one or more processes read of one file: bytes returned (every read), and the ranges read."""

    total: int = 0
    ranges: list[tuple[int, int]] = field(default_factory=list)

    def add(self, lo: int, n: int) -> None:
        self.total += n
        self.ranges.append((lo, lo + n))

    def merge(self, other: FileReads) -> None:
        self.total += other.total
        self.ranges += other.ranges

    @property
    def unique(self) -> int:
        """Bytes of the file read at least once."""
        out, end = 0, -1
        for lo, hi in sorted(self.ranges):
            if hi > end:
                out += hi - max(lo, end)
                end = hi
        return out


_READ_AT = {"pread64": 3, "preadv": 3, "preadv2": 3}  # the offset's argument
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"(?:\.\.\.)?')
_BRACKETS = re.compile(r"\[[^\]]*\]|\{[^}]*\}")
_RESULT = re.compile(r"\)\s+=\s+(-?\d+)(?:<(/[^>]*)>)?")


def count_reads(path: Path, under: Path, windows: dict[str, tuple[float, float]]) -> dict[str, dict[str, FileReads]]:
    """Bytes read from files under ``under`` in an ``strace -f -ttt -y -e trace=READS`` log of one process,
    per window (unix seconds) and file: ``read``/``readv`` at the descriptor's position (followed through
    ``openat`` and ``lseek``), ``pread64``/``preadv``/``preadv2`` at their offset, ``sendfile`` and
    ``copy_file_range`` from their source descriptor. A call split by another thread is joined again."""
    root = str(under) + "/"
    out: dict[str, dict[str, FileReads]] = {name: {} for name in windows}
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return out
    pending: dict[str, str] = {}
    position: dict[int, int] = {}
    for line in lines:
        tid, _, rest = line.partition(" ")
        if "<unfinished ...>" in rest:
            pending[tid] = rest.replace("<unfinished ...>", "")
            continue
        if "resumed>" in rest and tid in pending:
            rest = pending.pop(tid) + rest.partition("resumed>")[2]
        m = _LINE.match(f"{tid} {rest}")
        if m is None:
            continue
        ts, call, body = float(m.group(1)), m.group(2), m.group(3)
        body = _BRACKETS.sub("X", _STRINGS.sub("X", body))
        result = _RESULT.search(body)
        if result is None or int(result.group(1)) < 0:
            continue
        ret = int(result.group(1))
        args = [a.strip() for a in body[:result.start()].split(",")]
        if call == "openat":
            position[ret] = 0
            continue
        fd_m = re.match(r"(\d+)<(/[^>]*)>", args[1] if call in ("sendfile",) else args[0])
        if fd_m is None:
            continue
        fd, file = int(fd_m.group(1)), fd_m.group(2)
        if call == "lseek":
            position[fd] = ret
            continue
        if call in _READ_AT:
            lo = int(args[_READ_AT[call]])
        elif call in ("sendfile", "copy_file_range"):  # the offset, when given, is shown as [N]: not followed
            lo = position.get(fd, 0)
        else:
            lo = position.get(fd, 0)
            position[fd] = lo + ret
        if not file.startswith(root):
            continue
        for name, (a, b) in windows.items():
            if a <= ts <= b:
                out[name].setdefault(file, FileReads()).add(lo, ret)
    return out


def strace_from_start(log: Path, calls: str = TRACED, strings: int = 1024, detached: bool = False) -> list[str]:
    """The command prefix that runs a program under ``strace -f`` from its start, logging ``calls`` to ``log``.

    A seccomp filter stops the program only at the traced calls (``--seccomp-bpf``: far less overhead than
    :class:`Tracer`'s attach, which stops every call). ``detached``: strace runs as a grandchild and the
    program keeps the pid it was started with (``-D``: its signals and notifications stay its own)."""
    return ["strace", *(["-D"] if detached else []), "-f", "--seccomp-bpf", "-qq", "-ttt", "-y", "-s", str(strings),
            "-e", f"trace={calls}", "-o", str(log)]


class Tracer:
    """``strace -f`` attached to running processes, one log each, until :meth:`stop` (times are never taken
    under it: ptrace stops every traced call)."""

    def __init__(self, pids: Sequence[int], logs: Path, calls: str = TRACED, strings: int = 1024) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = [logs / f"{pid}.strace" for pid in pids]
        self.procs = [subprocess.Popen(["strace", "-f", "-qq", "-ttt", "-y", "-s", str(strings), "-e",
                                        f"trace={calls}", "-o", str(log), "-p", str(pid)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                      for pid, log in zip(pids, self.logs)]
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
