"""The daemon's domain errors. The servicer maps each to one gRPC status code."""

from __future__ import annotations


class DaemonError(Exception):
    """Base of every error the daemon reports to a client."""


class InvalidRequest(DaemonError, ValueError):
    """The request is malformed: a bad name, size, offset or manifest."""


class SessionNotFound(DaemonError, LookupError):
    def __init__(self, session_id: str) -> None:
        super().__init__(f"no open session {session_id!r} (closed, or the daemon restarted)")
        self.session_id = session_id


class SaveNotFound(DaemonError, LookupError):
    def __init__(self, save_id: str) -> None:
        super().__init__(f"no save {save_id!r} in flight (finished, aborted, or the daemon restarted)")
        self.save_id = save_id


class CheckpointNotFound(DaemonError, LookupError):
    def __init__(self, job: str, step: int | None, detail: str = "") -> None:
        what = f"step {step} of job {job!r}" if step is not None else f"complete checkpoint of job {job!r}"
        super().__init__(f"no {what}{': ' + detail if detail else ''}")
        self.job, self.step = job, step


class AlreadyExists(DaemonError):
    """A save for a (job, step, rank) that is already committed or in flight."""


class StepPinned(DaemonError):
    """A pinned step cannot be deleted; the message names the pin and how to lift it."""

    def __init__(self, job: str, step: int) -> None:
        super().__init__(f"step {step} of job {job!r} is pinned; unpin it first (`ckptstage unpin {job} {step}` "
                         "or Client.unpin) to delete it")
        self.job, self.step = job, step


class ArenaFull(DaemonError):
    """The global shared-memory budget cannot grant even one chunk."""

    def __init__(self, wanted: int, free: int, budget: int, chunk: int) -> None:
        super().__init__(
            f"arena budget exhausted: this session needs at least {chunk} bytes (one chunk; "
            f"{wanted} for the whole state without streaming), {free} of {budget} are free; "
            "raise [arena] max_bytes or close other sessions"
        )
        self.wanted, self.free, self.budget, self.chunk = wanted, free, budget, chunk


class SharedMemoryFull(ArenaFull):
    """The budget allows an arena but the shared-memory file system it is carved from has no room for it."""

    def __init__(self, wanted: int, free: int, fs_bytes: int, budget: int, chunk: int, where: str) -> None:
        DaemonError.__init__(
            self,
            f"no shared memory for an arena of {wanted} bytes: {where} has {free} bytes free of {fs_bytes} "
            f"(arena.max_bytes allows {budget}; a save needs at least one chunk of {chunk}); free space in {where}, "
            "enlarge that mount (docker run --shm-size, a Kubernetes emptyDir with medium: Memory) or set [arena] "
            "dir to a larger tmpfs, or lower arena.max_bytes to what the mount holds",
        )
        self.wanted, self.free, self.budget, self.chunk = wanted, free, budget, chunk
        self.fs_bytes, self.where = fs_bytes, where


class SaveFailed(DaemonError):
    """A save could not be committed on a tier; the message says why."""


class ShuttingDown(DaemonError):
    def __init__(self) -> None:
        super().__init__("the daemon is shutting down; retry against its successor")
