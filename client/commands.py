"""What each ``ckptstage`` command does: one function per command, over a connection to the daemon.

Each prints its result (text, or with ``--json`` one JSON object) and returns the exit status.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from ckptstage.client import errors
from ckptstage.client.cliformat import (
    age, drain_text, emit, job_line, one_line, print_json, ranges, size_text, stored_text, table, tier_line,
    tier_name, when,
)
from ckptstage.client.progress import Mode, Progress
from ckptstage.client.rpc import FETCH_TIMEOUT_S, Connection
from ckptstage.protos.v1 import ckptstage_pb2 as pb

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_DAEMON = 3
EXIT_TIMED_OUT = 4
# While a long call runs, how often the command samples the daemon for its progress.
POLL_S = 0.5


def cmd_status(conn: Connection, args: argparse.Namespace) -> int:
    st = conn.status()

    def text() -> str:
        lines = [f"ckptstaged {st.version} pid {st.pid} on {st.socket}, up {st.uptime_s:.0f}s",
                 f"arena: {size_text(st.arena_used_bytes)} of {size_text(st.arena_budget_bytes)} in use, "
                 f"{len(st.sessions)} session(s)"]
        for s in st.sessions:
            lines.append(f"  session {s.session_id}: job {s.job} rank {s.rank} pid {s.pid}, "
                         f"arena {size_text(s.arena_bytes)}, {s.saves_in_flight} save(s) in flight")
        lines.extend(tier_line(t) for t in st.tiers)
        lines.append(f"memory: {st.memory_parts} part(s) kept for restarts, {size_text(st.memory_bytes)}")
        lines.append(f"drain queue: {st.drain_queue} part(s)")
        if st.jobs:
            lines.append(f"jobs: {len(st.jobs)}")
            lines.extend(f"  {job_line(j)}" for j in st.jobs)
        if st.metrics_url:
            lines.append(f"metrics: {st.metrics_url}")
        return "\n".join(lines)

    emit(args, st, text)
    return EXIT_OK


def cmd_jobs(conn: Connection, args: argparse.Namespace) -> int:
    resp = conn.call("ListJobs", pb.ListJobsRequest())

    def text() -> str:
        if not resp.jobs:
            return "no jobs: this daemon holds no checkpoints and serves no session"
        rows = [[j.job, str(j.checkpoints), str(j.latest_step) if j.has_latest else "-", age(j.last_commit_time),
                 size_text(j.local_bytes), size_text(j.shared_bytes), str(j.sessions), drain_text(j.drain),
                 f"{age(j.drain.last_error_time)}: {j.drain.last_error}" if j.drain.last_error else ""]
                for j in resp.jobs]
        return table(rows, ["JOB", "CKPTS", "LATEST", "LAST COMMIT", "LOCAL", "SHARED", "SESSIONS", "DRAIN",
                             "LAST DRAIN ERROR"])

    emit(args, resp, text)
    return EXIT_OK


def cmd_ls(conn: Connection, args: argparse.Namespace) -> int:
    resp = conn.call("ListCheckpoints", pb.ListRequest(job=args.job, memory=True))

    def text() -> str:
        quarantined = [f"quarantined: {f'chunk {q.chunk}' if q.chunk else f'step {q.step} rank {q.rank}'} "
                       f"{tier_name(q.tier)} copy ({size_text(q.bytes)}), now {q.path}: {q.detail}"
                       for q in resp.quarantined]
        return "\n".join([checkpoints(), *quarantined])

    def checkpoints() -> str:
        if not resp.checkpoints:
            return f"no checkpoints for job {args.job!r}"
        rows = []
        for c in resp.checkpoints:
            # A tier holds the step when its commit record is there; else how many of its ranks' parts.
            tiers = [name for name, committed in (("local", c.committed_local), ("shared", c.committed_shared),
                                                  ("peer", c.committed_peer)) if committed]
            partial = [f"{name}:{len(ranks)}/{c.world_size}" for name, ranks, committed in
                       (("local", c.ranks_local, c.committed_local), ("shared", c.ranks_shared, c.committed_shared),
                        ("peer", c.ranks_peer, c.committed_peer))
                       if ranks and not committed]
            # The memory tier: parts kept after their trainer exited, ready for a restart on this node.
            if c.ranks_memory:
                partial.append("memory" if len(c.ranks_memory) == c.world_size
                               else f"memory:{len(c.ranks_memory)}/{c.world_size}")
            complete = "yes" if c.complete else "no" + (f" (missing ranks {ranges(c.ranks_missing)})"
                                                       if c.ranks_missing else "")
            rows.append([str(c.step), ",".join(tiers + partial) or "-", size_text(c.bytes),
                         stored_text(c.stored_local, c.bytes, c.ranks_local), stored_text(c.stored_shared, c.bytes,
                                                                                         c.ranks_shared),
                         when(c.created), complete, c.attempt[:12] or "-", c.drain_state, "pinned" if c.pinned else "",
                         " ".join(f"{k}={v:g}" for k, v in sorted(c.metrics.items()))])
        return table(rows, ["STEP", "TIERS", "SIZE", "LOCAL STORED", "SHARED STORED", "CREATED", "COMPLETE",
                            "ATTEMPT", "DRAIN", "PIN", "METRICS"])

    emit(args, resp, text)
    return EXIT_OK


def cmd_gc(conn: Connection, args: argparse.Namespace) -> int:
    resp = conn.call("CollectGarbage", pb.GcRequest(dry_run=args.dry_run), timeout=300)

    def text() -> str:
        verb = "would delete" if args.dry_run else "deleted"
        if not resp.deleted:
            return "nothing to delete: every checkpoint is kept by a rule"
        return "\n".join(f"{verb} {a.job} step {a.step} from {tier_name(a.tier)} "
                         f"({size_text(a.bytes)}): {a.reason}" for a in resp.deleted)

    emit(args, resp, text, {"dry_run": args.dry_run})
    return EXIT_OK


class _DrainQueue:
    """Samples what is left to drain (of one job, or all): bytes from ListJobs, or parts from Status on a
    daemon without it. ``done`` never goes back; ``total`` grows when new parts join the queue."""

    def __init__(self, conn: Connection, job: str | None) -> None:
        self.conn, self.job = conn, job
        self.by_bytes = True
        self.done = self.total = 0
        self.note = ""

    @property
    def unit(self) -> str:
        return "B" if self.by_bytes else "part"

    def sample(self) -> None:
        queued = self._queued()
        self.done = max(self.done, self.total - queued)
        self.total = max(self.total, self.done + queued)

    def _queued(self) -> int:
        if self.by_bytes:
            try:
                jobs = [j for j in self.conn.call("ListJobs", pb.ListJobsRequest(), timeout=10).jobs
                        if self.job in (None, j.job)]
            except errors.CkptStageError as e:
                if e.code != "unsupported":
                    raise
                self.by_bytes = False  # an older daemon: count parts, all jobs
                return self._queued()
            failing = [j for j in jobs if j.drain.last_error]
            self.note = (f"{failing[0].job} {failing[0].drain.state}: {failing[0].drain.last_error}"
                         if failing else "")
            return sum(j.drain.queued_bytes for j in jobs)
        return int(self.conn.status(timeout=10).drain_queue)


def cmd_drain(conn: Connection, args: argparse.Namespace) -> int:
    if not args.wait:
        resp = conn.call("Drain", pb.DrainRequest(job=args.job or "", wait=False))
        emit(args, resp, lambda: _drain_outcome(resp, 0))
        return EXIT_OK if resp.failed == 0 else EXIT_FAILED
    queue = _DrainQueue(conn, args.job)
    queue.sample()
    deadline = time.monotonic() + args.timeout if args.timeout else None
    with Progress(f"drain {args.job or 'all jobs'}", queue.unit, mode=args.progress) as progress:
        if queue.total:
            progress.update(queue.done, queue.total, queue.note)
        while True:
            left = 25.0 if deadline is None else max(0.0, min(25.0, deadline - time.monotonic()))
            call = conn.start("Drain", pb.DrainRequest(job=args.job or "", wait=True, timeout_s=left, newest=True),
                              timeout=left + 10)
            while not call.wait(POLL_S):
                queue.sample()
                if queue.total:
                    progress.update(queue.done, queue.total, queue.note)
            resp = call()
            if resp.pending == 0 or (deadline is not None and time.monotonic() >= deadline):
                break
        queue.sample()
        if queue.total:
            progress.update(queue.done, queue.total, queue.note)
        progress.close()
    emit(args, resp, lambda: _drain_outcome(resp, args.timeout))
    if resp.failed:
        return EXIT_FAILED
    return EXIT_OK if resp.pending == 0 else EXIT_TIMED_OUT


def _drain_outcome(resp: pb.DrainResponse, timeout: float) -> str:
    if resp.pending == 0 and resp.failed == 0:
        return "everything is on the shared tier"
    text = f"{resp.pending} part(s) still to drain"
    if resp.pending and timeout:
        text += f" after {timeout:g}s (--timeout)"
    return text + f", {resp.failed} failed" + ("; `ckptstage jobs` shows the errors" if resp.failed else "")


def cmd_pin(conn: Connection, args: argparse.Namespace) -> int:
    """Pins or unpins; one already in the asked state is no failure (idempotent, so scripts can repeat it)."""
    pinned = args.command == "pin"
    resp = conn.call("SetPin", pb.PinRequest(job=args.job, step=args.step, pinned=pinned))
    verb = "pinned" if pinned else "unpinned"
    already = "already pinned" if pinned else "not pinned"

    def text() -> str:
        return f"{args.job} step {args.step} {verb}" if resp.changed else \
            f"{args.job} step {args.step} was {already}: nothing changed"

    emit(args, resp, text, {"job": args.job, "step": args.step})
    return EXIT_OK


def cmd_rm(conn: Connection, args: argparse.Namespace) -> int:
    """Deletes each step; goes on past a step that fails and exits 1 if any did."""
    done: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    for step in args.steps:
        try:
            resp = conn.call("DeleteStep", pb.DeleteStepRequest(job=args.job, step=step), timeout=120)
        except errors.DaemonUnavailable:
            raise
        except errors.CkptStageError as e:
            message = one_line(errors.plain_message(e))
            print(f"ckptstage: {message}", file=sys.stderr)
            failures.append({"step": step, "code": e.code, "message": message})
            continue
        tiers = [tier_name(t) for t in resp.tiers]
        done.append({"job": args.job, "step": step, "parts_deleted": resp.parts_deleted,
                     "bytes_deleted": resp.bytes_deleted, "tiers": tiers})
        if not args.json:
            print(f"{args.job} step {step}: deleted from {' and '.join(tiers)} ({resp.parts_deleted} part(s), "
                  f"{size_text(resp.bytes_deleted)})")
    if args.json:
        print_json({"deleted": done, "failed": len(failures), "errors": failures})
    return EXIT_FAILED if failures else EXIT_OK


def _prefetch_target(conn: Connection, job: str, step: int | None) -> pb.CheckpointInfo | None:
    """The step a prefetch will copy (the newest complete one when none is named), for its progress."""
    listed = conn.call("ListCheckpoints", pb.ListRequest(job=job)).checkpoints
    if step is not None:
        return next((c for c in listed if c.step == step), None)
    return max((c for c in listed if c.complete), key=lambda c: c.step, default=None)


def cmd_prefetch(conn: Connection, args: argparse.Namespace) -> int:
    target = _prefetch_target(conn, args.job, args.step)
    req = pb.PrefetchRequest(job=args.job, step=args.step or 0, latest=args.step is None)
    if target is None:  # the daemon says what is missing
        resp = conn.call("Prefetch", req, timeout=FETCH_TIMEOUT_S)
    else:
        resp = _prefetch_with_progress(conn, args, req, target)
    emit(args, resp, lambda: f"{args.job} step {resp.step}: {resp.parts} part(s) copied to the local tier",
          {"job": args.job})
    return EXIT_OK


def _prefetch_with_progress(conn: Connection, args: argparse.Namespace, req: pb.PrefetchRequest,
                            target: pb.CheckpointInfo) -> pb.PrefetchResponse:
    """Prefetch, counting the parts that reach the local tier as it goes (a part lands whole, verified)."""
    before = set(target.ranks_local)
    total = len(set(target.ranks_shared) - before)

    def landed() -> int:
        now = _prefetch_target(conn, args.job, target.step)
        return len(set(now.ranks_local) - before) if now is not None else 0

    with Progress(f"prefetch {args.job} step {target.step}", "part", mode=args.progress) as progress:
        progress.update(0, total, size_text(target.bytes))
        call = conn.start("Prefetch", req, timeout=FETCH_TIMEOUT_S)
        while not call.wait(POLL_S):
            progress.update(min(total, landed()), total, size_text(target.bytes))
        resp = call()
        progress.update(int(resp.parts), max(total, int(resp.parts)), size_text(target.bytes))
        progress.close()
    return resp


def cmd_consolidate(args: argparse.Namespace) -> int:
    from ckptstage.client import consolidate  # imports torch

    progress: Mode = "bar" if sys.stderr.isatty() else "lines"
    done = consolidate.consolidate(args.job, args.step, out=args.out, prefix=args.prefix,
                                   max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                                   socket=args.socket, progress=progress)
    if args.json:
        print_json(done.to_json())
    else:
        print(f"{done.job} step {done.step}: {done.tensors} tensors, {size_text(done.bytes)} in "
              f"{len(done.files) - 1} file(s) under {done.out}")
    return EXIT_OK


COMMANDS: dict[str, Callable[[Connection, argparse.Namespace], int]] = {
    "status": cmd_status, "jobs": cmd_jobs, "ls": cmd_ls, "gc": cmd_gc, "drain": cmd_drain, "pin": cmd_pin,
    "unpin": cmd_pin, "prefetch": cmd_prefetch, "rm": cmd_rm,
}
