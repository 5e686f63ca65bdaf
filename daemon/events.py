"""Events: how a lower layer says what happened without knowing who acts on it.

The persister and the drainer publish what became of a save or a part
(written, committed, failed, drained) on a :class:`Bus`; the node subscribes
and does what follows (index, settle, drain, apply retention). Neither knows
the node, and each event is a small frozen dataclass defined beside its
publisher.

Publishing is synchronous: the handlers run on the publisher's thread, in
the order they subscribed, before :meth:`Bus.publish` returns, and a
handler's exception reaches the publisher. A publisher that must not go on
before its event is handled gets that order from the bus as it would from a
call: a save is acknowledged (``wait("local")`` wakes) only after the node
indexed it and queued it for draining; a drain counts as finished only after
the retention it triggers has run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

E = TypeVar("E")


class Bus:
    """Typed publish and subscribe, in process: a handler is subscribed to one event class."""

    def __init__(self) -> None:
        self._handlers: dict[type, tuple[Callable[[Any], object], ...]] = {}
        self._lock = threading.Lock()  # subscribing copies the tuple: publishing reads it without the lock

    def subscribe(self, kind: type[E], handler: Callable[[E], object]) -> None:
        """Calls ``handler(event)`` for every event of class ``kind`` (not its subclasses) published from now on;
        what it returns is ignored."""
        with self._lock:
            self._handlers[kind] = self._handlers.get(kind, ()) + (handler,)

    def publish(self, event: object) -> None:
        """Runs the handlers of ``event``'s class on this thread, in the order they subscribed (none: nothing)."""
        for handler in self._handlers.get(type(event), ()):
            handler(event)
