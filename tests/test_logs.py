"""The daemon's log lines: fields, priorities and formats (daemon/logs.py), and a real daemon's JSON lines."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import socket
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from support import wait_until

from ckptstage.daemon import logs
from ckptstage.daemon.catalog.index import TierName
from ckptstage.daemon.main import parse_args


def _record(level: int = logging.INFO, msg: str = "drained %s", args: tuple[Any, ...] = ("a",),
            extra: dict[str, Any] | None = None, exc: bool = False) -> logging.LogRecord:
    logger = logging.Logger("ckptstage.daemon.test")
    exc_info = None
    if exc:
        try:
            raise ZeroDivisionError("boom")
        except ZeroDivisionError:
            exc_info = sys.exc_info()
    return logger.makeRecord(logger.name, level, "/src/drainer.py", 42, msg, args, exc_info, "drain", extra)


# --- fields and priorities -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("level", "priority"), [
    (logging.CRITICAL + 5, 2), (logging.CRITICAL, 2), (logging.ERROR, 3), (logging.ERROR + 1, 3),
    (logging.WARNING, 4), (25, 5), (logging.INFO + 1, 5), (logging.INFO, 6), (15, 7), (logging.DEBUG, 7),
    (logging.NOTSET, 7),
])
def test_every_level_has_a_syslog_priority(level: int, priority: int) -> None:
    assert logs.priority(level) == priority


def test_fields_drop_none_and_log_plain_values() -> None:
    err = OSError(28, "No space left on device")
    extra = logs.fields(job="llama", step=0, rank=None, tier=TierName.SHARED, bytes=0, duration_s=1.23456789,
                        error=err, attempt=2)
    assert logs.record_fields(_record(extra=extra)) == {
        "job": "llama", "step": 0, "tier": "shared", "bytes": 0, "duration_s": 1.234568,
        "error": "[Errno 28] No space left on device", "attempt": 2}
    assert logs.record_fields(_record()) == {}


def test_a_field_named_like_a_record_attribute_does_not_break_the_call() -> None:
    # "name" and "args" are LogRecord's own: flat extras would raise KeyError inside the log call.
    record = _record(extra=logs.fields(name="x", args="y", module="z"))
    assert logs.record_fields(record) == {"name": "x", "args": "y", "module": "z"}
    assert record.name == "ckptstage.daemon.test"


# --- formats -------------------------------------------------------------------------------------------------


def test_text_appends_the_fields_quoting_what_needs_it() -> None:
    line = logs.TextFormatter().format(_record(logging.WARNING, extra=logs.fields(
        job="a", step=3, tier=TierName.LOCAL, error='disk "full" = bad', reason="x")))
    assert line.endswith(' WARNING ckptstage.daemon.test: drained a job=a step=3 tier=local '
                         'error="disk \\"full\\" = bad" reason=x')


def test_text_puts_a_bugs_traceback_after_the_fields() -> None:
    lines = logs.TextFormatter().format(_record(logging.ERROR, extra=logs.fields(job="a"), exc=True)).splitlines()
    assert lines[0].endswith("drained a job=a") and lines[1] == "Traceback (most recent call last):"


def test_json_is_one_object_per_record_with_the_fields_at_the_top() -> None:
    text = logs.JsonLineFormatter().format(_record(extra=logs.fields(job="a", step=3, bytes=10, duration_s=0.5)))
    assert "\n" not in text
    obj = json.loads(text)
    assert list(obj)[:5] == ["timestamp", "level", "priority", "logger", "message"]
    assert obj | {"timestamp": None} == {"timestamp": None, "level": "INFO", "priority": 6,
                                         "logger": "ckptstage.daemon.test", "message": "drained a", "job": "a",
                                         "step": 3, "bytes": 10, "duration_s": 0.5}
    assert obj["timestamp"].endswith("+00:00")


def test_prefixed_lines_carry_the_priority_on_every_line() -> None:
    text = logs.PrefixFormatter().format(_record(logging.ERROR, extra=logs.fields(job="a"), exc=True))
    lines = text.splitlines()
    assert lines[0] == "<3>ckptstage.daemon.test: drained a job=a"
    assert len(lines) > 2 and all(line.startswith("<3>") for line in lines)


def test_journal_entries_carry_the_fields_as_journal_fields() -> None:
    sent: list[dict[str, Any]] = []
    handler = logs.JournalHandler(send=lambda entry: sent.append(dict(entry)))
    handler.handle(_record(logging.WARNING, extra=logs.fields(job="a", step=3, rank=1, tier="shared",
                                                              error="gone", retry_in_s=1.5)))
    [entry] = sent
    assert entry == {"MESSAGE": "drained a", "PRIORITY": 4, "SYSLOG_IDENTIFIER": "ckptstaged",
                     "LOGGER": "ckptstage.daemon.test", "CODE_FILE": "/src/drainer.py", "CODE_LINE": 42,
                     "CODE_FUNC": "drain", "THREAD_NAME": entry["THREAD_NAME"], "JOB": "a", "STEP": 3, "RANK": 1,
                     "TIER": "shared", "ERROR": "gone", "RETRY_IN_S": 1.5}


def test_journal_falls_back_to_prefixed_stderr_without_the_journal_socket(tmp_path: Path) -> None:
    absent = logs.make_handler("journal", io.StringIO(), journal_socket=str(tmp_path / "no-socket"))
    assert isinstance(absent.formatter, logs.PrefixFormatter)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as journal:
        journal.bind(str(tmp_path / "socket"))
        present = logs.make_handler("journal", io.StringIO(), journal_socket=str(tmp_path / "socket"))
    assert isinstance(present, logs.JournalHandler)


def _journal_fields(datagram: bytes) -> list[tuple[str, str]]:
    """The fields of one native-protocol datagram, in order, repeats kept (journald's own parsing)."""
    out: list[tuple[str, str]] = []
    rest = datagram
    while rest:
        line, sep, after = rest.partition(b"\n")
        if b"=" in line:
            name, _, value = line.partition(b"=")
            out.append((name.decode(), value.decode()))
            rest = after
        else:
            size = struct.unpack("<Q", after[:8])[0]
            out.append((line.decode(), after[8:8 + size].decode()))
            assert after[8 + size:9 + size] == b"\n", "a binary field ends with a newline"
            rest = after[9 + size:]
    return out


def test_journal_entries_reach_the_socket_with_the_daemons_call_site_once(tmp_path: Path) -> None:
    """What journald receives: each CODE_* field once, naming the daemon's call site, never the journal
    library's; a multi-line message (a traceback) and an entry larger than a datagram arrive whole."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as journal:
        journal.bind(str(tmp_path / "socket"))
        journal.settimeout(5)
        handler = logs.make_handler("journal", io.StringIO(), journal_socket=str(tmp_path / "socket"))
        logger = logging.getLogger("ckptstage.daemon.test_journal")
        logger.addHandler(handler)
        logger.propagate = False
        try:
            logger.warning("drain of %s failed", "a", extra=logs.fields(job="a", step=3))
            line = sys._getframe().f_lineno - 1
            fields = _journal_fields(journal.recv(1 << 20))
            try:
                raise OSError("disk\ngone")
            except OSError:
                logger.exception("bug")
            traceback_fields = dict(_journal_fields(journal.recv(1 << 20)))
            logger.error("%s", "x" * (4 << 20))  # past any datagram: sent as a sealed memfd
            msg, ancillary, _, _ = journal.recvmsg(16, socket.CMSG_SPACE(4))
        finally:
            logger.removeHandler(handler)
    names = [name for name, _ in fields]
    for code in ("CODE_FILE", "CODE_LINE", "CODE_FUNC"):
        assert names.count(code) == 1, f"{code} appears {names.count(code)} times: {fields}"
    got = dict(fields)
    assert (got["CODE_FILE"], got["CODE_LINE"], got["CODE_FUNC"]) == (
        __file__, str(line), "test_journal_entries_reach_the_socket_with_the_daemons_call_site_once")
    assert got["MESSAGE"] == "drain of a failed" and got["JOB"] == "a" and got["PRIORITY"] == "4"
    assert "OSError: disk\ngone" in traceback_fields["MESSAGE"] and traceback_fields["PRIORITY"] == "3"
    assert msg == b"" and len(ancillary) == 1, "a large entry travels as one passed descriptor"
    fd = struct.unpack("i", ancillary[0][2][:4])[0]
    with os.fdopen(fd, "rb") as memfd:
        memfd.seek(0)  # the sender wrote through the same open file
        big = dict(_journal_fields(memfd.read()))
    assert big["MESSAGE"] == "x" * (4 << 20)


def test_auto_is_journal_only_on_the_journal_stream(tmp_path: Path) -> None:
    with open(tmp_path / "stderr", "w") as stream, open(tmp_path / "other", "w") as other:
        st, ot = os.fstat(stream.fileno()), os.fstat(other.fileno())
        assert logs.resolve_format("auto", {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}, stream) == "journal"
        assert logs.resolve_format("auto", {"JOURNAL_STREAM": f"{ot.st_dev}:{ot.st_ino}"}, stream) == "text"
        assert logs.resolve_format("auto", {}, stream) == "text"
        assert logs.resolve_format("json", {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}, stream) == "json"
    assert logs.resolve_format("auto", {"JOURNAL_STREAM": "1:2"}, io.StringIO()) == "text"  # no descriptor
    with pytest.raises(ValueError, match="unknown log format"):
        logs.resolve_format("xml", {}, io.StringIO())


def test_the_format_and_level_flags_and_their_environment(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CKPTSTAGE_LOG_FORMAT", "json")
    assert parse_args([]).log_format == "json"
    assert parse_args(["--log-format", "text"]).log_format == "text"
    for bad in (["--log-format", "xml"], ["--log-level", "LOUD"]):
        with pytest.raises(SystemExit) as exit_:
            parse_args(bad)
        assert exit_.value.code == 2
    assert "is not one of" in capsys.readouterr().err


# --- a real daemon -------------------------------------------------------------------------------------------


def _json_lines(log: Path) -> list[dict[str, Any]]:
    """Every line the daemon wrote, each of which must be a JSON object."""
    out = []
    for line in log.read_text().splitlines():
        obj = json.loads(line)  # fails on any line that is not JSON, e.g. a bare traceback
        assert isinstance(obj, dict), line
        out.append(obj)
    return out


def test_a_daemon_logging_json_reports_saves_and_failed_drains_with_their_fields(daemon_factory: Any) -> None:
    import numpy as np

    from ckptstage.client import Client

    d = daemon_factory("json")
    d.args += ["--log-format", "json", "--log-level", "INFO"]
    assert d.shared is not None
    d.shared.mkdir(parents=True)
    (d.shared / "blocked").write_text("a file where the job's directory must go\n")  # a real, lasting fault
    d.start()
    state = {"w": np.arange(50_000, dtype=np.float32)}
    with Client("fine", socket=d.socket) as fine, Client("blocked", socket=d.socket) as blocked:
        fine.save(1, state).wait("shared", timeout=60)
        blocked.save(7, state).wait("local", timeout=60)

        def drain_failures() -> list[dict[str, Any]]:
            return [o for o in _json_lines(d.log) if o.get("job") == "blocked" and o.get("tier") == "shared"
                    and o.get("error") and o["level"] in ("WARNING", "ERROR")]

        failures = wait_until(drain_failures, 30, "a failed drain of job 'blocked' logged with its error")
    d.stop()

    lines = _json_lines(d.log)
    assert all({"timestamp", "level", "priority", "logger", "message"} <= set(o) for o in lines)
    assert all(o["priority"] == logs.priority(logging.getLevelName(o["level"])) for o in lines)
    committed = [o for o in lines if o.get("job") == "fine" and o.get("step") == 1 and o.get("tier") == "local"
                 and "bytes" in o and "duration_s" in o]
    drained = [o for o in lines if o.get("job") == "fine" and o.get("step") == 1 and o.get("tier") == "shared"
               and "bytes" in o and "duration_s" in o]
    assert committed and drained, [o["message"] for o in lines]
    assert committed[0]["bytes"] >= state["w"].nbytes and committed[0]["duration_s"] >= 0
    failure = failures[0]
    assert failure["step"] == 7 and failure["rank"] == 0, failure
    assert "Not a directory" in failure["error"] and "retry_in_s" in failure, failure
    # An expected condition: one line, no traceback anywhere.
    assert not [o for o in lines if "exc_info" in o or "Traceback" in o["message"]]


def test_a_configuration_error_is_one_line_of_the_chosen_format(tmp_path: Path) -> None:
    import subprocess

    bad = tmp_path / "bad.toml"
    bad.write_text("[retention]\ninterval_s = 0.000001\n")
    base = [sys.executable, "-m", "ckptstage.daemon.main", "--config", str(bad)]
    as_json = subprocess.run([*base, "--log-format", "json"], capture_output=True, text=True, timeout=60)
    [line] = as_json.stderr.splitlines()
    obj = json.loads(line)
    assert (as_json.returncode, obj["level"], obj["priority"]) == (78, "ERROR", 3)
    assert "retention.interval_s" in obj["message"] and obj["error"] == obj["message"]
    prefixed = subprocess.run([*base, "--log-format", "journal"], capture_output=True, text=True, timeout=60)
    if not logs.journal_socket_present():  # else the line went to the journal
        [line] = prefixed.stderr.splitlines()
        assert line.startswith("<3>ckptstaged: ") and "retention.interval_s" in line
    assert prefixed.returncode == 78


def test_an_abort_writes_every_threads_stack_to_the_log(daemon: Any) -> None:
    """The watchdog's kill of a hung daemon (SIGABRT) leaves where each thread was, in the daemon's
    stderr (the journal under the unit): here the daemon's loop is stopped, aborted, then let run."""
    os.kill(daemon.pid, signal.SIGSTOP)
    os.kill(daemon.pid, signal.SIGABRT)
    os.kill(daemon.pid, signal.SIGCONT)
    assert daemon.proc.wait(timeout=60) == -signal.SIGABRT
    out = daemon.output_tail(400)
    assert "Fatal Python error: Aborted" in out, out
    assert out.count("Thread 0x") >= 3, f"every thread's stack, not only the main thread's:\n{out}"
    assert "_run_loop" in out and "in main" in out, out
