"""The ``[peers]`` section: replicas of each committed part on other nodes of the job.

Off unless ``listen`` is set. A peer tier must authenticate every call: a
shared token (``token_file``, readable by the daemon's user only) or mutual
TLS (``tls_cert``, ``tls_key``, ``tls_ca``), or both. Both are checked when
the configuration loads, like every other key, so a daemon never starts with
a peer port anyone could use.
"""

from __future__ import annotations

import os
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ckptstage.daemon.configvalues import (
    LISTEN,
    OPTIONAL_PATH,
    ConfigError,
    int_between,
    kind,
    rate_between,
    split_host_port,
)

# A token shorter than this is refused: it is the only thing between the port and the job's checkpoints.
MIN_TOKEN_BYTES = 16
MAX_TOKEN_BYTES = 4096
# Where [peers] advertise defaults from, before the host name (a pod's address: deploy/kubernetes).
PEER_ADVERTISE_ENV = "CKPTSTAGE_PEER_ADVERTISE"
# Replicas kept on the local SSD take at most this share of the local tier's file system.
DISK_SHARE = 0.25


@dataclass(frozen=True)
class PeersConfig:
    """Where this daemon listens for its job's other nodes, how many copies it sends, how it is trusted."""

    listen: str | None = field(default=None, metadata=kind(LISTEN))  # "HOST:PORT"; None: no peer tier
    # The address other nodes reach this one at; None: $CKPTSTAGE_PEER_ADVERTISE, else this host's name
    # and the listen port.
    advertise: str | None = field(default=None, metadata=kind(LISTEN))
    # Copies of each committed part on other nodes of the job (no two on one node).
    replicas: int = field(default=1, metadata=kind(int_between(1, 16)))
    # Newest steps of each job kept as replicas here.
    keep: int = field(default=1, metadata=kind(int_between(1, 100)))
    token_file: Path | None = field(default=None, metadata=kind(OPTIONAL_PATH))
    tls_cert: Path | None = field(default=None, metadata=kind(OPTIONAL_PATH))
    tls_key: Path | None = field(default=None, metadata=kind(OPTIONAL_PATH))
    tls_ca: Path | None = field(default=None, metadata=kind(OPTIONAL_PATH))
    # Replication's send rate cap in bytes/second, across jobs; None: uncapped.
    max_bandwidth: int | None = field(default=None, metadata=kind(rate_between(1 << 20, 1 << 40)))

    def __post_init__(self) -> None:
        if self.listen is None:
            for key in ("advertise", "token_file", "tls_cert", "tls_key", "tls_ca", "max_bandwidth"):
                if getattr(self, key) is not None:
                    raise ConfigError(f"peers.{key}", "is set but peers.listen is not: the peer tier is off "
                                                      'unless it listens (e.g. listen = "0.0.0.0:7461")')
            return
        tls = [k for k in ("tls_cert", "tls_key", "tls_ca") if getattr(self, k) is not None]
        if tls and len(tls) != 3:
            missing = next(k for k in ("tls_cert", "tls_key", "tls_ca") if k not in tls)
            raise ConfigError(f"peers.{missing}", "mutual TLS needs tls_cert, tls_key and tls_ca together")
        if self.token_file is None and not tls:
            raise ConfigError("peers.listen", "a peer tier must authenticate its peers: set peers.token_file "
                                              "(a secret shared by the job's nodes, mode 0600) or peers.tls_cert, "
                                              "tls_key and tls_ca (mutual TLS)")
        if self.token_file is not None:
            self.read_token()
        for key in tls:
            _readable(f"peers.{key}", getattr(self, key), secret=key == "tls_key")

    @property
    def enabled(self) -> bool:
        return self.listen is not None

    @property
    def address(self) -> str:
        """What other nodes dial: ``advertise``, else this host's name and the listen port."""
        if self.advertise is not None:
            return self.advertise
        if self.listen is None:
            return ""
        return f"{socket.gethostname()}:{split_host_port(self.listen)[1]}"

    def read_token(self) -> bytes | None:
        """The shared token (surrounding white space stripped); None without ``token_file``. Raises
        :class:`ConfigError` when the file is missing, readable by others, or too short."""
        if self.token_file is None:
            return None
        data = _readable("peers.token_file", self.token_file, secret=True).strip()
        if not MIN_TOKEN_BYTES <= len(data) <= MAX_TOKEN_BYTES:
            raise ConfigError("peers.token_file", f"{self.token_file} holds {len(data)} bytes; a token must be "
                                                  f"{MIN_TOKEN_BYTES} to {MAX_TOKEN_BYTES} bytes (e.g. "
                                                  "`openssl rand -hex 32`)")
        if not all(0x21 <= b <= 0x7e for b in data):
            raise ConfigError("peers.token_file", f"{self.token_file}: a token is printable ASCII without spaces "
                                                  "(it travels in each call's metadata)")
        return data


def _readable(key: str, path: Path, secret: bool) -> bytes:
    """The file's bytes; a secret must be a regular file no one but its owner can read or write."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(key, f"{path} is not a regular file")
            if secret and st.st_mode & 0o077:
                raise ConfigError(key, f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: a secret must be "
                                       f"readable by its owner only (chmod 600 {path})")
            return f.read(1 << 20)
    except OSError as e:
        raise ConfigError(key, f"cannot read {path}: {e.strerror}") from None
