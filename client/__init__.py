"""The library trainers import: ``from ckptstage.client import Client``.

Names are loaded on first use so that ``import ckptstage.client`` stays fast
(torch is imported only when a Client is actually needed).
"""

from __future__ import annotations

import importlib
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
    from ckptstage.client.api import CheckpointInfo, Client
    from ckptstage.client.saver import SaveHandle

__all__ = [
    "AlreadyCommitted", "ArenaFull", "CheckpointInfo", "CheckpointNotFound", "CkptStageError", "Client",
    "CorruptCheckpoint", "DaemonTimeout", "DaemonUnavailable", "InvalidRequest", "SaveFailed", "SaveHandle", "SessionLost",
    "StepPinned",
]

# Each lazily loaded name and the module it lives in.
_LAZY = {"Client": "api", "CheckpointInfo": "api", "SaveHandle": "saver"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"ckptstage.client.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'ckptstage.client' has no attribute {name!r}")
