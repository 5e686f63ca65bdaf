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
import sys
from typing import NoReturn

from ckptstage.client import errors
from ckptstage.client.cliformat import one_line, print_json
from ckptstage.client.commands import COMMANDS, EXIT_FAILED, EXIT_NO_DAEMON, EXIT_USAGE, cmd_consolidate
from ckptstage.client.progress import MODES
from ckptstage.client.rpc import Connection, resolve_socket


# --- the parser -------------------------------------------------------------------------

def _max_shard_size(text: str) -> str:
    from ckptstage.client.consolidate import parse_size

    try:
        parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


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


# --- failures ---------------------------------------------------------------------------

def _fail(code: str, message: str, socket: str, as_json: bool, status: int) -> int:
    """One line on stderr; with --json also ``{"error": {...}}`` on stdout."""
    message = one_line(message)
    print(f"ckptstage: {message}", file=sys.stderr)
    if as_json:
        print_json({"error": {"code": code, "message": message, "socket": socket}})
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
