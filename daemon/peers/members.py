"""Which nodes each job runs on, as the job's own clients said (``JoinPeers``), kept across restarts.

A job's ranks gather their daemons' advertised addresses over their process
group when their clients start, and each rank tells its daemon the whole
list. The newest list replaces the one before: a job restarted on other
nodes (one of them lost) replicates to, and reads from, the nodes it runs
on now. The lists are kept in ``<local>/.state/peers.json`` so that a
restarted daemon still knows whom to ask for a replica and whose replicas to
accept.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from ckptstage.daemon import fsutil
from ckptstage.daemon.configvalues import split_host_port
from ckptstage.daemon.errors import InvalidRequest
from ckptstage.daemon.logs import fields
from ckptstage.protos import layout

log = logging.getLogger(__name__)

MAX_NODES = 65536
MAX_ADDRESS_BYTES = 300


class Members:
    """job -> the advertised addresses of the nodes it runs on (this node's included)."""

    def __init__(self, path: Path, me: str) -> None:
        self.me = me
        self._path = path
        self._lock = threading.Lock()
        self._jobs: dict[str, tuple[str, ...]] = {}
        for job, nodes in fsutil.read_json(path, {}).items():
            try:
                self._jobs[layout.check_job(job)] = tuple(_checked(nodes))
            except (layout.InvalidName, InvalidRequest, TypeError) as e:
                log.warning("ignoring the peers of %r in %s: %s", job, path, e)

    def join(self, job: str, nodes: list[str]) -> list[str]:
        """Records the nodes ``job`` runs on now; returns the others. Raises :class:`InvalidRequest` for an
        address that is not ``HOST:PORT``, or a list that does not name this node."""
        ring = tuple(sorted(set(_checked(nodes))))
        if self.me not in ring:
            raise InvalidRequest(f"the peers of {job} do not include this daemon's advertised address {self.me!r} "
                                 "(is [peers] advertise the address the other nodes reach it at?)")
        with self._lock:
            changed = self._jobs.get(job) != ring
            self._jobs[job] = ring
            snapshot = {j: list(n) for j, n in sorted(self._jobs.items())}
        if changed:
            fsutil.write_json_atomic(self._path, snapshot)
            log.info("%s runs on %d node(s): %s", job, len(ring), ", ".join(ring),
                     extra=fields(job=job, nodes=len(ring)))
        return [n for n in ring if n != self.me]

    def nodes(self, job: str) -> tuple[str, ...]:
        """The nodes ``job`` runs on, this one included (empty: none known)."""
        with self._lock:
            return self._jobs.get(job, ())

    def others(self, job: str) -> list[str]:
        return [n for n in self.nodes(job) if n != self.me]

    def jobs(self) -> list[str]:
        with self._lock:
            return sorted(self._jobs)


def _checked(nodes: object) -> list[str]:
    if not isinstance(nodes, (list, tuple)) or not nodes or len(nodes) > MAX_NODES:
        raise InvalidRequest(f"expected 1 to {MAX_NODES} peer addresses, got {nodes!r:.200}")
    for node in nodes:
        if not isinstance(node, str) or len(node) > MAX_ADDRESS_BYTES:
            raise InvalidRequest(f"invalid peer address {node!r:.200}")
        try:
            split_host_port(node)
        except ValueError as e:
            raise InvalidRequest(f"invalid peer address: {e}") from None
    return list(nodes)
