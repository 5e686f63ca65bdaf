"""Small helpers shared by the test modules (importable: pytest's pythonpath includes tests/)."""

from __future__ import annotations

import contextlib
import re
import socket
import struct
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.request import urlopen

import pytest

from ckptstage.daemon.fsutil import PartWriter
from ckptstage.protos import chunks, layout
from ckptstage.protos.v1 import ckptstage_pb2 as pb

T = TypeVar("T")


def wait_until(pred: Callable[[], T], timeout: float, what: str, poll: float = 0.02) -> T:
    """Polls ``pred`` until it returns something truthy; fails naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(poll)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> str:
    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus exposition (0 when absent)."""
    want = ",".join(sorted(f'{k}="{v}"' for k, v in labels.items()))
    for line in text.splitlines():
        m = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        if m and m.group(1) == name and ",".join(sorted(p for p in (m.group(2) or "").split(",") if p)) == want:
            return float(m.group(3))
    return 0.0


def wait_metric(port: int, value: float, name: str, **labels: str) -> None:
    """Waits for a counter to reach ``value`` (a deletion is counted just after it is visible on disk)."""
    wait_until(lambda: metric(scrape(port), name, **labels) == value, 10,
               f"{name}{labels} == {value} (is {metric(scrape(port), name, **labels)})")


def drain(d: Any, timeout: float = 60.0) -> None:
    """``Drain(wait=True)`` on daemon ``d`` until nothing is pending; fails if anything failed."""
    deadline = time.monotonic() + timeout
    with d.connection() as conn:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"drain not finished after {timeout}s")
            resp = conn.call("Drain", pb.DrainRequest(wait=True, timeout_s=min(left, 25)), timeout=min(left, 25) + 10)
            assert resp.failed == 0
            if resp.pending == 0:
                return


def raw_bytes(t: Any) -> bytes:
    """A tensor's values as bytes (bit patterns, so NaN payloads and -0.0 count)."""
    import torch

    return bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def assert_same(a: Any, b: Any, path: str = "state", exact_dicts: bool = True) -> None:
    """Bit-identical states: the same container and key types in the same order, the same plain values
    (floats by bit pattern), tensors and numpy arrays of the same dtype, shape, device and bytes.

    ``exact_dicts=False`` lets any dict type hold the same keys in any order (what DCP rebuilds).
    """
    import numpy as np
    import torch

    if not exact_dicts and isinstance(a, dict) and isinstance(b, dict):
        assert sorted(map(str, a)) == sorted(map(str, b)), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]", exact_dicts)
        return
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, tuple(a.shape), a.device) == (b.dtype, tuple(b.shape), b.device), \
            f"{path}: {a.dtype}{list(a.shape)} on {a.device} != {b.dtype}{list(b.shape)} on {b.device}"
        assert raw_bytes(a) == raw_bytes(b), f"{path}: tensor bytes differ"
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape) and a.tobytes() == b.tobytes(), f"{path}: arrays differ"
    elif isinstance(a, dict):
        assert [(type(k), k) for k in a] == [(type(k), k) for k in b], f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]", exact_dicts)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]", exact_dicts)
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a!r} != {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def write_part(daemon: Any, job: str, state: dict[str, Any]) -> Path:
    """Saves ``state`` as step 1 of ``job`` and returns its local part, drained first: the drainer
    reading a copy a test has flipped a byte in would (rightly) have it quarantined under the test."""
    from ckptstage.client import Client
    from ckptstage.protos import layout

    with Client(job, socket=daemon.socket) as c:
        c.save(1, state).wait("shared", timeout=60)
    return layout.part_dir(daemon.local, job, 1, 0)


def data_extents(part: Path) -> list[chunks.Extent]:
    """Where the bytes of a part's data file are, whether it is stored whole or as chunks (loose or packed):
    bytes [lo, hi) of the data file are those of ``path`` from file offset ``lo - base``."""
    return chunks.extents(part, layout.read_manifest(part))


def data_size(part: Path) -> int:
    """The size of a part's data file, as its manifest gives it (stored whole or as chunks)."""
    return layout.manifest_files(layout.read_manifest(part))[layout.DATA_FILE].size


def read_data(part: Path) -> bytes:
    """A part's data file, whole or put together from its chunks (decoded where a tier keeps one compressed; no
    checksum checked)."""
    out = bytearray()
    for e in data_extents(part):
        with open(e.path, "rb") as f:
            f.seek(e.lo - e.base)
            out += e.decode(f.read(e.coded)) if e.coded else f.read(e.hi - e.lo)
    return bytes(out)


def flip_data_byte(part: Path, offset: int) -> Path:
    """Flips the lowest bit of byte ``offset`` of a part's data file wherever it is stored (the file
    itself, a chunk's own file, a pack; of a chunk kept compressed, a byte of its frame) and fsyncs it;
    returns the file it changed."""
    ext = next(e for e in data_extents(part) if e.lo <= offset < e.hi)
    at = ext.lo - ext.base + min(offset - ext.lo, ext.coded - 1) if ext.coded else offset - ext.base
    with open(ext.path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))
        f.flush()
        os.fsync(f.fileno())
    return ext.path


def evict(part: Path) -> None:
    """Drops the part's data file (or its chunks' files) from the page cache: the next read of it is cold."""
    for path in {e.path for e in data_extents(part)}:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def two_ranks(daemon: Any, job: str, attempt: str = "run") -> tuple[Any, Any]:
    """Clients for ranks 0 and 1 of a two-rank ``job`` (one attempt) on ``daemon``; the caller closes them."""
    from ckptstage.client import Client

    return (Client(job, socket=daemon.socket, rank=0, world_size=2, attempt=attempt),
            Client(job, socket=daemon.socket, rank=1, world_size=2, attempt=attempt))


def refuse_o_direct(monkeypatch: Any) -> None:
    """Makes the restore's ``open`` fail with EINVAL for O_DIRECT, as tmpfs before Linux 6.6 and some
    network file systems do (this machine's file systems all accept it)."""
    import errno

    real_open = os.open

    def no_direct(path: Any, flags: int, *args: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)


class RecordingTier:
    """A tier that is not the one it wraps (no isinstance of a concrete tier class passes): delegates to
    ``inner`` and records which operations were asked of it, to show a consumer uses only the interface."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if callable(value):
            def call(*args: Any, **kwargs: Any) -> Any:
                self.calls.append(name)
                return value(*args, **kwargs)
            return call
        return value


def begin_raw_save(conn: Any, job: str, step: int) -> tuple[str, str]:
    """A save begun over the wire and never finished (16 bytes of one tensor): it stays in flight until
    it is aborted or its session closes. Returns (session id, save id)."""
    from ckptstage.protos import layout

    sid = conn.call("OpenSession", pb.OpenSessionRequest(job=job, rank=0, world_size=1)).session_id
    conn.call("EnsureArena", pb.EnsureArenaRequest(session_id=sid, want_bytes=1 << 20))
    manifest = layout.encode_manifest({
        "format": layout.FORMAT, "job": job, "step": step, "rank": 0, "world_size": 1, "data_start": 64,
        "tensors": [{"name": "t", "dtype": "uint8", "shape": [16], "offset": 64, "nbytes": 16}],
        "tree": {"d": [[{"s": "t"}, {"T": 0}]]}})
    save = conn.call("BeginSave", pb.BeginSaveRequest(session_id=sid, step=step, manifest_json=manifest,
                                                      data_bytes=80))
    return str(sid), str(save.save_id)


def unit_directives(text: str, section: str) -> dict[str, list[str]]:
    """A systemd unit's (or drop-in's) directives in ``section`` (e.g. ``"[Service]"``): name -> every value."""
    found: dict[str, list[str]] = {}
    current = ""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            current = line
        elif line and not line.startswith("#") and current == section:
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


def mount(*args: str) -> None:
    """``mount ARGS``; raises CalledProcessError where it fails (not root, no permission in a container)."""
    subprocess.run(["mount", *args], check=True, capture_output=True, timeout=30)


def umount(path: Path) -> None:
    """Unmounts ``path``; a busy mount is detached now and freed by the kernel once idle."""
    if subprocess.run(["umount", str(path)], capture_output=True, check=False, timeout=30).returncode:
        subprocess.run(["umount", "--lazy", str(path)], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def read_only_mount(path: Path) -> Iterator[Callable[[], None]]:
    """``path`` made read-only, for root too: a bind mount of it over itself, remounted read-only.

    Skips the test where mounting is not permitted. Yields a function that
    makes ``path`` writable again early; the mount is undone at exit anyway.
    """
    try:
        mount("--bind", str(path), str(path))
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot bind-mount {path} here: {e}")
    mounted = True

    def writable() -> None:
        nonlocal mounted
        if mounted:
            umount(path)
            mounted = False

    try:
        mount("-o", "remount,bind,ro", str(path))
        with pytest.raises(OSError):  # read-only for root too, or the test would prove nothing
            (path / ".read-only-probe").touch()
        yield writable
    finally:
        writable()


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str | int, mode: str = "1777") -> Iterator[Path]:
    """A tmpfs of ``size`` bytes (or "24m") mounted at ``path`` (created); skips where mounting is not
    permitted."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        mount("-t", "tmpfs", "-o", f"size={size},mode={mode}", "tmpfs", str(path))
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    try:
        yield path
    finally:
        umount(path)


def booked_part(catalog: Any, storage: Any, tier_name: Any, job: str, step: int, record: bool = True,
                write: bool = True) -> Any:
    """A committed part of one rank written to ``storage`` (an ``FsTier``; ``write=False``: the one there)
    and added to ``catalog`` as the daemon's index holds it, with the step's commit record (in the catalogue,
    and on the tier when ``write``) unless ``record`` is False."""
    from ckptstage.daemon.catalog.parts import Part

    path = commit_part(storage.root, job, step, 0, world_size=1, created=float(step), attempt="a") if write \
        else layout.part_dir(storage.root, job, step, 0)
    part = Part.read(layout.PartRef(job, step, 0, path), tier_name, storage)
    catalog.add(part)
    if record:
        commit = layout.CommitRecord(job, step, "a", 1, float(step), {
            0: layout.CommittedPart(part.nbytes, part.digest, part.created, {})})
        catalog.set_record(tier_name, commit)
        if write:
            storage.create_commit_record(storage.step_location(job, step), commit)
    return part


def commit_part(tier: Path, job: str, step: int, rank: int, world_size: int = 2, created: float = 1.0,
                attempt: str | None = None, metrics: dict[str, float] | None = None) -> Path:
    """A committed part with an empty data file, written the way the daemon writes one."""
    writer = PartWriter(tier, "test-node", job, step, rank)
    writer.path(layout.DATA_FILE).write_bytes(b"")
    manifest = {"format": layout.FORMAT, "job": job, "step": step, "rank": rank, "world_size": world_size,
                "tensors": [], "tree": {}, "data_start": 0, "created": created, "metrics": metrics or {},
                "files": {layout.DATA_FILE: layout.FileEntry(0, 1 << 20, (layout.chunk_digest(b""),)).to_json()}}
    if attempt is not None:
        manifest["attempt"] = attempt
    return writer.commit(manifest)
