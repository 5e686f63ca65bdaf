"""Open clients at interpreter exit: their snapshots in flight finish, then they close.

A script that calls ``client.save(step, state)`` and ends (no ``wait``, no
``close()``) expects that checkpoint: the copy into the daemon's arena runs on
the client's snapshot thread, a daemon thread the interpreter would stop at
exit, dropping the save. At exit every client still open therefore waits for
its snapshots in flight (until the daemon holds each save whole: it then
commits it whatever this process does), for at most its ``exit_timeout``,
and closes.

Closing also ends the threads that sit in gRPC calls (the session's event
stream, the channel's polling thread): a thread left in one into interpreter
finalization is stopped inside C++ frames and the process aborts
("terminate called without an active exception", status 134) instead of
exiting with its own status, whatever error came before.

A process killed by a signal is the crash case: what the daemon already held
is committed, nothing else is.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import weakref
from typing import Protocol

log = logging.getLogger(__name__)

EXIT_TIMEOUT_ENV = "CKPTSTAGE_EXIT_TIMEOUT"
DEFAULT_EXIT_TIMEOUT_S = 60.0


class Closable(Protocol):
    def close_at_exit(self) -> None:
        """Finishes what the daemon must still get (bounded), then closes; never raises."""


_open: weakref.WeakSet[Closable] = weakref.WeakSet()
_lock = threading.Lock()
_hooked = False


def exit_timeout(given: float | None) -> float:
    """The bound on the wait at exit: ``given``, else ``$CKPTSTAGE_EXIT_TIMEOUT``, else 60 s."""
    if given is not None:
        value, where = float(given), "exit_timeout"
    else:
        raw = os.environ.get(EXIT_TIMEOUT_ENV)
        if raw is None:
            return DEFAULT_EXIT_TIMEOUT_S
        where = f"${EXIT_TIMEOUT_ENV}"
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{where}={raw!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where} must be a number of seconds >= 0, not {value!r}")
    return value


def track(client: Closable) -> None:
    """Closes ``client`` at interpreter exit unless it was closed (or collected) first.

    The hook is installed with the first client, after grpc and torch are
    imported: exit handlers run last-registered first, so it runs while both
    still work.
    """
    global _hooked
    with _lock:
        if not _hooked:
            atexit.register(_at_exit)
            os.register_at_fork(after_in_child=_forget_in_child)
            _hooked = True
        _open.add(client)


def untrack(client: Closable) -> None:
    with _lock:
        _open.discard(client)


def _forget_in_child() -> None:
    # A forked child (a DataLoader worker) has none of its parent's threads: its copies of the parent's
    # clients have nothing to finish, and closing them would end the parent's session.
    _open.clear()


def _at_exit() -> None:
    with _lock:
        clients = list(_open)
        _open.clear()
    for client in clients:
        try:
            client.close_at_exit()
        except Exception:  # noqa: BLE001 - the other clients still close
            log.exception("ckptstage: closing a client at exit failed")
