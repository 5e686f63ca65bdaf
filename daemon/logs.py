"""The daemon's log lines: one record, the same fields, in the format its destination reads.

A call site attaches the facts of an event with :func:`fields`::

    log.info("drained %s step %d", job, step,
             extra=fields(job=job, step=step, tier="shared", bytes=n, duration_s=t))

and :func:`configure` picks how records are written (``--log-format``):

* ``text``: a line for people, the fields appended as ``key=value``;
* ``json``: one JSON object per line (timestamp, level, priority, logger,
  message and the fields as top-level keys), for log pipelines;
* ``journal``: one journal entry per record through journald's native
  protocol, the fields as journal fields (``journalctl JOB=llama STEP=1200``),
  ``PRIORITY`` from the level; where the journal's socket is absent, text
  lines on stderr with the ``<N>`` priority prefix that journald (and
  syslog-style readers) parse;
* ``auto``: ``journal`` when stderr is the journal stream systemd connected
  (``$JOURNAL_STREAM`` names stderr's device and inode), ``text`` otherwise.

Expected conditions (a drain retried, a client gone, a full disk) are logged
as one line with ``error=str(e)``; only a bug earns a traceback.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable, Mapping
from enum import Enum
from typing import IO, Any

from pythonjsonlogger.json import JsonFormatter

from ckptstage.daemon import journald

FORMATS = ("auto", "text", "json", "journal")
# The fields a call site may set, in the order text lines append them.
FIELD_NAMES = ("job", "step", "rank", "tier", "bytes", "duration_s", "error")
# The LogRecord attribute that carries a record's fields: one attribute, so that no field name can clash
# with LogRecord's own (``name``, ``args``, ``module`` ...), and formatters know which extras are ours.
FIELDS_ATTR = "ckptstage_fields"
JOURNAL_SOCKET = journald.SOCKET
IDENTIFIER = "ckptstaged"

# syslog(3) priorities, from the lowest logging level each starts at (levels between INFO and WARNING,
# e.g. a custom 25, are NOTICE).
_PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO + 1, 5),
               (logging.INFO, 6))
DEBUG_PRIORITY = 7


def fields(job: str | None = None, step: int | None = None, rank: int | None = None, tier: object = None,
           bytes: int | None = None, duration_s: float | None = None, error: object = None,
           **more: object) -> dict[str, Any]:
    """The ``extra=`` mapping of a log call that carries these fields; None values are left out.

    ``tier`` may be a :class:`~ckptstage.daemon.catalog.index.TierName` (its value is logged), ``error``
    an exception (its ``str``); ``more`` adds fields of the call site's own (lower-case names).
    """
    given: dict[str, object] = {"job": job, "step": step, "rank": rank, "tier": tier, "bytes": bytes,
                                "duration_s": duration_s, "error": error, **more}
    return {FIELDS_ATTR: {k: _plain(v) for k, v in given.items() if v is not None}}


def _plain(value: object) -> Any:
    """A value every format can write as it is: enums by value, exceptions and paths as text."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, (bool, int, str)):
        return value
    return str(value)


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a record was logged with (empty when the call passed none)."""
    found = getattr(record, FIELDS_ATTR, None)
    return dict(found) if isinstance(found, Mapping) else {}


def priority(levelno: int) -> int:
    """The syslog priority (0-7) journald files a record of this logging level under."""
    for level, prio in _PRIORITIES:
        if levelno >= level:
            return prio
    return DEBUG_PRIORITY


# ------------------------------------------------------------------------- formats


def _value_text(value: Any) -> str:
    """``key=value`` text: quoted (JSON string rules) when a space, quote, ``=`` or control char would
    make the line ambiguous, so ``error="No space left on device"`` stays one field."""
    text = str(value)
    if text and not any(c.isspace() or c in '"=\\' or ord(c) < 0x20 for c in text):
        return text
    return json.dumps(text, ensure_ascii=False)


def _with_fields(line: str, record: logging.LogRecord) -> str:
    extra = record_fields(record)
    ordered = [k for k in FIELD_NAMES if k in extra] + sorted(k for k in extra if k not in FIELD_NAMES)
    return " ".join([line, *(f"{k}={_value_text(extra[k])}" for k in ordered)])


class TextFormatter(logging.Formatter):
    """``2025-05-01 12:00:00,123 WARNING ckptstage.daemon.drain.drainer: drain failed job=a step=3 error="..."``."""

    def __init__(self, timestamps: bool = True) -> None:
        fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s" if timestamps else "%(name)s: %(message)s"
        super().__init__(fmt)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        # The fields go after the message and before a traceback (which Formatter.format appends).
        return _with_fields(super().formatMessage(record), record)


class PrefixFormatter(TextFormatter):
    """Text lines with the ``<N>`` priority prefix journald parses, on every line of a multi-line record.

    No timestamp: whoever parses the prefix (journald, a syslog daemon) stamps the line itself.
    """

    def __init__(self) -> None:
        super().__init__(timestamps=False)

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).splitlines())


class JsonLineFormatter(JsonFormatter):
    """One JSON object per record: timestamp, level, priority, logger, message, then the fields."""

    def __init__(self) -> None:
        super().__init__("{levelname}{name}{message}", style="{", timestamp=True,
                         rename_fields={"levelname": "level", "name": "logger"})

    def add_fields(self, log_data: dict[str, Any], record: logging.LogRecord,
                   message_dict: dict[str, Any]) -> None:
        super().add_fields(log_data, record, message_dict)
        log_data["priority"] = priority(record.levelno)

    def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
        # The fields travel nested under FIELDS_ATTR (see there); a pipeline wants them at the top.
        extra = log_data.pop(FIELDS_ATTR, None) or {}
        head = {k: log_data.pop(k, None) for k in ("timestamp", "level", "priority", "logger", "message")}
        return {**head, **log_data, **extra}


# ------------------------------------------------------------------------- journal


def journal_entry(record: logging.LogRecord, message: str) -> dict[str, str | int]:
    """The journal fields of one record: systemd's well-known ones, then the record's fields upper-cased
    (``job`` -> ``JOB``), which ``journalctl JOB=...`` matches."""
    entry: dict[str, str | int] = {
        "MESSAGE": message, "PRIORITY": priority(record.levelno), "SYSLOG_IDENTIFIER": IDENTIFIER,
        "LOGGER": record.name, "CODE_FILE": record.pathname, "CODE_LINE": record.lineno,
        "CODE_FUNC": record.funcName, "THREAD_NAME": record.threadName or "",
    }
    for key, value in record_fields(record).items():
        entry[key.upper()] = value
    return entry


class JournalHandler(logging.Handler):
    """Writes each record as one journal entry through journald's native protocol.

    ``send`` takes the entry's fields (default: :class:`~ckptstage.daemon.journald.JournalSocket`
    on the journal's socket). :func:`make_handler` checks for the socket first and falls back to
    prefixed lines on stderr where it is missing.
    """

    def __init__(self, send: Callable[[Mapping[str, str | int]], None] | None = None) -> None:
        super().__init__()
        self._send = send or journald.JournalSocket().send
        # MESSAGE is the message (and a bug's traceback), without the timestamp journald adds itself.
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._send(journal_entry(record, self.format(record)))
        except Exception:  # noqa: BLE001 - logging's contract: a handler never raises into the caller
            self.handleError(record)


# ------------------------------------------------------------------------- setup


def stderr_is_journal(env: Mapping[str, str], stream: IO[str]) -> bool:
    """Whether ``stream`` is the journal stream systemd connected (``$JOURNAL_STREAM`` = ``dev:inode``)."""
    want = env.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):  # closed, or a stream without a descriptor
        return False
    return bool(want) and want == f"{st.st_dev}:{st.st_ino}"


def journal_socket_present(path: str = JOURNAL_SOCKET) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def resolve_format(requested: str, env: Mapping[str, str], stream: IO[str]) -> str:
    """``auto`` made concrete: ``journal`` under systemd's journal stream, else ``text``."""
    if requested not in FORMATS:
        raise ValueError(f"unknown log format {requested!r}: one of {', '.join(FORMATS)}")
    if requested != "auto":
        return requested
    return "journal" if stderr_is_journal(env, stream) else "text"


def make_handler(fmt: str, stream: IO[str], journal_socket: str = JOURNAL_SOCKET) -> logging.Handler:
    """The handler of a concrete format (``text``, ``json`` or ``journal``)."""
    if fmt == "journal" and journal_socket_present(journal_socket):
        return JournalHandler(journald.JournalSocket(journal_socket).send)
    handler = logging.StreamHandler(stream)
    formatter: logging.Formatter = {"text": TextFormatter, "json": JsonLineFormatter,
                                    "journal": PrefixFormatter}[fmt]()
    handler.setFormatter(formatter)
    return handler


def configure(requested: str, level: str | int, stream: IO[str], env: Mapping[str, str] | None = None) -> str:
    """Sends every log record of the process to one handler of the requested format; returns the
    concrete format (``auto`` resolved). Raises ValueError for an unknown format or level."""
    fmt = resolve_format(requested, os.environ if env is None else env, stream)
    root = logging.getLogger()
    if isinstance(level, str):
        level = level.upper()
        if not isinstance(logging.getLevelName(level), int):
            raise ValueError(f"unknown log level {level!r}: DEBUG, INFO, WARNING, ERROR or CRITICAL")
    root.setLevel(level)
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(make_handler(fmt, stream))
    return fmt
