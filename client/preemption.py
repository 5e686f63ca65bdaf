"""One last snapshot when the trainer is told to stop: ``Client.on_preemption``.

A spot node given notice, a node drained for maintenance, a SLURM job
signalled before its time limit: the trainer gets a signal (SIGTERM; SLURM's
``--signal`` can send SIGUSR1) some seconds before it is killed. Without
help, the steps since the last periodic checkpoint are lost::

    client = Client(job="run3")
    client.on_preemption(lambda: (step, {"model": model.state_dict(), "optim": opt.state_dict()}))

The signal handler only records the signal: Python runs handlers on the main
thread between bytecodes, possibly in the middle of an optimizer step, whose
tensors must not be copied half-updated. The snapshot is taken at the next
*safe point*:

* before the next ``torch.optim.Optimizer.step()`` of the process (any
  optimizer, through torch's global step pre-hook; not one nested in another
  optimizer's step): a plain training loop gets this without changing a line.
  The parameters and the optimizer state are then those of the last finished
  step, so ``state_fn`` must return the number of finished steps, the number
  the loop's own periodic save would use right after ``optimizer.step()``.
  ``at_optimizer_step=False`` turns this off (several optimizers stepped in
  turn, as a GAN's, where "before the next step" is between the two);
* :meth:`Preemption.check`, which a loop may call wherever its state is
  whole (a loop without a torch optimizer must);
* after ``timeout`` seconds (default 10) with no safe point since the signal
  and no optimizer step for as long (a long evaluation, a data loader
  stall), a watchdog thread takes it, never while an optimizer step runs
  (a step that starts meanwhile waits for the copy). It calls ``state_fn`` on
  that thread. What it can tear: anything the loop changes outside
  ``optimizer.step()`` (a step counter bumped more than ``timeout`` seconds
  after the step; BatchNorm statistics during a training forward pass).
  ``timeout=None``: safe points only.

``state_fn()`` returns ``(step, state)``; the snapshot is ``client.save(step,
state)`` and waits only until the daemon holds it (``wait_snapshot``, at most
:data:`SNAPSHOT_TIMEOUT_S`): from then on the daemon commits it even if the
process dies. A step this client already saved is not saved again (its own
snapshot is waited for); one committed by an earlier run is left as it is.
A snapshot that fails is logged, never raised: the process still ends.

Then the process ends as it would have without ckptstage: a Python handler
installed before is called (with the signal and the frame it interrupted);
``SIG_DFL`` is restored and the signal raised again, so the process dies by
it (exit status -15 for SIGTERM); ``SIG_IGN``: the trainer goes on (a later
signal takes another snapshot).

Only the main thread installs signal handlers (a Python rule): elsewhere
:func:`install` raises ``RuntimeError``. A second ``on_preemption`` on the
same client replaces the first (its handlers are restored first, so nothing
chains to itself); ``Client.close()`` and :meth:`Preemption.close` restore
the handlers that were there before (unless another handler was installed on
top since: then ours passes every signal on to its predecessor).

Several ranks: each rank snapshots at its own next safe point. Ranks in
lockstep (DDP) that get the signal in different steps save different steps,
and neither is complete; the integrations agree on the step first
(:mod:`ckptstage.hf`), a plain loop can call :meth:`Preemption.check` after
agreeing itself.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any, Protocol

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ckptstage.client import errors
from ckptstage.client.saver import SaveHandle

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_TIMEOUT_S", "SNAPSHOT_TIMEOUT_S", "Preemption", "SignalLatch", "install"]

DEFAULT_TIMEOUT_S = 10.0
# How long the last snapshot may take to reach the daemon before the process ends without it.
SNAPSHOT_TIMEOUT_S = 120.0
_POLL_S = 0.05

Handler = Callable[[int, FrameType | None], Any] | int | None


class Saving(Protocol):
    """What a preemption's snapshot needs of its client (``Client`` is one)."""

    def save(self, step: int, state: Any) -> SaveHandle: ...

    def _saving(self, step: int) -> SaveHandle | None:
        """This client's save of ``step`` still good (in flight, or snapshotted without error), if any."""

    def _check_open(self) -> None: ...


def _check_main_thread(what: str) -> None:
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(f"{what} must be called from the main thread: only it can install signal handlers "
                           f"(a Python rule); call it where the training script starts, not from "
                           f"thread {threading.current_thread().name!r}")


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class SignalLatch:
    """Records the first of ``signals`` to arrive; :meth:`finish` then ends as the signal would have.

    The building block of :class:`Preemption`, and of the integrations whose
    trainers have their own safe points. The handler sets attributes and
    writes one byte to a pipe, nothing else: no lock, no allocation that could
    wait on the thread it interrupted.
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM,)) -> None:
        _check_main_thread("installing a ckptstage signal handler")
        self.signals = tuple(dict.fromkeys(signal.Signals(s) for s in signals))
        if not self.signals:
            raise ValueError("signals must name at least one signal")
        for s in self.signals:
            if s in (signal.SIGKILL, signal.SIGSTOP):
                raise ValueError(f"{s.name} cannot be caught")
        self.received: int | None = None   # the signal waiting for its safe point
        self.received_at = 0.0             # when it came (monotonic seconds)
        self._frame: FrameType | None = None
        self._seq = 0                      # notices recorded so far
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._previous: dict[int, Handler] = {}
        for s in self.signals:
            self._previous[s] = signal.getsignal(s)
            signal.signal(s, self._on_signal)

    @property
    def previous(self) -> dict[int, Handler]:
        """The handler each signal had before (``SIG_DFL``, ``SIG_IGN``, a callable, or None: not set from Python)."""
        return dict(self._previous)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._closed:
            self._pass_on(signum, frame)
            return
        if self.received is None:
            self.received, self._frame = signum, frame
            self.received_at = time.monotonic()
            self._seq += 1
            try:
                os.write(self._wake_w, b"\0")
            except OSError:
                pass  # the pipe is full: a wake-up is already waiting

    def finish(self, signum: int | None = None) -> None:
        """Ends the process as ``signum`` (the signal received, else the first of ``signals``) would have.

        Does not return when the previous disposition was ``SIG_DFL`` (for a
        signal whose default ends the process) or a handler that exits;
        returns after ``SIG_IGN`` or a handler that returns, ready for the
        next signal. On the main thread only.
        """
        signum = signum or self.received or self.signals[0]
        frame = self._frame
        self.received, self._frame = None, None
        self._pass_on(signum, frame)

    def _pass_on(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signum, signal.SIG_DFL)
        if previous == signal.SIG_IGN:
            log.info("ckptstage: signal %s was ignored before ckptstage handled it: training goes on",
                     signal.Signals(signum).name)
            return
        if callable(previous):
            previous(signum, frame)
            owner = getattr(previous, "__self__", None)
            if isinstance(owner, Preemption):  # another client's: its snapshot is due now too
                owner.check()
            return
        _die_by(signum)
        if _on_main_thread() and not self._closed:
            signal.signal(signum, self._on_signal)  # its default does not end a process: keep catching it

    def close(self) -> None:
        """Restores the handlers that were installed before (those still ours; see the module docstring)."""
        if self._closed:
            return
        self._closed = True
        if _on_main_thread():
            for s, previous in self._previous.items():
                if signal.getsignal(s) == self._on_signal:
                    signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        try:
            os.write(self._wake_w, b"\1")  # wakes a watchdog to end
        except OSError:
            pass

    def _wait_wake(self, timeout: float | None) -> bool:
        """Blocks until the handler (or close) writes to the pipe; whether it did."""
        ready, _, _ = select.select([self._wake_r], [], [], timeout)
        if ready:
            os.read(self._wake_r, 64)
        return bool(ready)


def _die_by(signum: int) -> None:
    """Ends the process by ``signum`` with its default action, as if nothing had caught it."""
    log.info("ckptstage: ending the process by %s", signal.Signals(signum).name)
    for h in logging.getLogger().handlers:
        h.flush()
    if _on_main_thread():
        signal.signal(signum, signal.SIG_DFL)
    else:  # Python sets handlers on the main thread only; the C library does it from any thread
        ctypes.CDLL(None, use_errno=True).signal(ctypes.c_int(signum), ctypes.c_void_p(0))
    signal.pthread_kill(threading.get_ident(), signum)


class Preemption(SignalLatch):
    """What ``Client.on_preemption`` installs: see the module docstring."""

    def __init__(self, client: Saving, state_fn: Callable[[], tuple[int, Any]], signals: Iterable[int],
                 timeout: float | None = DEFAULT_TIMEOUT_S, at_optimizer_step: bool = True) -> None:
        if not callable(state_fn):
            raise TypeError(f"state_fn must be callable, returning (step, state); got {type(state_fn).__name__}")
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be None or >= 0 seconds, got {timeout}")
        self._client = client
        self._state_fn = state_fn
        self.timeout = timeout
        self.at_optimizer_step = at_optimizer_step
        self._lock = threading.Lock()  # one snapshot at a time; an optimizer step waits for it
        self._in_step = 0              # optimizer steps running (nested ones count)
        self._last_step_end = 0.0      # monotonic time the last optimizer step ended
        self._taken_seq = 0            # the notice the last snapshot answered
        self._done = False             # the watchdog took the snapshot; the re-sent signal finishes
        self.last_step: int | None = None  # the step the last snapshot saved (None: none, or it failed)
        super().__init__(signals)
        self._hooks = [register_optimizer_step_pre_hook(self._before_step),
                       register_optimizer_step_post_hook(self._after_step)]
        self._main_ident = threading.get_ident()  # install() runs on the main thread
        self._watchdog: threading.Thread | None = None
        if timeout is not None:
            self._watchdog = threading.Thread(target=self._watch, name="ckptstage-preemption", daemon=True)
            self._watchdog.start()

    # --- safe points ------------------------------------------------------------------

    def check(self) -> bool:
        """A safe point: if a signal is waiting, takes the snapshot and ends as the signal would have.

        Call it in a training loop where the state is whole (after the step
        counter moved on). Returns False when no signal was waiting (or
        outside the main thread, or inside an optimizer step); True after a
        snapshot when the process goes on (``SIG_IGN``, or a previous handler
        that returned). Otherwise it does not return.
        """
        if self.received is None or self._closed or not _on_main_thread():
            return False
        with self._lock:
            if self._done or self._in_step:
                return False  # the watchdog took it (the signal it re-sent finishes) / not between steps
            self._snapshot()
        self.finish()
        return True

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.at_optimizer_step and self.received is not None:
            self.check()
        with self._lock:  # waits while the watchdog copies
            self._in_step += 1

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        with self._lock:
            self._in_step = max(0, self._in_step - 1)
            self._last_step_end = time.monotonic()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self._closed and self._done:  # re-sent by the watchdog after its snapshot
            self._done = False
            self.finish(signum)
            return
        super()._on_signal(signum, frame)

    # --- the snapshot -----------------------------------------------------------------

    def _snapshot(self) -> None:
        """``state_fn()`` saved and its snapshot waited for; never raises (the process must still end)."""
        self._taken_seq = self._seq
        name = signal.Signals(self.received or self.signals[0]).name
        t0 = time.monotonic()
        try:
            step, state = self._state_fn()
            handle = self._client._saving(step)
            if handle is None:
                handle = self._client.save(step, state)
            handle.wait_snapshot(SNAPSHOT_TIMEOUT_S)
        except errors.AlreadyCommitted:
            self.last_step = step
            log.warning("ckptstage: %s: step %d is already committed; nothing more to save", name, step)
        except Exception:  # noqa: BLE001 - logged; the process ends as the signal says all the same
            self.last_step = None
            log.exception("ckptstage: %s: the last snapshot failed; the newest checkpoint is the previous one",
                          name)
        else:
            self.last_step = step
            log.warning("ckptstage: %s: step %d is with the daemon (%.2f s); it commits it whatever this process "
                        "does now", name, step, time.monotonic() - t0)

    def _watch(self) -> None:
        """The watchdog: a notice with no safe point for ``timeout`` seconds gets its snapshot here."""
        assert self.timeout is not None
        while not self._closed:
            seq = self._seq
            if seq <= self._taken_seq:
                self._wait_wake(None)  # until the handler records a signal (or close)
                continue
            with self._lock:
                now = time.monotonic()
                due = min(now - self.received_at, now - self._last_step_end) >= self.timeout
                take = due and not self._in_step and not self._closed and self._taken_seq < seq
                if take:
                    log.warning("ckptstage: no safe point %.0f s after the signal: taking the snapshot from "
                                "the watchdog thread", self.timeout)
                    self._snapshot()
                    self._done = True
            if take:
                self._end_from_watchdog()
            else:
                self._wait_wake(_POLL_S)

    def _end_from_watchdog(self) -> None:
        signum = self.received or self.signals[0]
        if self._previous.get(signum) in (signal.SIG_DFL, None):
            _die_by(signum)  # no handler of the trainer's to run: needs no main thread
        else:
            signal.pthread_kill(self._main_ident, signum)  # its handler runs there (see _on_signal)

    # --- life cycle -------------------------------------------------------------------

    def close(self) -> None:
        """Restores the previous handlers and removes the optimizer hooks."""
        if self._closed:
            return
        super().close()
        for h in self._hooks:
            h.remove()
        if _INSTALLED.get(self._client) is self:
            del _INSTALLED[self._client]


_INSTALLED: weakref.WeakKeyDictionary[Saving, Preemption] = weakref.WeakKeyDictionary()


def install(client: Saving, state_fn: Callable[[], tuple[int, Any]], signals: Iterable[int] = (signal.SIGTERM,),
            *, timeout: float | None = DEFAULT_TIMEOUT_S, at_optimizer_step: bool = True) -> Preemption:
    """``client.on_preemption``: replaces what an earlier call on ``client`` installed (a signal it had
    recorded and not yet answered carries over)."""
    _check_main_thread("Client.on_preemption()")
    client._check_open()
    old = _INSTALLED.pop(client, None)
    carried = None
    if old is not None:
        carried = old.received
        old.close()
    new = Preemption(client, state_fn, signals, timeout=timeout, at_optimizer_step=at_optimizer_step)
    if carried is not None:
        new._on_signal(carried, None)
    _INSTALLED[client] = new
    return new


def release(client: Saving) -> None:
    """What ``Client.close`` calls: the client's handlers, if any, are restored."""
    installed = _INSTALLED.pop(client, None)
    if installed is not None:
        installed.close()
