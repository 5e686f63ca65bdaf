"""``ckptstaged``: the node daemon's entry point (flags, socket, signals, metrics endpoint)."""

from __future__ import annotations

import argparse
import errno
import faulthandler
import fcntl
import logging
import os
import signal
import socket as socketlib
import stat
import sys
import threading
from pathlib import Path
from typing import IO, Any

from ckptstage.daemon import fsutil, logs, tierpath
from ckptstage.daemon.config import Config, ConfigError, load_config
from ckptstage.daemon.configvalues import format_size
from ckptstage.daemon.serve.handoff import HandoffServer
from ckptstage.daemon.node.node import STATE_DIR, VERSION, Node
from ckptstage.daemon.serve.notify import Notifier
from ckptstage.daemon.node.status import OK
from ckptstage.daemon.tiers.interface import TierName
from ckptstage.daemon.serve.peerserver import PeerServer
from ckptstage.daemon.serve.server import RpcServer
from ckptstage.protos.handoff import socket_path as handoff_socket

log = logging.getLogger("ckptstaged")

# Exit status of a configuration the daemon cannot run with (a bad key, or a directory, socket or
# port it cannot use): one line on stderr names the key, the value and the reason. EX_CONFIG from
# sysexits.h, distinct from argparse's 2 for a bad flag. Documented in deploy/systemd/README.md and
# default.toml; the unit does not restart on it (RestartPreventExitStatus=78).
EXIT_CONFIG = 78


class StartupError(Exception):
    """A configured value the daemon cannot use on this machine, found while starting."""

    def __init__(self, key: str, value: object, reason: str) -> None:
        super().__init__(f"{key} = {str(value)!r}: {reason}")


def _cannot(key: str, value: object, what: str, e: OSError) -> StartupError:
    """``key = 'value': cannot <what>: <reason> (<the path that failed>, when it is not the value)``."""
    where = f" ({e.filename})" if e.filename and str(e.filename) != str(value) else ""
    return StartupError(key, value, f"cannot {what}: {e.strerror or e}{where}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ckptstaged", description="ckptstage node daemon. Flags override the config file.")
    p.add_argument("--config", type=Path, help="TOML config file (default: built-in defaults)")
    p.add_argument("--socket", help="Unix socket to serve on")
    p.add_argument("--local-dir", help="local tier directory (node SSD)")
    p.add_argument("--shared-dir", help="shared tier directory (parallel file system)")
    p.add_argument("--shared-url", help="shared tier on an S3-compatible object store: s3://bucket/prefix")
    p.add_argument("--metrics-listen", help="HOST:PORT for Prometheus /metrics")
    p.add_argument("--log-level", default=os.environ.get("CKPTSTAGE_LOG_LEVEL", "INFO"),
                   help="DEBUG, INFO, WARNING, ERROR or CRITICAL (default: $CKPTSTAGE_LOG_LEVEL, else INFO)")
    p.add_argument("--log-format", default=os.environ.get("CKPTSTAGE_LOG_FORMAT", "auto"),
                   help="text (key=value fields), json (one object per line), journal (journal fields), or "
                        "auto: journal when stderr is systemd's journal stream, else text "
                        "(default: $CKPTSTAGE_LOG_FORMAT, else auto)")
    p.add_argument("--version", action="version", version=f"ckptstaged {VERSION}")
    args = p.parse_args(argv)
    if args.log_format not in logs.FORMATS:
        p.error(f"--log-format: {args.log_format!r} is not one of {', '.join(logs.FORMATS)}")
    if not isinstance(logging.getLevelName(args.log_level.upper()), int):
        p.error(f"--log-level: {args.log_level!r} is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
    return args


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    flags = {"socket": args.socket, "local.dir": args.local_dir, "shared.dir": args.shared_dir,
             "shared.url": args.shared_url, "metrics.listen": args.metrics_listen}
    return {k: v for k, v in flags.items() if v is not None}


class Daemon:
    """One running daemon: node, gRPC server on the Unix socket, optional metrics server."""

    def __init__(self, config: Config, notifier: Notifier | None = None) -> None:
        self.config = config
        self._lock_file = self._lock_local_tier()
        _check_tiers_disjoint(config)
        self.node = Node(config, attach_timeout_s=config.arena.attach_timeout_s)
        self.metrics_url = ""
        self._stopped = threading.Event()
        self._done = threading.Event()
        self.rpc = RpcServer(self.node, config.socket)
        self.handoff = HandoffServer(handoff_socket(config.socket), self.node.memory, self.node.metrics,
                                     self.node.take_lifeline)
        self.notifier = notifier or Notifier(self.status_line)
        self.peer_server: PeerServer | None = None

    def start(self) -> None:
        """Claims the socket and the metrics port, recovers the local tier, then serves.

        What can fail for a reason of configuration fails first, before any
        thread starts, as a :class:`StartupError`. The service manager hears
        ``READY=1`` once this returns: temporaries are gone, the local tier is
        indexed and the socket answers (the shared tier is indexed on the
        drainer's thread: a hung shared file system must not hold the node).
        """
        _prepare_socket(self.config.socket)
        self._start_metrics()
        if self.node.peers is not None:
            try:
                self.peer_server = PeerServer(self.config.peers, self.node.peers, self.node.metrics)
            except OSError as e:
                raise StartupError("peers.listen", self.config.peers.listen, str(e)) from e
        self.rpc.set_metrics_url(self.metrics_url)
        try:
            self.node.recover()
        except OSError as e:  # e.g. a link planted in the local tier: the operator must look at it
            raise _cannot("local.dir", self.config.local.dir, "recover it", e) from e
        try:
            self.handoff.start()
        except OSError as e:
            raise StartupError("socket", self.handoff.path, f"cannot listen on it: {e}") from e
        try:
            self.rpc.start()
        except RuntimeError as e:  # grpc: "Failed to bind to address ..."
            raise StartupError("socket", self.config.socket, f"cannot listen on it: {e}") from e
        if self.peer_server is not None:
            self.peer_server.start()
            log.info("peers on %s, advertised as %s", self.config.peers.listen, self.config.peers.address)
        shared = self.node.tiers.get(TierName.SHARED)
        log.info("ckptstaged %s serving on %s (local %s, shared %s, arena budget %d bytes)", VERSION,
                 self.config.socket, self.config.local.dir, shared.location if shared is not None else "disabled",
                 self.node.budget.total)
        if self.notifier.heartbeat_s is not None:
            self.rpc.start_heartbeat(self.notifier.heartbeat_s, self.notifier.heartbeat)
        self.notifier.ready()

    def status_line(self) -> str:
        """The service's one-line state for ``systemctl status``: sessions and the drain queue."""
        sessions = len(self.node.sessions.all())
        line = f"serving: {sessions} session{'' if sessions == 1 else 's'}"
        drainer = self.node.drainer
        if drainer is None:
            return line + ", no shared tier"
        parts, nbytes = drainer.pending()
        line += f", drain queue {parts} part{'' if parts == 1 else 's'} ({format_size(nbytes)})"
        state = self.node.tier_status(TierName.SHARED).state  # as `ckptstage status` says it
        return line + ("" if state == OK else f", shared tier {state}")

    def stop(self) -> None:
        """SIGTERM path: refuse new work, let in-flight saves commit (bounded), exit."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        timeout = self.config.persist.shutdown_timeout_s
        drain_s = self.config.shared.drain_on_stop_s if self.node.drainer is not None else 0.0
        then = f", then draining each job's newest step (up to {drain_s:.0f}s)" if drain_s else ""
        self.notifier.stopping(f"stopping: finishing in-flight saves (up to {timeout:.0f}s){then}")
        log.info("shutting down: finishing in-flight saves (up to %.0fs)%s", timeout, then)
        self.rpc.begin_shutdown()
        if self.peer_server is not None:
            self.peer_server.stop(grace=1)
        self.node.shutdown(timeout, drain_s)
        self.handoff.stop()
        self.rpc.stop(grace=2)
        try:
            self.config.socket.unlink()
        except FileNotFoundError:
            pass
        log.info("stopped")
        self.notifier.close()
        self._done.set()

    def wait(self) -> None:
        # Timed waits: a signal the kernel hands to another thread (e.g. the
        # SIGTERM pending when a stopped or frozen daemon is continued) runs its
        # Python handler only once the main thread executes bytecode again.
        while not self._done.wait(0.5):
            pass

    def _start_metrics(self) -> None:
        listen = self.config.metrics.listen
        if not listen:
            return
        from prometheus_client import disable_created_metrics, start_http_server

        disable_created_metrics()  # the _created series only double the scrape here

        try:
            start_http_server(self.config.metrics.port, addr=self.config.metrics.host,
                              registry=self.node.metrics.registry)
        except OSError as e:  # in use, or an address not on this host
            raise _cannot("metrics.listen", listen, "listen there", e) from e
        self.metrics_url = f"http://{listen}/metrics"
        log.info("metrics on %s", self.metrics_url)

    def _lock_local_tier(self) -> IO[bytes]:
        """Two daemons must never share a local tier: hold an exclusive lock on it."""
        local = self.config.local.dir
        state = local / STATE_DIR
        try:
            fsutil.makedirs_durable(state, within=local)
            probe = state / f".write-probe-{os.getpid()}"
            probe.unlink(missing_ok=True)  # left by a crashed daemon that had this pid (containers reuse pids)
            fsutil.write_file_durable(probe, b"")  # the tier must be writable, not just its lock file
            probe.unlink()
            fd = os.open(state / "daemon.lock", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
                         | os.O_CLOEXEC, fsutil.PRIVATE_FILE)
        except OSError as e:
            raise _cannot("local.dir", local, "create or write it", e) from e
        f = os.fdopen(fd, "ab")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise StartupError("local.dir", local, f"another daemon already uses the local tier {local} "
                                                   "(one daemon per local tier)") from None
        return f


def _check_tiers_disjoint(config: Config) -> None:
    """Refuses tiers that overlap once links are resolved; bounded, as the shared tier may hang.

    When the shared tier does not answer in time the daemon starts anyway and
    the drainer repeats the check (:func:`tierpath.check_disjoint`) before
    its first use of the shared tier.
    """
    if config.shared.dir is None:
        return
    try:
        tierpath.check_disjoint(config.local.dir, config.shared.dir)
    except tierpath.TiersOverlap as e:
        raise StartupError("shared.dir", config.shared.dir, str(e)) from None


def _prepare_socket(path: Path) -> None:
    """Creates the socket's directory (0700: only this user may connect) and clears a stale socket."""
    try:
        if not path.parent.exists():
            path.parent.mkdir(parents=True, mode=0o700)
        if not os.access(path.parent, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable")
    except OSError as e:
        raise _cannot("socket", path, f"create a socket in {path.parent}", e) from e
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise StartupError("socket", path, "exists and is not a socket; remove it or choose another path")
    probe = socketlib.socket(socketlib.AF_UNIX)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()  # nobody listens: left by a killed daemon
    else:
        raise StartupError("socket", path, "another ckptstaged is serving on it (one daemon per socket)")
    finally:
        probe.close()


def main(argv: list[str] | None = None) -> int:
    # Private by default: manifests hold every plain value of a training state. Every file and
    # directory the daemon creates is 0600/0700, whatever umask it was started with.
    os.umask(0o077)
    # A fatal signal (the watchdog's SIGABRT when the loop hangs, a SIGSEGV) writes every thread's
    # stack to stderr, which the unit sends to the journal: the one trace of where the daemon hung.
    faulthandler.enable(all_threads=True)
    args = parse_args(argv)
    log_format = logs.configure(args.log_format, args.log_level, sys.stderr)
    daemon: Daemon | None = None
    try:
        config = load_config(args.config, overrides_from(args))
        daemon = started = Daemon(config)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: threading.Thread(target=started.stop, name="shutdown").start())
        daemon.start()
    except (ConfigError, StartupError) as e:
        if daemon is not None:
            daemon.rpc.discard()
        if log_format == "text":
            print(f"ckptstaged: {e}", file=sys.stderr)
        else:  # one JSON object, or one journal entry at error priority
            log.error("%s", e, extra=logs.fields(error=str(e)))
        return EXIT_CONFIG
    daemon.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
