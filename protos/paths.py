"""Default locations both the daemon and its clients must agree on."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def default_data_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_DATA_HOME/ckptstage``, else ``~/.local/share/ckptstage``.

    A relative XDG value is ignored, as the XDG base directory spec requires.
    """
    env = os.environ if env is None else env
    xdg = env.get("XDG_DATA_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path(env.get("HOME") or Path.home()) / ".local" / "share"
    return base / "ckptstage"


def default_socket_path(env: Mapping[str, str] | None = None) -> Path:
    """Where a daemon started with no flags listens (clients look there when told nothing).

    ``$XDG_RUNTIME_DIR/ckptstage/ckptstage.sock`` (a per-user 0700 directory
    on systemd machines), else ``<data dir>/ckptstage.sock``.
    """
    env = os.environ if env is None else env
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime):
        return Path(runtime) / "ckptstage" / "ckptstage.sock"
    return default_data_dir(env) / "ckptstage.sock"
