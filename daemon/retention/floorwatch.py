"""The local tier's free-space floor (``local.min_free_bytes``), watched for a disk already below it.

``min_free_bytes`` evicts the oldest drained steps while the disk has less
free space than the floor. On a disk that is below the floor whatever the
daemon deletes (a floor larger than the disk, or space taken by something
else), every retention pass evicts all it may, at each commit: a node keeps
only the steps retention never deletes, and the operator sees nothing but
INFO lines. :class:`FloorWatch` turns that into one WARNING per episode (the
disk below the floor after a retention pass; the episode ends at the first
pass that leaves it above), naming the key and the figures, and a warning
that ``ckptstage status`` shows while the episode lasts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ckptstage.daemon.configvalues import format_size
from ckptstage.daemon.logs import fields

log = logging.getLogger(__name__)

KEY = "local.min_free_bytes"


class FloorWatch:
    """Whether the local tier stays below its free-space floor after retention; see the module."""

    def __init__(self, floor: int | None, location: str, free_bytes: Callable[[], int | None]) -> None:
        """``floor``: ``local.min_free_bytes`` (None: no floor, nothing to watch); ``free_bytes`` reads the
        tier's free space now (None: cannot tell)."""
        self.floor = floor
        self.location = location
        self._free_bytes = free_bytes
        self._lock = threading.Lock()
        self._warning = ""

    @property
    def warning(self) -> str:
        """The episode's warning while the disk stays below the floor; "" otherwise."""
        return self._warning

    def after_pass(self, evicted: int) -> None:
        """Called after each local retention pass that deleted ``evicted`` steps (dry runs excluded)."""
        if self.floor is None:
            return
        free = self._free_bytes()
        if free is None:
            return
        with self._lock:
            below = free < self.floor
            if below and not self._warning:
                self._warning = (
                    f"{KEY} = {format_size(self.floor)} but {self.location} has {format_size(free)} free after "
                    f"retention: every local step retention may delete is evicted at each commit; lower "
                    f"{KEY} below what the disk can free, or free space on it")
                log.warning("%s (%d step(s) evicted in this pass)", self._warning, evicted,
                            extra=fields(tier="local", bytes=free, key=KEY, floor_bytes=self.floor))
            elif not below and self._warning:
                self._warning = ""
                log.info("%s holds again: %s has %s free (floor %s)", KEY, self.location, format_size(free),
                         format_size(self.floor), extra=fields(tier="local", bytes=free, key=KEY,
                                                               floor_bytes=self.floor))
