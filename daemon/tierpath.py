"""Containment of the tiers: nothing the daemon creates, renames or deletes leaves a tier.

Two ideas, one helper each:

* :func:`check_contained`: no component of a path below a tier's root is a
  symbolic link (a link planted at ``<tier>/<job>`` or ``<tier>/.tmp/<node>``
  would carry a write or a delete out of the tier). The root itself may be a
  link: that is the operator's choice, not a plant.
* :func:`check_disjoint`: the two tiers, once links are resolved, are neither
  equal nor one inside the other (local retention would delete the "shared"
  copies). The shared tier may be a network file system that hangs, so it is
  resolved on a helper thread with a deadline, and the check can be repeated.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from pathlib import Path

from ckptstage.daemon.logs import fields

log = logging.getLogger(__name__)

RESOLVE_TIMEOUT_S = 2.0


class TiersOverlap(ValueError):
    """The shared tier is the local one, or inside it, or contains it, once links are resolved."""

    def __init__(self, local: Path, shared: Path, real_local: Path, real_shared: Path) -> None:
        self.local, self.shared = local, shared
        super().__init__(f"shared.dir {shared} (really {real_shared}) overlaps local.dir {local} "
                         f"(really {real_local}): the tiers must be separate directories")


def check_contained(tier_dir: Path, path: Path) -> Path | None:
    """Raises OSError(ELOOP) naming the link if a component of ``path`` below ``tier_dir`` is one; returns
    the first component that does not exist (None: ``path`` exists), which a caller about to create it
    need not look up again.

    Components are checked with ``lstat`` from the root down; nothing below a
    missing component can be a link yet. A path that is not below the tier
    (or climbs out of it with ``..``) raises OSError(EXDEV) naming both.
    """
    try:
        rel = path.relative_to(tier_dir)
    except ValueError:
        raise OSError(errno.EXDEV, f"{path} is not inside the tier {tier_dir}") from None
    if ".." in rel.parts:
        raise OSError(errno.EXDEV, f"{path} climbs out of the tier {tier_dir} with '..'")
    current = tier_dir
    for name in rel.parts:
        current = current / name
        try:
            mode = os.lstat(current).st_mode
        except FileNotFoundError:
            return current
        if stat.S_ISLNK(mode):
            raise OSError(errno.ELOOP, f"{current} is a symbolic link inside the tier {tier_dir}; "
                                       "ckptstage never follows one out of a tier (remove it)")
    return None


def tiers_overlap(a: Path, b: Path) -> bool:
    """Whether two resolved directories are equal or one contains the other."""
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


class _Resolver:
    """``realpath`` with a deadline, on a daemon thread; one thread at most per path.

    A call that hangs in the kernel (a dead NFS server) can never be
    cancelled, so a repeated check waits on the thread already stuck on that
    path instead of starting another.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[Path, tuple[threading.Thread, list[Path]]] = {}

    def resolve(self, path: Path, timeout_s: float) -> Path | None:
        """The resolved path, or None if it did not answer within ``timeout_s``."""
        with self._lock:
            thread, box = self._pending.get(path) or self._start(path)
        thread.join(timeout_s)
        if thread.is_alive():
            return None
        with self._lock:
            if self._pending.get(path, (None, None))[0] is thread:
                del self._pending[path]
        return box[0] if box else None

    def _start(self, path: Path) -> tuple[threading.Thread, list[Path]]:
        box: list[Path] = []
        thread = threading.Thread(target=lambda: box.append(Path(os.path.realpath(path))),
                                  name="resolve-tier", daemon=True)
        thread.start()
        self._pending[path] = (thread, box)
        return thread, box


_resolver = _Resolver()


def check_disjoint(local: Path, shared: Path, timeout_s: float = RESOLVE_TIMEOUT_S) -> bool:
    """Raises :class:`TiersOverlap` if the tiers overlap once links are resolved.

    Returns True when checked, False when the shared tier did not answer
    within ``timeout_s`` (a warning is logged): the caller checks again before
    its first use of the shared tier. The local tier is resolved the same way.
    """
    real_local = _resolver.resolve(local, timeout_s)
    real_shared = _resolver.resolve(shared, timeout_s)
    if real_local is None or real_shared is None:
        late = shared if real_shared is None else local
        log.warning("cannot resolve %s within %gs (hung file system?): the tiers are not yet checked for "
                    "overlap; checked again before the shared tier is used", late, timeout_s,
                    extra=fields(path=late, duration_s=timeout_s))
        return False
    if tiers_overlap(real_local, real_shared):
        raise TiersOverlap(local, shared, real_local, real_shared)
    return True
