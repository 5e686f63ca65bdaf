"""The daemon's configuration: one frozen dataclass per TOML section.

A config file is optional: with none, every key takes the default written on
its dataclass field below (the one place defaults live; ``default.toml`` beside
this module documents them and a test keeps the two in step). Two defaults
depend on the environment and are filled in by :func:`load_config`:

* ``socket``: ``$XDG_RUNTIME_DIR/ckptstage/ckptstage.sock``, else
  ``<data_dir>/ckptstage.sock``;
* ``local.dir``: ``<data_dir>/local``,

where ``data_dir`` is ``$XDG_DATA_HOME/ckptstage``, else
``~/.local/share/ckptstage``.

Everything is validated on load. A mistake raises :class:`ConfigError` naming
the dotted key and where the value came from (the file, a command-line
override, or the environment); unknown sections and keys are errors too, so a
typo is never silently ignored.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from fractions import Fraction
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from ckptstage.daemon.retention.planner import KeepBest  # the one keep_best rule; re-exported for the config's users
from ckptstage.protos.paths import default_data_dir, default_socket_path  # noqa: F401 - re-exported

# Linux's sockaddr_un.sun_path holds 108 bytes including the terminating NUL;
# a longer path fails at bind() with an error that does not say why.
MAX_SOCKET_PATH_BYTES = 107
OVERRIDE_ORIGIN = "command-line override"
ENV_ORIGIN = "default from the environment"
DEFAULTS_ORIGIN = "built-in defaults"

# Upper bounds of numeric keys: far above any real use, low enough that a typo or a unit slip
# ("16TB" for "16GB", 1000 threads) is refused at load rather than exhausting the node.
MAX_ARENA_BYTES = 4 << 40  # all of a large node's memory
MAX_TIER_BYTES = 1 << 50  # 1 PiB: far above any node-local disk
MAX_KEEP = 10_000  # checkpoints kept per job by one rule
MAX_KEEP_EVERY = 1_000_000_000  # steps


class ConfigError(ValueError):
    """A configuration value that cannot be used.

    ``key`` is the dotted key (``"shared.keep_last"``), or None for a problem
    with the whole file; ``source`` says where the value came from: the config
    file's path or a phrase such as ``"command-line override"``.
    """

    def __init__(self, key: str | None, problem: str, source: Path | str | None = None) -> None:
        self.key = key
        self.problem = problem
        self.source = source
        parts = [str(p) for p in (source, key) if p is not None]
        super().__init__(": ".join([*parts, problem]))

    def with_source(self, source: Path | str) -> ConfigError:
        """The same error, now saying where the bad value came from."""
        return ConfigError(self.key, self.problem, source)


# ---------------------------------------------------------------- sizes, rates


def _size_units() -> dict[str, int]:
    """Lower-case unit -> bytes: "k" and "kib" are binary, "kb" decimal (as disks are sold)."""
    units = {"": 1, "b": 1}
    for power, prefix in enumerate("kmgt", start=1):
        units[prefix] = units[prefix + "ib"] = 1024**power
        units[prefix + "b"] = 1000**power
    return units


_UNITS = _size_units()
_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]*)", re.IGNORECASE)
_FORMAT_UNITS = [("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)]


def parse_size(value: object, key: str) -> int:
    """Bytes from an int or a string such as ``"64MiB"``, ``"1.5 GiB"``, ``"500MB"``, ``"4096"``.

    KiB/MiB/GiB/TiB and the bare K/M/G/T are binary; KB/MB/GB/TB are decimal.
    Units are case-insensitive; a fractional result is rounded down to whole bytes.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(key, f'expected a size such as "64MiB" or an int of bytes, got {value!r}')
    if isinstance(value, int):
        n = value
    else:
        match = _SIZE_RE.fullmatch(value.strip())
        unit = _UNITS.get(match.group(2).lower()) if match else None
        if match is None or unit is None:
            raise ConfigError(
                key, f'invalid size {value!r}: expected e.g. "4096", "64MiB", "1.5GiB" or "500MB"'
            )
        n = int(Fraction(match.group(1)) * unit)
    if n < 0:
        raise ConfigError(key, f"a size cannot be negative, got {value!r}")
    return n


def parse_rate(value: object, key: str) -> int:
    """Bytes per second from an int or a string such as ``"2GiB/s"`` or ``"500 MB/s"``; must be > 0."""
    if isinstance(value, str):
        if not value.strip().lower().endswith("/s"):
            raise ConfigError(key, f'invalid rate {value!r}: expected a size per second such as "2GiB/s"')
        rate = parse_size(value.strip()[:-2], key)
    else:
        rate = parse_size(value, key)
    if rate <= 0:
        raise ConfigError(key, f"a rate must be positive, got {value!r}")
    return rate


def format_size(n: int) -> str:
    """A size for people: ``1610612736`` -> ``"1.5 GiB"``, ``512`` -> ``"512 B"``."""
    for name, unit in _FORMAT_UNITS:
        if abs(n) >= unit:
            number = f"{n / unit:.2f}".rstrip("0").rstrip(".")
            return f"{number} {name}"
    return f"{n} B"


# ------------------------------------------------------- kinds of config value


class _Kind(NamedTuple):
    """How one key is read from TOML and written back to it."""

    parse: Callable[[Any, str], Any]
    dump: Callable[[Any], str]
    # The documented range of a numeric key ("1 to 64"), as default.toml writes it; "" if not numeric.
    bounds: str = ""


def _exact_size(n: int) -> str:
    """``n`` in the largest binary unit that keeps it exact (``"4GiB"``), so a dump round-trips."""
    for name, unit in _FORMAT_UNITS:
        if n and n % unit == 0:
            return f"{n // unit}{name}"
    return str(n)


def _dump_size(n: int) -> str:
    text = _exact_size(n)
    return text if text.isdigit() else f'"{text}"'


def _dump_rate(n: int) -> str:
    return f'"{_exact_size(n)}/s"'


def _dump_str(text: str) -> str:
    """A TOML basic string: escape quotes, backslashes and control characters."""
    escaped = "".join(
        "\\" + ch if ch in '"\\' else f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch
        for ch in text
    )
    return f'"{escaped}"'


def _size_bound(n: int) -> str:
    """A bound as default.toml writes it: ``"4KiB"``, ``"1PiB"``, ``"0"``, ``"1B"``."""
    text = _exact_size(n)
    return text + "B" if text.isdigit() and n else text


def _size(minimum: int, maximum: int, multiple_of: int = 1) -> _Kind:
    """Bytes from ``minimum`` to ``maximum`` (a typo such as "16TB" for "16GB" is refused)."""
    bounds = f"{_size_bound(minimum)} to {_size_bound(maximum)}"

    def parse(value: Any, key: str) -> int:
        n = parse_size(value, key)
        if not minimum <= n <= maximum:
            raise ConfigError(key, f"must be a size from {bounds}, got {value!r}")
        if n % multiple_of:
            raise ConfigError(key, f"must be a multiple of {multiple_of} bytes, got {value!r}")
        return n

    return _Kind(parse, _dump_size, bounds)


def _rate(minimum: int, maximum: int) -> _Kind:
    """Bytes per second from ``minimum`` to ``maximum``."""
    bounds = f"{_size_bound(minimum)}/s to {_size_bound(maximum)}/s"

    def parse(value: Any, key: str) -> int:
        rate = parse_rate(value, key)
        if not minimum <= rate <= maximum:
            raise ConfigError(key, f"must be a rate from {bounds}, got {value!r}")
        return rate

    return _Kind(parse, _dump_rate, bounds)


def _check_int(value: Any, key: str, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ConfigError(key, f"must be an integer from {minimum} to {maximum}, got {value!r}")
    return value


def _int(minimum: int, maximum: int) -> _Kind:
    """An integer from ``minimum`` to ``maximum``."""
    def parse(value: Any, key: str) -> int:
        return _check_int(value, key, minimum, maximum)

    return _Kind(parse, str, f"{minimum} to {maximum}")


def _parse_seconds(value: Any, key: str, zero: bool = False) -> float:
    """A number of seconds; 0 only where ``zero`` (a key whose 0 turns something off)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value if zero else 0 < value) \
            or value == math.inf:
        raise ConfigError(key, f"must be a {'non-negative' if zero else 'positive'} number of seconds, got {value!r}")
    return float(value)


def _parse_bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, f"must be true or false, got {value!r}")
    return value


def _parse_path(value: Any, key: str) -> Path:
    """A path as written; :func:`_absolute` expands ``~`` and anchors it later."""
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise ConfigError(key, f"must be a non-empty path string, got {value!r}")
    return Path(value)


def _parse_optional_path(value: Any, key: str) -> Path | None:
    """A path, or None for "" (how a config or a flag turns a tier off)."""
    return None if value == "" else _parse_path(value, key)


def split_host_port(value: str) -> tuple[str, int]:
    """``("::1", 9464)`` from ``"[::1]:9464"``, ``("127.0.0.1", 9464)`` from ``"127.0.0.1:9464"``.

    The host loses IPv6 brackets. Raises ValueError unless ``value`` is a non-empty host, a colon and
    a port from 1 to 65535.
    """
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f'expected "HOST:PORT" with a port from 1 to 65535, got {value!r}')
    return host, int(port)


def _parse_listen(value: Any, key: str) -> str | None:
    """``"HOST:PORT"`` (``"[::1]:9464"`` for IPv6), or None for "" = no metrics endpoint."""
    if value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(key, f'expected "HOST:PORT", got {value!r}')
    try:
        split_host_port(value)
    except ValueError as e:
        raise ConfigError(key, str(e)) from None
    return value


def _parse_keep_best(value: Any, key: str) -> KeepBest:
    if not isinstance(value, Mapping):
        raise ConfigError(
            key, f'expected a table such as {{metric = "val_loss", mode = "min", n = 3}}, got {value!r}'
        )
    _reject_unknown(value, {"metric", "mode", "n"}, key + ".")
    metric, mode = value.get("metric"), value.get("mode")
    if not isinstance(metric, str) or not metric:
        raise ConfigError(key + ".metric", f"must be a non-empty metric name, got {metric!r}")
    if mode not in ("min", "max"):
        raise ConfigError(key + ".mode", f'must be "min" or "max", got {mode!r}')
    n = _check_int(value.get("n", 1), key + ".n", 1, MAX_KEEP)
    return KeepBest(metric, mode, n)


def _dump_keep_best(best: KeepBest) -> str:
    return f"{{ metric = {_dump_str(best.metric)}, mode = {_dump_str(best.mode)}, n = {best.n} }}"




def _seconds(minimum: float, maximum: float) -> _Kind:
    """Seconds within documented bounds: a value outside them is a mistake (a 1 µs timer burns a core)."""
    bounds = f"{minimum:g} to {maximum:g} s"

    def parse(value: Any, key: str) -> float:
        seconds = _parse_seconds(value, key, zero=minimum == 0)
        if not minimum <= seconds <= maximum:
            raise ConfigError(key, f"must be a number of seconds from {bounds}, got {value!r}")
        return seconds

    return _Kind(parse, repr, bounds)


_S3_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_REGION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_PROFILE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}")
_NODE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
NODE_NAME_ENV = "CKPTSTAGE_NODE_NAME"


def _parse_s3_url(value: Any, key: str) -> str | None:
    """``"s3://bucket/prefix"`` (the prefix optional, no trailing slash kept), or None for "" = no such tier."""
    if value == "":
        return None
    if not isinstance(value, str) or not value.startswith("s3://"):
        raise ConfigError(key, f'must be an S3 URL such as "s3://bucket/prefix", got {value!r}')
    bucket, _, prefix = value[len("s3://"):].partition("/")
    if not _S3_BUCKET_RE.fullmatch(bucket) or ".." in bucket:
        raise ConfigError(key, f"{bucket!r} is not a valid bucket name (3 to 63 lower-case letters, digits, dots "
                               f"and hyphens, starting and ending with a letter or digit), got {value!r}")
    prefix = prefix.rstrip("/")
    for seg in prefix.split("/") if prefix else []:
        if not seg or seg.startswith(".") or any(ord(c) < 0x20 or ord(c) == 0x7F for c in seg):
            raise ConfigError(key, f"the prefix may not hold an empty, dot-led or control-character segment "
                                   f"({seg!r}), got {value!r}")
    return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"


def _parse_endpoint(value: Any, key: str) -> str | None:
    """``"http(s)://host[:port]"`` of an S3-compatible server, or None for "" = the AWS endpoint of the region."""
    if value == "":
        return None
    parts = urlsplit(value) if isinstance(value, str) else None
    try:
        port_ok = parts is not None and (parts.port is None or 1 <= parts.port <= 65535)
    except ValueError:
        port_ok = False
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or not port_ok \
            or parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ConfigError(key, f'must be an http:// or https:// URL such as "http://127.0.0.1:8333" (host and '
                               f"port only), got {value!r}")
    return value.rstrip("/")


def _name(pattern: re.Pattern[str], what: str) -> Callable[[Any, str], str | None]:
    """A name matching ``pattern`` (``what`` says which), or None for ""."""
    def parse(value: Any, key: str) -> str | None:
        if value == "":
            return None
        if not isinstance(value, str) or not pattern.fullmatch(value):
            raise ConfigError(key, f"must be {what}, got {value!r}")
        return value

    return parse


def _parse_secret(value: Any, key: str) -> str | None:
    """A credential written in the file; an error never repeats it."""
    if value == "":
        return None
    if not isinstance(value, str) or not value.strip() or any(ord(c) < 0x21 for c in value):
        raise ConfigError(key, "must be a non-empty string without spaces (the value is not shown)")
    return value


_BOOL = _Kind(_parse_bool, lambda b: "true" if b else "false")
_PATH = _Kind(_parse_path, lambda p: _dump_str(str(p)))
_OPTIONAL_PATH = _Kind(_parse_optional_path, lambda p: _dump_str(str(p)))
_LISTEN = _Kind(_parse_listen, _dump_str)
_KEEP_BEST = _Kind(_parse_keep_best, _dump_keep_best)
_S3_URL = _Kind(_parse_s3_url, _dump_str)
_ENDPOINT = _Kind(_parse_endpoint, _dump_str)
_REGION = _Kind(_name(_REGION_RE, 'a region name such as "us-east-1"'), _dump_str)
_NODE_NAME = _Kind(_name(_NODE_NAME_RE, "a name of letters, digits, '.', '_' and '-' (at most 100)"), _dump_str)
_PROFILE = _Kind(_name(_PROFILE_RE, "a profile name of the shared credentials file"), _dump_str)
_SECRET = _Kind(_parse_secret, _dump_str)


def _kind(kind: _Kind) -> dict[str, _Kind]:
    """Field metadata: how the field is read from TOML and written back."""
    return {"kind": kind}


# ------------------------------------------------------------------- sections


@dataclass(frozen=True)
class ArenaConfig:
    """Shared memory the daemon hands to trainers, across all sessions."""

    max_bytes: int = field(default=4 << 30, metadata=_kind(_size(1 << 20, MAX_ARENA_BYTES)))
    # The smallest arena granted; a state larger than its arena streams through it.
    min_session_bytes: int = field(default=64 << 20, metadata=_kind(_size(4096, MAX_ARENA_BYTES)))
    # A session whose client has not opened its Attach stream after this long is closed (the client died).
    attach_timeout_s: float = field(default=30.0, metadata=_kind(_seconds(0.5, 3600)))
    # The shared-memory file system the arenas are files in; max_bytes is capped at start to what it has free.
    dir: Path = field(default=Path("/dev/shm"), metadata=_kind(_PATH))

    def __post_init__(self) -> None:
        if self.min_session_bytes > self.max_bytes:
            raise ConfigError(
                "arena.min_session_bytes",
                f"{format_size(self.min_session_bytes)} exceeds arena.max_bytes "
                f"({format_size(self.max_bytes)})",
            )


@dataclass(frozen=True)
class LocalConfig:
    """The node-local tier (an SSD): where checkpoints are first committed."""

    # Default <data_dir>/local, filled in by load_config because it depends on the environment.
    dir: Path = field(metadata=_kind(_PATH))
    # Committed checkpoints kept per job (never the ones not yet drained).
    keep_last: int = field(default=2, metadata=_kind(_int(1, MAX_KEEP)))
    # Evict the oldest drained checkpoints while the tier holds more than max_bytes
    # or the disk has less than min_free_bytes free. None: no such limit.
    max_bytes: int | None = field(default=None, metadata=_kind(_size(1, MAX_TIER_BYTES)))
    min_free_bytes: int | None = field(default=None, metadata=_kind(_size(0, MAX_TIER_BYTES)))
    # Only steps whose number is a multiple of this are written to local SSD; the others are kept in
    # memory only (the memory tier), for a restart of the trainer on this node.
    persist_every: int = field(default=1, metadata=_kind(_int(1, MAX_KEEP_EVERY)))

    def persists(self, step: int) -> bool:
        """Whether ``step`` is written to local SSD (``persist_every``); every node of a job decides alike."""
        return step % self.persist_every == 0


@dataclass(frozen=True)
class SharedConfig:
    """The shared tier, drained to behind the local one: a directory of a (parallel) file system, or an
    S3-compatible object store (``url``)."""

    dir: Path | None = field(default=None, metadata=_kind(_OPTIONAL_PATH))  # None: no shared tier (or a url)
    # "s3://bucket/prefix": the shared tier on an object store instead of a directory.
    url: str | None = field(default=None, metadata=_kind(_S3_URL))
    # The object store's endpoint, for a server other than AWS S3 ("http://127.0.0.1:8333").
    endpoint: str | None = field(default=None, metadata=_kind(_ENDPOINT))
    region: str | None = field(default=None, metadata=_kind(_REGION))
    # A profile of the shared credentials and config files (~/.aws/credentials); None: the SDK's chain.
    profile: str | None = field(default=None, metadata=_kind(_PROFILE))
    # Keys in the config file: refused unless allow_inline_credentials (prefer the environment or a role).
    access_key_id: str | None = field(default=None, metadata=_kind(_SECRET))
    secret_access_key: str | None = field(default=None, metadata=_kind(_SECRET))
    allow_inline_credentials: bool = field(default=False, metadata=_kind(_BOOL))
    # An object store's files go up as multipart uploads in pieces of this size (S3 allows 5 MiB to 5 GiB;
    # a file of more than 10,000 pieces gets larger ones), this many pieces of one file at once.
    multipart_bytes: int = field(default=64 << 20, metadata=_kind(_size(5 << 20, 5 << 30)))
    multipart_concurrency: int = field(default=8, metadata=_kind(_int(1, 64)))
    keep_last: int = field(default=5, metadata=_kind(_int(1, MAX_KEEP)))
    # Also keep every step divisible by this.
    keep_every: int | None = field(default=None, metadata=_kind(_int(1, MAX_KEEP_EVERY)))
    # Only steps whose number is a multiple of this go to the shared tier; the others stay on local SSD
    # (and the memory tier), where local retention treats them as needing no shared copy.
    drain_every: int = field(default=1, metadata=_kind(_int(1, MAX_KEEP_EVERY)))
    keep_best: KeepBest | None = field(default=None, metadata=_kind(_KEEP_BEST))
    # Drain rate cap in bytes/second; None: uncapped.
    max_bandwidth: int | None = field(default=None, metadata=_kind(_rate(1 << 20, 1 << 40)))
    # Parts (one rank's share of one step) drained at once.
    max_concurrent: int = field(default=2, metadata=_kind(_int(1, 64)))
    # A failed drain is retried after retry_initial_s, the delay doubling up to retry_max_s.
    retry_initial_s: float = field(default=1.0, metadata=_kind(_seconds(0.01, 3600)))
    retry_max_s: float = field(default=60.0, metadata=_kind(_seconds(0.1, 86400)))
    # On SIGTERM, after in-flight saves commit: at most this long draining the newest complete step of
    # each job that the shared tier lacks (off the drain_every cadence too) before exiting. 0: off.
    drain_on_stop_s: float = field(default=20.0, metadata=_kind(_seconds(0, 3600)))

    def __post_init__(self) -> None:
        if self.retry_max_s < self.retry_initial_s:
            raise ConfigError(
                "shared.retry_max_s",
                f"{self.retry_max_s} is below shared.retry_initial_s ({self.retry_initial_s})",
            )
        self._check_object_store()

    def _check_object_store(self) -> None:
        """``url`` and ``dir`` name one tier two ways; the object store's keys need a url; keys in the
        file need the operator's consent."""
        if self.url is not None and self.dir is not None:
            raise ConfigError("shared.url", f"{self.url!r} and shared.dir ({self.dir}) both name the shared tier; "
                                            "set only one")
        if self.url is None:
            for key in ("endpoint", "region", "profile", "access_key_id", "secret_access_key"):
                if getattr(self, key) is not None:
                    raise ConfigError(f"shared.{key}", "is for an object store, but shared.url is not set "
                                                       '(e.g. url = "s3://bucket/prefix")')
        inline = [k for k in ("access_key_id", "secret_access_key") if getattr(self, k) is not None]
        if inline and not self.allow_inline_credentials:
            raise ConfigError(f"shared.{inline[0]}", "credentials in the config file are refused unless "
                                                     "shared.allow_inline_credentials = true; prefer the "
                                                     "environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), "
                                                     "shared.profile of ~/.aws/credentials, or the node's role")
        if len(inline) == 1:
            other = "secret_access_key" if inline[0] == "access_key_id" else "access_key_id"
            raise ConfigError(f"shared.{other}", f"must be set with shared.{inline[0]}")

    @property
    def enabled(self) -> bool:
        """Whether there is a shared tier at all (if not, local retention deletes undrained checkpoints)."""
        return self.dir is not None or self.url is not None

    def drains(self, step: int) -> bool:
        """Whether ``step`` goes to the shared tier (``drain_every``); every node of a job decides alike."""
        return step % self.drain_every == 0


@dataclass(frozen=True)
class PersistConfig:
    """Writing arenas to the local tier."""

    # Writer threads per node.
    workers: int = field(default=2, metadata=_kind(_int(1, 64)))
    # Unit of writes and of per-chunk checksums; a multiple of the page size for O_DIRECT.
    chunk_bytes: int = field(default=64 << 20, metadata=_kind(_size(4096, 1 << 30, multiple_of=4096)))
    # Aligned chunks bypass the page cache with O_DIRECT (2-3x faster here; falls back where refused).
    direct_io: bool = field(default=True, metadata=_kind(_BOOL))
    # On SIGTERM, how long to wait for in-flight writes (the systemd unit's TimeoutStopSec is above it).
    shutdown_timeout_s: float = field(default=30.0, metadata=_kind(_seconds(1, 3600)))
    # Niceness added to the writer and drain threads (0-19): under CPU contention the trainer and the
    # daemon's control plane (e.g. the FinishSave answer a trainer waits for) run first.
    nice: int = field(default=10, metadata=_kind(_int(0, 19)))
    # Incremental parts: each tier stores (and the drain copies) only the chunks of a part that the
    # job's chunk store there lacks; unchanged tensors cost nothing (docs/FORMAT.md, "Incremental parts").
    incremental: bool = field(default=False, metadata=_kind(_BOOL))
    # A chunk no part refers to is removed only once nobody wrote or reused it for this long: the margin
    # for a save or drain on another node that relies on it before its part is published.
    chunk_grace_s: float = field(default=600.0, metadata=_kind(_seconds(0.01, 7 * 86400)))


@dataclass(frozen=True)
class MetricsConfig:
    """The Prometheus endpoint.

    Off by default, so that two daemons on one machine (tests, two users) never fight over a port.
    """

    listen: str | None = field(default=None, metadata=_kind(_LISTEN))  # "HOST:PORT"

    @property
    def enabled(self) -> bool:
        return self.listen is not None

    @property
    def host(self) -> str:
        """The host to bind, without IPv6 brackets; raises if metrics are disabled."""
        return self._split()[0]

    @property
    def port(self) -> int:
        return self._split()[1]

    def _split(self) -> tuple[str, int]:
        if self.listen is None:
            raise ValueError("metrics are disabled (metrics.listen is not set)")
        return split_host_port(self.listen)


@dataclass(frozen=True)
class RetentionConfig:
    """When retention runs and what a client may ask for."""

    # Seconds between timed retention passes.
    interval_s: float = field(default=60.0, metadata=_kind(_seconds(0.1, 86400)))
    # The largest keep_last a client may request for its own job.
    max_job_keep_last: int = field(default=100, metadata=_kind(_int(1, MAX_KEEP)))
    # A step whose first part is this old and that still lacks ranks is reported (log, metric).
    incomplete_after_s: float = field(default=120.0, metadata=_kind(_seconds(1, 86400)))


@dataclass(frozen=True)
class MemoryConfig:
    """The memory tier: each rank's newest checkpoint stays in its arena after the trainer exits.

    A trainer restarted on the same node then loads it at memory speed
    instead of from disk. The copies live in shared memory counted against
    ``arena.max_bytes``: a session that needs the room evicts them, oldest first.
    """

    enabled: bool = field(default=True, metadata=_kind(_BOOL))
    # How long a copy is kept once its trainer has gone.
    keep_s: float = field(default=3600.0, metadata=_kind(_seconds(1, 7 * 86400)))


@dataclass(frozen=True)
class Config:
    """The whole configuration of one daemon. ``source`` is the file it came from (not compared)."""

    socket: Path = field(metadata=_kind(_PATH))
    arena: ArenaConfig = field(metadata={"section": ArenaConfig})
    local: LocalConfig = field(metadata={"section": LocalConfig})
    shared: SharedConfig = field(metadata={"section": SharedConfig})
    persist: PersistConfig = field(metadata={"section": PersistConfig})
    metrics: MetricsConfig = field(metadata={"section": MetricsConfig})
    retention: RetentionConfig = field(metadata={"section": RetentionConfig})
    memory: MemoryConfig = field(default_factory=MemoryConfig, metadata={"section": MemoryConfig})
    # The node's name for what it leaves on tiers several daemons share (its temporaries): stable
    # across restarts of the daemon, its container or its pod, unique per node. None: the host name.
    # Default from $CKPTSTAGE_NODE_NAME (a Kubernetes DaemonSet sets it from spec.nodeName).
    node_name: str | None = field(default=None, metadata=_kind(_NODE_NAME))
    source: Path | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if len(os.fsencode(self.socket)) > MAX_SOCKET_PATH_BYTES:
            raise ConfigError(
                "socket",
                f"{self.socket} is longer than {MAX_SOCKET_PATH_BYTES} bytes, "
                "the limit for a Unix socket path",
            )
        if self.shared.drain_every % self.local.persist_every:
            raise ConfigError(
                "shared.drain_every",
                f"{self.shared.drain_every} is not a multiple of local.persist_every ({self.local.persist_every}): "
                "only steps written to local SSD can be drained",
            )
        shared = self.shared.dir
        # Retention on one tier would delete the other's checkpoints.
        if shared is not None and (
            shared.is_relative_to(self.local.dir) or self.local.dir.is_relative_to(shared)
        ):
            raise ConfigError(
                "shared.dir", f"{shared} overlaps local.dir ({self.local.dir}); use separate directories"
            )
        # An arena is granted in whole chunks: a budget below one chunk fails every save.
        if self.arena.max_bytes < self.persist.chunk_bytes:
            raise ConfigError(
                "arena.max_bytes",
                f"{format_size(self.arena.max_bytes)} is less than one persist.chunk_bytes "
                f"({format_size(self.persist.chunk_bytes)}); no save could ever get an arena",
            )

    def to_toml(self) -> str:
        """Equivalent TOML text: ``load_config`` of it equals this config."""
        return dump_config(self)


# --------------------------------------------------------------- load and dump


def default_toml() -> str:
    """The text of the packaged ``default.toml``, which documents every key and its default."""
    return resources.files("ckptstage.daemon").joinpath("default.toml").read_text(encoding="utf-8")


def load_config(
    path: Path | None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> Config:
    """Reads, merges and validates the configuration.

    ``path`` is the TOML file (None: built-in defaults only). ``overrides``
    come from command-line flags, keyed by dotted name (``"local.dir"``); a None
    value means the flag was not given. ``env`` (default ``os.environ``) supplies
    HOME and the XDG directories, so tests can inject their own.
    """
    env = os.environ if env is None else env
    raw = _read_toml(path) if path is not None else {}
    origins: dict[str, str] = {}
    try:
        _merge_overrides(raw, overrides or {}, origins)
        _fill_env_defaults(raw, env, origins)
        return _build(Config, raw, "", env, source=path)
    except ConfigError as err:
        if err.source is not None:
            raise
        where: Path | str = origins.get(err.key or "", path if path is not None else DEFAULTS_ORIGIN)
        raise err.with_source(where) from None


def dump_config(cfg: Config) -> str:
    """Renders ``cfg`` as TOML; keys whose value is None (absent) are left out."""
    lines = _dump_table(cfg)
    for f in fields(cfg):
        if "section" in f.metadata:
            lines += ["", f"[{f.name}]", *_dump_table(getattr(cfg, f.name))]
    return "\n".join(lines) + "\n"


def _dump_table(obj: Any) -> list[str]:
    return [
        f"{f.name} = {f.metadata['kind'].dump(getattr(obj, f.name))}"
        for f in fields(obj)
        if "kind" in f.metadata and getattr(obj, f.name) is not None
    ]


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as err:
        raise ConfigError(None, f"cannot read the config file: {err.strerror}", path) from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(None, f"invalid TOML: {err}", path) from None


def _merge_overrides(raw: dict[str, Any], overrides: Mapping[str, Any], origins: dict[str, str]) -> None:
    """Puts command-line values over the file's, remembering which keys they set."""
    for key, value in overrides.items():
        if value is None:
            continue
        section, _, name = key.rpartition(".")
        table = raw.setdefault(section, {}) if section else raw
        if not isinstance(table, dict):
            raise ConfigError(section, f"expected a [{section}] table, got {table!r}")
        table[name] = value
        origins[key] = OVERRIDE_ORIGIN


def _fill_env_defaults(raw: dict[str, Any], env: Mapping[str, str], origins: dict[str, str]) -> None:
    """Supplies the defaults that depend on HOME and the XDG variables, where nothing set them."""
    if "socket" not in raw:
        raw["socket"] = str(default_socket_path(env))
        origins["socket"] = ENV_ORIGIN
    if "node_name" not in raw and env.get(NODE_NAME_ENV):
        raw["node_name"] = env[NODE_NAME_ENV]
        origins["node_name"] = f"${NODE_NAME_ENV}"
    local = raw.setdefault("local", {})
    if isinstance(local, dict) and "dir" not in local:
        local["dir"] = str(default_data_dir(env) / "local")
        origins["local.dir"] = ENV_ORIGIN


def _build(cls: type, table: Mapping[str, Any], prefix: str, env: Mapping[str, str], **extra: Any) -> Any:
    """Parses ``table`` into ``cls``, recursing into ``[section]`` fields; unknown keys are errors."""
    if not isinstance(table, Mapping):
        raise ConfigError(prefix.rstrip("."), f"expected a [{prefix.rstrip('.')}] table, got {table!r}")
    known = {f.name: f for f in fields(cls) if f.metadata}
    _reject_unknown(table, set(known), prefix)
    kwargs = dict(extra)
    for name, f in known.items():
        if "section" in f.metadata:
            kwargs[name] = _build(f.metadata["section"], table.get(name, {}), f"{name}.", env)
        elif name in table:
            value = f.metadata["kind"].parse(table[name], prefix + name)
            kwargs[name] = _absolute(value, env) if isinstance(value, Path) else value
    return cls(**kwargs)


def _reject_unknown(table: Mapping[str, Any], known: set[str], prefix: str) -> None:
    for name in table:
        if name not in known:
            what = "section" if isinstance(table[name], Mapping) and not prefix else "key"
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(known))})"
            raise ConfigError(prefix + name, f"unknown {what}{hint}")


def _home(env: Mapping[str, str]) -> Path:
    return Path(env.get("HOME") or Path.home())


def _absolute(path: Path, env: Mapping[str, str]) -> Path:
    """Expands ``~`` (with the injected HOME) and anchors a relative path at the working directory."""
    text = str(path)
    if text == "~" or text.startswith("~/"):
        path = Path(str(_home(env)) + text[1:])
    return Path(os.path.abspath(path.expanduser()))
