"""The daemon's side of the service notification protocol (``sd_notify``) of systemd and of launchers.

Whoever starts ``ckptstaged`` with ``$NOTIFY_SOCKET`` (systemd for a
``Type=notify`` unit, or a launcher that binds the socket itself) learns:

* ``READY=1`` once the local tier is recovered and the socket serves;
* ``STATUS=...`` a line for ``systemctl status`` (sessions, drain queue, the
  shared tier's state), on start and whenever it changes: the notifier's
  thread checks it every :data:`STATUS_CHECK_S` and sends a changed line at
  most once per :data:`STATUS_MIN_INTERVAL_S`, so ``systemctl status`` is never
  more than about a second behind, whatever the watchdog's period;
* ``WATCHDOG=1`` every heartbeat when the service manager asks for it
  (``$WATCHDOG_USEC``, and ``$WATCHDOG_PID`` naming this process if set): the
  heartbeat runs on the loop that answers RPCs, so a hung loop stops the pings
  and systemd restarts the daemon;
* ``STOPPING=1`` when shutdown begins.

Without ``$NOTIFY_SOCKET`` every call does nothing. Messages are sent by one
thread of their own through a bounded queue: a receiver that stops reading
(``sendmsg`` on a full datagram queue blocks) then delays only that thread,
never the RPC loop whose liveness the pings report.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

# How often the STATUS line is computed (from memory: cheap), and how often a changed one may be sent.
STATUS_CHECK_S = 0.5
STATUS_MIN_INTERVAL_S = 1.0
_QUEUE_MAX = 64
_TICK = "tick"  # a heartbeat: WATCHDOG=1 if asked for
_STATUS = "status"  # the line now, sent at once whatever the rate (start, READY)


def watchdog_interval_s(env: Mapping[str, str], pid: int) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings: half of ``$WATCHDOG_USEC`` (systemd's advice), or None
    when no watchdog is asked of this process (unset, not a positive number, or ``$WATCHDOG_PID``
    naming another process, e.g. a wrapper's)."""
    usec = env.get("WATCHDOG_USEC", "")
    owner = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if owner and owner != str(pid):
        return None
    return int(usec) / 2e6


def _sd_notify(line: str) -> None:
    from cysystemd.daemon import sd_notify

    sd_notify(line, False)  # raises ValueError carrying the negative errno when the send fails


class Notifier:
    """Sends notifications to ``$NOTIFY_SOCKET``; a no-op when the variable is unset.

    ``status`` (called on the notifier's thread, never on the RPC loop) returns the current STATUS
    line. ``env``, ``pid`` and ``send`` are injectable for tests; ``send`` takes one
    ``VARIABLE=value`` line (default: cysystemd's ``sd_notify``).
    """

    def __init__(self, status: Callable[[], str], env: Mapping[str, str] | None = None, pid: int | None = None,
                 send: Callable[[str], None] = _sd_notify, clock: Callable[[], float] = time.monotonic) -> None:
        env = os.environ if env is None else env
        self.enabled = bool(env.get("NOTIFY_SOCKET"))
        self.watchdog_s = watchdog_interval_s(env, os.getpid() if pid is None else pid) if self.enabled else None
        self._status = status
        self._send = send
        self._queue: queue.Queue[str | None] = queue.Queue(_QUEUE_MAX)
        self._last_status = ""
        self._clock = clock
        self._status_sent_at = -math.inf
        self._stopping = False
        self._failed_once = False
        self._thread = threading.Thread(target=self._run, name="sd-notify", daemon=True)
        if self.enabled:
            self._thread.start()

    @property
    def heartbeat_s(self) -> float | None:
        """How often :meth:`heartbeat` should be called; None: never (no watchdog is asked for)."""
        return self.watchdog_s

    def ready(self) -> None:
        """The daemon serves: its STATUS line, then ``READY=1`` (so the first status is there when
        ``systemctl start`` returns)."""
        self._put(_STATUS)
        self._put("READY=1")

    def heartbeat(self) -> None:
        """Called by the RPC loop every :attr:`heartbeat_s`: the watchdog ping. Never blocks (the queue
        is bounded; a full one means the receiver is not reading)."""
        self._put(_TICK)

    def stopping(self, status: str) -> None:
        """Shutdown begins: ``STOPPING=1`` and a last STATUS line (heartbeats no longer replace it)."""
        self._put("STOPPING=1")
        self._put(f"STATUS={status}")

    def close(self, timeout: float = 2.0) -> None:
        """Sends what is queued (bounded by ``timeout``), then stops the thread."""
        if self._thread.is_alive():
            self._put(None)
            self._thread.join(timeout)

    def _put(self, item: str | None) -> None:
        if not self.enabled:
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            pass  # the receiver is not reading: this heartbeat is lost like the ones before it

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=STATUS_CHECK_S)
            except queue.Empty:
                self._refresh_status(now=False)
                continue
            if item is None:
                return
            if item == _TICK:
                if self.watchdog_s is not None:
                    self._deliver("WATCHDOG=1")
                self._refresh_status(now=False)
            elif item == _STATUS:
                self._refresh_status(now=True)
            else:
                if item == "STOPPING=1":
                    self._stopping = True
                self._deliver(item)

    def _refresh_status(self, now: bool) -> None:
        """Sends the STATUS line if it changed, and (unless ``now``) the last one went out long enough ago;
        a change held back goes out at a later check."""
        if self._stopping:  # the stopping line stays
            return
        if not now and self._clock() - self._status_sent_at < STATUS_MIN_INTERVAL_S:
            return
        try:
            status = self._status()
        except Exception:  # noqa: BLE001 - a status line must not end the notifier
            log.exception("cannot compute the service status line")
            return
        if status != self._last_status:
            self._last_status = status
            self._status_sent_at = self._clock()
            self._deliver(f"STATUS={status}")

    def _deliver(self, line: str) -> None:
        try:
            self._send(line)
        except (OSError, ValueError, RuntimeError) as e:
            # The launcher may close its socket once it has READY=1: say so once, not every heartbeat.
            if not self._failed_once:
                self._failed_once = True
                log.warning("cannot notify the service manager (%s): %s; later failures are not logged",
                            line.split("=", 1)[0], e)
