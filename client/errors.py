"""Typed exceptions for trainers; every daemon status code maps to one of these."""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

import grpc


class CkptStageError(Exception):
    """Base of every ckptstage client error.

    ``code`` names the kind of failure for machines (``ckptstage --json``
    prints it; docs/CLI.md lists them); an instance may carry a narrower one.
    """

    code = "error"


class DaemonUnavailable(CkptStageError, ConnectionError):
    """No daemon answers on the socket (not started, wrong path, or restarting)."""

    code = "daemon_unavailable"


class InvalidRequest(CkptStageError, ValueError):
    """The daemon rejected the request as malformed; the message names what."""

    code = "invalid_request"


class CheckpointNotFound(CkptStageError, LookupError):
    """No such checkpoint (or no complete one) for this job."""

    code = "not_found"


class SessionLost(CkptStageError):
    """The daemon no longer knows this session or save (it restarted, or the session was closed)."""

    code = "session_lost"


class AlreadyCommitted(CkptStageError, FileExistsError):
    """That step of this job and rank is already committed or being saved."""

    code = "already_exists"


class StepPinned(CkptStageError, PermissionError):
    """The step is pinned: unpin it before deleting it."""

    code = "pinned"


class ArenaFull(CkptStageError, MemoryError):
    """The daemon's shared-memory budget cannot take this session."""

    code = "arena_full"


class SaveFailed(CkptStageError):
    """A save could not be committed on the tier waited for."""

    code = "failed"


class CorruptCheckpoint(CkptStageError):
    """Every copy of a checkpoint failed verification (sizes or checksums)."""

    code = "corrupt"


class DaemonTimeout(CkptStageError, TimeoutError):
    """The daemon did not answer within the call's timeout (it is hung, stopped or overloaded)."""

    code = "daemon_timeout"


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


def from_rpc_error(error: grpc.RpcError, socket: str, method: str = "", timeout: float | None = None,
                   answered_before: bool = False) -> CkptStageError:
    """The typed exception for a failed call, its message in words a person can act on.

    The daemon's own message (it names the job, step or file) is kept; what
    gRPC says about the transport is replaced by what happened to the socket
    and what to do. ``str()`` of a daemon-reported error ends with the status
    name (``[NOT_FOUND]``) for logs; :func:`plain_message` is the text
    without it, which the command line prints.
    """
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    detail = (error.details() if hasattr(error, "details") else None) or ""
    request = f" the {method} request" if method else ""
    if code == grpc.StatusCode.UNAVAILABLE:
        return _mark(DaemonUnavailable(_unavailable(socket, detail, request, answered_before)))
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        within = f" within {timeout:g}s" if timeout else " in time"
        return _mark(DaemonTimeout(
            f"the daemon on {socket} did not answer{request}{within}: it is hung, stopped (SIGSTOP) or overloaded; "
            "check its log and `systemctl status ckptstaged@<instance>`"))
    if code == grpc.StatusCode.UNIMPLEMENTED:
        err = CkptStageError(f"the daemon on {socket} does not know{request or ' this request'}: it runs an older "
                             "ckptstage than this client; restart it from this installation")
        err.code = "unsupported"
        return _mark(err)
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS):
        err = CkptStageError(f"the daemon on {socket} failed{request}: {detail or 'no detail given'} "
                             "(its log has the traceback)")
        err.code = "daemon_error"
        return _mark(err)
    plain = detail or f"the daemon refused{request or ' the request'} ({code.name.lower().replace('_', ' ')})"
    return _mark(_BY_CODE.get(code, CkptStageError)(f"{plain} [{code.name}]"), plain)


def plain_message(error: BaseException) -> str:
    """The error's message for a person, without the status name a daemon-reported one ends with."""
    plain = getattr(error, "plain", None)
    return plain if isinstance(plain, str) else str(error)


def _mark(error: CkptStageError, plain: str | None = None) -> CkptStageError:
    error.plain = plain if plain is not None else str(error)  # type: ignore[attr-defined]
    return error


# gRPC's words for a connection that could not be made (as opposed to one lost during a call).
_CONNECT_FAILED = ("failed to connect", "connect failed", "No such file or directory", "Connection refused")
_WHAT_TO_DO = ("start it (`ckptstaged`, or `systemctl start ckptstaged@<instance>`), or point ckptstage at the "
               "socket it serves (--socket, $CKPTSTAGE_SOCKET, Client(socket=...))")


def _another_users(socket: str) -> str:
    """A socket this user may not connect to: it belongs to another user's daemon, which is running."""
    path = Path(socket)
    owner = None
    for candidate in (path, *path.parents):  # the socket, else the nearest directory this user may stat
        try:
            owner = _user_name(candidate.stat().st_uid)
            break
        except OSError:
            continue
    whose = f"user {owner!r}" if owner else "another user"
    return (f"permission denied on {socket}: it belongs to {whose}'s daemon; each user runs their own "
            "(`systemctl start ckptstaged@$USER`, or `ckptstaged` as yourself) and connects to its socket "
            "(--socket, $CKPTSTAGE_SOCKET, Client(socket=...))")


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _unavailable(socket: str, detail: str, request: str, answered_before: bool = False) -> str:
    """Why nothing answers on ``socket``, said from the socket file's side, and what to do.

    ``answered_before``: the daemon answered earlier on this connection, so a
    connection refused now means it went away while this client worked with
    it (between two polls of a waiting command, say), not that it never ran.
    """
    if "shutting down" in detail:  # the daemon's own answer while it stops
        return f"the daemon on {socket} is shutting down and takes no new requests; retry once it is back"
    connect_failed = any(marker in detail for marker in _CONNECT_FAILED)
    if not connect_failed or answered_before:
        during = request if not connect_failed else " the work it was doing for this client"
        return (f"the daemon on {socket} went away during{during or ' the request'} (it stopped or crashed); "
                "check its log, and retry once `ckptstage status` answers")
    try:
        st = os.stat(socket)
    except FileNotFoundError:
        return f"no daemon socket at {socket}: ckptstaged is not running there; {_WHAT_TO_DO}"
    except PermissionError:  # its directory is private to the user whose daemon serves there
        return _another_users(socket)
    except OSError as e:
        return f"cannot reach the daemon socket {socket}: {e.strerror}; {_WHAT_TO_DO}"
    if not stat.S_ISSOCK(st.st_mode):
        return f"{socket} is not a socket: {_WHAT_TO_DO}"
    if "Permission denied" in detail:
        return _another_users(socket)
    if "Connection refused" in detail:
        return (f"nothing listens on {socket} (a socket left behind by a daemon that stopped or crashed); "
                f"{_WHAT_TO_DO}")
    return f"cannot connect to the daemon on {socket}; {_WHAT_TO_DO}"
