"""``ckptstage``: the operator's and the job script's command line.

    ckptstage status [--json]            daemon reachable? sessions, arena, tiers
    ckptstage ls JOB [--json]            steps, tiers, sizes, times, drain state
    ckptstage gc [--dry-run] [--json]    apply retention now (or show what it would delete)
    ckptstage drain [--wait] [--job J]   drain to the shared tier (--wait: for job epilogues)
    ckptstage pin JOB STEP / unpin JOB STEP
    ckptstage rm JOB STEP [STEP ...]     delete steps from the local and the shared tier (pinned ones refuse)
    ckptstage prefetch JOB [STEP]        stage a checkpoint from the shared tier onto local SSD
    ckptstage consolidate JOB [STEP] --out DIR [--prefix P] [--max-shard-size 5GB] [--overwrite]
                                         full tensors as Hugging Face style safetensors files
    ckptstage demo                       train, kill, resume: see README

Exit status: 0 on success, 1 when the daemon reports a failure, 2 for bad usage,
3 when no daemon answers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from google.protobuf.json_format import MessageToDict

from ckptstage.client import errors
from ckptstage.client.rpc import Connection
from ckptstage.protos.v1 import ckptstage_pb2 as pb


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


def _emit(args: argparse.Namespace, message: Any, text: Callable[[], str]) -> None:
    if args.json:
        print(json.dumps(MessageToDict(message, preserving_proto_field_name=True), indent=2, sort_keys=True))
    else:
        print(text())


def cmd_status(conn: Connection, args: argparse.Namespace) -> int:
    st = conn.status()

    def text() -> str:
        lines = [f"ckptstaged {st.version} pid {st.pid} on {st.socket}, up {st.uptime_s:.0f}s",
                 f"arena: {_size(st.arena_used_bytes)} of {_size(st.arena_budget_bytes)} in use, "
                 f"{len(st.sessions)} session(s)"]
        for s in st.sessions:
            lines.append(f"  session {s.session_id}: job {s.job} rank {s.rank} pid {s.pid}, "
                         f"arena {_size(s.arena_bytes)}, {s.saves_in_flight} save(s) in flight")
        for t in st.tiers:
            name = pb.Tier.Name(t.tier).lower()
            if not t.enabled:
                lines.append(f"{name}: disabled")
                continue
            lines.append(f"{name}: {t.dir} — {t.checkpoints} part(s), {_size(t.used_bytes)} used, "
                         f"{_size(t.free_bytes)} free" + ("" if t.reachable else " (UNREACHABLE)"))
        lines.append(f"memory: {st.memory_parts} part(s) kept for restarts, {_size(st.memory_bytes)}")
        lines.append(f"drain queue: {st.drain_queue} part(s)")
        if st.metrics_url:
            lines.append(f"metrics: {st.metrics_url}")
        return "\n".join(lines)

    _emit(args, st, text)
    return 0


def cmd_ls(conn: Connection, args: argparse.Namespace) -> int:
    resp = conn.call("ListCheckpoints", pb.ListRequest(job=args.job, memory=True))

    def text() -> str:
        quarantined = [f"quarantined: step {q.step} rank {q.rank} {pb.Tier.Name(q.tier).lower()} copy, "
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
    return 0


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
            return f"nothing to delete: every checkpoint is kept by a rule"
        return "\n".join(f"{verb} {a.job} step {a.step} from {pb.Tier.Name(a.tier).lower()} "
                         f"({_size(a.bytes)}): {a.reason}" for a in resp.deleted)

    _emit(args, resp, text)
    return 0


def cmd_drain(conn: Connection, args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.timeout if args.timeout else None
    while True:
        left = 25.0 if deadline is None else max(0.0, min(25.0, deadline - time.monotonic()))
        resp = conn.call("Drain", pb.DrainRequest(job=args.job or "", wait=args.wait, timeout_s=left),
                         timeout=left + 10)
        if not args.wait or resp.pending == 0 or (deadline is not None and time.monotonic() >= deadline):
            break
    _emit(args, resp, lambda: f"{resp.pending} part(s) still to drain, {resp.failed} failed")
    return 0 if resp.failed == 0 and (not args.wait or resp.pending == 0) else 1


def cmd_pin(conn: Connection, args: argparse.Namespace) -> int:
    conn.call("SetPin", pb.PinRequest(job=args.job, step=args.step, pinned=args.command == "pin"))
    print(f"{args.job} step {args.step} {'pinned' if args.command == 'pin' else 'unpinned'}")
    return 0


def cmd_rm(conn: Connection, args: argparse.Namespace) -> int:
    """Deletes each step; goes on past a step that fails and exits 1 if any did."""
    failed = 0
    done = []
    for step in args.steps:
        try:
            resp = conn.call("DeleteStep", pb.DeleteStepRequest(job=args.job, step=step), timeout=120)
        except errors.DaemonUnavailable:
            raise
        except errors.CkptStageError as e:
            print(f"ckptstage: {e}", file=sys.stderr)
            failed += 1
            continue
        tiers = " and ".join(pb.Tier.Name(t).lower() for t in resp.tiers)
        done.append({"job": args.job, "step": step, "parts_deleted": resp.parts_deleted,
                     "bytes_deleted": resp.bytes_deleted, "tiers": [pb.Tier.Name(t).lower() for t in resp.tiers]})
        if not args.json:
            print(f"{args.job} step {step}: deleted from {tiers} ({resp.parts_deleted} part(s), "
                  f"{_size(resp.bytes_deleted)})")
    if args.json:
        print(json.dumps({"deleted": done, "failed": failed}, indent=2, sort_keys=True))
    return 1 if failed else 0


def cmd_prefetch(conn: Connection, args: argparse.Namespace) -> int:
    req = pb.PrefetchRequest(job=args.job, step=args.step or 0, latest=args.step is None)
    resp = conn.call("Prefetch", req, timeout=3600)
    _emit(args, resp, lambda: f"{args.job} step {resp.step}: {resp.parts} part(s) copied to the local tier")
    return 0


def cmd_consolidate(args: argparse.Namespace) -> int:
    from ckptstage.client import consolidate  # imports torch

    progress = "bar" if sys.stderr.isatty() else "lines"
    done = consolidate.consolidate(args.job, args.step, out=args.out, prefix=args.prefix,
                                   max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                                   socket=args.socket, progress=progress)
    if args.json:
        print(json.dumps(done.to_json(), indent=2, sort_keys=True))
    else:
        print(f"{done.job} step {done.step}: {done.tensors} tensors, {_size(done.bytes)} in "
              f"{len(done.files) - 1} file(s) under {done.out}")
    return 0


def _max_shard_size(text: str) -> str:
    from ckptstage.client.consolidate import parse_size

    try:
        parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptstage", description="Inspect and operate the node's ckptstaged.")
    p.add_argument("--socket", help="daemon socket (default: $CKPTSTAGE_SOCKET, else the daemon's default)")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, help_: str, json_flag: bool = True) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_)
        if json_flag:
            sp.add_argument("--json", action="store_true", help="machine-readable output")
        return sp

    add("status", "daemon, sessions, arena and tier usage")
    add("ls", "a job's checkpoints").add_argument("job")
    add("gc", "apply retention now").add_argument("--dry-run", action="store_true",
                                                  help="show what would be deleted and why")
    d = add("drain", "drain committed checkpoints to the shared tier")
    d.add_argument("--wait", action="store_true", help="block until nothing is left to drain")
    d.add_argument("--job", help="only this job")
    d.add_argument("--timeout", type=float, default=0, help="with --wait: give up after this many seconds")
    for name in ("pin", "unpin"):
        sp = add(name, f"{name} a checkpoint (pinned ones are never deleted by a rule)", json_flag=False)
        sp.add_argument("job")
        sp.add_argument("step", type=int)
    rm = add("rm", "delete steps from this node's local tier and from the shared tier")
    rm.add_argument("job")
    rm.add_argument("steps", type=int, nargs="+", metavar="step")
    pf = add("prefetch", "copy a checkpoint from the shared tier onto local SSD")
    pf.add_argument("job")
    pf.add_argument("step", type=int, nargs="?")
    co = add("consolidate", "write a step's full tensors as Hugging Face style safetensors files")
    co.add_argument("job")
    co.add_argument("step", type=int, nargs="?", help="default: the newest complete step")
    co.add_argument("--out", required=True, help="directory for model*.safetensors and the index")
    co.add_argument("--prefix", default="", help="keep only keys under this prefix and strip it (e.g. model.)")
    co.add_argument("--max-shard-size", default="5GB", type=_max_shard_size,
                    help="largest file, e.g. 5GB, 500MB (decimal units, as transformers), 2GiB (binary)")
    co.add_argument("--overwrite", action="store_true", help="replace a model already in --out")
    demo = add("demo", "train a small model, kill it, resume from the latest checkpoint", json_flag=False)
    demo.add_argument("--steps", type=int, default=60)
    demo.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    demo.add_argument("--kill-at", type=int, default=36, help="SIGKILL the trainer after this step")
    return p


COMMANDS: dict[str, Callable[[Connection, argparse.Namespace], int]] = {
    "status": cmd_status, "ls": cmd_ls, "gc": cmd_gc, "drain": cmd_drain, "pin": cmd_pin, "unpin": cmd_pin,
    "prefetch": cmd_prefetch, "rm": cmd_rm,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from ckptstage.client import demo  # imports torch

        return demo.run(args.socket, args.steps, args.every, args.kill_at)
    try:
        if args.command == "consolidate":
            return cmd_consolidate(args)
        with Connection(args.socket) as conn:
            return COMMANDS[args.command](conn, args)
    except errors.DaemonUnavailable as e:
        print(f"ckptstage: {e}", file=sys.stderr)
        return 3
    except errors.CkptStageError as e:
        print(f"ckptstage: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # consolidate's output directory
        print(f"ckptstage: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
