"""Tests for the daemon's configuration: parsing, defaults, validation, round-trip."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ckptstage.daemon.config import (
    ArenaConfig,
    Config,
    ConfigError,
    KeepBest,
    default_toml,
    dump_config,
    load_config,
)
from ckptstage.daemon.configvalues import format_size, parse_rate, parse_size

REPO = Path(__file__).resolve().parents[1]
KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """An environment with only HOME set, inside tmp_path."""
    return {"HOME": str(tmp_path / "home")}


def write(tmp_path: Path, text: str, name: str = "ckptstage.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ------------------------------------------------------------- sizes and rates


@pytest.mark.parametrize(
    "value, expected",
    [
        (0, 0),
        (4096, 4096),
        ("4096", 4096),
        ("10B", 10),
        ("64MiB", 64 * MiB),
        ("64mib", 64 * MiB),
        ("1.5GiB", 3 * GiB // 2),
        ("500 MB", 500_000_000),
        (" 8 KiB ", 8 * KiB),
        ("16G", 16 * GiB),
        ("2k", 2 * KiB),
        ("1KB", 1000),
        ("2gb", 2_000_000_000),
        ("1TiB", TiB),
        ("3T", 3 * TiB),
        ("0.1KiB", 102),  # rounded down to whole bytes
    ],
)
def test_parse_size_accepts(value: object, expected: int) -> None:
    assert parse_size(value, "arena.max_bytes") == expected


@pytest.mark.parametrize(
    "value", [-1, True, 1.5, None, [1], "", "abc", "GiB", "10XB", "1.2.3GiB", "-5MiB", "5 Gi B", "1e9"]
)
def test_parse_size_rejects(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^arena\.max_bytes: ") as info:
        parse_size(value, "arena.max_bytes")
    assert info.value.key == "arena.max_bytes"


@pytest.mark.parametrize(
    "value, expected",
    [
        ("2GiB/s", 2 * GiB),
        ("500MB/s", 500_000_000),
        ("500 MB/s", 500_000_000),
        ("1k/S", 1024),
        ("1.5 GiB/s", 3 * GiB // 2),
        (1000, 1000),
    ],
)
def test_parse_rate_accepts(value: object, expected: int) -> None:
    assert parse_rate(value, "shared.max_bandwidth") == expected


@pytest.mark.parametrize("value", ["2GiB", "0/s", 0, "fast", "/s", True, "2GiB/min", -5, 2.5])
def test_parse_rate_rejects(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^shared\.max_bandwidth: "):
        parse_rate(value, "shared.max_bandwidth")


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (KiB, "1 KiB"),
        (3 * GiB // 2, "1.5 GiB"),
        (4 * GiB, "4 GiB"),
        (TiB + TiB // 4, "1.25 TiB"),
        (64 * MiB, "64 MiB"),
    ],
)
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text


# ------------------------------------------------------------------- defaults


def test_defaults_without_xdg(tmp_path: Path, env: dict[str, str]) -> None:
    cfg = load_config(None, env=env)
    data = tmp_path / "home" / ".local" / "share" / "ckptstage"
    assert cfg.socket == data / "ckptstage.sock"
    assert cfg.local.dir == data / "local"
    assert cfg.source is None
    assert (cfg.arena.max_bytes, cfg.arena.min_session_bytes) == (4 * GiB, 64 * MiB)
    assert (cfg.local.keep_last, cfg.local.max_bytes, cfg.local.min_free_bytes) == (2, None, None)
    assert cfg.shared.dir is None and not cfg.shared.enabled
    assert (cfg.shared.keep_last, cfg.shared.keep_every, cfg.shared.keep_best) == (5, None, None)
    assert (cfg.shared.max_bandwidth, cfg.shared.max_concurrent) == (None, 2)
    assert (cfg.shared.retry_initial_s, cfg.shared.retry_max_s) == (1.0, 60.0)
    assert (cfg.persist.workers, cfg.persist.chunk_bytes, cfg.persist.direct_io) == (2, 64 * MiB, True)
    assert cfg.persist.shutdown_timeout_s == 30.0
    assert cfg.metrics.listen is None and not cfg.metrics.enabled
    assert (cfg.retention.interval_s, cfg.retention.max_job_keep_last) == (60.0, 100)


@pytest.mark.parametrize(
    "extra, socket, local",
    [
        (
            {"XDG_RUNTIME_DIR": "/run/user/7"},
            "/run/user/7/ckptstage/ckptstage.sock",
            "{home}/.local/share/ckptstage/local",
        ),
        ({"XDG_DATA_HOME": "/data/x"}, "/data/x/ckptstage/ckptstage.sock", "/data/x/ckptstage/local"),
        (
            {"XDG_RUNTIME_DIR": "/run/user/7", "XDG_DATA_HOME": "/data/x"},
            "/run/user/7/ckptstage/ckptstage.sock",
            "/data/x/ckptstage/local",
        ),
        # The XDG spec says relative values are invalid and must be ignored.
        (
            {"XDG_RUNTIME_DIR": "rel", "XDG_DATA_HOME": "rel"},
            "{home}/.local/share/ckptstage/ckptstage.sock",
            "{home}/.local/share/ckptstage/local",
        ),
    ],
)
def test_defaults_follow_xdg(env: dict[str, str], extra: dict[str, str], socket: str, local: str) -> None:
    cfg = load_config(None, env={**env, **extra})
    assert cfg.socket == Path(socket.format(home=env["HOME"]))
    assert cfg.local.dir == Path(local.format(home=env["HOME"]))


def test_default_toml_documents_the_defaults(tmp_path: Path, env: dict[str, str]) -> None:
    path = write(tmp_path, default_toml())
    assert load_config(path, env=env) == load_config(None, env=env)
    # Every key of every section is shown in its section, set or commented out.
    for section, keys in _all_keys().items():
        body = _section_text(default_toml(), section)
        for key in keys:
            assert f"{key} = " in body, f"default.toml does not show {section}.{key}"


def _all_keys() -> dict[str, list[str]]:
    cfg = load_config(None, env={"HOME": "/h"})
    names = ("arena", "local", "shared", "persist", "metrics", "retention")
    return {"": ["socket", "node_name"], **{name: list(vars(getattr(cfg, name))) for name in names}}


def _section_text(text: str, section: str) -> str:
    """The lines of ``[section]`` (or before the first section for ""), comments included."""
    chunks = ("\n" + text).split("\n[")
    if not section:
        return chunks[0]
    return next(c for c in chunks if c.startswith(section + "]"))


# ---------------------------------------------------------------- file, overrides

FULL = """
socket = "/run/ckptstage/bob/ckptstage.sock"
[arena]
max_bytes = "16GiB"
min_session_bytes = 134217728
[local]
dir = "/ssd/bob"
keep_last = 3
max_bytes = "500GiB"
min_free_bytes = "50 GB"
[shared]
dir = "/lustre/ckpt/bob"
keep_last = 7
keep_every = 1000
keep_best = { metric = "val_loss", mode = "min", n = 3 }
max_bandwidth = "500MB/s"
max_concurrent = 4
retry_initial_s = 0.5
retry_max_s = 30
[persist]
workers = 8
chunk_bytes = "16MiB"
direct_io = true
shutdown_timeout_s = 20
[metrics]
listen = "[::1]:9500"
[retention]
interval_s = 5
max_job_keep_last = 10
"""


def test_load_full_file(tmp_path: Path, env: dict[str, str]) -> None:
    path = write(tmp_path, FULL)
    cfg = load_config(path, env=env)
    assert cfg.source == path
    assert cfg.socket == Path("/run/ckptstage/bob/ckptstage.sock")
    assert cfg.arena == ArenaConfig(max_bytes=16 * GiB, min_session_bytes=128 * MiB)
    assert (cfg.local.dir, cfg.local.keep_last) == (Path("/ssd/bob"), 3)
    assert (cfg.local.max_bytes, cfg.local.min_free_bytes) == (500 * GiB, 50_000_000_000)
    assert cfg.shared.enabled and cfg.shared.dir == Path("/lustre/ckpt/bob")
    assert (cfg.shared.keep_last, cfg.shared.keep_every) == (7, 1000)
    assert cfg.shared.keep_best == KeepBest(metric="val_loss", mode="min", n=3)
    assert (cfg.shared.max_bandwidth, cfg.shared.max_concurrent) == (500_000_000, 4)
    assert (cfg.shared.retry_initial_s, cfg.shared.retry_max_s) == (0.5, 30.0)
    assert isinstance(cfg.shared.retry_max_s, float)
    assert (cfg.persist.workers, cfg.persist.chunk_bytes, cfg.persist.direct_io) == (8, 16 * MiB, True)
    assert cfg.persist.shutdown_timeout_s == 20.0
    assert (cfg.metrics.listen, cfg.metrics.host, cfg.metrics.port) == ("[::1]:9500", "::1", 9500)
    assert (cfg.retention.interval_s, cfg.retention.max_job_keep_last) == (5.0, 10)


def test_keep_best_n_defaults_to_one(tmp_path: Path, env: dict[str, str]) -> None:
    path = write(tmp_path, '[shared]\nkeep_best = { metric = "acc", mode = "max" }\n')
    assert load_config(path, env=env).shared.keep_best == KeepBest("acc", "max", 1)


def test_overrides_beat_the_file(tmp_path: Path, env: dict[str, str]) -> None:
    path = write(tmp_path, FULL)
    overrides = {
        "socket": str(tmp_path / "s.sock"),
        "local.dir": str(tmp_path / "local"),
        "shared.dir": "",  # a flag can turn the shared tier off
        "metrics.listen": "127.0.0.1:9999",
        "persist.workers": None,  # a flag that was not given
    }
    cfg = load_config(path, overrides, env=env)
    assert cfg.socket == tmp_path / "s.sock"
    assert cfg.local.dir == tmp_path / "local"
    assert cfg.shared.dir is None and not cfg.shared.enabled
    assert (cfg.metrics.host, cfg.metrics.port) == ("127.0.0.1", 9999)
    assert cfg.persist.workers == 8
    assert cfg.local.keep_last == 3  # the rest of the file still applies


def test_overrides_without_a_file(tmp_path: Path, env: dict[str, str]) -> None:
    cfg = load_config(None, {"shared.dir": str(tmp_path / "shared")}, env=env)
    assert cfg.shared.dir == tmp_path / "shared"
    assert cfg.local.dir == tmp_path / "home" / ".local" / "share" / "ckptstage" / "local"


def test_paths_expand_home_and_become_absolute(
    tmp_path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, 'socket = "~/run/x.sock"\n[local]\ndir = "rel/ssd"\n[shared]\ndir = "~"\n')
    cfg = load_config(path, env=env)
    assert cfg.socket == tmp_path / "home" / "run" / "x.sock"
    assert cfg.local.dir == tmp_path / "rel" / "ssd"
    assert cfg.shared.dir == tmp_path / "home"


# ------------------------------------------------------------------ validation

BAD = [
    ("socket = 3", "socket", "non-empty path"),
    ('socket = ""', "socket", "non-empty path"),
    (f'socket = "/{"x" * 120}.sock"', "socket", "longer than 107 bytes"),
    ('[arena]\nmax_bytes = "lots"', "arena.max_bytes", "invalid size 'lots'"),
    ("[arena]\nmax_bytes = 0", "arena.max_bytes", "a size from 1MiB to 4TiB, got 0"),
    ("[persist]\nnice = 20", "persist.nice", "from 0 to 19, got 20"),
    ("[persist]\nnice = -5", "persist.nice", "from 0 to 19, got -5"),
    (
        '[arena]\nmax_bytes = "1GiB"\nmin_session_bytes = "2GiB"',
        "arena.min_session_bytes",
        "exceeds arena.max_bytes",
    ),
    ('[local]\ndir = ""', "local.dir", "non-empty path"),
    ("[local]\nkeep_last = 0", "local.keep_last", "integer from 1 to 10000, got 0"),
    ('[local]\nkeep_last = "2"', "local.keep_last", "integer from 1 to 10000, got '2'"),
    ("[local]\nkeep_last = true", "local.keep_last", "integer from 1 to 10000, got True"),
    ("[local]\nmax_bytes = -1", "local.max_bytes", "cannot be negative"),
    ('[local]\nmin_free_bytes = "10 parsecs"', "local.min_free_bytes", "invalid size"),
    ("[shared]\nkeep_last = 0", "shared.keep_last", "integer from 1 to"),
    ("[shared]\nkeep_every = 0", "shared.keep_every", "integer from 1 to"),
    ("[local]\npersist_every = 2\n[shared]\ndrain_every = 3", "shared.drain_every",
     "3 is not a multiple of local.persist_every (2): only steps written to local SSD can be drained"),
    ('[shared]\nkeep_best = "val_loss"', "shared.keep_best", "expected a table"),
    ('[shared]\nkeep_best = { mode = "min" }', "shared.keep_best.metric", "non-empty metric name"),
    ('[shared]\nkeep_best = { metric = "l", mode = "lowest" }', "shared.keep_best.mode", '"min" or "max"'),
    ('[shared]\nkeep_best = { metric = "l", mode = "min", n = 0 }', "shared.keep_best.n", "integer from 1 to"),
    ('[shared]\nkeep_best = { metric = "l", mode = "min", top = 2 }', "shared.keep_best.top", "unknown key"),
    ('[shared]\nmax_bandwidth = "2GiB"', "shared.max_bandwidth", "invalid rate"),
    ('[shared]\nmax_bandwidth = "0/s"', "shared.max_bandwidth", "must be positive"),
    ("[shared]\nmax_concurrent = 0", "shared.max_concurrent", "integer from 1 to"),
    ("[shared]\nretry_initial_s = 0", "shared.retry_initial_s", "positive number of seconds"),
    ("[shared]\nretry_initial_s = nan", "shared.retry_initial_s", "positive number of seconds"),
    (
        "[shared]\nretry_initial_s = 10.0\nretry_max_s = 5.0",
        "shared.retry_max_s",
        "below shared.retry_initial_s",
    ),
    ('[local]\ndir = "/t/a"\n[shared]\ndir = "/t/a/b"', "shared.dir", "overlaps local.dir"),
    ('[local]\ndir = "/t/a"\n[shared]\ndir = "/t"', "shared.dir", "overlaps local.dir"),
    ("[persist]\nworkers = 0", "persist.workers", "integer from 1 to"),
    ("[persist]\nchunk_bytes = 6000", "persist.chunk_bytes", "multiple of 4096"),
    ("[persist]\nchunk_bytes = 0", "persist.chunk_bytes", "a size from 4KiB to 1GiB, got 0"),
    ('[persist]\ndirect_io = "yes"', "persist.direct_io", "true or false"),
    ("[persist]\nshutdown_timeout_s = -1", "persist.shutdown_timeout_s", "positive number"),
    ('[metrics]\nlisten = "9464"', "metrics.listen", "HOST:PORT"),
    ('[metrics]\nlisten = "localhost:70000"', "metrics.listen", "from 1 to 65535"),
    ('[metrics]\nlisten = "localhost:0"', "metrics.listen", "from 1 to 65535"),
    ('[metrics]\nlisten = "localhost:http"', "metrics.listen", "HOST:PORT"),
    ('[metrics]\nlisten = ":9464"', "metrics.listen", "HOST:PORT"),
    ("[metrics]\nlisten = 9464", "metrics.listen", "HOST:PORT"),
    ("[retention]\ninterval_s = 0", "retention.interval_s", "positive number"),
    ("[retention]\ninterval_s = 0.000001", "retention.interval_s", "from 0.1 to 86400 s"),
    ("[shared]\nmax_concurrent = 1000", "shared.max_concurrent", "from 1 to 64"),
    ("[persist]\nworkers = 1000", "persist.workers", "from 1 to 64"),
    ("[arena]\nattach_timeout_s = 0.01", "arena.attach_timeout_s", "from 0.5 to 3600 s"),
    ("[retention]\nmax_job_keep_last = 0", "retention.max_job_keep_last", "integer from 1 to"),
    ("[shared]\nkeep_lst = 3", "shared.keep_lst", "unknown key (did you mean 'keep_last'?)"),
    ("[sharde]\ndir = '/x'", "sharde", "unknown section (did you mean 'shared'?)"),
    ("[persist]\nfrobnicate = 1", "persist.frobnicate",
     "unknown key (known: chunk_bytes, chunk_grace_s, dedup, direct_io"),
    ("[shared]\ncompression = 'lz4'", "shared.compression", "must be one of 'auto', 'none', 'zstd', 'bg-zstd'"),
    ("[persist]\ndedup = 'everyone'", "persist.dedup", "must be one of 'job', 'user', got 'everyone'"),
    ("[persist]\ndedup = true", "persist.dedup", "must be one of 'job', 'user', got True"),
    ("local_dir = '/x'", "local_dir", "unknown key"),
    ("arena = 3", "arena", "expected a [arena] table"),
]


@pytest.mark.parametrize("text, key, problem", BAD, ids=[f"{k}:{p[:20]}" for _, k, p in BAD])
def test_errors_name_the_key_and_the_file(
    tmp_path: Path, env: dict[str, str], text: str, key: str, problem: str
) -> None:
    path = write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env=env)
    assert str(info.value).startswith(f"{path}: {key}: ")
    assert problem in str(info.value)
    assert (info.value.key, info.value.source) == (key, path)


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"metrics.listen": "nope"}, "metrics.listen"),
        ({"local.dir": ""}, "local.dir"),
        ({"shared.dirr": "/x"}, "shared.dirr"),
    ],
)
def test_override_errors_say_they_came_from_the_command_line(
    tmp_path: Path, env: dict[str, str], overrides: dict[str, str], key: str
) -> None:
    path = write(tmp_path, FULL)
    with pytest.raises(ConfigError, match=rf"^command-line override: {key}: "):
        load_config(path, overrides, env=env)


def test_override_into_a_bad_section_blames_the_file(tmp_path: Path, env: dict[str, str]) -> None:
    path = write(tmp_path, "local = 3\n")
    with pytest.raises(ConfigError, match=rf"^{path}: local: expected a \[local\] table"):
        load_config(path, {"local.dir": "/x"}, env=env)


def test_environment_default_errors_say_so(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=r"^default from the environment: socket: .* longer than 107"):
        load_config(None, env={"HOME": "/" + "h" * 120})


def test_invalid_toml_names_the_file(tmp_path: Path, env: dict[str, str]) -> None:
    path = write(tmp_path, "[arena\nmax_bytes = 1\n")
    with pytest.raises(ConfigError, match=rf"^{path}: invalid TOML: ") as info:
        load_config(path, env=env)
    assert info.value.key is None


def test_missing_file_names_the_file(tmp_path: Path, env: dict[str, str]) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError, match=rf"^{path}: cannot read the config file: No such file"):
        load_config(path, env=env)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


# ------------------------------------------------------------- shipped files


def test_example_toml_loads(env: dict[str, str]) -> None:
    """deploy/systemd/example.toml must load without its directories existing."""
    path = REPO / "deploy" / "systemd" / "example.toml"
    cfg = load_config(path, env=env)
    assert cfg.socket == Path("/run/ckptstage/alice/ckptstage.sock")
    assert cfg.local.dir == Path("/local_ssd/ckptstage/alice")
    assert cfg.shared.dir == Path("/lustre/project/ckpt/alice")
    assert (cfg.metrics.host, cfg.metrics.port) == ("127.0.0.1", 9464)
    assert cfg.shared.max_bandwidth == 2 * GiB


def test_unit_stops_after_the_daemon_shutdown_timeout(env: dict[str, str]) -> None:
    """systemd must not SIGKILL the daemon while it still finishes in-flight writes."""
    unit = (REPO / "deploy" / "systemd" / "ckptstaged@.service").read_text()
    settings = dict(
        line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#")
    )
    assert float(settings["TimeoutStopSec"]) > load_config(None, env=env).persist.shutdown_timeout_s
    assert settings["User"] == "%i"
    assert settings["RuntimeDirectoryMode"] == "0700"


# ------------------------------------------------------------------ round-trip


@pytest.mark.parametrize(
    "text", ["", FULL, "[local]\nmin_free_bytes = 0\nmax_bytes = 123457\n[shared]\nmax_bandwidth = 1048577\n"]
)
def test_dump_load_round_trip(tmp_path: Path, env: dict[str, str], text: str) -> None:
    original = load_config(write(tmp_path, text), env=env)
    dumped = write(tmp_path, dump_config(original), name="dumped.toml")
    again = load_config(dumped, env=env)
    assert again == original
    assert again.source == dumped  # source is not compared, but is kept
    assert original.to_toml() == dump_config(original)


def test_round_trip_escapes_strings(tmp_path: Path, env: dict[str, str]) -> None:
    odd = tmp_path / 'we"ird\\dïr\t\x7f'
    cfg = load_config(None, {"local.dir": str(odd), "socket": str(tmp_path / "s")}, env=env)
    again = load_config(write(tmp_path, cfg.to_toml()), env=env)
    assert again.local.dir == odd
    assert again == cfg


def test_dump_writes_sizes_for_people(env: dict[str, str]) -> None:
    text = dump_config(load_config(None, {"shared.dir": "/s"}, env=env))
    assert 'max_bytes = "4GiB"' in text
    assert 'chunk_bytes = "64MiB"' in text
    assert "keep_every" not in text  # absent values are left out
    assert "[metrics]" in text


def test_config_is_frozen(env: dict[str, str]) -> None:
    cfg = load_config(None, env=env)
    with pytest.raises(AttributeError):
        cfg.socket = Path("/x")  # type: ignore[misc]
    assert isinstance(cfg, Config)


def test_arena_budget_below_one_chunk_is_rejected(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(None, {"arena.max_bytes": "1MiB", "arena.min_session_bytes": "1MiB", "persist.chunk_bytes": "2MiB"}, env={"HOME": str(tmp_path)})
    assert err.value.key == "arena.max_bytes"
    assert "1 MiB" in str(err.value) and "2 MiB" in str(err.value)


# ------------------------------------------------------------------ bounds

# Every numeric key, with the nearest values outside its documented bounds (None: no lower value
# can be written, e.g. a negative size is refused as such).
OUT_OF_BOUNDS: dict[str, tuple[object, object]] = {
    "arena.max_bytes": (1048575, "5TiB"),
    "arena.min_session_bytes": (4095, "5TiB"),
    "arena.attach_timeout_s": (0.49, 3601),
    "local.keep_last": (0, 10001),
    "local.max_bytes": (0, "1025TiB"),
    "local.min_free_bytes": (None, "1025TiB"),
    "shared.keep_last": (0, 10001),
    "shared.keep_every": (0, 1_000_000_001),
    "shared.max_bandwidth": (1048575, "1025GiB/s"),
    "shared.max_concurrent": (0, 65),
    "shared.multipart_bytes": ((5 << 20) - 1, (5 << 30) + 1),
    "shared.multipart_concurrency": (0, 65),
    "shared.retry_initial_s": (0.009, 3601),
    "shared.retry_max_s": (0.09, 86401),
    "shared.drain_on_stop_s": (None, 3601),
    "shared.stale_after_s": (0.04, 601),
    "shared.stale_wait_s": (0.009, 61),
    "shared.watch_interval_s": (0.09, 601),
    "shared.step_poll_s": (0.009, 61),
    "persist.workers": (0, 65),
    "persist.chunk_bytes": (0, "1025MiB"),
    "persist.shutdown_timeout_s": (0.99, 3601),
    "persist.chunk_grace_s": (0.005, 7 * 86400 + 1),
    "persist.nice": (-1, 20),
    "persist.yield_to_loads_s": (None, 3601),
    "retention.quarantine_keep_s": (0.5, 365 * 86400 + 1),
    "retention.quarantine_max_bytes": (0, "1025TiB"),
    "retention.interval_s": (0.09, 86401),
    "retention.max_job_keep_last": (0, 10001),
    "retention.incomplete_after_s": (0.99, 86401),
    "memory.keep_s": (0.99, 7 * 86400 + 1),
    "shared.drain_every": (0, 1_000_000_001),
    "local.persist_every": (0, 1_000_000_001),
    "peers.replicas": (0, 17),
    "peers.keep": (0, 101),
    "peers.max_bandwidth": ("1000KiB/s", "2TiB/s"),
}


def _numeric_fields() -> dict[str, Any]:
    """Dotted key -> dataclass field, for every key whose value is a number."""
    from dataclasses import fields

    out = {}
    for section in fields(Config):
        if "section" not in section.metadata:
            continue
        for f in fields(section.metadata["section"]):
            if str(f.type).split(" ")[0] in ("int", "float"):
                out[f"{section.name}.{f.name}"] = f
    return out


def test_every_numeric_key_has_bounds_tested_and_documented() -> None:
    numeric = _numeric_fields()
    assert set(numeric) == set(OUT_OF_BOUNDS)
    for key, f in numeric.items():
        bounds = f.metadata["kind"].bounds
        assert bounds, f"{key} has no bounds"
        section, name = key.split(".")
        assert f"Bounds: {bounds}." in _comment_above(_section_text(default_toml(), section), name), key


def _comment_above(body: str, key: str) -> str:
    """The comment lines directly above ``key = `` (set or commented out) in a section's text."""
    lines = body.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith((f"{key} = ", f"# {key} = ")))
    block = []
    for line in reversed(lines[:at]):
        if not line.startswith("#"):
            break
        block.append(line)
    return "\n".join(reversed(block))


@pytest.mark.parametrize("key", sorted(OUT_OF_BOUNDS))
@pytest.mark.parametrize("side", [0, 1], ids=["below", "above"])
def test_a_value_outside_the_bounds_is_refused_naming_them(tmp_path: Path, env: dict[str, str],
                                                           key: str, side: int) -> None:
    value = OUT_OF_BOUNDS[key][side]
    if value is None:
        pytest.skip(f"{key} has no writable value below its bounds")
    bounds = _numeric_fields()[key].metadata["kind"].bounds
    with pytest.raises(ConfigError) as info:
        load_config(None, {key: value}, env=env)
    assert info.value.key == key
    assert bounds in str(info.value) and repr(value) in str(info.value)


def test_the_bounds_themselves_are_accepted(tmp_path: Path, env: dict[str, str]) -> None:
    lowest = load_config(None, {"arena.max_bytes": "1MiB", "arena.min_session_bytes": "4KiB",
                                "persist.chunk_bytes": "4KiB", "retention.interval_s": 0.1,
                                "shared.max_concurrent": 1, "shared.max_bandwidth": "1MiB/s",
                                "local.min_free_bytes": 0, "persist.nice": 0}, env=env)
    assert (lowest.arena.max_bytes, lowest.persist.chunk_bytes, lowest.retention.interval_s) == (MiB, 4 * KiB, 0.1)
    highest = load_config(None, {"arena.max_bytes": "4TiB", "persist.chunk_bytes": "1GiB",
                                 "shared.max_concurrent": 64, "persist.workers": 64, "local.keep_last": 10000,
                                 "retention.interval_s": 86400, "shared.max_bandwidth": "1TiB/s"}, env=env)
    assert (highest.arena.max_bytes, highest.shared.max_concurrent, highest.local.keep_last) == (4 * TiB, 64, 10000)


# --- start-up failures: one line naming the key, the value and the reason; exit 78; no traceback --------


def _run_daemon(config_path: Path) -> tuple[int, str]:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "ckptstage.daemon.main", "--config", str(config_path)],
                         capture_output=True, text=True, timeout=60)
    return out.returncode, out.stderr


def _start_failure(tmp_path: Path, **overrides: Any) -> tuple[int, str]:
    from conftest import DaemonProc

    return _run_daemon(DaemonProc(tmp_path / "node", **overrides).config_path)


def _assert_one_line(code: int, stderr: str, *needles: str) -> None:
    from ckptstage.daemon.main import EXIT_CONFIG

    assert code == EXIT_CONFIG == 78, stderr
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_a_bad_value_in_the_file_is_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "[retention]\ninterval_s = 0.000001\n")
    code, err = _run_daemon(path)
    _assert_one_line(code, err, str(path), "retention.interval_s", "1e-06", "from 0.1 to 86400")


def test_metrics_port_in_use_is_one_line(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        listen = f"127.0.0.1:{busy.getsockname()[1]}"
        code, err = _start_failure(tmp_path, **{"metrics.listen": listen})
    _assert_one_line(code, err, "metrics.listen", listen, "cannot listen there", "in use")


def test_metrics_address_not_on_this_host_is_one_line(tmp_path: Path) -> None:
    code, err = _start_failure(tmp_path, **{"metrics.listen": "192.0.2.1:9464"})  # TEST-NET-1: never local
    _assert_one_line(code, err, "metrics.listen", "192.0.2.1:9464", "cannot listen there")


def test_unwritable_local_dir_is_one_line(tmp_path: Path) -> None:
    import os

    if os.geteuid() == 0:
        blocker = tmp_path / "a-file"  # even root cannot make a directory inside a regular file
        blocker.write_text("")
        local = blocker / "local"
    else:
        local = Path("/proc/ckptstage-local")
    code, err = _start_failure(tmp_path, **{"local.dir": str(local)})
    _assert_one_line(code, err, "local.dir", str(local), "cannot create or write it")


def test_read_only_local_dir_is_one_line(tmp_path: Path) -> None:
    import subprocess

    local = tmp_path / "ro"
    local.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(local)],
                      capture_output=True).returncode:
        pytest.skip("mounting a read-only tmpfs needs root")
    try:
        code, err = _start_failure(tmp_path, **{"local.dir": str(local)})
    finally:
        subprocess.run(["umount", str(local)], check=True)
    _assert_one_line(code, err, "local.dir", str(local), "cannot create or write it", "Read-only file system")


def test_impossible_socket_dir_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    sock = blocker / "run" / "s.sock"
    code, err = _start_failure(tmp_path, socket=str(sock))
    _assert_one_line(code, err, "socket", str(sock), "cannot create a socket")


def test_a_socket_path_that_is_a_directory_is_one_line(tmp_path: Path) -> None:
    sock = tmp_path / "dir.sock"
    (sock / "inside").mkdir(parents=True)
    code, err = _start_failure(tmp_path, socket=str(sock))
    _assert_one_line(code, err, "socket", str(sock), "not a socket")
    assert (sock / "inside").is_dir()  # left as it was


def test_a_socket_served_by_another_daemon_is_one_line(daemon_factory: Any) -> None:
    first = daemon_factory().start()
    second = daemon_factory("second", socket=str(first.socket))
    code, err = _run_daemon(second.config_path)
    _assert_one_line(code, err, "socket", str(first.socket), "another ckptstaged is serving on it")
    assert first.proc.poll() is None and first.socket.is_socket()  # the first one still serves


def test_a_local_tier_used_by_another_daemon_is_one_line(daemon_factory: Any) -> None:
    first = daemon_factory().start()
    second = daemon_factory("second", **{"local.dir": str(first.local)})
    code, err = _run_daemon(second.config_path)
    _assert_one_line(code, err, "local.dir", str(first.local), "another daemon already uses the local tier")
    assert first.proc.poll() is None


def test_unit_does_not_restart_on_a_configuration_error() -> None:
    from ckptstage.daemon.main import EXIT_CONFIG

    unit = (REPO / "deploy" / "systemd" / "ckptstaged@.service").read_text()
    assert f"RestartPreventExitStatus={EXIT_CONFIG}\n" in unit
    assert f"**{EXIT_CONFIG}**" in (REPO / "deploy" / "systemd" / "README.md").read_text()
    assert f"status {EXIT_CONFIG}" in default_toml()


def test_the_node_name_comes_from_the_key_else_the_environment(tmp_path: Path, env: dict[str, str]) -> None:
    assert load_config(None, env=env).node_name is None  # the host name, at run time
    assert load_config(None, env={**env, "CKPTSTAGE_NODE_NAME": "gpu-07"}).node_name == "gpu-07"
    path = write(tmp_path, 'node_name = "gpu-01"\n')
    assert load_config(path, env={**env, "CKPTSTAGE_NODE_NAME": "gpu-07"}).node_name == "gpu-01"
    with pytest.raises(ConfigError, match=r"^\$CKPTSTAGE_NODE_NAME: node_name: must be a name of letters, digits"):
        load_config(None, env={**env, "CKPTSTAGE_NODE_NAME": "gpu 07/x"})


# --- [peers] --------------------------------------------------------------------------------


def _token(tmp_path: Path, text: str = "a" * 32, mode: int = 0o600) -> Path:
    path = tmp_path / "peer.token"
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


def test_peers_are_off_unless_they_listen_and_then_must_authenticate(tmp_path: Path, env: dict[str, str]) -> None:
    assert not load_config(None, env=env).peers.enabled
    with pytest.raises(ConfigError, match=r"peers\.listen: a peer tier must authenticate its peers"):
        load_config(None, {"peers.listen": "0.0.0.0:7461"}, env=env)
    with pytest.raises(ConfigError, match=r"peers\.token_file: is set but peers\.listen is not"):
        load_config(None, {"peers.token_file": str(_token(tmp_path))}, env=env)
    cfg = load_config(None, {"peers.listen": "0.0.0.0:7461", "peers.token_file": str(_token(tmp_path))}, env=env)
    assert cfg.peers.enabled and cfg.peers.read_token() == b"a" * 32
    assert (cfg.peers.replicas, cfg.peers.keep, cfg.peers.max_bandwidth) == (1, 1, None)
    assert cfg.peers.address.endswith(":7461")  # this host's name and the listen port
    assert load_config(write(tmp_path, cfg.to_toml()), env=env) == cfg


@pytest.mark.parametrize("text, mode, problem", [
    ("a" * 32, 0o644, r"has mode 0644: a secret must be readable by its owner only \(chmod 600 "),
    ("a" * 32, 0o640, r"has mode 0640"),
    ("short", 0o600, r"holds 5 bytes; a token must be 16 to 4096 bytes"),
    ("with a space in it, long enough", 0o600, r"printable ASCII without spaces"),
])
def test_a_token_file_others_can_read_or_that_is_too_weak_is_refused_at_load(
        tmp_path: Path, env: dict[str, str], text: str, mode: int, problem: str) -> None:
    token = _token(tmp_path, text, mode)
    with pytest.raises(ConfigError, match=r"peers\.token_file: .*" + problem):
        load_config(None, {"peers.listen": "0.0.0.0:7461", "peers.token_file": str(token)}, env=env)


def test_a_missing_token_file_or_half_a_tls_setup_is_refused_naming_the_key(tmp_path: Path,
                                                                             env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=r"peers\.token_file: cannot read .*No such file"):
        load_config(None, {"peers.listen": "0.0.0.0:7461", "peers.token_file": str(tmp_path / "nope")}, env=env)
    cert = tmp_path / "peer.crt"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(ConfigError, match=r"peers\.tls_key: mutual TLS needs tls_cert, tls_key and tls_ca"):
        load_config(None, {"peers.listen": "0.0.0.0:7461", "peers.tls_cert": str(cert)}, env=env)


def test_the_advertised_address_comes_from_the_key_else_the_environment(tmp_path: Path, env: dict[str, str]) -> None:
    given = {"peers.listen": "0.0.0.0:7461", "peers.token_file": str(_token(tmp_path))}
    pod = {**env, "CKPTSTAGE_PEER_ADVERTISE": "10.1.2.3:7461"}
    assert load_config(None, given, env=pod).peers.address == "10.1.2.3:7461"
    assert load_config(None, {**given, "peers.advertise": "gpu-01:7461"}, env=pod).peers.address == "gpu-01:7461"
    assert load_config(None, env=pod).peers.advertise is None  # no peer tier: the variable is not used
