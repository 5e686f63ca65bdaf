"""``ckptstage``: the operator's and the job script's command line.

    ckptstage status                     daemon reachable? sessions, arena, tiers, jobs' drain health
    ckptstage jobs                       every job: checkpoints, latest step, bytes per tier, drain state
    ckptstage ls JOB                     steps, tiers, sizes, times, drain state
    ckptstage gc [--dry-run]             apply retention now (or show what it would delete)
    ckptstage drain [--wait] [--job J]   drain to the shared tier (--wait: for job epilogues)
    ckptstage pin JOB STEP / unpin JOB STEP
    ckptstage rm JOB STEP [STEP ...]     delete steps from the local and the shared tier (pinned ones refuse)
    ckptstage prefetch JOB [STEP]        stage a checkpoint from the shared tier onto local SSD
    ckptstage consolidate JOB [STEP] --out DIR [--prefix P] [--max-shard-size 5GB] [--overwrite]
                                         full tensors as Hugging Face style safetensors files
    ckptstage demo                       train, kill, resume: see README

``--socket S`` and ``--json`` go before or after the command, in any order.
With ``--json`` each command prints one JSON object on stdout, every field
present (docs/CLI.md has the schema); a failure prints ``{"error": {...}}``
there too. Progress (``drain --wait``, ``prefetch``) goes to stderr.

Exit status: 0 success; 1 the daemon refused or failed the request; 2 bad usage;
3 no daemon answers (no socket, nothing listening, gone, or not answering in
time); 4 ``drain --wait --timeout`` ran out of time with parts still queued.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from ckptstage.client import errors
from ckptstage.client.progress import MODES, Mode, Progress
from ckptstage.client.progress import size_text as _size  # one byte formatter for tables and progress
from ckptstage.client.rpc import FETCH_TIMEOUT_S, Connection, resolve_socket
from ckptstage.protos.v1 import ckptstage_pb2 as pb

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_DAEMON = 3
EXIT_TIMED_OUT = 4
# While a long call runs, how often the command samples the daemon for its progress.
POLL_S = 0.5


# --- formatting -------------------------------------------------------------------------

def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def _age(ts: float, now: float | None = None) -> str:
    """``ts`` as ``"42s ago"``, ``"3m ago"``, ``"5h ago"``, ``"2d ago"``; ``"-"`` for none."""
    if not ts:
        return "-"
    left = max(0.0, (time.time() if now is None else now) - ts)
    for unit, seconds in (("d", 86400), ("h", 3600), ("m", 60)):
        if left >= seconds:
            return f"{left // seconds:.0f}{unit} ago"
    return f"{left:.0f}s ago"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


def _tier(value: int) -> str:
    return pb.Tier.Name(value).lower()


def to_json(message: Message) -> dict[str, Any]:
    """A message as the stable JSON object of docs/CLI.md: every field present (zero, false, empty and
    unset sub-messages included), 64-bit integers as numbers, tiers as ``"local"``/``"shared"``/``"memory"``."""
    plain = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True,
                          unquote_int64_if_possible=True)
    return _normalized(message, plain)


_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def _normalized(message: Message, plain: dict[str, Any]) -> dict[str, Any]:
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            continue  # map<string, double>: as json_format writes it
        if field.message_type is not None:
            plain[field.name] = ([to_json(v) for v in value] if field.is_repeated else to_json(value))
        elif field.enum_type is not None:
            plain[field.name] = ([field.enum_type.values_by_number[v].name.lower() for v in value]
                                 if field.is_repeated else field.enum_type.values_by_number[value].name.lower())
        elif field.type in _INT64:  # beyond 2**53 json_format quotes them; a script wants one type
            plain[field.name] = list(value) if field.is_repeated else int(value)
    return plain


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


def _emit(args: argparse.Namespace, message: Message, text: Callable[[], str],
          extra: dict[str, Any] | None = None) -> None:
    if args.json:
        _print_json({**(extra or {}), **to_json(message)})
    else:
        print(text())


# --- commands ---------------------------------------------------------------------------

def cmd_status(conn: Connection, args: argparse.Namespace) -> int:
    st = conn.status()

    def text() -> str:
        lines = [f"ckptstaged {st.version} pid {st.pid} on {st.socket}, up {st.uptime_s:.0f}s",
                 f"arena: {_size(st.arena_used_bytes)} of {_size(st.arena_budget_bytes)} in use, "
                 f"{len(st.sessions)} session(s)"]
        for s in st.sessions:
            lines.append(f"  session {s.session_id}: job {s.job} rank {s.rank} pid {s.pid}, "
                         f"arena {_size(s.arena_bytes)}, {s.saves_in_flight} save(s) in flight")
        lines.extend(_tier_line(t) for t in st.tiers)
        lines.append(f"memory: {st.memory_parts} part(s) kept for restarts, {_size(st.memory_bytes)}")
        lines.append(f"drain queue: {st.drain_queue} part(s)")
        if st.jobs:
            lines.append(f"jobs: {len(st.jobs)}")
            lines.extend(f"  {_job_line(j)}" for j in st.jobs)
        if st.metrics_url:
            lines.append(f"metrics: {st.metrics_url}")
        return "\n".join(lines)

    _emit(args, st, text)
    return EXIT_OK


def _tier_line(t: pb.TierStatus) -> str:
    name = _tier(t.tier)
    if not t.enabled:
        return f"{name}: disabled"
    room = "no size limit" if t.unbounded else f"{_size(t.free_bytes)} free"
    line = f"{name}: {t.dir} — {t.checkpoints} part(s), {_size(t.used_bytes)} used, {room}"
    state = t.state or ("ok" if t.reachable else "unreachable")
    if state != "ok":
        line += f" ({state.upper()})"
    if t.last_error:
        line += f"; last error {_when(t.last_error_time)} ({_age(t.last_error_time)}): {t.last_error}"
    return "\n".join([line, *(f"  WARNING: {w}" for w in t.warnings)])


def _drain_text(d: pb.DrainState) -> str:
    text = d.state or "-"
    if d.queued_parts:
        text += f", {d.queued_parts} part(s) / {_size(d.queued_bytes)} queued"
    if d.consecutive_failures:
        text += f", {d.consecutive_failures} failure(s) in a row"
    return text


def _job_line(j: pb.JobStatus) -> str:
    latest = f"latest step {j.latest_step}" if j.has_latest else "no complete step"
    line = (f"{j.job}: {j.checkpoints} checkpoint(s), {latest}, last commit {_age(j.last_commit_time)}, "
            f"{j.sessions} session(s), drain {_drain_text(j.drain)}")
    if j.drain.last_error:
        line += (f"; last drain error {_when(j.drain.last_error_time)} ({_age(j.drain.last_error_time)}): "
                 f"{j.drain.last_error}")
    return line


def cmd_jobs(conn: Connection, args: argparse.Namespace) -> int:
    resp = conn.call("ListJobs", pb.ListJobsRequest())

    def text() -> str:
        if not resp.jobs:
            return "no jobs: this daemon holds no checkpoints and serves no session"
        rows = [[j.job, str(j.checkpoints), str(j.latest_step) if j.has_latest else "-", _age(j.last_commit_time),
                 _size(j.local_bytes), _size(j.shared_bytes), str(j.sessions), _drain_text(j.drain),
                 f"{_age(j.drain.last_error_time)}: {j.drain.last_error}" if j.drain.last_error else ""]
                for j in resp.jobs]
        return _table(rows, ["JOB", "CKPTS", "LATEST", "LAST COMMIT", "LOCAL", "SHARED", "SESSIONS", "DRAIN",
                             "LAST DRAIN ERROR"])

    _emit(args, resp, text)
    return EXIT_OK


def cmd_ls(conn: Connection, args: argparse.Namespace) -> int:
    resp = conn.call("ListCheckpoints", pb.ListRequest(job=args.job, memory=True))

    def text() -> str:
        quarantined = [f"quarantined: step {q.step} rank {q.rank} {_tier(q.tier)} copy, "
                       f"now {q.path}: {q.detail}" for q in resp.quarantined]
        return "\n".join([checkpoints(), *quarantined])

    def checkpoints() -> str:
        if not resp.checkpoints:
            return f"no checkpoints for job {args.job!r}"
        rows = []
        for c in resp.checkpoints:
            # A tier holds the step when its commit record is there; else how many of its ranks' parts.
            tiers = [name for name, committed in (("local", c.committed_local), ("shared", c.committed_shared))
                     if committed]
            partial = [f"{name}:{len(ranks)}/{c.world_size}" for name, ranks, committed in
                       (("local", c.ranks_local, c.committed_local), ("shared", c.ranks_shared, c.committed_shared))
                       if ranks and not committed]
            # The memory tier: parts kept after their trainer exited, ready for a restart on this node.
            if c.ranks_memory:
                partial.append("memory" if len(c.ranks_memory) == c.world_size
                               else f"memory:{len(c.ranks_memory)}/{c.world_size}")
            complete = "yes" if c.complete else "no" + (f" (missing ranks {_ranges(c.ranks_missing)})"
                                                       if c.ranks_missing else "")
            rows.append([str(c.step), ",".join(tiers + partial) or "-", _size(c.bytes), _when(c.created),
                         complete, c.attempt[:12] or "-", c.drain_state, "pinned" if c.pinned else "",
                         " ".join(f"{k}={v:g}" for k, v in sorted(c.metrics.items()))])
        return _table(rows, ["STEP", "TIERS", "SIZE", "CREATED", "COMPLETE", "ATTEMPT", "DRAIN", "PIN", "METRICS"])

    _emit(args, resp, text)
    return EXIT_OK


def _ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``0-2,5,7-8``: a 1,000-rank job's missing ranks on one line."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def cmd_gc(conn: Connection, args: argparse.Namespace) -> int:
    resp = conn.call("CollectGarbage", pb.GcRequest(dry_run=args.dry_run), timeout=300)

    def text() -> str:
        verb = "would delete" if args.dry_run else "deleted"
        if not resp.deleted:
            return "nothing to delete: every checkpoint is kept by a rule"
        return "\n".join(f"{verb} {a.job} step {a.step} from {_tier(a.tier)} "
                         f"({_size(a.bytes)}): {a.reason}" for a in resp.deleted)

    _emit(args, resp, text, {"dry_run": args.dry_run})
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
        _emit(args, resp, lambda: _drain_outcome(resp, 0))
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
    _emit(args, resp, lambda: _drain_outcome(resp, args.timeout))
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

    _emit(args, resp, text, {"job": args.job, "step": args.step})
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
            message = _one_line(errors.plain_message(e))
            print(f"ckptstage: {message}", file=sys.stderr)
            failures.append({"step": step, "code": e.code, "message": message})
            continue
        tiers = [_tier(t) for t in resp.tiers]
        done.append({"job": args.job, "step": step, "parts_deleted": resp.parts_deleted,
                     "bytes_deleted": resp.bytes_deleted, "tiers": tiers})
        if not args.json:
            print(f"{args.job} step {step}: deleted from {' and '.join(tiers)} ({resp.parts_deleted} part(s), "
                  f"{_size(resp.bytes_deleted)})")
    if args.json:
        _print_json({"deleted": done, "failed": len(failures), "errors": failures})
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
    _emit(args, resp, lambda: f"{args.job} step {resp.step}: {resp.parts} part(s) copied to the local tier",
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
        progress.update(0, total, _size(target.bytes))
        call = conn.start("Prefetch", req, timeout=FETCH_TIMEOUT_S)
        while not call.wait(POLL_S):
            progress.update(min(total, landed()), total, _size(target.bytes))
        resp = call()
        progress.update(int(resp.parts), max(total, int(resp.parts)), _size(target.bytes))
        progress.close()
    return resp


def cmd_consolidate(args: argparse.Namespace) -> int:
    from ckptstage.client import consolidate  # imports torch

    progress: Mode = "bar" if sys.stderr.isatty() else "lines"
    done = consolidate.consolidate(args.job, args.step, out=args.out, prefix=args.prefix,
                                   max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                                   socket=args.socket, progress=progress)
    if args.json:
        _print_json(done.to_json())
    else:
        print(f"{done.job} step {done.step}: {done.tensors} tensors, {_size(done.bytes)} in "
              f"{len(done.files) - 1} file(s) under {done.out}")
    return EXIT_OK


def _max_shard_size(text: str) -> str:
    from ckptstage.client.consolidate import parse_size

    try:
        parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


# --- the parser -------------------------------------------------------------------------

class UsageError(Exception):
    """Bad usage: ``main`` reports it (as JSON too with --json) and exits 2."""

    def __init__(self, usage: str, message: str) -> None:
        super().__init__(message)
        self.usage = usage


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(self.format_usage(), message)


def _global_options(on_command: bool) -> _Parser:
    """--socket and --json, for the top level and (defaults suppressed, so a value given before the command
    survives) for every command: the options work before or after the command."""
    g = _Parser(add_help=False)
    g.add_argument("--socket", default=argparse.SUPPRESS if on_command else None,
                   help="daemon socket (default: $CKPTSTAGE_SOCKET, else the daemon's default)")
    g.add_argument("--json", action="store_true", default=argparse.SUPPRESS if on_command else False,
                   help="one JSON object on stdout, every field present (docs/CLI.md); errors too")
    return g


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ckptstage", description="Inspect and operate the node's ckptstaged.",
                parents=[_global_options(False)],
                epilog="Exit status: 0 ok, 1 the daemon refused or failed the request, 2 bad usage, "
                       "3 no daemon answers, 4 drain --wait --timeout ran out with parts still queued.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    common = _global_options(True)

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, parents=[common])

    def progress_option(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--progress", choices=MODES, default="auto",
                        help="on stderr: auto (a bar on a terminal, else plain lines), bar, lines or none")

    add("status", "daemon, sessions, arena and tier usage, jobs' drain health")
    add("jobs", "every job: checkpoints, latest step, bytes per tier, sessions, drain state")
    add("ls", "a job's checkpoints").add_argument("job")
    add("gc", "apply retention now").add_argument("--dry-run", action="store_true",
                                                  help="show what would be deleted and why")
    d = add("drain", "drain committed checkpoints to the shared tier")
    d.add_argument("--wait", action="store_true", help="block until nothing is left to drain")
    d.add_argument("--job", help="only this job")
    d.add_argument("--timeout", type=float, default=0, help="with --wait: give up after this many seconds")
    progress_option(d)
    for name in ("pin", "unpin"):
        sp = add(name, f"{name} a checkpoint (pinned ones are never deleted by a rule)")
        sp.add_argument("job")
        sp.add_argument("step", type=int)
    rm = add("rm", "delete steps from this node's local tier and from the shared tier")
    rm.add_argument("job")
    rm.add_argument("steps", type=int, nargs="+", metavar="step")
    pf = add("prefetch", "copy a checkpoint from the shared tier onto local SSD")
    pf.add_argument("job")
    pf.add_argument("step", type=int, nargs="?")
    progress_option(pf)
    co = add("consolidate", "write a step's full tensors as Hugging Face style safetensors files")
    co.add_argument("job")
    co.add_argument("step", type=int, nargs="?", help="default: the newest complete step")
    co.add_argument("--out", required=True, help="directory for model*.safetensors and the index")
    co.add_argument("--prefix", default="", help="keep only keys under this prefix and strip it (e.g. model.)")
    co.add_argument("--max-shard-size", default="5GB", type=_max_shard_size,
                    help="largest file, e.g. 5GB, 500MB (decimal units, as transformers), 2GiB (binary)")
    co.add_argument("--overwrite", action="store_true", help="replace a model already in --out")
    demo = add("demo", "train a small model, kill it, resume from the latest checkpoint (text only)")
    demo.add_argument("--steps", type=int, default=60)
    demo.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    demo.add_argument("--kill-at", type=int, default=36, help="SIGKILL the trainer after this step")
    return p


COMMANDS: dict[str, Callable[[Connection, argparse.Namespace], int]] = {
    "status": cmd_status, "jobs": cmd_jobs, "ls": cmd_ls, "gc": cmd_gc, "drain": cmd_drain, "pin": cmd_pin,
    "unpin": cmd_pin, "prefetch": cmd_prefetch, "rm": cmd_rm,
}


# --- failures ---------------------------------------------------------------------------

def _one_line(text: str) -> str:
    return " ".join(text.split())


def _fail(code: str, message: str, socket: str, as_json: bool, status: int) -> int:
    """One line on stderr; with --json also ``{"error": {...}}`` on stdout."""
    message = _one_line(message)
    print(f"ckptstage: {message}", file=sys.stderr)
    if as_json:
        _print_json({"error": {"code": code, "message": message, "socket": socket}})
    return status


def _given(argv: list[str]) -> tuple[bool, str | None]:
    """--json and --socket as far as they can be read from a command line argparse refused."""
    scan = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    scan.add_argument("--socket")
    scan.add_argument("--json", action="store_true")
    try:
        known, _ = scan.parse_known_args(argv)
    except argparse.ArgumentError:
        return "--json" in argv, None
    return bool(known.json), known.socket


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        as_json, socket = _given(argv)
        sys.stderr.write(e.usage)
        return _fail("usage", str(e), str(resolve_socket(socket)), as_json, EXIT_USAGE)
    socket = str(resolve_socket(args.socket))
    if args.command == "demo":
        from ckptstage.client import demo  # imports torch

        return demo.run(args.socket, args.steps, args.every, args.kill_at)
    try:
        if args.command == "consolidate":
            return cmd_consolidate(args)
        with Connection(args.socket) as conn:
            return COMMANDS[args.command](conn, args)
    except (errors.DaemonUnavailable, errors.DaemonTimeout) as e:
        return _fail(e.code, errors.plain_message(e), socket, args.json, EXIT_NO_DAEMON)
    except errors.CkptStageError as e:
        return _fail(e.code, errors.plain_message(e), socket, args.json, EXIT_FAILED)
    except OSError as e:  # consolidate's output directory
        return _fail("io_error", str(e), socket, args.json, EXIT_FAILED)
    except KeyboardInterrupt:
        return _fail("interrupted", "interrupted (what the daemon was asked to do goes on)", socket, args.json, 130)


if __name__ == "__main__":
    sys.exit(main())
