from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    LOCAL: _ClassVar[Tier]
    SHARED: _ClassVar[Tier]
    MEMORY: _ClassVar[Tier]
    PEER: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
LOCAL: Tier
SHARED: Tier
MEMORY: Tier
PEER: Tier

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RetentionOverrides(_message.Message):
    __slots__ = ("local_keep_last", "shared_keep_last", "shared_keep_every", "keep_best_metric", "keep_best_mode", "keep_best_n")
    LOCAL_KEEP_LAST_FIELD_NUMBER: _ClassVar[int]
    SHARED_KEEP_LAST_FIELD_NUMBER: _ClassVar[int]
    SHARED_KEEP_EVERY_FIELD_NUMBER: _ClassVar[int]
    KEEP_BEST_METRIC_FIELD_NUMBER: _ClassVar[int]
    KEEP_BEST_MODE_FIELD_NUMBER: _ClassVar[int]
    KEEP_BEST_N_FIELD_NUMBER: _ClassVar[int]
    local_keep_last: int
    shared_keep_last: int
    shared_keep_every: int
    keep_best_metric: str
    keep_best_mode: str
    keep_best_n: int
    def __init__(self, local_keep_last: _Optional[int] = ..., shared_keep_last: _Optional[int] = ..., shared_keep_every: _Optional[int] = ..., keep_best_metric: _Optional[str] = ..., keep_best_mode: _Optional[str] = ..., keep_best_n: _Optional[int] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("job", "rank", "world_size", "pid", "hostname", "retention", "attempt")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    world_size: int
    pid: int
    hostname: str
    retention: RetentionOverrides
    attempt: str
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., pid: _Optional[int] = ..., hostname: _Optional[str] = ..., retention: _Optional[_Union[RetentionOverrides, _Mapping]] = ..., attempt: _Optional[str] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "chunk_bytes", "daemon_version", "expected_bytes", "memory_copy", "peer_address")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_COPY_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    chunk_bytes: int
    daemon_version: str
    expected_bytes: int
    memory_copy: bool
    peer_address: str
    def __init__(self, session_id: _Optional[str] = ..., chunk_bytes: _Optional[int] = ..., daemon_version: _Optional[str] = ..., expected_bytes: _Optional[int] = ..., memory_copy: _Optional[bool] = ..., peer_address: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("kind", "message", "released", "arena_generation")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[SessionEvent.Kind]
        READY: _ClassVar[SessionEvent.Kind]
        SHUTTING_DOWN: _ClassVar[SessionEvent.Kind]
        RELEASED: _ClassVar[SessionEvent.Kind]
    KIND_UNSPECIFIED: SessionEvent.Kind
    READY: SessionEvent.Kind
    SHUTTING_DOWN: SessionEvent.Kind
    RELEASED: SessionEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    ARENA_GENERATION_FIELD_NUMBER: _ClassVar[int]
    kind: SessionEvent.Kind
    message: str
    released: int
    arena_generation: int
    def __init__(self, kind: _Optional[_Union[SessionEvent.Kind, str]] = ..., message: _Optional[str] = ..., released: _Optional[int] = ..., arena_generation: _Optional[int] = ...) -> None: ...

class EnsureArenaRequest(_message.Message):
    __slots__ = ("session_id", "want_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WANT_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    want_bytes: int
    def __init__(self, session_id: _Optional[str] = ..., want_bytes: _Optional[int] = ...) -> None: ...

class ArenaInfo(_message.Message):
    __slots__ = ("path", "size_bytes", "generation")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    path: str
    size_bytes: int
    generation: int
    def __init__(self, path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class ArenaMappedRequest(_message.Message):
    __slots__ = ("session_id", "generation")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    generation: int
    def __init__(self, session_id: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class BeginSaveRequest(_message.Message):
    __slots__ = ("session_id", "step", "manifest_json", "data_bytes", "metrics", "stream_base", "overwrite")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    DATA_BYTES_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    STREAM_BASE_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step: int
    manifest_json: bytes
    data_bytes: int
    metrics: _containers.ScalarMap[str, float]
    stream_base: int
    overwrite: bool
    def __init__(self, session_id: _Optional[str] = ..., step: _Optional[int] = ..., manifest_json: _Optional[bytes] = ..., data_bytes: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., stream_base: _Optional[int] = ..., overwrite: _Optional[bool] = ...) -> None: ...

class BeginSaveResponse(_message.Message):
    __slots__ = ("save_id", "stream_base", "released")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_BASE_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    stream_base: int
    released: int
    def __init__(self, save_id: _Optional[str] = ..., stream_base: _Optional[int] = ..., released: _Optional[int] = ...) -> None: ...

class ProgressRequest(_message.Message):
    __slots__ = ("save_id", "copied_upto", "wait_released")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    COPIED_UPTO_FIELD_NUMBER: _ClassVar[int]
    WAIT_RELEASED_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    copied_upto: int
    wait_released: int
    def __init__(self, save_id: _Optional[str] = ..., copied_upto: _Optional[int] = ..., wait_released: _Optional[int] = ...) -> None: ...

class ProgressResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class FinishSaveRequest(_message.Message):
    __slots__ = ("save_id",)
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    def __init__(self, save_id: _Optional[str] = ...) -> None: ...

class FinishSaveResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class AbortSaveRequest(_message.Message):
    __slots__ = ("save_id", "reason")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    reason: str
    def __init__(self, save_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class WaitSaveRequest(_message.Message):
    __slots__ = ("save_id", "tier", "timeout_s")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    tier: Tier
    timeout_s: float
    def __init__(self, save_id: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class WaitSaveResponse(_message.Message):
    __slots__ = ("done",)
    DONE_FIELD_NUMBER: _ClassVar[int]
    done: bool
    def __init__(self, done: _Optional[bool] = ...) -> None: ...

class CheckpointInfo(_message.Message):
    __slots__ = ("job", "step", "world_size", "ranks_local", "ranks_shared", "bytes", "created", "complete", "pinned", "drain_state", "metrics", "attempt", "committed_local", "committed_shared", "ranks_missing", "ranks_memory", "ranks_peer", "committed_peer", "stored_local", "stored_shared")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_LOCAL_FIELD_NUMBER: _ClassVar[int]
    RANKS_SHARED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    DRAIN_STATE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LOCAL_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_SHARED_FIELD_NUMBER: _ClassVar[int]
    RANKS_MISSING_FIELD_NUMBER: _ClassVar[int]
    RANKS_MEMORY_FIELD_NUMBER: _ClassVar[int]
    RANKS_PEER_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_PEER_FIELD_NUMBER: _ClassVar[int]
    STORED_LOCAL_FIELD_NUMBER: _ClassVar[int]
    STORED_SHARED_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    world_size: int
    ranks_local: _containers.RepeatedScalarFieldContainer[int]
    ranks_shared: _containers.RepeatedScalarFieldContainer[int]
    bytes: int
    created: float
    complete: bool
    pinned: bool
    drain_state: str
    metrics: _containers.ScalarMap[str, float]
    attempt: str
    committed_local: bool
    committed_shared: bool
    ranks_missing: _containers.RepeatedScalarFieldContainer[int]
    ranks_memory: _containers.RepeatedScalarFieldContainer[int]
    ranks_peer: _containers.RepeatedScalarFieldContainer[int]
    committed_peer: bool
    stored_local: int
    stored_shared: int
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., world_size: _Optional[int] = ..., ranks_local: _Optional[_Iterable[int]] = ..., ranks_shared: _Optional[_Iterable[int]] = ..., bytes: _Optional[int] = ..., created: _Optional[float] = ..., complete: _Optional[bool] = ..., pinned: _Optional[bool] = ..., drain_state: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ..., attempt: _Optional[str] = ..., committed_local: _Optional[bool] = ..., committed_shared: _Optional[bool] = ..., ranks_missing: _Optional[_Iterable[int]] = ..., ranks_memory: _Optional[_Iterable[int]] = ..., ranks_peer: _Optional[_Iterable[int]] = ..., committed_peer: _Optional[bool] = ..., stored_local: _Optional[int] = ..., stored_shared: _Optional[int] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("job", "memory")
    JOB_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    job: str
    memory: bool
    def __init__(self, job: _Optional[str] = ..., memory: _Optional[bool] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("checkpoints", "quarantined")
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointInfo]
    quarantined: _containers.RepeatedCompositeFieldContainer[QuarantinedCopy]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[CheckpointInfo, _Mapping]]] = ..., quarantined: _Optional[_Iterable[_Union[QuarantinedCopy, _Mapping]]] = ...) -> None: ...

class QuarantinedCopy(_message.Message):
    __slots__ = ("step", "rank", "tier", "path", "detail", "chunk", "bytes", "since")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    step: int
    rank: int
    tier: Tier
    path: str
    detail: str
    chunk: str
    bytes: int
    since: float
    def __init__(self, step: _Optional[int] = ..., rank: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., path: _Optional[str] = ..., detail: _Optional[str] = ..., chunk: _Optional[str] = ..., bytes: _Optional[int] = ..., since: _Optional[float] = ...) -> None: ...

class LocateRequest(_message.Message):
    __slots__ = ("job", "step", "latest", "rank", "all_ranks", "memory", "ranks", "node_copy", "step_index")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALL_RANKS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    NODE_COPY_FIELD_NUMBER: _ClassVar[int]
    STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    latest: bool
    rank: int
    all_ranks: bool
    memory: bool
    ranks: _containers.RepeatedScalarFieldContainer[int]
    node_copy: bool
    step_index: bool
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., latest: _Optional[bool] = ..., rank: _Optional[int] = ..., all_ranks: _Optional[bool] = ..., memory: _Optional[bool] = ..., ranks: _Optional[_Iterable[int]] = ..., node_copy: _Optional[bool] = ..., step_index: _Optional[bool] = ...) -> None: ...

class RankParts(_message.Message):
    __slots__ = ("rank", "locations")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    locations: _containers.RepeatedCompositeFieldContainer[PartLocation]
    def __init__(self, rank: _Optional[int] = ..., locations: _Optional[_Iterable[_Union[PartLocation, _Mapping]]] = ...) -> None: ...

class PartLocation(_message.Message):
    __slots__ = ("tier", "dir", "manifest_digest")
    TIER_FIELD_NUMBER: _ClassVar[int]
    DIR_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    dir: str
    manifest_digest: str
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., dir: _Optional[str] = ..., manifest_digest: _Optional[str] = ...) -> None: ...

class LocateResponse(_message.Message):
    __slots__ = ("step", "world_size", "locations", "attempt", "parts", "commit", "fetch_ranks", "fetch_bytes", "step_index", "step_index_digest")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    FETCH_RANKS_FIELD_NUMBER: _ClassVar[int]
    FETCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    STEP_INDEX_DIGEST_FIELD_NUMBER: _ClassVar[int]
    step: int
    world_size: int
    locations: _containers.RepeatedCompositeFieldContainer[PartLocation]
    attempt: str
    parts: _containers.RepeatedCompositeFieldContainer[RankParts]
    commit: str
    fetch_ranks: _containers.RepeatedScalarFieldContainer[int]
    fetch_bytes: int
    step_index: str
    step_index_digest: str
    def __init__(self, step: _Optional[int] = ..., world_size: _Optional[int] = ..., locations: _Optional[_Iterable[_Union[PartLocation, _Mapping]]] = ..., attempt: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[RankParts, _Mapping]]] = ..., commit: _Optional[str] = ..., fetch_ranks: _Optional[_Iterable[int]] = ..., fetch_bytes: _Optional[int] = ..., step_index: _Optional[str] = ..., step_index_digest: _Optional[str] = ...) -> None: ...

class WaitStepRequest(_message.Message):
    __slots__ = ("job", "step", "tier", "timeout_s")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    tier: Tier
    timeout_s: float
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class WaitStepResponse(_message.Message):
    __slots__ = ("done", "attempt", "world_size")
    DONE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    done: bool
    attempt: str
    world_size: int
    def __init__(self, done: _Optional[bool] = ..., attempt: _Optional[str] = ..., world_size: _Optional[int] = ...) -> None: ...

class ReportCorruptRequest(_message.Message):
    __slots__ = ("job", "step", "rank", "tier", "detail")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    rank: int
    tier: Tier
    detail: str
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class LoadingRequest(_message.Message):
    __slots__ = ("lease", "ttl_s", "done")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    lease: str
    ttl_s: float
    done: bool
    def __init__(self, lease: _Optional[str] = ..., ttl_s: _Optional[float] = ..., done: _Optional[bool] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("job", "step", "pinned")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    pinned: bool
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., pinned: _Optional[bool] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("changed", "pinned")
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    changed: bool
    pinned: bool
    def __init__(self, changed: _Optional[bool] = ..., pinned: _Optional[bool] = ...) -> None: ...

class DeleteStepRequest(_message.Message):
    __slots__ = ("job", "step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class DeleteStepResponse(_message.Message):
    __slots__ = ("parts_deleted", "bytes_deleted", "tiers")
    PARTS_DELETED_FIELD_NUMBER: _ClassVar[int]
    BYTES_DELETED_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    parts_deleted: int
    bytes_deleted: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, parts_deleted: _Optional[int] = ..., bytes_deleted: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("job", "wait", "timeout_s", "newest")
    JOB_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    NEWEST_FIELD_NUMBER: _ClassVar[int]
    job: str
    wait: bool
    timeout_s: float
    newest: bool
    def __init__(self, job: _Optional[str] = ..., wait: _Optional[bool] = ..., timeout_s: _Optional[float] = ..., newest: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("pending", "failed")
    PENDING_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    pending: int
    failed: int
    def __init__(self, pending: _Optional[int] = ..., failed: _Optional[int] = ...) -> None: ...

class GcRequest(_message.Message):
    __slots__ = ("dry_run",)
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    dry_run: bool
    def __init__(self, dry_run: _Optional[bool] = ...) -> None: ...

class GcAction(_message.Message):
    __slots__ = ("job", "step", "tier", "reason", "bytes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    tier: Tier
    reason: str
    bytes: int
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., reason: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class GcResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: _containers.RepeatedCompositeFieldContainer[GcAction]
    def __init__(self, deleted: _Optional[_Iterable[_Union[GcAction, _Mapping]]] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("job", "step", "latest", "ranks")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    latest: bool
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., latest: _Optional[bool] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("step", "parts")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    step: int
    parts: int
    def __init__(self, step: _Optional[int] = ..., parts: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStatus(_message.Message):
    __slots__ = ("tier", "dir", "enabled", "reachable", "used_bytes", "free_bytes", "checkpoints", "state", "last_error", "last_error_time", "unbounded", "warnings")
    TIER_FIELD_NUMBER: _ClassVar[int]
    DIR_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_TIME_FIELD_NUMBER: _ClassVar[int]
    UNBOUNDED_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    dir: str
    enabled: bool
    reachable: bool
    used_bytes: int
    free_bytes: int
    checkpoints: int
    state: str
    last_error: str
    last_error_time: float
    unbounded: bool
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., dir: _Optional[str] = ..., enabled: _Optional[bool] = ..., reachable: _Optional[bool] = ..., used_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., checkpoints: _Optional[int] = ..., state: _Optional[str] = ..., last_error: _Optional[str] = ..., last_error_time: _Optional[float] = ..., unbounded: _Optional[bool] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class SessionStatus(_message.Message):
    __slots__ = ("session_id", "job", "rank", "pid", "arena_bytes", "saves_in_flight")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    SAVES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    job: str
    rank: int
    pid: int
    arena_bytes: int
    saves_in_flight: int
    def __init__(self, session_id: _Optional[str] = ..., job: _Optional[str] = ..., rank: _Optional[int] = ..., pid: _Optional[int] = ..., arena_bytes: _Optional[int] = ..., saves_in_flight: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("version", "pid", "uptime_s", "socket", "arena_budget_bytes", "arena_used_bytes", "sessions", "tiers", "drain_queue", "metrics_url", "memory_parts", "memory_bytes", "jobs")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    ARENA_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARENA_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_QUEUE_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PARTS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    version: str
    pid: int
    uptime_s: float
    socket: str
    arena_budget_bytes: int
    arena_used_bytes: int
    sessions: _containers.RepeatedCompositeFieldContainer[SessionStatus]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStatus]
    drain_queue: int
    metrics_url: str
    memory_parts: int
    memory_bytes: int
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    def __init__(self, version: _Optional[str] = ..., pid: _Optional[int] = ..., uptime_s: _Optional[float] = ..., socket: _Optional[str] = ..., arena_budget_bytes: _Optional[int] = ..., arena_used_bytes: _Optional[int] = ..., sessions: _Optional[_Iterable[_Union[SessionStatus, _Mapping]]] = ..., tiers: _Optional[_Iterable[_Union[TierStatus, _Mapping]]] = ..., drain_queue: _Optional[int] = ..., metrics_url: _Optional[str] = ..., memory_parts: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ...) -> None: ...

class DrainState(_message.Message):
    __slots__ = ("state", "queued_parts", "queued_bytes", "last_error", "last_error_time", "consecutive_failures")
    STATE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PARTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_TIME_FIELD_NUMBER: _ClassVar[int]
    CONSECUTIVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    state: str
    queued_parts: int
    queued_bytes: int
    last_error: str
    last_error_time: float
    consecutive_failures: int
    def __init__(self, state: _Optional[str] = ..., queued_parts: _Optional[int] = ..., queued_bytes: _Optional[int] = ..., last_error: _Optional[str] = ..., last_error_time: _Optional[float] = ..., consecutive_failures: _Optional[int] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job", "checkpoints", "latest_step", "has_latest", "last_commit_time", "local_bytes", "shared_bytes", "sessions", "drain", "peers")
    JOB_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    LATEST_STEP_FIELD_NUMBER: _ClassVar[int]
    HAS_LATEST_FIELD_NUMBER: _ClassVar[int]
    LAST_COMMIT_TIME_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    job: str
    checkpoints: int
    latest_step: int
    has_latest: bool
    last_commit_time: float
    local_bytes: int
    shared_bytes: int
    sessions: int
    drain: DrainState
    peers: PeerState
    def __init__(self, job: _Optional[str] = ..., checkpoints: _Optional[int] = ..., latest_step: _Optional[int] = ..., has_latest: _Optional[bool] = ..., last_commit_time: _Optional[float] = ..., local_bytes: _Optional[int] = ..., shared_bytes: _Optional[int] = ..., sessions: _Optional[int] = ..., drain: _Optional[_Union[DrainState, _Mapping]] = ..., peers: _Optional[_Union[PeerState, _Mapping]] = ...) -> None: ...

class PeerState(_message.Message):
    __slots__ = ("peers", "replicated_step", "has_replicated", "lag_s", "queued_parts")
    PEERS_FIELD_NUMBER: _ClassVar[int]
    REPLICATED_STEP_FIELD_NUMBER: _ClassVar[int]
    HAS_REPLICATED_FIELD_NUMBER: _ClassVar[int]
    LAG_S_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PARTS_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedCompositeFieldContainer[PeerHealth]
    replicated_step: int
    has_replicated: bool
    lag_s: float
    queued_parts: int
    def __init__(self, peers: _Optional[_Iterable[_Union[PeerHealth, _Mapping]]] = ..., replicated_step: _Optional[int] = ..., has_replicated: _Optional[bool] = ..., lag_s: _Optional[float] = ..., queued_parts: _Optional[int] = ...) -> None: ...

class PeerHealth(_message.Message):
    __slots__ = ("address", "state", "last_error", "last_ok_time")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_OK_TIME_FIELD_NUMBER: _ClassVar[int]
    address: str
    state: str
    last_error: str
    last_ok_time: float
    def __init__(self, address: _Optional[str] = ..., state: _Optional[str] = ..., last_error: _Optional[str] = ..., last_ok_time: _Optional[float] = ...) -> None: ...

class JoinPeersRequest(_message.Message):
    __slots__ = ("session_id", "nodes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_id: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class JoinPeersResponse(_message.Message):
    __slots__ = ("peers",)
    PEERS_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, peers: _Optional[_Iterable[str]] = ...) -> None: ...

class ReplicaHeader(_message.Message):
    __slots__ = ("job", "step", "rank", "sender", "manifest", "digest", "chunks_only")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_ONLY_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    rank: int
    sender: str
    manifest: bytes
    digest: str
    chunks_only: bool
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., sender: _Optional[str] = ..., manifest: _Optional[bytes] = ..., digest: _Optional[str] = ..., chunks_only: _Optional[bool] = ...) -> None: ...

class ChunksQuery(_message.Message):
    __slots__ = ("job", "store", "names")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    job: str
    store: str
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job: _Optional[str] = ..., store: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class ChunksMissing(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class FileData(_message.Message):
    __slots__ = ("name", "offset", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReplicaChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ReplicaHeader
    data: FileData
    def __init__(self, header: _Optional[_Union[ReplicaHeader, _Mapping]] = ..., data: _Optional[_Union[FileData, _Mapping]] = ...) -> None: ...

class PutReplicaResponse(_message.Message):
    __slots__ = ("kept_in",)
    KEPT_IN_FIELD_NUMBER: _ClassVar[int]
    kept_in: str
    def __init__(self, kept_in: _Optional[str] = ...) -> None: ...

class HoldingsRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class HeldPart(_message.Message):
    __slots__ = ("step", "rank", "world_size", "attempt", "digest", "bytes", "created", "replica", "metrics", "in_memory")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    IN_MEMORY_FIELD_NUMBER: _ClassVar[int]
    step: int
    rank: int
    world_size: int
    attempt: str
    digest: str
    bytes: int
    created: float
    replica: bool
    metrics: _containers.ScalarMap[str, float]
    in_memory: bool
    def __init__(self, step: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., attempt: _Optional[str] = ..., digest: _Optional[str] = ..., bytes: _Optional[int] = ..., created: _Optional[float] = ..., replica: _Optional[bool] = ..., metrics: _Optional[_Mapping[str, float]] = ..., in_memory: _Optional[bool] = ...) -> None: ...

class HoldingsResponse(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[HeldPart]
    def __init__(self, parts: _Optional[_Iterable[_Union[HeldPart, _Mapping]]] = ...) -> None: ...

class PeerPart(_message.Message):
    __slots__ = ("job", "step", "rank", "digest")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    rank: int
    digest: str
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class PeerManifest(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: bytes
    def __init__(self, manifest: _Optional[bytes] = ...) -> None: ...

class PeerFileRequest(_message.Message):
    __slots__ = ("part", "name")
    PART_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    part: PeerPart
    name: str
    def __init__(self, part: _Optional[_Union[PeerPart, _Mapping]] = ..., name: _Optional[str] = ...) -> None: ...
