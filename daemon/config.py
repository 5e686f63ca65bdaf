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

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from ckptstage.daemon.configpeers import PEER_ADVERTISE_ENV, PeersConfig
from ckptstage.daemon.configvalues import (
    BOOL,
    ENDPOINT,
    KEEP_BEST,
    LISTEN,
    MAX_ARENA_BYTES,
    MAX_KEEP,
    MAX_KEEP_EVERY,
    MAX_TIER_BYTES,
    NODE_NAME,
    NODE_NAME_ENV,
    OPTIONAL_PATH,
    PATH,
    PROFILE,
    REGION,
    S3_URL,
    SECRET,
    ConfigError,
    format_size,
    int_between,
    kind,
    one_of,
    rate_between,
    reject_unknown,
    seconds_between,
    size_between,
    split_host_port,
)
from ckptstage.daemon.retention.planner import KeepBest  # the one keep_best rule; re-exported for the config's users
from ckptstage.protos.paths import default_data_dir, default_socket_path  # noqa: F401 - re-exported

# Linux's sockaddr_un.sun_path holds 108 bytes including the terminating NUL;
# a longer path fails at bind() with an error that does not say why.
MAX_SOCKET_PATH_BYTES = 107
OVERRIDE_ORIGIN = "command-line override"
ENV_ORIGIN = "default from the environment"
DEFAULTS_ORIGIN = "built-in defaults"



# ------------------------------------------------------------------- sections


@dataclass(frozen=True)
class ArenaConfig:
    """Shared memory the daemon hands to trainers, across all sessions."""

    max_bytes: int = field(default=4 << 30, metadata=kind(size_between(1 << 20, MAX_ARENA_BYTES)))
    # The smallest arena granted; a state larger than its arena streams through it.
    min_session_bytes: int = field(default=64 << 20, metadata=kind(size_between(4096, MAX_ARENA_BYTES)))
    # A session whose client has not opened its Attach stream after this long is closed (the client died).
    attach_timeout_s: float = field(default=30.0, metadata=kind(seconds_between(0.5, 3600)))
    # The shared-memory file system the arenas are files in; max_bytes is capped at start to what it has free.
    dir: Path = field(default=Path("/dev/shm"), metadata=kind(PATH))

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
    dir: Path = field(metadata=kind(PATH))
    # Committed checkpoints kept per job (never the ones not yet drained).
    keep_last: int = field(default=2, metadata=kind(int_between(1, MAX_KEEP)))
    # Evict the oldest drained checkpoints while the tier holds more than max_bytes
    # or the disk has less than min_free_bytes free. None: no such limit.
    max_bytes: int | None = field(default=None, metadata=kind(size_between(1, MAX_TIER_BYTES)))
    min_free_bytes: int | None = field(default=None, metadata=kind(size_between(0, MAX_TIER_BYTES)))
    # Only steps whose number is a multiple of this are written to local SSD; the others are kept in
    # memory only (the memory tier), for a restart of the trainer on this node.
    persist_every: int = field(default=1, metadata=kind(int_between(1, MAX_KEEP_EVERY)))

    def persists(self, step: int) -> bool:
        """Whether ``step`` is written to local SSD (``persist_every``); every node of a job decides alike."""
        return step % self.persist_every == 0


@dataclass(frozen=True)
class SharedConfig:
    """The shared tier, drained to behind the local one: a directory of a (parallel) file system, or an
    S3-compatible object store (``url``)."""

    dir: Path | None = field(default=None, metadata=kind(OPTIONAL_PATH))  # None: no shared tier (or a url)
    # "s3://bucket/prefix": the shared tier on an object store instead of a directory.
    url: str | None = field(default=None, metadata=kind(S3_URL))
    # The object store's endpoint, for a server other than AWS S3 ("http://127.0.0.1:8333").
    endpoint: str | None = field(default=None, metadata=kind(ENDPOINT))
    region: str | None = field(default=None, metadata=kind(REGION))
    # A profile of the shared credentials and config files (~/.aws/credentials); None: the SDK's chain.
    profile: str | None = field(default=None, metadata=kind(PROFILE))
    # Keys in the config file: refused unless allow_inline_credentials (prefer the environment or a role).
    access_key_id: str | None = field(default=None, metadata=kind(SECRET))
    secret_access_key: str | None = field(default=None, metadata=kind(SECRET))
    allow_inline_credentials: bool = field(default=False, metadata=kind(BOOL))
    # An object store's files go up as multipart uploads in pieces of this size (S3 allows 5 MiB to 5 GiB;
    # a file of more than 10,000 pieces gets larger ones), this many pieces of one file at once.
    multipart_bytes: int = field(default=64 << 20, metadata=kind(size_between(5 << 20, 5 << 30)))
    multipart_concurrency: int = field(default=8, metadata=kind(int_between(1, 64)))
    keep_last: int = field(default=5, metadata=kind(int_between(1, MAX_KEEP)))
    # Also keep every step divisible by this.
    keep_every: int | None = field(default=None, metadata=kind(int_between(1, MAX_KEEP_EVERY)))
    # Only steps whose number is a multiple of this go to the shared tier; the others stay on local SSD
    # (and the memory tier), where local retention treats them as needing no shared copy.
    drain_every: int = field(default=1, metadata=kind(int_between(1, MAX_KEEP_EVERY)))
    keep_best: KeepBest | None = field(default=None, metadata=kind(KEEP_BEST))
    # Chunks of incremental parts kept compressed on the shared tier (a file system or an object store): "auto"
    # (when it makes the write finish sooner, from what the tier measures), "none", "zstd", "bg-zstd"
    # (byte-grouped: what model states gain most from). The local tier never compresses.
    compression: str = field(default="auto", metadata=kind(one_of("auto", "none", "zstd", "bg-zstd")))
    # Drain rate cap in bytes/second; None: uncapped.
    max_bandwidth: int | None = field(default=None, metadata=kind(rate_between(1 << 20, 1 << 40)))
    # Parts (one rank's share of one step) drained at once.
    max_concurrent: int = field(default=2, metadata=kind(int_between(1, 64)))
    # A failed drain is retried after retry_initial_s, the delay doubling up to retry_max_s.
    retry_initial_s: float = field(default=1.0, metadata=kind(seconds_between(0.01, 3600)))
    retry_max_s: float = field(default=60.0, metadata=kind(seconds_between(0.1, 86400)))
    # On SIGTERM, after in-flight saves commit: at most this long draining the newest complete step of
    # each job that the shared tier lacks (off the drain_every cadence too) before exiting. 0: off.
    drain_on_stop_s: float = field(default=20.0, metadata=kind(seconds_between(0, 3600)))
    # How this daemon keeps up with what other nodes write to the shared tier (see default.toml): the age
    # of the index an answer may come from, how long a request waits for a re-read, how often jobs are
    # looked for and watched jobs re-read, and how often a step wait looks for the step's commit record.
    stale_after_s: float = field(default=1.0, metadata=kind(seconds_between(0.05, 600)))
    stale_wait_s: float = field(default=0.75, metadata=kind(seconds_between(0.01, 60)))
    watch_interval_s: float = field(default=1.0, metadata=kind(seconds_between(0.1, 600)))
    step_poll_s: float = field(default=0.25, metadata=kind(seconds_between(0.01, 60)))

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

    def why_not_drained(self, step: int) -> str:
        """What a wait for ``step`` on the shared tier is told when :meth:`drains` says no."""
        return (f"step {step} does not go to the shared tier: only steps that are multiples of "
                f"[shared] drain_every = {self.drain_every} do")


@dataclass(frozen=True)
class PersistConfig:
    """Writing arenas to the local tier."""

    # Writer threads per node.
    workers: int = field(default=2, metadata=kind(int_between(1, 64)))
    # Unit of writes and of per-chunk checksums; a multiple of the page size for O_DIRECT.
    chunk_bytes: int = field(default=64 << 20, metadata=kind(size_between(4096, 1 << 30, multiple_of=4096)))
    # Aligned chunks bypass the page cache with O_DIRECT (2-3x faster here; falls back where refused).
    direct_io: bool = field(default=True, metadata=kind(BOOL))
    # On SIGTERM, how long to wait for in-flight writes (the systemd unit's TimeoutStopSec is above it).
    shutdown_timeout_s: float = field(default=30.0, metadata=kind(seconds_between(1, 3600)))
    # Niceness added to the writer and drain threads (0-19): under CPU contention the trainer and the
    # daemon's control plane (e.g. the FinishSave answer a trainer waits for) run first.
    nice: int = field(default=10, metadata=kind(int_between(0, 19)))
    # While a checkpoint is being loaded on this node, drains and replicas sent to peers wait (their disk
    # reads and writes stop), at most this long per stretch of loads; 0: they never wait.
    yield_to_loads_s: float = field(default=60.0, metadata=kind(seconds_between(0, 3600)))
    # Incremental parts: each tier stores (and the drain copies) only the chunks of a part that the
    # job's chunk store there lacks; unchanged tensors cost nothing (docs/FORMAT.md, "Incremental parts").
    # False: each part one data file.
    incremental: bool = field(default=True, metadata=kind(BOOL))
    # Whose chunks an incremental part may share: "job" (its job's store) or "user" (one store per tier for
    # every job of this daemon's user: a fine-tune stores its base model's chunks only if no job did).
    dedup: str = field(default="job", metadata=kind(one_of("job", "user")))
    # A chunk no part refers to is removed only once nobody wrote or reused it for this long: the margin
    # for a save or drain on another node that relies on it before its part is published.
    chunk_grace_s: float = field(default=600.0, metadata=kind(seconds_between(0.01, 7 * 86400)))


@dataclass(frozen=True)
class MetricsConfig:
    """The Prometheus endpoint.

    Off by default, so that two daemons on one machine (tests, two users) never fight over a port.
    """

    listen: str | None = field(default=None, metadata=kind(LISTEN))  # "HOST:PORT"

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
    interval_s: float = field(default=60.0, metadata=kind(seconds_between(0.1, 86400)))
    # The largest keep_last a client may request for its own job.
    max_job_keep_last: int = field(default=100, metadata=kind(int_between(1, MAX_KEEP)))
    # A step whose first part is this old and that still lacks ranks is reported (log, metric).
    incomplete_after_s: float = field(default=120.0, metadata=kind(seconds_between(1, 86400)))
    # Copies moved aside as corrupt stay (listed) this long for forensics, then go.
    quarantine_keep_s: float = field(default=7 * 86400.0, metadata=kind(seconds_between(1, 365 * 86400)))
    # At most this many bytes of them per tier: beyond, the oldest go first (None: no cap but the time).
    quarantine_max_bytes: int | None = field(default=None, metadata=kind(size_between(1, MAX_TIER_BYTES)))


@dataclass(frozen=True)
class MemoryConfig:
    """The memory tier: each rank's newest checkpoint stays in its arena after the trainer exits.

    A trainer restarted on the same node then loads it at memory speed
    instead of from disk. The copies live in shared memory counted against
    ``arena.max_bytes``: a session that needs the room evicts them, oldest first.
    """

    enabled: bool = field(default=True, metadata=kind(BOOL))
    # How long a copy is kept once its trainer has gone.
    keep_s: float = field(default=3600.0, metadata=kind(seconds_between(1, 7 * 86400)))


@dataclass(frozen=True)
class Config:
    """The whole configuration of one daemon. ``source`` is the file it came from (not compared)."""

    socket: Path = field(metadata=kind(PATH))
    arena: ArenaConfig = field(metadata={"section": ArenaConfig})
    local: LocalConfig = field(metadata={"section": LocalConfig})
    shared: SharedConfig = field(metadata={"section": SharedConfig})
    persist: PersistConfig = field(metadata={"section": PersistConfig})
    metrics: MetricsConfig = field(metadata={"section": MetricsConfig})
    retention: RetentionConfig = field(metadata={"section": RetentionConfig})
    memory: MemoryConfig = field(default_factory=MemoryConfig, metadata={"section": MemoryConfig})
    peers: PeersConfig = field(default_factory=PeersConfig, metadata={"section": PeersConfig})
    # The node's name for what it leaves on tiers several daemons share (its temporaries): stable
    # across restarts of the daemon, its container or its pod, unique per node. None: the host name.
    # Default from $CKPTSTAGE_NODE_NAME (a Kubernetes DaemonSet sets it from spec.nodeName).
    node_name: str | None = field(default=None, metadata=kind(NODE_NAME))
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
    peers = raw.get("peers")
    if isinstance(peers, dict) and peers.get("listen") and "advertise" not in peers \
            and env.get(PEER_ADVERTISE_ENV):
        peers["advertise"] = env[PEER_ADVERTISE_ENV]
        origins["peers.advertise"] = f"${PEER_ADVERTISE_ENV}"
    local = raw.setdefault("local", {})
    if isinstance(local, dict) and "dir" not in local:
        local["dir"] = str(default_data_dir(env) / "local")
        origins["local.dir"] = ENV_ORIGIN


def _build(cls: type, table: Mapping[str, Any], prefix: str, env: Mapping[str, str], **extra: Any) -> Any:
    """Parses ``table`` into ``cls``, recursing into ``[section]`` fields; unknown keys are errors."""
    if not isinstance(table, Mapping):
        raise ConfigError(prefix.rstrip("."), f"expected a [{prefix.rstrip('.')}] table, got {table!r}")
    known = {f.name: f for f in fields(cls) if f.metadata}
    reject_unknown(table, set(known), prefix)
    kwargs = dict(extra)
    for name, f in known.items():
        if "section" in f.metadata:
            kwargs[name] = _build(f.metadata["section"], table.get(name, {}), f"{name}.", env)
        elif name in table:
            value = f.metadata["kind"].parse(table[name], prefix + name)
            kwargs[name] = _absolute(value, env) if isinstance(value, Path) else value
    return cls(**kwargs)


def _home(env: Mapping[str, str]) -> Path:
    return Path(env.get("HOME") or Path.home())


def _absolute(path: Path, env: Mapping[str, str]) -> Path:
    """Expands ``~`` (with the injected HOME) and anchors a relative path at the working directory."""
    text = str(path)
    if text == "~" or text.startswith("~/"):
        path = Path(str(_home(env)) + text[1:])
    return Path(os.path.abspath(path.expanduser()))
