"""Walking a file-system tier's directories: the subdirectories of one, never through a symbolic link."""

from __future__ import annotations

import os
from pathlib import Path


def subdirs(path: Path, prefix: str = "") -> list[Path]:
    """The subdirectories (never links) of ``path`` named ``prefix...``; dot-names only when ``prefix`` is one.
    None when ``path`` is gone; any other error is raised."""
    try:
        with os.scandir(path) as it:
            return [Path(e.path) for e in it if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)
                    and (prefix or not e.name.startswith("."))]
    except (FileNotFoundError, NotADirectoryError):
        return []


def subdirs_or_none(path: Path, prefix: str = "") -> list[Path]:
    """:func:`subdirs`, and none when ``path`` cannot be read (a walk that skips what it cannot see)."""
    try:
        return subdirs(path, prefix)
    except OSError:
        return []
