"""The library trainers import: ``from ckptstage.client import Client``.

Names are loaded on first use so that ``import ckptstage.client`` stays fast
(torch is imported only when a Client is actually needed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptstage.client.errors import (
    AlreadyCommitted,
    ArenaFull,
    CheckpointNotFound,
    CkptStageError,
    CorruptCheckpoint,
    DaemonTimeout,
    DaemonUnavailable,
    InvalidRequest,
    SaveFailed,
    SessionLost,
    StepPinned,
)

if TYPE_CHECKING:
    from ckptstage.client.api import CheckpointInfo, Client, SaveHandle

__all__ = [
    "AlreadyCommitted", "ArenaFull", "CheckpointInfo", "CheckpointNotFound", "CkptStageError", "Client",
    "CorruptCheckpoint", "DaemonTimeout", "DaemonUnavailable", "InvalidRequest", "SaveFailed", "SaveHandle", "SessionLost",
    "StepPinned",
]

_LAZY = {"Client", "SaveHandle", "CheckpointInfo"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from ckptstage.client import api

        return getattr(api, name)
    raise AttributeError(f"module 'ckptstage.client' has no attribute {name!r}")
