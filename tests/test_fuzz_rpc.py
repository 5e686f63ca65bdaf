"""Every RPC, driven with random and boundary fields: a clear error or a correct answer, never more.

Requests are generated from each method's protobuf descriptor, so a field
added to the contract is fuzzed without touching this file. Identifiers are
sometimes real (a session and a save this module opened, a job with a
committed checkpoint), so the domain code is reached, not only the checks at
its door. Properties: no ``INTERNAL`` or ``UNKNOWN`` status ever; the daemon
still answers; afterwards no temporaries, descriptors or ``/dev/shm`` files
are left behind.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from ckptstage.client import Client
from ckptstage.client.rpc import Connection
from ckptstage.protos import layout
from ckptstage.protos.v1 import ckptstage_pb2 as pb
from conftest import DaemonProc
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import wait_until

SERVICE = pb.DESCRIPTOR.services_by_name["Checkpointer"]
METHODS = [m.name for m in SERVICE.methods]
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
JOB = "fuzzjob"
pytestmark = pytest.mark.slow


class Known:
    """Real identifiers the strategies may pick, so requests reach past validation."""

    session_ids: list[str] = []
    save_ids: list[str] = []


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = DaemonProc(tmp_path_factory.mktemp("fuzz") / "node", **{"arena.max_bytes": "64MiB"}).start()
    with Client(JOB, socket=d.socket) as c:
        c.save(3, {"w": torch.arange(1000.0)}).wait("local", timeout=30)
    yield d
    d.stop()


def open_known(d: DaemonProc, step: int) -> None:
    """A live session with an arena and a save in flight, for the strategies to aim at."""
    with d.connection() as conn:
        sid = conn.call("OpenSession", pb.OpenSessionRequest(job=JOB, rank=0, world_size=1)).session_id
        conn.call("EnsureArena", pb.EnsureArenaRequest(session_id=sid, want_bytes=1 << 20))
        manifest = layout.encode_manifest({
            "format": layout.FORMAT, "job": JOB, "step": step, "rank": 0, "world_size": 1, "data_start": 64,
            "tensors": [{"name": "t", "dtype": "uint8", "shape": [16], "offset": 64, "nbytes": 16}],
            "tree": {"d": [[{"s": "t"}, {"T": 0}]]}})
        save = conn.call("BeginSave", pb.BeginSaveRequest(session_id=sid, step=step, manifest_json=manifest,
                                                          data_bytes=80))
    Known.session_ids, Known.save_ids = [sid], [save.save_id]


_INT_BOUNDS = {FieldDescriptor.TYPE_UINT32: 2**32 - 1, FieldDescriptor.TYPE_UINT64: 2**64 - 1,
               FieldDescriptor.TYPE_INT32: 2**31 - 1, FieldDescriptor.TYPE_INT64: 2**63 - 1}


def _ints(field: FieldDescriptor) -> st.SearchStrategy[int]:
    hi = _INT_BOUNDS[field.type]
    lo = 0 if field.type in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64) else -hi - 1
    return st.one_of(st.sampled_from([lo, 0, 1, 3, 9, 4096, 1 << 20, hi]), st.integers(lo, hi))


def _strings(field: FieldDescriptor) -> st.SearchStrategy[str]:
    name = field.name
    picks: list[str] = ["", "x", "../../etc", "a" * 300, "\x00", "é" * 50]
    real = {"job": [JOB], "session_id": Known.session_ids, "save_id": Known.save_ids}.get(name, [])
    if real:  # half the time a real one: the request then reaches the domain code
        return st.one_of(st.sampled_from(real), st.sampled_from(real), st.sampled_from(picks), st.text(max_size=40))
    return st.one_of(st.sampled_from(picks), st.text(max_size=40))


def _bytes(field: FieldDescriptor) -> st.SearchStrategy[bytes]:
    nested = b"[" * 5000 + b"]" * 5000
    hostile = [nested, b'{"a":' * 3000 + b"1" + b"}" * 3000, b'{"format":"ckptstage/1"}', b"null", b"{}", b""]
    return st.one_of(st.sampled_from(hostile), st.sampled_from(hostile), st.binary(max_size=200))


def _field(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    if field.type in _INT_BOUNDS:
        return _ints(field)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.sampled_from([0.0, 0.01, 0.1, -1.0, float("nan"), float("inf"), 1e300])
    if field.type == FieldDescriptor.TYPE_STRING:
        return _strings(field)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return _bytes(field)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return st.integers(-1, len(field.enum_type.values) + 1)
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return _message(field.message_type)
    raise AssertionError(f"no strategy for {field.full_name}")


def _message(desc: Any) -> st.SearchStrategy[dict[str, Any]]:
    fields = {}
    for f in desc.fields:
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            fields[f.name] = st.dictionaries(st.text(max_size=10), st.floats(allow_nan=True), max_size=3)
        elif f.is_repeated:
            fields[f.name] = st.lists(_field(f), max_size=3)
        else:
            fields[f.name] = _field(f)
    # Every field set: unset ones are zero anyway, which the boundary values above include.
    return st.fixed_dictionaries(fields)


def _request(method: str) -> st.SearchStrategy[Any]:
    desc = SERVICE.methods_by_name[method].input_type
    cls = getattr(pb, desc.name)
    return _message(desc).map(lambda fields: _build(cls, fields))


def _build(cls: Any, fields: dict[str, Any]) -> Any:
    msg = cls()
    for name, value in fields.items():
        field = msg.DESCRIPTOR.fields_by_name[name]
        if isinstance(value, dict) and field.message_type is not None and not field.message_type.GetOptions().map_entry:
            getattr(msg, name).CopyFrom(_build(getattr(pb, field.message_type.name), value))
        elif isinstance(value, dict):
            getattr(msg, name).update(value)
        elif isinstance(value, list):
            target = getattr(msg, name)
            for v in value:
                target.add().CopyFrom(_build(getattr(pb, field.message_type.name), v)) if isinstance(v, dict) \
                    else target.append(v)
        else:
            setattr(msg, name, value)
    return msg


@pytest.mark.parametrize("method", METHODS)
def test_every_rpc_answers_random_input_with_a_clear_status(daemon: DaemonProc, method: str) -> None:
    open_known(daemon, 100 + METHODS.index(method))
    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.data_too_large])
    @given(request=_request(method))
    def answers(request: Any) -> None:
        call(daemon, method, request)

    answers()


def call(daemon: DaemonProc, method: str, request: Any) -> None:
    with Connection(daemon.socket) as conn:
        stub = getattr(conn.stub, method)
        try:
            if method == "Attach":
                stream = stub(request, timeout=1.0)
                try:
                    next(stream)
                finally:
                    stream.cancel()
            else:
                stub(request, timeout=2.0)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                return  # our own deadline or cancel, not the daemon's answer
            assert e.code() not in NEVER, f"{method}({request}) -> {e.code().name}: {e.details()}"
        except StopIteration:
            pass
        conn.status(timeout=5)  # still answering


def test_after_the_fuzz_nothing_is_left_behind(daemon: DaemonProc) -> None:
    # Runs after the property above (file order): close what it opened, then look for leftovers.
    assert daemon.proc is not None
    with daemon.connection() as conn:
        for sid in [s.session_id for s in conn.status().sessions]:
            conn.call("CloseSession", pb.CloseSessionRequest(session_id=sid))
        wait_until(lambda: not conn.status().sessions and conn.status().arena_used_bytes == 0, 30,
                   "every session closed and the arena budget free")
    wait_until(lambda: not list(daemon.local.glob(".tmp/*/*")), 10, "no temporaries on the local tier")
    assert not list(Path("/dev/shm").glob(f"ckptstage-{daemon.proc.pid}-*"))
    fds = len(list(Path(f"/proc/{daemon.proc.pid}/fd").iterdir()))
    assert fds < 64, f"the daemon holds {fds} descriptors after the fuzz"
    with Client(JOB, socket=daemon.socket) as c:
        assert torch.equal(c.load(3)["w"], torch.arange(1000.0))
