"""What a client needs from ``torch.distributed``: its rank, its world, its run's attempt id.

A job's ranks must agree on one attempt id per run (a restarted run gets a
new one): parts of different attempts never make a step complete, so a crashed
run's parts can never be mixed with its restart's. The id is, in order:
``attempt=`` given to the client; ``$CKPTSTAGE_ATTEMPT``; rank 0's fresh id
broadcast over the default process group when one is initialized and spans
the client's world; torchelastic's run id and restart count; a fresh id for a
single-rank job. A multi-rank job with none of these gets the anonymous
attempt ``""`` (a warning says so): its ranks still agree, but a restart is
indistinguishable from the run it replaces.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import Mapping
from typing import Any

import torch

log = logging.getLogger(__name__)

_ATTEMPT_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``rank``/``world_size`` as given, else the default process group's, else 0 of 1.

    ``world_size=1`` in a larger group declares that only one process saves
    (e.g. DDP, where every rank holds the same state): the client is rank 0 of
    a one-rank checkpoint world, whatever its rank in the group.
    """
    if initialized():
        group_world = torch.distributed.get_world_size()
        world_size = group_world if world_size is None else world_size
        if rank is None:
            if world_size == group_world:
                rank = torch.distributed.get_rank()
            elif world_size == 1:
                rank = 0
            else:
                raise ValueError(f"world_size={world_size} differs from the process group's ({group_world}): "
                                 "give rank= too")
    return (0 if rank is None else rank), (1 if world_size is None else world_size)


def group_rank() -> int | None:
    """This process's rank in the default process group, if one is initialized and has several ranks."""
    if initialized() and torch.distributed.get_world_size() > 1:
        return int(torch.distributed.get_rank())
    return None


def refuse_saves(world_size: int, given_rank: int | None) -> str | None:
    """Why this process must not save, or None: under "only rank 0 saves" (a client created with
    ``world_size=1`` and no ``rank`` in a larger process group) every process but the group's rank 0."""
    mine = group_rank()
    return (f"this process is rank {mine} of its process group and the client was "
            "created with world_size=1 (only rank 0 saves): save from rank 0 only"
            if world_size == 1 and given_rank is None and mine else None)


def check_attempt(attempt: str) -> str:
    if attempt and not _ATTEMPT_RE.fullmatch(attempt):
        raise ValueError(f"invalid attempt id {attempt!r}: 1-128 characters from [A-Za-z0-9._:-]")
    return attempt


def agree_attempt(attempt: str | None, world_size: int, env: Mapping[str, str] | None = None) -> str:
    """The attempt id of this run, the same on every rank (see the module docstring).

    Collective when it broadcasts: every rank of the default group must call it.
    """
    env = os.environ if env is None else env
    if attempt is not None:
        return check_attempt(attempt)
    if env.get("CKPTSTAGE_ATTEMPT"):
        return check_attempt(env["CKPTSTAGE_ATTEMPT"])
    if initialized() and torch.distributed.get_world_size() == world_size:
        box: list[Any] = [uuid.uuid4().hex if torch.distributed.get_rank() == 0 else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return check_attempt(str(box[0]))
    if env.get("TORCHELASTIC_RUN_ID"):
        run = re.sub(r"[^A-Za-z0-9._-]", "_", env["TORCHELASTIC_RUN_ID"])[:100]
        return check_attempt(f"{run}:{env.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    if world_size == 1:
        return uuid.uuid4().hex
    log.warning("ckptstage: %d ranks and no way to agree on an attempt id (no process group, no "
                "$CKPTSTAGE_ATTEMPT, no torchelastic): using the anonymous attempt, so a restarted run "
                "cannot be told from the one it replaces", world_size)
    return ""


def gather(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (collective over ``group``, the default group when None)."""
    out: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


def exchange_peers(session: Any, world_size: int) -> list[str]:
    """The other nodes of the job whose daemons keep this one's replicas and hold those of the others
    (``[peers]``): every rank's daemon's advertised address, gathered over the default process group when it
    spans the job, told to this rank's daemon; [] when the daemon has no peer tier or there is no group.

    Collective when it gathers: every rank of the group calls it, from the ``Client`` constructor (the
    daemons of one job have ``[peers]`` set alike, as they have ``[shared] drain_every``).
    """
    if not session.peer_address or world_size < 2 or not initialized() or \
            torch.distributed.get_world_size() != world_size:
        return []
    nodes = sorted({str(a) for a in gather(session.peer_address) if a})
    return list(session.join_peers(nodes))
