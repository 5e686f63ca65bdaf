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
from ckptstage.client import tree
from ckptstage.daemon.save import manifest_check
from ckptstage.daemon.errors import InvalidRequest
from ckptstage.protos import layout
from ckptstage.protos.v1 import ckptstage_pb2 as pb
from conftest import DaemonProc
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import begin_raw_save, wait_until

SERVICE = pb.DESCRIPTOR.services_by_name["Checkpointer"]
METHODS = [m.name for m in SERVICE.methods]
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
JOB = "fuzzjob"
KEPT_JOB = "fuzz-untouched"
pytestmark = pytest.mark.slow


class Known:
    """Real identifiers the strategies may pick, so requests reach past validation."""

    session_ids: list[str] = []
    save_ids: list[str] = []
    baseline_fds = 0  # the daemon's descriptors before the fuzz, once it is warm


def fd_count(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = DaemonProc(tmp_path_factory.mktemp("fuzz") / "node", **{"arena.max_bytes": "64MiB"}).start()
    with Client(JOB, socket=d.socket) as c:
        c.save(3, {"w": torch.arange(1000.0)}).wait("local", timeout=30)
    # A job the fuzz never names: whatever it does to JOB (DeleteStep may delete step 3), this stays.
    with Client(KEPT_JOB, socket=d.socket) as c:
        c.save(3, {"w": torch.arange(1000.0)}).wait("local", timeout=30)
    assert d.proc is not None
    wait_until(lambda: not d.connection().status().sessions, 10, "the warm-up session to close")
    Known.baseline_fds = fd_count(d.proc.pid)
    yield d
    d.stop()


def open_known(d: DaemonProc, step: int) -> None:
    """A live session with an arena and a save in flight, for the strategies to aim at."""
    with d.connection() as conn:
        sid, save_id = begin_raw_save(conn, JOB, step)
    Known.session_ids, Known.save_ids = [sid], [save_id]


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
    return st.one_of(st.sampled_from(hostile), st.sampled_from(hostile), st.binary(max_size=200),
                     mutated_manifests().map(layout.encode_manifest))


# --- manifests: valid ones with one field made hostile ----------------------------------------------

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=8)
EDGE_INTS = st.sampled_from([-1, 0, 1, 15, 16, 63, 64, 80, 2**31, 2**53 + 1, 2**63, 2**64 - 1, 2**64, 10**30])
TREE_NODES = st.recursive(
    st.one_of(st.integers(-2, 3).map(lambda i: {"T": i}), st.just({"N": 0}), st.booleans().map(lambda b: {"b": b}),
              st.integers().map(lambda i: {"i": i}), st.sampled_from(["0x1p+0", "nan", "-inf", "zz"]).map(
                  lambda f: {"f": f}), st.text(max_size=6).map(lambda x: {"s": x}),
              st.sampled_from(["", "AAEC", "!!"]).map(lambda y: {"y": y}), st.lists(EDGE_INTS, max_size=3).map(
                  lambda n: {"S": n}), JSON),
    lambda inner: st.one_of(st.lists(inner, max_size=3).map(lambda v: {"l": v}),
                            st.lists(st.tuples(st.text(max_size=4).map(lambda k: {"s": k}), inner).map(list),
                                     max_size=3).map(lambda v: {"d": v}),
                            st.lists(st.tuples(JSON, inner).map(list), max_size=2).map(lambda v: {"o": v})),
    max_leaves=10)
# Where in a valid manifest a hostile value goes.
SPOTS: list[tuple[Any, ...]] = [("format",), ("job",), ("step",), ("rank",), ("world_size",), ("data_start",),
                                ("tensors",), ("tensors", 0), ("tensors", 0, "name"), ("tensors", 0, "dtype"),
                                ("tensors", 0, "shape"), ("tensors", 0, "shape", 0), ("tensors", 1, "shape", 1),
                                ("tensors", 0, "offset"), ("tensors", 1, "nbytes"), ("tree",), ("tree", "d", 0, 1),
                                ("tree", "d", 1, 1, "l", 0), ("tree", "d", 0, 0), ("tree", "d", 1)]


def valid_manifest(step: int = 1) -> dict[str, Any]:
    """A manifest a real session of JOB may save at ``step`` with data_bytes=96."""
    return {"format": layout.FORMAT, "job": JOB, "step": step, "rank": 0, "world_size": 1, "data_start": 64,
            "tensors": [{"name": "a", "dtype": "float32", "shape": [4], "offset": 64, "nbytes": 16},
                        {"name": "b", "dtype": "int8", "shape": [4, 4], "offset": 80, "nbytes": 16}],
            "tree": {"d": [[{"s": "a"}, {"T": 0}], [{"s": "b"}, {"l": [{"T": 1}, {"i": 5}, {"f": "0x1p+0"}]}]]}}


@st.composite
def mutated_manifests(draw: st.DrawFn) -> dict[str, Any]:
    manifest = valid_manifest(draw(st.sampled_from([1, 2, 101, 2**40])))
    for _ in range(draw(st.integers(0, 2))):
        *parents, last = draw(st.sampled_from(SPOTS))
        value = draw(st.one_of(EDGE_INTS, JSON, TREE_NODES))
        node: Any = manifest
        try:  # an earlier mutation may have replaced the way there
            for key in parents:
                node = node[key]
            node[last]  # noqa: B018 - only where a value already is
            node[last] = value
        except (KeyError, IndexError, TypeError):
            pass
    return manifest


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


WAITS = {"WaitStep", "WaitSave", "Progress"}  # RPCs that wait for a step, a save or progress to come


@pytest.mark.parametrize("method", METHODS)
def test_every_rpc_answers_random_input_with_a_clear_status(daemon: DaemonProc, method: str) -> None:
    open_known(daemon, 100 + METHODS.index(method))
    # A wait for something random never comes: it would use its whole deadline each time. What is checked
    # is the status of an answer (refused input answers at once), so those waits get a short one.
    patient = 0.3 if method in WAITS else 1.0
    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.data_too_large])
    @given(request=_request(method), deadline=st.sampled_from([patient, patient, patient, 0.01]))
    def answers(request: Any, deadline: float) -> None:
        call(daemon, method, request, deadline)

    answers()


def call(daemon: DaemonProc, method: str, request: Any, deadline: float) -> None:
    with Connection(daemon.socket) as conn:
        stub = getattr(conn.stub, method)
        try:
            if method == "Attach":
                stream = stub(request, timeout=deadline)
                try:
                    next(stream)
                finally:
                    stream.cancel()
            else:
                stub(request, timeout=deadline)
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
        # What stays granted is the memory tier's (the newest committed part of each closed rank).
        wait_until(lambda: not (s := conn.status()).sessions and s.arena_used_bytes == s.memory_bytes, 30,
                   "every session closed and the arena budget free but for the memory tier")
        kept = conn.status().memory_parts
    wait_until(lambda: not list(daemon.local.glob(".tmp/*/*")), 10, "no temporaries on the local tier")
    assert not list(Path("/dev/shm").glob(f"ckptstage-{daemon.proc.pid}-*"))
    # Every session is closed and every save settled, so every data file and arena is closed: back to the
    # warm daemon's count. One gRPC connection may still be winding down (2 descriptors).
    pid = daemon.proc.pid
    # Two descriptors per part the memory tier keeps (its arena's, for handing over, and the mapping's).
    wait_until(lambda: fd_count(pid) <= Known.baseline_fds + 2 * kept + 2, 10,
               f"the daemon's descriptors back to {Known.baseline_fds} + {2 * kept} (now {fd_count(pid)})")
    with Client(KEPT_JOB, socket=daemon.socket) as c:
        assert torch.equal(c.load(3)["w"], torch.arange(1000.0))


# --- the manifest parser itself, in process (thousands of cases a second) ----------------------------


@settings(max_examples=1500, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(manifest=mutated_manifests(), data_bytes=st.one_of(st.just(96), EDGE_INTS))
def test_parse_manifest_refuses_clearly_or_accepts_what_a_client_can_load(manifest: Any, data_bytes: int) -> None:
    """A clear InvalidRequest, or a manifest whose tensors fit the data and whose tree rebuilds."""
    raw = layout.encode_manifest(manifest)
    try:
        spec = manifest_check.parse_manifest(raw, JOB, manifest.get("step") if isinstance(manifest.get("step"), int)
                                        else 1, 0, 1, data_bytes, {})
    except InvalidRequest as e:
        assert str(e) and "Traceback" not in str(e)
        return
    assert 0 <= data_bytes <= manifest_check.MAX_PART_BYTES
    entries = [layout.TensorEntry.from_json(t) for t in spec.manifest["tensors"]]
    layout.validate_tensor_table(entries, spec.manifest["data_start"], data_bytes)
    for t in entries:
        numel = 1
        for n in t.shape:
            numel *= n
        dtype = getattr(torch, t.dtype)
        assert numel * torch.empty(0, dtype=dtype).element_size() == t.nbytes
    rebuilt = tree.unflatten(spec.manifest["tree"], lambda i: torch.zeros(entries[i].shape))
    assert rebuilt is not None or spec.manifest["tree"] == {"N": 0}
