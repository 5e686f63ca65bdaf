"""A load tells its daemon it is reading: drains and replicas on this node wait until it is done.

A trainer restarted after a crash loads right when the drain of its last
step is copying that step off the same disk; the daemon holds such
background copies back while any load holds a lease
(``[persist] yield_to_loads_s``). The lease is renewed every third of its
time to live while the load runs and ended when it returns; a process that
dies mid-load leaves one that expires on its own.

The lease only ever helps: a daemon that cannot be told (an older one, one
that is restarting) never fails or slows a load beyond one short call.
"""

from __future__ import annotations

import logging
import threading
import uuid

from ckptstage.client import errors
from ckptstage.client.rpc import Connection
from ckptstage.protos.v1 import ckptstage_pb2 as pb

log = logging.getLogger(__name__)

TTL_S = 10.0   # a lease not renewed for this long is over (the reader died)
CALL_TIMEOUT_S = 2.0


class LoadLease:
    """``with LoadLease(conn): ...`` holds a lease on ``conn``'s daemon for the block's duration."""

    def __init__(self, conn: Connection, ttl_s: float = TTL_S) -> None:
        self._conn = conn
        self._ttl_s = ttl_s
        self._lease = uuid.uuid4().hex
        self._done = threading.Event()
        self._renewer: threading.Thread | None = None

    def __enter__(self) -> LoadLease:
        if self._tell(done=False):
            self._renewer = threading.Thread(target=self._renew, name="ckptstage-load-lease", daemon=True)
            self._renewer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._renewer is not None:
            self._renewer.join()
            self._tell(done=True)

    def _renew(self) -> None:
        while not self._done.wait(self._ttl_s / 3):
            if not self._tell(done=False):
                return

    def _tell(self, done: bool) -> bool:
        """True when the daemon took it."""
        try:
            self._conn.call("Loading", pb.LoadingRequest(lease=self._lease, ttl_s=self._ttl_s, done=done),
                            timeout=CALL_TIMEOUT_S)
        except errors.CkptStageError as e:
            log.debug("the daemon at %s was not told of this load (%s): background copies may run beside it",
                      self._conn.socket, e)
            return False
        return True
