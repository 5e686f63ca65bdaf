"""Progress of a long command (``ckptstage drain --wait``, ``prefetch``) on stderr.

On a terminal a tqdm bar; elsewhere (a job log, a pipe) plain lines: one when
the numbers change, at most one every ``interval`` seconds, and a last one at
the end, never a carriage return. The caller samples what it measures and
hands over absolute values (``done`` of ``total``); this module only shows them.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any, Literal, TextIO

Mode = Literal["auto", "bar", "lines", "none"]
MODES: tuple[str, ...] = ("auto", "bar", "lines", "none")
# Plain lines: at most one per this many seconds while the numbers change.
LINE_INTERVAL_S = 2.0


def size_text(n: int) -> str:
    """A byte count for people: ``512 B``, ``1.5 GiB``."""
    value = float(n)
    for name in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or name == "TiB":
            return f"{value:.0f} {name}" if name == "B" else f"{value:.1f} {name}"
        value /= 1024
    return f"{n} B"


def _count(n: int, unit: str) -> str:
    return size_text(n) if unit == "B" else f"{n} {unit}(s)"


class Progress:
    """``update(done, total, note)`` as the work goes; ``close(final)`` once it ends."""

    def __init__(self, what: str, unit: str, mode: Mode = "auto", stream: TextIO | None = None,
                 interval: float = LINE_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.unit, self.interval, self.clock = what, unit, interval, clock
        self.stream = stream if stream is not None else sys.stderr
        if mode == "auto":
            mode = "bar" if _isatty(self.stream) else "lines"
        self.mode = mode
        self._bar: Any = None
        self._shown: tuple[int, int, str] | None = None
        self._latest: tuple[int, int, str] | None = None
        self._last_line = float("-inf")

    def update(self, done: int, total: int, note: str = "") -> None:
        self._latest = (done, total, note)
        if self.mode == "bar":
            self._draw_bar(done, total, note)
        elif self.mode == "lines" and self._latest != self._shown and self.clock() - self._last_line >= self.interval:
            self._line()

    def close(self, final: str = "") -> None:
        """Shows the last numbers (a line they have not had yet), then ``final`` if given."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.mode == "lines" and self._latest is not None and self._latest != self._shown:
            self._line()
        if final and self.mode != "none":
            print(f"{self.what}: {final}", file=self.stream, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _draw_bar(self, done: int, total: int, note: str) -> None:
        if self._bar is None:
            from tqdm import tqdm  # only for a terminal: the command imports fast otherwise

            scale = self.unit == "B"
            self._bar = tqdm(total=total, desc=self.what, unit=self.unit, unit_scale=scale,
                             unit_divisor=1024 if scale else 1000, file=self.stream, leave=True)
        bar = self._bar
        if total != bar.total:
            bar.total = total
        bar.update(done - bar.n)
        if note != (bar.postfix or ""):
            bar.set_postfix_str(note, refresh=False)
        bar.refresh()

    def _line(self) -> None:
        assert self._latest is not None
        done, total, note = self._latest
        amount = (f"{_count(done, self.unit)} of {_count(total, self.unit)}" if self.unit == "B"
                  else f"{done} of {total} {self.unit}(s)")
        print(f"{self.what}: {amount} done" + (f", {note}" if note else ""), file=self.stream, flush=True)
        self._shown = self._latest
        self._last_line = self.clock()


def _isatty(stream: TextIO) -> bool:
    """A terminal a bar can be drawn on: one with a width (a pty nobody sized reads 0 columns)."""
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, ValueError, OSError):
        return False
