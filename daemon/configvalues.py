"""How each kind of config value is read and written back: sizes, rates, seconds, paths, names, endpoints.

:mod:`ckptstage.daemon.config` declares each key with one of these kinds
(``metadata=kind(...)`` on its field); a value that cannot be used raises
:class:`ConfigError` naming the dotted key. Sizes and rates are also what the
rest of the daemon parses and prints (``parse_size``, ``format_size``).
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from ckptstage.daemon.retention.planner import KeepBest

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


class Kind(NamedTuple):
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


def size_between(minimum: int, maximum: int, multiple_of: int = 1) -> Kind:
    """Bytes from ``minimum`` to ``maximum`` (a typo such as "16TB" for "16GB" is refused)."""
    bounds = f"{_size_bound(minimum)} to {_size_bound(maximum)}"

    def parse(value: Any, key: str) -> int:
        n = parse_size(value, key)
        if not minimum <= n <= maximum:
            raise ConfigError(key, f"must be a size from {bounds}, got {value!r}")
        if n % multiple_of:
            raise ConfigError(key, f"must be a multiple of {multiple_of} bytes, got {value!r}")
        return n

    return Kind(parse, _dump_size, bounds)


def rate_between(minimum: int, maximum: int) -> Kind:
    """Bytes per second from ``minimum`` to ``maximum``."""
    bounds = f"{_size_bound(minimum)}/s to {_size_bound(maximum)}/s"

    def parse(value: Any, key: str) -> int:
        rate = parse_rate(value, key)
        if not minimum <= rate <= maximum:
            raise ConfigError(key, f"must be a rate from {bounds}, got {value!r}")
        return rate

    return Kind(parse, _dump_rate, bounds)


def _check_int(value: Any, key: str, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ConfigError(key, f"must be an integer from {minimum} to {maximum}, got {value!r}")
    return value


def int_between(minimum: int, maximum: int) -> Kind:
    """An integer from ``minimum`` to ``maximum``."""
    def parse(value: Any, key: str) -> int:
        return _check_int(value, key, minimum, maximum)

    return Kind(parse, str, f"{minimum} to {maximum}")


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
    reject_unknown(value, {"metric", "mode", "n"}, key + ".")
    metric, mode = value.get("metric"), value.get("mode")
    if not isinstance(metric, str) or not metric:
        raise ConfigError(key + ".metric", f"must be a non-empty metric name, got {metric!r}")
    if mode not in ("min", "max"):
        raise ConfigError(key + ".mode", f'must be "min" or "max", got {mode!r}')
    n = _check_int(value.get("n", 1), key + ".n", 1, MAX_KEEP)
    return KeepBest(metric, mode, n)


def _dump_keep_best(best: KeepBest) -> str:
    return f"{{ metric = {_dump_str(best.metric)}, mode = {_dump_str(best.mode)}, n = {best.n} }}"




def seconds_between(minimum: float, maximum: float) -> Kind:
    """Seconds within documented bounds: a value outside them is a mistake (a 1 µs timer burns a core)."""
    bounds = f"{minimum:.15g} to {maximum:.15g} s"

    def parse(value: Any, key: str) -> float:
        seconds = _parse_seconds(value, key, zero=minimum == 0)
        if not minimum <= seconds <= maximum:
            raise ConfigError(key, f"must be a number of seconds from {bounds}, got {value!r}")
        return seconds

    return Kind(parse, repr, bounds)


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


def one_of(*choices: str) -> Kind:
    """One of ``choices`` (strings)."""
    def parse(value: Any, key: str) -> str:
        if value not in choices:
            raise ConfigError(key, f"must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")
        return str(value)

    return Kind(parse, _dump_str)


BOOL = Kind(_parse_bool, lambda b: "true" if b else "false")
PATH = Kind(_parse_path, lambda p: _dump_str(str(p)))
OPTIONAL_PATH = Kind(_parse_optional_path, lambda p: _dump_str(str(p)))
LISTEN = Kind(_parse_listen, _dump_str)
KEEP_BEST = Kind(_parse_keep_best, _dump_keep_best)
S3_URL = Kind(_parse_s3_url, _dump_str)
ENDPOINT = Kind(_parse_endpoint, _dump_str)
REGION = Kind(_name(_REGION_RE, 'a region name such as "us-east-1"'), _dump_str)
NODE_NAME = Kind(_name(_NODE_NAME_RE, "a name of letters, digits, '.', '_' and '-' (at most 100)"), _dump_str)
PROFILE = Kind(_name(_PROFILE_RE, "a profile name of the shared credentials file"), _dump_str)
SECRET = Kind(_parse_secret, _dump_str)


def kind(kind: Kind) -> dict[str, Kind]:
    """Field metadata: how the field is read from TOML and written back."""
    return {"kind": kind}


def reject_unknown(table: Mapping[str, Any], known: set[str], prefix: str) -> None:
    for name in table:
        if name not in known:
            what = "section" if isinstance(table[name], Mapping) and not prefix else "key"
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(known))})"
            raise ConfigError(prefix + name, f"unknown {what}{hint}")
