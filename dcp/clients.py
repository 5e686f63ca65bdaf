"""One ckptstage ``Client`` per job and daemon in a process, shared by every ``Writer`` and ``Reader``.

DCP builds a new storage writer for every checkpoint. A ``Client`` is a
session with the node's daemon and a shared-memory arena: made per
checkpoint, every save would open a session, agree on a new attempt id and
allocate and pre-fault a fresh arena on the trainer's path (the first-touch
copy runs at a fraction of a warm one). Shared, the arena is there for the
next checkpoint, and the run keeps one attempt id, as a run should. The
clients close when the process exits.
"""

from __future__ import annotations

import atexit
import os
import socket as socketlib
import threading
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ckptstage.client import Client
from ckptstage.client.dist import gather, rank_and_world


@dataclass(frozen=True)
class Session:
    client: Client
    multi_node: bool  # the job's ranks talk to more than one daemon: a step completes on the shared tier


_lock = threading.Lock()
_sessions: dict[tuple[Any, ...], Session] = {}


def session(job: str, socket: str | os.PathLike[str] | None) -> Session:
    """The process's session for ``job`` on ``socket``; made on first use (collective with a process group)."""
    key = (job, os.fspath(socket) if socket is not None else None, *rank_and_world(None, None))
    with _lock:
        found = _sessions.get(key)
        if found is not None:
            return found
        if not _sessions:
            atexit.register(close_all)
        client = Client(job, socket=socket)
        made = _sessions[key] = Session(client, _spans_nodes(client, socket))
        return made


def close_all() -> None:
    """Closes every shared client (at exit; also for tests that stop their daemons)."""
    with _lock:
        sessions = list(_sessions.values())
        _sessions.clear()
    for s in sessions:
        s.client.close()


def _spans_nodes(client: Client, socket: str | os.PathLike[str] | None) -> bool:
    """Whether the job's ranks talk to more than one daemon (collective with a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != client.world_size:
        return False
    me = (socketlib.gethostname(), os.fspath(socket) if socket is not None else os.environ.get("CKPTSTAGE_SOCKET", ""))
    return len(set(gather(me))) > 1
