"""Starts, stops and restarts a ``ckptstaged`` process: one launcher for the tests, the benchmarks and the demo.

A :class:`DaemonProcess` owns a root directory. It writes the daemon's config
there (dotted settings over defaults, validated and rendered by the daemon's
own :func:`~ckptstage.daemon.config.load_config` and
:func:`~ckptstage.daemon.config.dump_config`) or takes a config file it is
given, and runs ``python -m ckptstage.daemon.main --config FILE`` with stdout
and stderr appended to ``ROOT/daemon.log``.

Readiness is the systemd protocol, as under the packaged unit: the launcher
binds an ``AF_UNIX`` datagram socket in the root, passes it to the daemon as
``NOTIFY_SOCKET``, and :meth:`DaemonProcess.start` returns once the daemon
process itself (the sender's pid is checked, as systemd's ``NotifyAccess=main``
does) sent ``READY=1``: by then it serves on its socket. A daemon that exits
first raises :class:`DaemonExited` with its exit status and the tail of its
output (a configuration error is status 78, one line naming the key). Where the
installed daemon does not send ``READY=1`` (decided once per daemon module, from
its source) the launcher instead waits until a ``Status`` call answers.

Imports neither torch nor the client: a benchmark or a tool may start a daemon
without either.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import secrets
import signal
import socket as socketlib
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from ckptstage.daemon.config import Config, dump_config, load_config

MODULE = "ckptstage.daemon.main"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 60.0  # SIGTERM lets in-flight saves commit (persist.shutdown_timeout_s): then SIGKILL
_TAIL_LINES = 40
_MAX_UNIX_PATH = 107  # sun_path holds 108 bytes, the last a NUL


class DaemonExited(RuntimeError):
    """The daemon exited before it was ready; ``returncode`` (negative: the signal) and its ``output`` tail."""

    def __init__(self, returncode: int, output: str, log: Path) -> None:
        how = (f"was killed by {signal.Signals(-returncode).name}" if returncode < 0
               else f"exited with status {returncode}")
        super().__init__(f"ckptstaged {how} before it was ready (log {log}):\n{output}")
        self.returncode = returncode
        self.output = output


class DaemonNotReady(TimeoutError):
    """The daemon neither became ready nor exited in time."""


@functools.cache
def sends_ready(module: str = MODULE) -> bool:
    """Whether the daemon ``module`` tells its readiness over ``NOTIFY_SOCKET`` (read from its source, once)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"no daemon module {module!r}")
    return re.search(r"\bnotify\b|READY=1", Path(spec.origin).read_text(encoding="utf-8")) is not None


class DaemonProcess:
    """A ``ckptstaged`` subprocess with its own socket, tiers, config file and log, all under ``root``.

    ``settings`` are dotted config keys (``{"shared.keep_last": 3}``) applied
    over ``defaults``, which apply over the launcher's own: socket
    ``ROOT/run/ckptstage.sock``, local tier ``ROOT/local``, shared tier
    ``ROOT/shared`` (``"shared.dir": ""`` turns it off). ``config`` instead
    names a TOML file to run as it is (no settings then). ``log_level``
    is passed as ``--log-level`` (None: the daemon's default), ``args`` are
    more flags, ``env`` more environment variables. :attr:`wrapper`: a command
    the daemon's runs under, which must exec it in its own process (the
    benchmarks' ``strace -D``), so that its pid, signals and notifications stay
    the daemon's.

    :attr:`socket`, :attr:`local`, :attr:`shared` follow the config; a test may
    also set them and call :meth:`write_config` to point the daemon elsewhere.
    """

    config: Config  # the daemon's configuration as last written (or read from the given file)

    def __init__(self, root: Path, settings: Mapping[str, Any] | None = None, *, config: Path | None = None,
                 defaults: Mapping[str, Any] | None = None, log_level: str | None = None,
                 args: Sequence[str] = (), env: Mapping[str, str] | None = None, module: str = MODULE,
                 ready_timeout: float = READY_TIMEOUT_S, stop_timeout: float = STOP_TIMEOUT_S) -> None:
        if config is not None and (settings or defaults):
            raise ValueError("pass either a config file or settings, not both")
        self.root = Path(root)
        self.log = self.root / "daemon.log"
        self.settings: dict[str, Any] = dict(settings or {})
        self.defaults: dict[str, Any] = dict(defaults or {})
        self.log_level = log_level
        self.args = list(args)
        self.env = dict(env or {})
        self.module = module
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.wrapper: list[str] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self._notify: _NotifySocket | None = None
        self._notes: list[str] = []  # what the latest process sent, once its socket is closed
        self._log_offset = 0
        self.socket: Path = self.root / "run" / "ckptstage.sock"
        self.local: Path = self.root / "local"
        self.shared: Path | None = self.root / "shared"
        self.root.mkdir(parents=True, exist_ok=True)
        self._owns_config = config is None
        if config is None:
            self.config_path = self.root / "ckptstaged.toml"
            self.write_config()
        else:
            self.config_path = Path(config)
            self._adopt(load_config(self.config_path, env={**os.environ, **self.env}))

    # --- the config ---------------------------------------------------------------------

    def write_config(self, **settings: Any) -> None:
        """(Re)writes the config with ``settings`` added to the earlier ones; read at the next start.

        A setting of None drops an earlier one (the key's default again).
        """
        if not self._owns_config:
            raise ValueError(f"{self.config_path} was given to the launcher: it does not rewrite it")
        self.settings.update(settings)
        overrides: dict[str, Any] = {"socket": str(self.socket), "local.dir": str(self.local),
                                     "shared.dir": str(self.shared) if self.shared is not None else ""}
        overrides.update(self.defaults)
        overrides.update(self.settings)
        cfg = load_config(None, overrides, env={"HOME": str(self.root)})
        self.config_path.write_text(dump_config(cfg))
        self._adopt(cfg)

    def _adopt(self, cfg: Config) -> None:
        self.config = cfg
        self.socket, self.local, self.shared = cfg.socket, cfg.local.dir, cfg.shared.dir

    @property
    def metrics_url(self) -> str | None:
        """``http://HOST:PORT/metrics``, or None without ``metrics.listen``."""
        listen = self.config.metrics.listen
        return f"http://{listen}/metrics" if listen else None

    # --- the process --------------------------------------------------------------------

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("ckptstaged was never started")
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def notifications(self) -> list[str]:
        """What the daemon process sent to ``NOTIFY_SOCKET`` since its start (``"READY=1"``, ...), in order."""
        if self._notify is not None and self.proc is not None:
            return self._notify.messages_from(self.proc.pid)
        return list(self._notes)

    def start(self, wait: bool = True, timeout: float | None = None) -> Self:
        """Starts the daemon; with ``wait``, returns once it is ready (see :meth:`wait_ready`)."""
        if self.running:
            raise RuntimeError(f"ckptstaged (pid {self.pid}) is already running")
        self._release()
        self._notes = []
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        env.pop("NOTIFY_SOCKET", None)  # never the caller's own service manager
        if sends_ready(self.module):
            self._notify = _NotifySocket(self.root / "notify.sock")
            env["NOTIFY_SOCKET"] = self._notify.address
        cmd = [*self.wrapper, sys.executable, "-m", self.module, "--config", str(self.config_path)]
        if self.log_level is not None:
            cmd += ["--log-level", self.log_level]
        cmd += self.args
        with open(self.log, "ab") as logf:
            self._log_offset = logf.tell()
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                         env=env)
        if wait:
            try:
                self.wait_ready(timeout)
            except DaemonNotReady:
                self.stop()
                raise
            except DaemonExited:
                self._release()
                raise
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Until the daemon is ready; :class:`DaemonExited` if it exits first, :class:`DaemonNotReady` after
        ``timeout`` seconds (default ``ready_timeout``)."""
        proc = self.proc
        if proc is None:
            raise RuntimeError("ckptstaged was never started")
        limit = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not self._is_ready(proc.pid):
            code = proc.poll()
            if code is not None:
                raise DaemonExited(code, self.output_tail(), self.log)
            if time.monotonic() > deadline:
                raise DaemonNotReady(f"ckptstaged (pid {proc.pid}) not ready after {limit:g}s (log {self.log}):\n"
                                     f"{self.output_tail()}")
            if self._notify is None:
                time.sleep(0.05)

    def _is_ready(self, pid: int) -> bool:
        if self._notify is not None:
            return self._notify.wait_ready(pid, 0.05)
        return _answers(self.socket)

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM, then waits (``stop_timeout`` by default) and SIGKILLs; returns the exit status (None: never
        started). A daemon already gone is only reaped."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(self.stop_timeout if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._release()
        return proc.returncode

    def kill(self, sig: int = signal.SIGKILL) -> int:
        """Sends ``sig`` (SIGKILL: a crash) and waits for the process to exit; returns its exit status."""
        if self.proc is None:
            raise RuntimeError("ckptstaged was never started")
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=60)
        self._release()
        return code

    def restart(self, wait: bool = True, timeout: float | None = None) -> Self:
        """:meth:`stop`, then :meth:`start` on the same config, socket and tiers."""
        self.stop()
        return self.start(wait, timeout)

    def _release(self) -> None:
        if self._notify is not None:
            self._notify.close()
            if self.proc is not None:
                self._notes = self._notify.messages_from(self.proc.pid)
            self._notify = None

    # --- its output -----------------------------------------------------------------------

    def output_tail(self, lines: int = _TAIL_LINES) -> str:
        """The last ``lines`` lines the daemon wrote since its latest start."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self._log_offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def log_tail(self, lines: int = _TAIL_LINES) -> str:
        """The last ``lines`` lines of the whole log (every start)."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.proc.pid}" if self.running and self.proc else "stopped"
        return f"<DaemonProcess {self.root} {state}>"


class _NotifySocket:
    """The launcher's end of ``NOTIFY_SOCKET``: sd_notify datagrams, each recorded under its sender's pid.

    A thread reads them as they come, so a daemon never blocks on a full
    socket buffer, whether or not anyone waits.
    """

    def __init__(self, path: Path) -> None:
        self._sock = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_DGRAM | socketlib.SOCK_CLOEXEC)
        self._path: Path | None = None
        try:
            self._sock.setsockopt(socketlib.SOL_SOCKET, socketlib.SO_PASSCRED, 1)  # the sender's pid with each
            if len(os.fsencode(path)) <= _MAX_UNIX_PATH:
                path.unlink(missing_ok=True)  # left by a launcher that was killed
                self._sock.bind(str(path))
                os.chmod(path, 0o600)
                self._path = path
                self.address = str(path)
            else:  # a root too deep for a socket path: an abstract name (Linux), "@..." in NOTIFY_SOCKET
                name = f"ckptstage-notify-{os.getpid()}-{secrets.token_hex(8)}"
                self._sock.bind("\0" + name)
                self.address = "@" + name
        except OSError:
            self._sock.close()
            raise
        self._cond = threading.Condition()
        self._messages: list[tuple[int, str]] = []
        self._closing = False
        self._thread = threading.Thread(target=self._read, name="ckptstaged-notify", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        space = socketlib.CMSG_SPACE(struct.calcsize("3i"))
        while True:
            try:
                data, ancillary, _, _ = self._sock.recvmsg(65536, space)
            except OSError:
                return
            if self._closing:
                return
            pid = next((struct.unpack("3i", payload[:12])[0] for level, kind, payload in ancillary
                        if level == socketlib.SOL_SOCKET and kind == socketlib.SCM_CREDENTIALS), 0)
            with self._cond:
                self._messages += [(pid, line) for line in data.decode(errors="replace").splitlines() if line]
                self._cond.notify_all()

    def messages_from(self, pid: int) -> list[str]:
        with self._cond:
            return [line for sender, line in self._messages if sender == pid]

    def wait_ready(self, pid: int, timeout: float) -> bool:
        """Whether ``pid`` has sent ``READY=1``, waiting up to ``timeout`` seconds for it."""
        with self._cond:
            return self._cond.wait_for(lambda: (pid, "READY=1") in self._messages, timeout)

    def close(self) -> None:
        self._closing = True
        try:
            self._sock.shutdown(socketlib.SHUT_RDWR)  # wakes the reader
        except OSError:
            pass
        self._thread.join(timeout=5)
        self._sock.close()
        if self._path is not None:
            self._path.unlink(missing_ok=True)


def _answers(socket: Path) -> bool:
    """Whether a daemon answers a ``Status`` call on ``socket`` (readiness of a daemon without ``READY=1``)."""
    if not socket.exists():
        return False
    import grpc

    from ckptstage.protos.v1 import ckptstage_pb2 as pb
    from ckptstage.protos.v1 import ckptstage_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"unix:{socket}") as channel:
        try:
            pb_grpc.CheckpointerStub(channel).Status(pb.StatusRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return True
