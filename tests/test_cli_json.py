"""``ckptstage`` for scripts: the JSON schema of docs/CLI.md, options anywhere, errors without gRPC in them,
idempotent pins, progress on a terminal and in a log, against a real daemon."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import socket as socketlib
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstage.client import Client
from ckptstage.client import cli, cliformat
from ckptstage.client import commands as cli_commands
from ckptstage.protos.v1 import ckptstage_pb2 as pb
from support import drain, wait_until

DOC = Path(__file__).resolve().parents[1] / "docs" / "CLI.md"
# What a user must never see: gRPC's own words.
GRPC_WORDS = re.compile(r"StatusCode\.|_InactiveRpcError|debug_error_string|grpc|\[[A-Z_]+\]", re.I)
MiB = 1 << 20


# --- the schema, read from docs/CLI.md ----------------------------------------------------

def schema() -> dict[str, dict[str, str]]:
    """``{object name: {field: type}}`` from the doc's ``### `Name``` sections and their tables."""
    objects: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for line in DOC.read_text().splitlines():
        heading = re.fullmatch(r"### `(\w+)`", line)
        if heading:
            current = objects.setdefault(heading.group(1), {})
            continue
        row = re.fullmatch(r"\| `(\w+)` \| ([^|]+) \| .*\|", line)
        if row and current is not None:
            current[row.group(1)] = row.group(2).strip()
    return objects


def commands() -> dict[str, str]:
    """``{command name: object name}`` from the doc's command table."""
    found = {}
    for line in DOC.read_text().splitlines():
        m = re.fullmatch(r"\| (`ckptstage .*`) \| `(\w+)` \|", line)
        if m:
            for name in re.findall(r"`ckptstage (\w+)", m.group(1)):
                found[name] = m.group(2)
    return found


SCHEMA = schema()
SCALARS = {"string": str, "integer": int, "number": (int, float), "boolean": bool}


def check(value: Any, kind: str, where: str) -> None:
    """``value`` is of the doc's type ``kind``: an object has exactly its fields, each of its type."""
    if kind.startswith("array of "):
        assert isinstance(value, list), f"{where}: {value!r} is not an array"
        for i, item in enumerate(value):
            check(item, kind[len("array of "):], f"{where}[{i}]")
    elif kind.startswith("map of string to "):
        assert isinstance(value, dict), f"{where}: {value!r} is not an object"
        for k, v in value.items():
            assert isinstance(k, str)
            check(v, kind[len("map of string to "):], f"{where}[{k!r}]")
    elif kind in SCALARS:
        ok = isinstance(value, SCALARS[kind]) and (kind == "boolean" or not isinstance(value, bool))
        assert ok, f"{where}: {value!r} is not a {kind}"
    else:
        name = kind.strip("`")
        fields = SCHEMA[name]
        assert isinstance(value, dict), f"{where}: {value!r} is not a {name} object"
        assert sorted(value) == sorted(fields), f"{where}: keys {sorted(value)} != the doc's {name} {sorted(fields)}"
        for field, field_kind in fields.items():
            check(value[field], field_kind, f"{where}.{field}")


def test_the_doc_describes_every_command_and_each_proto_field() -> None:
    assert set(commands()) == set(cli_commands.COMMANDS) | {"consolidate"}, commands()
    # The objects that are protobuf messages list exactly the message's fields (so one that no test run
    # happens to fill, e.g. a quarantined copy, is still right).
    for name, message in {"Status": pb.StatusResponse, "Session": pb.SessionStatus, "Tier": pb.TierStatus,
                          "Jobs": pb.ListJobsResponse, "Job": pb.JobStatus, "DrainState": pb.DrainState,
                          "PeerState": pb.PeerState, "PeerHealth": pb.PeerHealth,
                          "Checkpoints": pb.ListResponse, "Checkpoint": pb.CheckpointInfo,
                          "QuarantinedCopy": pb.QuarantinedCopy, "GcAction": pb.GcAction,
                          "Drain": pb.DrainResponse}.items():
        assert sorted(SCHEMA[name]) == sorted(f.name for f in message.DESCRIPTOR.fields), name
    # to_json itself: every field of an empty message, unset sub-messages and big integers included.
    empty = cliformat.to_json(pb.StatusResponse(jobs=[pb.JobStatus(local_bytes=2**63 + 1)]))
    check(empty, "Status", "Status")
    assert empty["jobs"][0]["local_bytes"] == 2**63 + 1


# --- running the command ------------------------------------------------------------------

def run(capsys: Any, *argv: str) -> tuple[int, str, str]:
    """``ckptstage ARGV`` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: Any, *argv: str, expect: int = 0) -> Any:
    code, out, err = run(capsys, *argv, "--json")
    assert code == expect, (argv, code, out, err)
    return json.loads(out)


def ckptstage(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptstage.client.cli", *argv], capture_output=True, text=True,
                          timeout=timeout)


def state(step: int, nbytes: int = 64 << 10) -> dict[str, Any]:
    return {"w": torch.full((nbytes // 4,), float(step))}


def test_every_command_prints_the_documented_object(daemon_factory: Any, capsys: Any, tmp_path: Path) -> None:
    d = daemon_factory("n", **{"local.keep_last": 2}).start()
    s = str(d.socket)
    with Client("sj", socket=d.socket) as c:
        for step in (1, 2, 3):
            c.save(step, state(step), metrics={"loss": 1.0 / step}).wait("shared", timeout=30)
        c.pin(3)
        drain(d)  # local keep_last = 2: step 1 now lives on the shared tier only
        st = run_json(capsys, "status", "--socket", s)
        check(st, "Status", "status")
        assert st["sessions"] and st["tiers"] and st["jobs"], st  # the element objects were checked too
        assert [t["tier"] for t in st["tiers"]] == ["local", "shared"]
    out = {name: run_json(capsys, *argv, "--socket", s) for name, argv in {
        "jobs": ["jobs"], "ls": ["ls", "sj"], "gc": ["gc", "--dry-run"], "drain": ["drain", "--wait"],
        "pin": ["pin", "sj", "2"], "unpin": ["unpin", "sj", "2"], "prefetch": ["prefetch", "sj", "1"],
        "rm": ["rm", "sj", "2", "7"],  # one deleted, one missing: both lists filled
        "consolidate": ["consolidate", "sj", "--out", str(tmp_path / "hf")],
    }.items() if name != "rm"}
    out["rm"] = run_json(capsys, "rm", "sj", "2", "7", "--socket", s, expect=1)
    for name, obj in out.items():
        check(obj, commands()[name], name)
    assert [j["job"] for j in out["jobs"]["jobs"]] == ["sj"] and out["jobs"]["jobs"][0]["latest_step"] == 3
    assert [c["step"] for c in out["ls"]["checkpoints"]] == [1, 2, 3]
    assert out["ls"]["checkpoints"][0]["committed_local"] is False  # false printed, not left out
    assert out["gc"]["dry_run"] is True and out["drain"] == {"pending": 0, "failed": 0}
    assert (out["pin"]["changed"], out["pin"]["pinned"], out["unpin"]["pinned"]) == (True, True, False)
    assert (out["prefetch"]["step"], out["prefetch"]["parts"]) == (1, 1)
    assert [x["step"] for x in out["rm"]["deleted"]] == [2] and out["rm"]["errors"][0]["code"] == "not_found"
    assert out["consolidate"]["step"] == 3
    error = run_json(capsys, "ls", "no/such", "--socket", s, expect=1)
    check(error, "Error", "error")
    assert error["error"]["code"] == "invalid_request" and error["error"]["socket"] == s


# --- options anywhere ---------------------------------------------------------------------

MINIMAL = {"status": [], "jobs": [], "ls": ["j"], "gc": [], "drain": [], "pin": ["j", "1"], "unpin": ["j", "1"],
           "rm": ["j", "1"], "prefetch": ["j"], "consolidate": ["j", "--out", "o"], "demo": []}


@pytest.mark.parametrize("command", sorted(MINIMAL))
def test_global_options_in_any_position(command: str) -> None:
    parser = cli.build_parser()
    rest = MINIMAL[command]
    placements = [
        ["--socket", "S", "--json", command, *rest],
        ["--json", "--socket=S", command, *rest],
        ["--socket", "S", command, *rest, "--json"],
        ["--json", command, *rest, "--socket", "S"],
        [command, "--socket", "S", *rest, "--json"],
        [command, *rest, "--json", "--socket", "S"],
        [command, "--json", *rest, "--socket", "S"],
    ]
    for argv in placements:
        args = parser.parse_args(argv)
        assert (args.socket, args.json, args.command) == ("S", True, command), argv
    plain = parser.parse_args([command, *rest])
    assert (plain.socket, plain.json) == (None, False)
    assert parser.parse_args(["--socket", "A", command, *rest, "--socket", "B"]).socket == "B"
    assert parser.parse_args(["--socket", "A", "--json", command, *rest]).json is True


def test_the_same_answer_wherever_the_options_go(daemon: Any, capsys: Any) -> None:
    s = str(daemon.socket)
    answers = [run_json(capsys, *argv) for argv in (["--socket", s, "status"], ["status", "--socket", s],
                                                     ["--socket", s, "jobs"], ["jobs", "--socket", s])]
    for a in answers[:2]:
        assert a["pid"] == daemon.proc.pid and a["socket"] == s
    assert answers[2] == answers[3]
    env = dict(os.environ)
    env.pop("CKPTSTAGE_SOCKET", None)
    for argv in (["--socket", s, "status", "--json"], ["status", "--socket", s, "--json"],
                 ["status", "--json", "--socket", s]):
        res = subprocess.run([sys.executable, "-m", "ckptstage.client.cli", *argv], capture_output=True, text=True,
                             timeout=60, env=env)
        assert res.returncode == 0 and json.loads(res.stdout)["pid"] == daemon.proc.pid, (argv, res.stderr)


# --- no daemon ----------------------------------------------------------------------------

ALL = {"status": [], "jobs": [], "ls": ["j"], "gc": [], "drain": ["--wait"], "pin": ["j", "1"],
       "unpin": ["j", "1"], "rm": ["j", "1"], "prefetch": ["j"], "consolidate": ["j", "--out", "OUT"]}


def stale_socket(path: Path) -> Path:
    """A socket file nobody listens on (what a SIGKILLed daemon leaves)."""
    s = socketlib.socket(socketlib.AF_UNIX)
    s.bind(str(path))
    s.close()
    return path


@pytest.mark.parametrize("kind", ["absent", "refused"])
def test_every_command_without_a_daemon(kind: str, tmp_path: Path, capsys: Any) -> None:
    sock = tmp_path / "gone.sock" if kind == "absent" else stale_socket(tmp_path / "stale.sock")
    say = "no daemon socket at" if kind == "absent" else "nothing listens on"
    for command, rest in ALL.items():
        rest = [str(tmp_path / "out") if a == "OUT" else a for a in rest]
        code, out, err = run(capsys, command, *rest, "--socket", str(sock), "--json")
        assert code == cli_commands.EXIT_NO_DAEMON == 3, (command, out, err)
        error = json.loads(out)["error"]
        assert error["code"] == "daemon_unavailable" and error["socket"] == str(sock), (command, error)
        assert f"{say} {sock}" in error["message"] and "--socket" in error["message"], error
        assert not GRPC_WORDS.search(out + err), (command, out, err)
        code, out, err = run(capsys, command, *rest, "--socket", str(sock))
        assert code == 3 and out == "", (command, out)
        assert err.count("\n") == 1 and err.startswith(f"ckptstage: {say} {sock}"), (command, err)
        assert "start it" in err and not GRPC_WORDS.search(err), err


def test_a_hung_daemon_times_out_with_its_own_code(daemon: Any, capsys: Any) -> None:
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        code, out, err = run(capsys, "status", "--json", "--socket", str(daemon.socket))
        took = time.monotonic() - started
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert code == 3 and took < 15, (code, took)
    error = json.loads(out)["error"]
    assert error["code"] == "daemon_timeout" and str(daemon.socket) in error["message"], error
    assert "did not answer the Status request within 5s" in error["message"] and not GRPC_WORDS.search(out + err)


def test_usage_errors_are_json_too(capsys: Any, tmp_path: Path) -> None:
    code, out, err = run(capsys, "--json", "--socket", str(tmp_path / "s"), "pin", "j", "notastep")
    assert code == 2 and "invalid int value: 'notastep'" in err
    assert json.loads(out)["error"] == {"code": "usage", "socket": str(tmp_path / "s"),
                                        "message": "argument step: invalid int value: 'notastep'"}
    code, out, err = run(capsys, "frobnicate")
    assert code == 2 and out == "" and "invalid choice: 'frobnicate'" in err


# --- errors from the daemon, in words -----------------------------------------------------

def test_each_error_names_what_failed_without_grpc(daemon_factory: Any, capsys: Any) -> None:
    d = daemon_factory("n").start()
    s = str(d.socket)
    with Client("ej", socket=d.socket) as c:
        c.save(1, state(1)).wait("local", timeout=30)
        c.pin(1)
    cases = [  # argv, exit status, code, words the message must have
        (["pin", "ej", "9"], 1, "not_found", "no step 9 of job 'ej'"),
        (["unpin", "ej", "9"], 1, "not_found", "no step 9 of job 'ej'"),
        (["prefetch", "ej", "9"], 1, "not_found", "no step 9 of job 'ej'"),
        (["rm", "ej", "1"], 1, "pinned", "step 1 of job 'ej' is pinned; unpin it first"),
        (["ls", "../up"], 1, "invalid_request", "invalid job name '../up'"),
        (["pin", "a b", "1"], 1, "invalid_request", "invalid job name 'a b'"),
        (["drain", "--job", "x/y"], 1, "invalid_request", "invalid job name 'x/y'"),
    ]
    for argv, status, code, words in cases:
        got, out, err = run(capsys, *argv, "--socket", s)
        assert got == status and out == "" and words in err and err.count("\n") == 1, (argv, err)
        assert not GRPC_WORDS.search(err), (argv, err)
        got, out, err = run(capsys, *argv, "--socket", s, "--json")
        obj = json.loads(out)
        if argv[0] == "rm":  # goes on past a failed step: its errors are in its own object
            assert obj["failed"] == 1 and obj["errors"][0]["code"] == code, obj
            assert words in obj["errors"][0]["message"]
        else:
            assert obj["error"]["code"] == code and words in obj["error"]["message"], (argv, obj)
        assert got == status and not GRPC_WORDS.search(out + err), (argv, out, err)


def test_pin_and_unpin_are_idempotent(daemon: Any, capsys: Any) -> None:
    s = str(daemon.socket)
    with Client("pj", socket=daemon.socket) as c:
        c.save(4, state(4)).wait("local", timeout=30)
    said = []
    for command in ("pin", "pin", "unpin", "unpin"):
        code, out, err = run(capsys, command, "pj", "4", "--socket", s)
        assert code == 0, err
        said.append(out.strip())
    assert said == ["pj step 4 pinned", "pj step 4 was already pinned: nothing changed",
                    "pj step 4 unpinned", "pj step 4 was not pinned: nothing changed"]
    missing = run_json(capsys, "unpin", "pj", "12", "--socket", s, expect=1)  # no such step: not "nothing changed"
    assert missing["error"]["code"] == "not_found" and "no step 12 of job 'pj'" in missing["error"]["message"]
    assert run_json(capsys, "pin", "pj", "4", "--socket", s)["changed"] is True
    assert run_json(capsys, "pin", "pj", "4", "--socket", s) == {"job": "pj", "step": 4, "changed": False,
                                                                 "pinned": True}


# --- drain health in status and jobs --------------------------------------------------------

def test_failing_drains_show_in_status_and_jobs(daemon_factory: Any, capsys: Any) -> None:
    d = daemon_factory("n")
    assert d.shared is not None
    d.shared.mkdir(parents=True)
    (d.shared / "fj").write_text("not a directory")  # every copy of the job's parts fails
    d.start()
    s = str(d.socket)
    with Client("fj", socket=d.socket) as c:
        c.save(1, state(1)).wait("local", timeout=30)

    def degraded() -> dict[str, Any] | None:
        st = run_json(capsys, "status", "--socket", s)
        return st if st["tiers"][1]["state"] == "degraded" and st["jobs"][0]["drain"]["last_error"] else None

    st = wait_until(degraded, 30, "the shared tier degraded")
    job = st["jobs"][0]
    assert job["job"] == "fj" and job["drain"]["state"] in ("retrying", "failed") and job["drain"]["last_error_time"] > 0
    code, out, err = run(capsys, "status", "--socket", s)
    shared_line = next(line for line in out.splitlines() if line.startswith("shared:"))
    assert "(DEGRADED)" in shared_line and "last error" in shared_line, out
    job_line = next(line for line in out.splitlines() if line.strip().startswith("fj:"))
    assert "last drain error" in job_line and job["drain"]["last_error"] in job_line, out
    assert time.strftime("%Y-%m-%d", time.localtime(job["drain"]["last_error_time"])) in job_line
    code, out, err = run(capsys, "jobs", "--socket", s)
    header, row = out.splitlines()
    assert header.split()[:3] == ["JOB", "CKPTS", "LATEST"] and "LAST DRAIN ERROR" in header
    assert row.split()[:3] == ["fj", "1", "1"] and "ago: " in row and job["drain"]["state"] in row, row
    # drain --wait gives up at --timeout: parts still queued, exit 4, and the error is named meanwhile
    code, out, err = run(capsys, "drain", "--wait", "--timeout", "1.5", "--progress", "lines", "--socket", s)
    assert code == cli_commands.EXIT_TIMED_OUT == 4, (out, err)
    assert out == "1 part(s) still to drain after 1.5s (--timeout), 0 failed\n", (out, err)
    assert re.search(r"drain all jobs: 0 B of .* done, fj \w+: .*fj", err), err


# --- progress -----------------------------------------------------------------------------

def slow_node(daemon_factory: Any) -> Any:
    return daemon_factory("slow", **{"shared.max_bandwidth": "1MiB/s", "shared.max_concurrent": 1,
                                     "shared.keep_last": 10}).start()


def save_unDrained(d: Any, job: str, steps: range, nbytes: int) -> None:
    with Client(job, socket=d.socket) as c:
        for step in steps:
            c.save(step, state(step, nbytes)).wait("local", timeout=30)


def test_drain_wait_prints_plain_progress_lines_off_a_terminal(daemon_factory: Any) -> None:
    d = slow_node(daemon_factory)
    save_unDrained(d, "lj", range(1, 5), MiB)  # ~4 s at 1 MiB/s
    res = ckptstage("drain", "--wait", "--socket", str(d.socket), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == {"pending": 0, "failed": 0}  # stdout: the result only
    human = ckptstage("drain", "--wait", "--socket", str(d.socket))
    assert (human.returncode, human.stdout, human.stderr) == (0, "everything is on the shared tier\n", "")
    assert "\r" not in res.stderr
    lines = res.stderr.splitlines()
    progress = [line for line in lines if re.fullmatch(r"drain all jobs: .* of .* done.*", line)]
    assert len(progress) >= 2 and len(progress) == len(lines), lines
    done = [float(re.match(r"drain all jobs: ([\d.]+)", line).group(1)) for line in progress]  # type: ignore[union-attr]
    assert done == sorted(done) and done[0] < done[-1], progress

    # prefetch: a step back from the shared tier (local keep_last = 2 let steps 1 and 2 go), a line per change
    res = ckptstage("prefetch", "lj", "1", "--socket", str(d.socket))
    assert res.returncode == 0 and "\r" not in res.stderr, res.stderr
    assert res.stdout == "lj step 1: 1 part(s) copied to the local tier\n"
    assert res.stderr.splitlines()[-1].startswith("prefetch lj step 1: 1 of 1 part(s) done"), res.stderr


def test_drain_wait_draws_a_tqdm_bar_on_a_terminal(daemon_factory: Any) -> None:
    d = slow_node(daemon_factory)
    save_unDrained(d, "tj", range(1, 4), MiB)
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal 100 wide
    proc = subprocess.Popen([sys.executable, "-m", "ckptstage.client.cli", "drain", "--wait", "--socket",
                             str(d.socket)], stdout=subprocess.PIPE, stderr=follower, stdin=subprocess.DEVNULL)
    os.close(follower)
    seen = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 1)
        if ready:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    os.close(leader)
    out, _ = proc.communicate(timeout=30)
    text = seen.decode(errors="replace")
    assert proc.returncode == 0, text
    assert "\r" in text and re.search(r"drain all jobs:\s+\d+%\|", text), text  # tqdm redraws one line
    assert re.search(r"100%\|.*\| (\d\.\d\dM)/\1 ", text), text  # as far as the bytes queued
    assert out == b"everything is on the shared tier\n", out


def test_the_daemon_going_away_mid_command(daemon_factory: Any) -> None:
    d = slow_node(daemon_factory)
    save_unDrained(d, "gj", range(1, 9), MiB)  # 8 s of draining
    proc = subprocess.Popen([sys.executable, "-m", "ckptstage.client.cli", "drain", "--wait", "--progress", "lines",
                             "--json", "--socket", str(d.socket)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stderr is not None
    first = proc.stderr.readline()
    assert first.startswith("drain all jobs: "), first
    d.kill()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, (out, err)
    error = json.loads(out)["error"]
    assert error["code"] == "daemon_unavailable" and error["socket"] == str(d.socket)
    assert f"the daemon on {d.socket} went away during the" in error["message"], error
    assert f"ckptstage: {error['message']}" in err and not GRPC_WORDS.search(out + err), (out, err)


def test_a_daemon_gone_between_two_calls_went_away_it_was_not_never_there(daemon_factory: Any) -> None:
    """A waiting command polls: the daemon killed between two polls refuses the next connection, which
    must still read as a daemon that went away, not as a socket nobody ever served."""
    from ckptstage.client import errors
    from ckptstage.client.rpc import Connection

    d = daemon_factory("gone").start()
    with Connection(d.socket) as conn:
        conn.status()
        d.kill()
        with pytest.raises(errors.DaemonUnavailable) as seen:
            conn.status()
    assert f"the daemon on {d.socket} went away during the" in str(seen.value), seen.value
    with Connection(d.socket) as fresh, pytest.raises(errors.DaemonUnavailable) as never:
        fresh.status()  # a connection that never had an answer: the socket left behind is named
    assert f"nothing listens on {d.socket}" in str(never.value), never.value


def test_plain_lines_come_once_per_change_and_at_most_every_interval() -> None:
    import io

    from ckptstage.client.progress import Progress

    now = [0.0]
    out = io.StringIO()
    p = Progress("copy", "part", mode="auto", stream=out, interval=2.0, clock=lambda: now[0])
    assert p.mode == "lines"  # not a terminal
    for t, done in [(0.0, 0), (0.5, 0), (1.0, 1), (1.5, 2), (2.5, 2), (3.0, 3), (9.0, 3)]:
        now[0] = t
        p.update(done, 5)
    p.update(5, 5)  # within the interval: shown by close
    p.close()
    assert out.getvalue().splitlines() == ["copy: 0 of 5 part(s) done", "copy: 2 of 5 part(s) done",
                                           "copy: 3 of 5 part(s) done", "copy: 5 of 5 part(s) done"]
    leader, follower = pty.openpty()  # a terminal nobody gave a size: no bar drawn into 0 columns
    try:
        with open(follower, "w", closefd=False) as tty:
            assert Progress("x", "B", stream=tty).mode == "lines"
            fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
            assert Progress("x", "B", stream=tty).mode == "bar"
    finally:
        os.close(leader)
        os.close(follower)
