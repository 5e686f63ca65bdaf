"""Runs a function on N real ranks (separate processes, gloo on CPU) and brings their results back.

A test hands :func:`run_ranks` a module-level function ``fn(ctx, *args)``
from a module under ``tests/``; each rank process imports that module by
file, joins a fresh gloo process group (file rendezvous, so no port can be
taken by someone else), calls ``fn`` and pickles what it returns (or its
traceback) back to the test. A rank that fails makes the others be killed
after a short grace (they are likely stuck in a collective with it); a rank
that runs past the timeout has its Python stack dumped (faulthandler on
SIGUSR1) and is killed, and the test fails with every rank's error and the
tail of its stderr, instead of hanging the suite.

To kill a rank mid-save, the rank itself calls :func:`kill_self` at the point
wanted (deterministic: no race with a parent's timer), and the test names it
in ``expect_killed``; or the test uses :class:`Ranks` directly, waits for a
marker the rank set with ``ctx.mark(name)`` and calls :meth:`Ranks.kill`.

Run as a script, this module is the rank process's entry point.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import importlib
import inspect
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

_TESTS_DIR = Path(__file__).resolve().parent
_GRACE_S = 5.0  # how long the other ranks may go on once one has failed


@dataclasses.dataclass(frozen=True)
class RankContext:
    """What a rank function gets: who it is, its node's daemon socket, a scratch directory."""

    rank: int
    world_size: int
    socket: str
    workdir: str

    def mark(self, name: str) -> None:
        """Tells the test (see :meth:`Ranks.wait_marker`) that this rank reached ``name``."""
        path = Path(self.workdir) / f"mark-{self.rank}-{name}"
        path.write_text("")


@dataclasses.dataclass
class RankOutcome:
    rank: int
    returncode: int | None  # None: still running when it was killed for the timeout
    value: Any = None
    error: str | None = None  # the rank's traceback, or why it has no result
    stderr_tail: str = ""


class RanksFailed(AssertionError):
    """One or more ranks did not return a value (raised, died, or timed out)."""


def kill_self() -> None:
    """SIGKILLs the calling process now: no atexit, no finally, no flush (a trainer's crash)."""
    os.kill(os.getpid(), signal.SIGKILL)


class Ranks:
    """``world_size`` rank processes running ``fn``; start them, then :meth:`join`."""

    def __init__(self, fn: Callable[..., Any], world_size: int, sockets: str | Sequence[str] | Callable[[int], str],
                 args: Sequence[Any] = (), env: dict[str, str] | None = None,
                 workdir: str | os.PathLike[str] | None = None, collective_timeout_s: float = 60.0) -> None:
        self.fn_file = inspect.getfile(fn)
        self.fn_name = fn.__qualname__
        if "<locals>" in self.fn_name or Path(self.fn_file).resolve().parent != _TESTS_DIR:
            raise ValueError(f"{fn!r} must be a module-level function of a module in {_TESTS_DIR}")
        self.world_size = world_size
        self._socket = sockets if callable(sockets) else (
            (lambda r: sockets) if isinstance(sockets, str) else (lambda r: sockets[r]))
        self.args = tuple(args)
        self.env = dict(env or {})
        self._own_tmp = None if workdir is not None else tempfile.TemporaryDirectory(prefix="ranks-")
        self.workdir = Path(workdir if workdir is not None else self._own_tmp.name)  # type: ignore[union-attr]
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.collective_timeout_s = collective_timeout_s
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> Ranks:
        rdzv = self.workdir / f"rdzv-{time.monotonic_ns()}"
        for rank in range(self.world_size):
            spec = {"fn_file": self.fn_file, "fn_name": self.fn_name, "args": self.args, "rank": rank,
                    "world_size": self.world_size, "socket": str(self._socket(rank)), "workdir": str(self.workdir),
                    "rdzv": str(rdzv), "collective_timeout_s": self.collective_timeout_s}
            spec_path = self.workdir / f"spec-{rank}.pkl"
            spec_path.write_bytes(pickle.dumps(spec))
            self._result_path(rank).unlink(missing_ok=True)
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo",
                       PYTHONPATH=os.pathsep.join([str(_TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
                       CKPTSTAGE_SOCKET=str(self._socket(rank)), RANK=str(rank), WORLD_SIZE=str(self.world_size),
                       LOCAL_RANK=str(rank))
            env.pop("CKPTSTAGE_ATTEMPT", None)
            env.update(self.env)
            with open(self._stderr_path(rank), "wb") as err:
                self.procs.append(subprocess.Popen([sys.executable, __file__, str(spec_path)], stdin=subprocess.DEVNULL,
                                                   stdout=err, stderr=subprocess.STDOUT, env=env,
                                                   cwd=str(_TESTS_DIR.parent)))
        return self

    def wait_marker(self, rank: int, name: str, timeout: float = 60.0) -> None:
        """Until rank ``rank`` called ``ctx.mark(name)``; raises :class:`RanksFailed` if it exits first."""
        path = self.workdir / f"mark-{rank}-{name}"
        deadline = time.monotonic() + timeout
        while not path.exists():
            if self.procs[rank].poll() is not None or time.monotonic() > deadline:
                self._kill_all()
                raise RanksFailed(f"rank {rank} never reached marker {name!r}\n" + self._report(self._outcomes()))
            time.sleep(0.01)

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        self.procs[rank].send_signal(sig)
        self.procs[rank].wait(timeout=30)

    def join(self, timeout: float = 120.0, expect_killed: Sequence[int] = ()) -> list[Any]:
        """Every rank's return value (``None`` for those in ``expect_killed``, which must die by SIGKILL)."""
        deadline = time.monotonic() + timeout
        failed_at: float | None = None
        try:
            while True:
                codes = [p.poll() for p in self.procs]
                if all(c is not None for c in codes):
                    break
                bad = [r for r, c in enumerate(codes) if c not in (None, 0) and r not in expect_killed]
                if bad and failed_at is None:
                    failed_at = time.monotonic()
                now = time.monotonic()
                if now > deadline or (failed_at is not None and now > failed_at + _GRACE_S):
                    self._dump_stacks()
                    break
                time.sleep(0.02)
        finally:
            self._kill_all()
        outcomes = self._outcomes(timed_out=time.monotonic() > deadline)
        problems = []
        for o in outcomes:
            if o.rank in expect_killed:
                if o.returncode != -signal.SIGKILL:
                    problems.append(o)
            elif o.error is not None:
                problems.append(o)
        if problems:
            raise RanksFailed(self._report(problems))
        if self._own_tmp is not None:
            self._own_tmp.cleanup()
        return [o.value for o in outcomes]

    # --- internals ----------------------------------------------------------------------

    def _result_path(self, rank: int) -> Path:
        return self.workdir / f"result-{rank}.pkl"

    def _stderr_path(self, rank: int) -> Path:
        return self.workdir / f"stderr-{rank}.txt"

    def _dump_stacks(self) -> None:
        alive = [p for p in self.procs if p.poll() is None]
        for p in alive:
            p.send_signal(signal.SIGUSR1)  # faulthandler prints every thread's stack to stderr
        if alive:
            time.sleep(1.0)

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def _outcomes(self, timed_out: bool = False) -> list[RankOutcome]:
        out = []
        for rank, p in enumerate(self.procs):
            code = p.poll()
            tail = self._stderr_path(rank).read_bytes()[-6000:].decode(errors="replace")
            o = RankOutcome(rank, code, stderr_tail=tail)
            path = self._result_path(rank)
            if path.exists():
                status, payload = pickle.loads(path.read_bytes())
                if status == "ok":
                    o.value = payload
                else:
                    o.error = payload
            elif code == -signal.SIGKILL:
                o.error = "killed (SIGKILL): by the harness after another rank failed or the timeout" \
                    if not timed_out else "timed out and was killed"
            else:
                o.error = f"exited with {code} and no result"
            out.append(o)
        return out

    @staticmethod
    def _report(outcomes: list[RankOutcome]) -> str:
        parts = []
        for o in outcomes:
            parts.append(f"--- rank {o.rank} (exit {o.returncode}): {o.error}\n--- rank {o.rank} stderr tail:\n"
                         f"{o.stderr_tail}")
        return "\n".join(parts)


def run_ranks(fn: Callable[..., Any], world_size: int, sockets: str | Sequence[str] | Callable[[int], str],
              args: Sequence[Any] = (), timeout: float = 120.0, expect_killed: Sequence[int] = (),
              env: dict[str, str] | None = None, workdir: str | os.PathLike[str] | None = None) -> list[Any]:
    """Runs ``fn(ctx, *args)`` on ``world_size`` ranks; returns their values by rank or raises :class:`RanksFailed`."""
    return Ranks(fn, world_size, sockets, args, env=env, workdir=workdir).start().join(timeout, expect_killed)


def node_sockets(sockets: Sequence[str], ranks_per_node: int) -> Callable[[int], str]:
    """Ranks ``0..k-1`` talk to ``sockets[0]``, the next ``k`` to ``sockets[1]``, ... (one daemon per node)."""
    return lambda rank: str(sockets[rank // ranks_per_node])


# --- state helpers for rank functions -----------------------------------------------------------


def detached(obj: Any) -> Any:
    """``obj`` with every tensor replaced by a detached copy (dicts, lists and tuples rebuilt): a snapshot."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: detached(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(detached(v) for v in obj)
    return obj


def full_state(model: Any, opt: Any) -> dict[str, Any]:
    """Model and optimizer as full, unsharded CPU tensors and values (collective under FSDP/TP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return detached({"model": msd, "optim": osd})


# --- the rank process ---------------------------------------------------------------------


def _rank_main(spec_path: str) -> None:
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    spec = pickle.loads(Path(spec_path).read_bytes())
    result_path = Path(spec["workdir"]) / f"result-{spec['rank']}.pkl"
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{spec['rdzv']}", rank=spec["rank"],
                                world_size=spec["world_size"], timeout=timedelta(seconds=spec["collective_timeout_s"]))
        module = importlib.import_module(Path(spec["fn_file"]).stem)
        fn = getattr(module, spec["fn_name"])
        ctx = RankContext(spec["rank"], spec["world_size"], spec["socket"], spec["workdir"])
        value = fn(ctx, *spec["args"])
        payload = pickle.dumps(("ok", value))
    except BaseException:  # noqa: BLE001 - everything goes back to the test
        payload = pickle.dumps(("err", traceback.format_exc()))
    tmp = result_path.with_suffix(".tmp")
    tmp.write_bytes(payload)
    tmp.rename(result_path)
    # Leaving the group is local for gloo, but a peer already gone can make it wait: do not let it.
    os._exit(0)


if __name__ == "__main__":
    sys.path.insert(0, str(_TESTS_DIR))
    _rank_main(sys.argv[1])
