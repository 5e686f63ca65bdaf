"""Typed exceptions for trainers; every daemon status code maps to one of these."""

from __future__ import annotations

import grpc


class CkptStageError(Exception):
    """Base of every ckptstage client error."""


class DaemonUnavailable(CkptStageError, ConnectionError):
    """No daemon answers on the socket (not started, wrong path, or restarting)."""


class InvalidRequest(CkptStageError, ValueError):
    """The daemon rejected the request as malformed; the message names what."""


class CheckpointNotFound(CkptStageError, LookupError):
    """No such checkpoint (or no complete one) for this job."""


class SessionLost(CkptStageError):
    """The daemon no longer knows this session or save (it restarted, or the session was closed)."""


class AlreadyCommitted(CkptStageError, FileExistsError):
    """That step of this job and rank is already committed or being saved."""


class StepPinned(CkptStageError, PermissionError):
    """The step is pinned: unpin it before deleting it."""


class ArenaFull(CkptStageError, MemoryError):
    """The daemon's shared-memory budget cannot take this session."""


class SaveFailed(CkptStageError):
    """A save could not be committed on the tier waited for."""


class CorruptCheckpoint(CkptStageError):
    """Every copy of a checkpoint failed verification (sizes or checksums)."""


class DaemonTimeout(CkptStageError, TimeoutError):
    """The daemon did not answer within the call's timeout (it is hung, stopped or overloaded)."""


_BY_CODE: dict[grpc.StatusCode, type[CkptStageError]] = {
    grpc.StatusCode.UNAVAILABLE: DaemonUnavailable,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: CheckpointNotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyCommitted,
    grpc.StatusCode.PERMISSION_DENIED: StepPinned,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ArenaFull,
    grpc.StatusCode.ABORTED: SaveFailed,
    grpc.StatusCode.FAILED_PRECONDITION: SessionLost,
}


def from_rpc_error(error: grpc.RpcError, socket: str) -> CkptStageError:
    """The typed exception for a failed call, with the daemon's message."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    detail = error.details() if hasattr(error, "details") else str(error)
    if code == grpc.StatusCode.UNAVAILABLE:
        return DaemonUnavailable(f"no ckptstaged answering on {socket}: {detail} "
                                 "(start it with `ckptstaged`, or set CKPTSTAGE_SOCKET)")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DaemonTimeout(f"the daemon on {socket} did not answer in time: {detail}")
    return _BY_CODE.get(code, CkptStageError)(f"{detail} [{code.name}]")
