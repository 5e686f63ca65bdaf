"""Which nodes keep the replicas of a node's parts: the next ones on the job's ring.

The job's nodes, by their advertised addresses, sorted, form a ring; a node
sends each of its parts to the ``replicas`` nodes after it. Every node of the
job computes the same ring from the same list, no two copies of a part share
a node (the part's own node and ``replicas`` distinct others), every node
keeps the same number of other nodes' parts, and any node count works, odd
ones included. A job with fewer other nodes than ``replicas`` gets one copy
on each of them; a one-node job gets none.
"""

from __future__ import annotations

from collections.abc import Iterable


def targets(nodes: Iterable[str], me: str, replicas: int) -> list[str]:
    """The nodes that keep replicas of ``me``'s parts, nearest on the ring first."""
    ring = sorted(set(nodes) | {me})
    at = ring.index(me)
    count = min(replicas, len(ring) - 1)
    return [ring[(at + k) % len(ring)] for k in range(1, count + 1)]

