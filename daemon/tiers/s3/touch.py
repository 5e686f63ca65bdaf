"""When a writer last relied on an object of a chunk store (a chunk of its own, or a pack's index).

A touch tags the object with the time (:data:`TOUCHED_TAG`): no bytes move,
and a versioned bucket keeps no extra version for each save that reuses it.
A store that refuses tags has the object copied onto itself instead, as S3
sets no modification time otherwise. A sweep reads both (:meth:`Touches.idle`)
before it condemns anything.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from ckptstage.daemon.logs import fields
from ckptstage.daemon.tiers.s3.client import is_refused
from ckptstage.daemon.tiers.s3.objects import Objects

log = logging.getLogger(__name__)

TOUCHED_TAG = "ckptstage-touched"  # an object's tag: when a writer last relied on it (unix time)


class Touches:
    """Touches and their reading on ``objects``, for the tier at ``url`` (named in warnings)."""

    def __init__(self, objects: Objects, url: str) -> None:
        self._objects = objects
        self._url = url
        self._refused: set[str] = set()  # what the store declined to do ("tagging", "reading tags")

    def touch(self, key: str) -> bool:
        """Marks the object as relied on now; False when it is gone."""
        now = f"{math.ceil(time.time() * 1000) / 1000:.3f}"  # to the millisecond, never before the touch
        try:
            if "tagging" not in self._refused:
                try:
                    self._objects.tag(key, {TOUCHED_TAG: now})
                    return True
                except OSError as e:
                    if not is_refused(e):
                        raise
                    self._refuse("tagging", e, "objects reused are touched by copying them onto themselves")
            head = self._objects.head(key)
            if head is None:
                return False
            self._objects.rewrite(key, {**(head.get("Metadata") or {}), "touched": now})  # a decoded size stays
        except FileNotFoundError:
            return False
        return True

    def idle(self, key: str, head: dict[str, Any], since: float) -> bool:
        """Whether nobody wrote or touched the object (``head``: its metadata) since ``since`` (unix time).
        FileNotFoundError when it is gone."""
        # S3 keeps modification times to the second: the second it names may run up to 1 s later.
        return head["LastModified"].timestamp() + 1 <= since and self._touched(key) <= since

    def _touched(self, key: str) -> float:
        """When a writer last touched the object by its tag (unix time; 0: never, or the store keeps no
        tags); FileNotFoundError when it is gone."""
        if "reading tags" in self._refused:
            return 0.0
        try:
            tags = self._objects.tags(key)
        except OSError as e:
            if not is_refused(e):
                raise
            self._refuse("reading tags", e, "a sweep knows when an object was used last by its modification time only")
            return 0.0
        try:
            return float(tags.get(TOUCHED_TAG, 0))
        except ValueError:
            return 0.0

    def _refuse(self, what: str, e: OSError, instead: str) -> None:
        """Notes (once, with a warning) that the store refuses ``what``: the tier does ``instead`` from now on."""
        if what not in self._refused:
            log.warning("%s refuses %s (%s): %s", self._url, what, e, instead,
                        extra=fields(tier="shared", path=self._url, error=e))
        self._refused.add(what)
