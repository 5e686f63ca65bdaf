"""Bad input gets a clear, typed error, and the daemon keeps serving (invariant 6).

Client-side checks (names, value types) must fail before anything reaches the
daemon; daemon-side checks are exercised with raw gRPC requests, the way a
buggy or hostile client would send them.
"""

from __future__ import annotations

import base64

import itertools
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ckptstage.client import (
    AlreadyCommitted,
    ArenaFull,
    Client,
    DaemonUnavailable,
    InvalidRequest,
)
from ckptstage.daemon.save import manifest_check
from ckptstage.protos import layout
from ckptstage.protos.v1 import ckptstage_pb2 as pb
from conftest import DaemonProc
from support import wait_until

_steps = itertools.count(1000)


def assert_serves(daemon: Any, job: str = "healthy") -> None:
    """A normal save and load still work on this daemon."""
    step = next(_steps)
    w = torch.arange(257, dtype=torch.float32) * step
    with Client(job, socket=daemon.socket) as c:
        c.save(step, {"w": w, "step": step}).wait("local", timeout=30)
        loaded = c.load(step)
    assert loaded["step"] == step and torch.equal(loaded["w"], w)


def temporaries(local: Path) -> list[Path]:
    """What the daemon's temporaries hold once retention's deletions in flight are done: a deletion renames a
    step's part into ``del.*`` there, then removes it (the previous case's save may start one just now)."""
    wait_until(lambda: not any(p.name.startswith("del.") for p in local.glob(f"{layout.TMP_DIR}/*/*")), 30,
               "retention's deletions in flight")
    return [p for p in local.glob(f"{layout.TMP_DIR}/*/*")]


# --- job names -----------------------------------------------------------------------------


@pytest.mark.parametrize("job", ["a/b", "..", "../escape", "a/../b", "", "x" * 129, "/abs", ".hidden", "a..b",
                                 "sp ace", "nul\x00"])
def test_bad_job_name_is_refused_naming_it(daemon, job):
    with pytest.raises(InvalidRequest) as info:
        Client(job, socket=daemon.socket)
    assert isinstance(info.value, ValueError)
    assert repr(job) in str(info.value)

    # The daemon checks too: a raw OpenSession with the same name is refused.
    with daemon.connection() as conn:
        with pytest.raises(InvalidRequest, match="INVALID_ARGUMENT") as raw:
            conn.call("OpenSession", pb.OpenSessionRequest(job=job, rank=0, world_size=1, pid=os.getpid()))
        assert repr(job) in str(raw.value)
        assert list(conn.status().sessions) == []
    assert {p.name for p in daemon.local.iterdir()} <= {".state", layout.TMP_DIR}
    assert_serves(daemon)


def test_longest_valid_job_name_is_accepted(daemon):
    assert_serves(daemon, "j" * 128)


def test_bad_rank_and_step_are_refused(daemon):
    with pytest.raises(InvalidRequest, match="rank 2"):
        Client("ranks", socket=daemon.socket, rank=2, world_size=2)
    with Client("ranks", socket=daemon.socket) as c:
        for step in (-1, 10**12, True, 1.5):
            with pytest.raises(InvalidRequest, match=f"invalid step {step!r}"):
                c.save(step, {"w": torch.ones(2)})
    assert_serves(daemon)


# --- unsupported values ---------------------------------------------------------------------------


class Opaque:
    pass


BAD_VALUES = [
    ({"s": {1, Opaque()}}, "state['s']<item", "Opaque"),
    ({"model": {"layer": [torch.ones(2), Opaque()]}}, "state['model']['layer'][1]", "Opaque"),
    ({"a": [1, {"f": lambda: 1}]}, "state['a'][1]['f']", "function"),
    ({"emb": torch.eye(3).to_sparse()}, "state['emb']", "sparse"),
    ({"k": {(1, 2): torch.ones(1)}}, "state['k']", "tuple"),
    ({"optim": {"state": {0: {"m": torch.ones(2), "f": frozenset({1j})}}}}, "state['optim']['state'][0]['f']",
     "complex"),
    ({"arr": bytearray(b"x")}, "state['arr']", "bytearray"),
]


@pytest.mark.parametrize("state,path,what", BAD_VALUES, ids=[v[2] for v in BAD_VALUES])
def test_unsupported_value_is_a_type_error_naming_its_key_path_and_sends_nothing(daemon, state, path, what):
    with Client("types", socket=daemon.socket) as c:
        with pytest.raises(TypeError) as info:
            c.save(1, state)
        assert path in str(info.value) and what in str(info.value)
        with daemon.connection() as conn:
            [session] = conn.status().sessions
        assert session.saves_in_flight == 0 and session.arena_bytes == 0  # not even an arena was asked for
        assert c.list() == []
        # Step 1 was never begun: saving it now works.
        c.save(1, {"w": torch.ones(3)}).wait("local", timeout=30)
        assert torch.equal(c.load(1)["w"], torch.ones(3))
    assert temporaries(daemon.local) == []


def test_reference_cycle_is_a_type_error(daemon):
    loop: list[Any] = [torch.ones(1)]
    loop.append(loop)
    with Client("cycle", socket=daemon.socket) as c, \
            pytest.raises(TypeError, match=r"state\['x'\]\[1\] contains itself"):
        c.save(1, {"x": loop})
    assert_serves(daemon)


def nested(depth: int) -> Any:
    state: Any = {"w": torch.ones(2)}
    for _ in range(depth):
        state = {"x": state}
    return state


TOO_BIG = [
    ("deep", nested(500), "nested more than 100 containers deep"),
    ("big-str", {"cfg": {"blob": "x" * (layout.MAX_PLAIN_VALUE_BYTES + 1)}},
     rf"state\['cfg'\]\['blob'\] is a str/bytes value of {layout.MAX_PLAIN_VALUE_BYTES + 1} bytes, over the "
     rf"limit of {layout.MAX_PLAIN_VALUE_BYTES} bytes \(16 MiB\)"),
    ("big-bytes", {"b": b"\0" * (layout.MAX_PLAIN_VALUE_BYTES + 1)},
     rf"state\['b'\] is a str/bytes value of {layout.MAX_PLAIN_VALUE_BYTES + 1} bytes.*store it as a tensor"),
]


@pytest.mark.parametrize("value", [b"\xff" * layout.MAX_PLAIN_VALUE_BYTES, "\u00e9" * (layout.MAX_PLAIN_VALUE_BYTES // 2)],
                         ids=["bytes", "str"])
def test_a_plain_value_of_exactly_the_limit_is_saved_and_loaded(daemon, value):
    # The client counts the value's own bytes; the daemon used to count a bytes value's base64 form, padding
    # included, and refused the 16 MiB the client and the README accept.
    with Client("at-limit", socket=daemon.socket) as c:
        c.save(1, {"blob": value, "w": torch.ones(2)}).wait("local", timeout=60)
        assert c.load(1)["blob"] == value


@pytest.mark.parametrize("state,pattern", [t[1:] for t in TOO_BIG], ids=[t[0] for t in TOO_BIG])
def test_a_state_beyond_the_limits_is_refused_naming_the_key_and_the_limit(daemon, state, pattern):
    # 500 levels of nesting used to be a RecursionError, a 300 MiB string a gRPC message-size error.
    with Client("limits", socket=daemon.socket) as c:
        with pytest.raises(ValueError, match=pattern):
            c.save(1, state)
        assert c.list() == []
        c.save(1, nested(90)).wait("local", timeout=30)  # just inside the limit: saved and loaded
        loaded = c.load(1)
        for _ in range(90):
            loaded = loaded["x"]
        assert torch.equal(loaded["w"], torch.ones(2))
    assert temporaries(daemon.local) == []


# --- resources and conflicts ---------------------------------------------------------------


def test_arena_budget_exhausted_is_arena_full_naming_sizes(daemon_factory):
    d = daemon_factory(**{"arena.max_bytes": "4MiB", "arena.min_session_bytes": "1MiB",
                          "persist.chunk_bytes": "1MiB"}).start()
    hog = Client("hog", socket=d.socket, arena_bytes=64 << 20)  # takes the whole budget
    try:
        with d.connection() as conn:
            assert conn.status().arena_used_bytes == 4 << 20
        # Asking for an arena up front fails in the constructor, and leaves no session behind.
        with pytest.raises(ArenaFull, match=str(4 << 20)):
            Client("greedy", socket=d.socket, arena_bytes=8 << 20)
        with d.connection() as conn:
            assert [s.job for s in conn.status().sessions] == ["hog"]
        with Client("starved", socket=d.socket) as c:
            h = c.save(1, {"w": torch.ones(3 << 20)})
            with pytest.raises(ArenaFull) as info:
                h.wait("local", timeout=30)
            msg = str(info.value)
            assert str(1 << 20) in msg          # one chunk is the least it needs
            assert str(4 << 20) in msg          # the budget
            assert "[arena] max_bytes" in msg   # what to change
            assert c.latest() is None and c.list() == []
            assert temporaries(d.local) == []

            hog.close()  # frees its arena: the same client can now save
            c.save(1, {"w": torch.ones(3 << 20)}).wait("local", timeout=30)
            assert torch.equal(c.load(1)["w"], torch.ones(3 << 20))
    finally:
        hog.close()
    assert_serves(d)


def test_no_daemon_on_the_socket_is_daemon_unavailable_naming_it(tmp_path):
    sock = tmp_path / "nobody-here.sock"
    with pytest.raises(DaemonUnavailable) as info:
        Client("orphan", socket=sock, connect_timeout=0.5)
    assert str(sock) in str(info.value) and "check that the daemon runs" in str(info.value)
    assert isinstance(info.value, ConnectionError)

    # A stale socket file nobody listens on reads the same.
    import socket as socketlib

    stale = tmp_path / "stale.sock"
    s = socketlib.socket(socketlib.AF_UNIX)
    s.bind(str(stale))
    s.close()
    with pytest.raises(DaemonUnavailable, match=str(stale)):
        Client("orphan", socket=stale, connect_timeout=0)


def test_a_client_waits_for_a_daemon_that_is_starting(daemon_factory, caplog):
    # The job prologue starts the daemon a moment after the trainer: the client waits (one log line) and works.
    d = daemon_factory("late")
    starter = threading.Timer(1.5, d.start, kwargs={"wait": False})
    starter.start()
    try:
        with caplog.at_level(logging.WARNING, logger="ckptstage.client.rpc"):
            with Client("late-job", socket=d.socket, connect_timeout=30) as c:
                c.save(1, {"w": torch.ones(4)}).wait("local", timeout=30)
    finally:
        starter.join()
    waits = [r.getMessage() for r in caplog.records if "waiting up to 30s" in r.getMessage()]
    assert len(waits) == 1 and str(d.socket) in waits[0], caplog.text


def test_socket_from_the_environment(daemon, monkeypatch):
    monkeypatch.setenv("CKPTSTAGE_SOCKET", str(daemon.socket))
    with Client("envsock") as c:
        c.save(1, {"w": torch.ones(2)}).wait("local", timeout=30)
        assert c.latest() == 1


def test_resaving_a_committed_or_in_flight_step_is_already_committed(daemon):
    first = {"w": torch.full((1000,), 1.0)}
    with Client("dup", socket=daemon.socket) as c:
        c.save(1, first).wait("local", timeout=30)
        with pytest.raises(AlreadyCommitted, match="step 1 of job 'dup'"):
            c.save(1, {"w": torch.full((1000,), 2.0)}).wait("local", timeout=30)
        assert torch.equal(c.load(1)["w"], first["w"])

        # Twice in a row without waiting: the second is refused, the first commits.
        h1 = c.save(2, {"w": torch.full((1000,), 3.0)})
        h2 = c.save(2, {"w": torch.full((1000,), 4.0)})
        h1.wait("local", timeout=30)
        with pytest.raises(AlreadyCommitted):
            h2.wait("local", timeout=30)
        assert torch.equal(c.load(2)["w"], torch.full((1000,), 3.0))
        assert [i.step for i in c.list()] == [1, 2]
    assert_serves(daemon)


# --- validation at the daemon boundary (raw gRPC) -------------------------------------------------


def _raw_session(conn: Any, job: str) -> str:
    resp = conn.call("OpenSession", pb.OpenSessionRequest(job=job, rank=0, world_size=1, pid=os.getpid()))
    conn.call("EnsureArena", pb.EnsureArenaRequest(session_id=resp.session_id, want_bytes=1 << 20))
    return resp.session_id


def _manifest(job: str, step: int, tensors: list[dict[str, Any]], data_start: int = 64) -> bytes:
    return layout.encode_manifest({
        "format": layout.FORMAT, "job": job, "step": step, "rank": 0, "world_size": 1, "data_start": data_start,
        "tensors": tensors, "tree": {"d": [[{"s": t["name"]}, {"T": i}] for i, t in enumerate(tensors)]}})


def _tensor(name: str, offset: int, nbytes: int) -> dict[str, Any]:
    return {"name": name, "dtype": "uint8", "shape": [max(nbytes, 0)], "offset": offset, "nbytes": nbytes}


BAD_TABLES = [
    ("overlap", [_tensor("first", 64, 32), _tensor("second", 80, 32)], 256, "'second'.*overlaps 'first'"),
    ("past-end", [_tensor("first", 64, 32), _tensor("tail", 96, 200)], 256, "'tail' ends at 296.*256"),
    ("in-header", [_tensor("early", 8, 16)], 256, "'early'.*overlaps '<header>'"),
    ("negative-size", [_tensor("neg", 128, -64), _tensor("after", 80, 16)], 256,
     r"tensors\[0\] \('neg'\)\.nbytes = -64 is out of range: an int in \[0, 256\]"),
    ("negative-offset", [_tensor("before", -32, 16)], 256,
     r"tensors\[0\] \('before'\)\.offset = -32 is out of range: an int in \[0, 256\]"),
]


@pytest.mark.parametrize("label,tensors,data_bytes,pattern", BAD_TABLES, ids=[b[0] for b in BAD_TABLES])
def test_begin_save_rejects_a_bad_tensor_table_naming_the_tensor(daemon, label, tensors, data_bytes, pattern):
    with daemon.connection() as conn:
        sid = _raw_session(conn, "raw")
        with pytest.raises(InvalidRequest, match="INVALID_ARGUMENT") as info:
            conn.call("BeginSave", pb.BeginSaveRequest(session_id=sid, step=1, manifest_json=_manifest(
                "raw", 1, tensors), data_bytes=data_bytes))
        assert info.match(pattern)
        [session] = conn.status().sessions
        assert session.saves_in_flight == 0
        conn.call("CloseSession", pb.CloseSessionRequest(session_id=sid))
        assert conn.status().arena_used_bytes == 0
    assert temporaries(daemon.local) == []
    assert_serves(daemon, "raw")


def test_begin_save_rejects_a_manifest_for_another_job_or_step(daemon):
    good = [_tensor("t", 64, 16)]
    with daemon.connection() as conn:
        sid = _raw_session(conn, "mine")
        cases = [(b"not json", 80, "not valid JSON"),
                 (_manifest("other", 1, good), 80, "job='other'"),
                 (_manifest("mine", 2, good), 80, "step=2"),
                 (layout.encode_manifest({"format": "pickle"}), 80, "not a ckptstage/1 manifest"),
                 (b"[" * 200_000 + b"]" * 200_000, 80, "nested 200000 levels deep"),
                 (b" " * (layout.MAX_MANIFEST_BYTES + 1), 80, f"exceeds the limit of {layout.MAX_MANIFEST_BYTES}"),
                 (_manifest("mine", 1, good), 2**64 - 1, "data_bytes = 18446744073709551615 is out of range"),
                 (_manifest("mine", 1, [_tensor("t", 64, 2**60)]), 2**60 + 64, "out of range")]
        for raw, data_bytes, pattern in cases:
            with pytest.raises(InvalidRequest, match=pattern):
                conn.call("BeginSave", pb.BeginSaveRequest(session_id=sid, step=1, manifest_json=raw,
                                                           data_bytes=data_bytes))
        # Progress past the declared size is refused too, and fails nothing else.
        resp = conn.call("BeginSave", pb.BeginSaveRequest(session_id=sid, step=1, manifest_json=_manifest(
            "mine", 1, good), data_bytes=80))
        with pytest.raises(InvalidRequest, match="past the data size 80"):
            conn.call("Progress", pb.ProgressRequest(save_id=resp.save_id, copied_upto=81))
        conn.call("AbortSave", pb.AbortSaveRequest(save_id=resp.save_id, reason="test"))
        conn.call("CloseSession", pb.CloseSessionRequest(session_id=sid))
    assert temporaries(daemon.local) == []
    assert_serves(daemon, "mine")


def test_begin_save_refuses_a_stream_position_that_is_taken_or_misaligned(daemon):
    # The client copies before BeginSave is answered, to the position it proposes; the daemon takes
    # only a chunk-aligned one at or after the end of the session's previous save.
    good = [_tensor("t", 64, 16)]
    chunk = 1 << 20  # persist.chunk_bytes in the test daemon
    with daemon.connection() as conn:
        sid = _raw_session(conn, "pos")
        with pytest.raises(InvalidRequest, match=f"stream_base 4096 .*{chunk}-byte aligned.*next free one is 0"):
            conn.call("BeginSave", pb.BeginSaveRequest(session_id=sid, step=1, manifest_json=_manifest(
                "pos", 1, good), data_bytes=80, stream_base=4096))
        first = conn.call("BeginSave", pb.BeginSaveRequest(session_id=sid, step=1, manifest_json=_manifest(
            "pos", 1, good), data_bytes=80, stream_base=0))
        assert first.stream_base == 0
        # Step 2 may not start inside step 1's stream positions (0..80): the next free one is one chunk on.
        with pytest.raises(InvalidRequest, match=f"stream_base 0 .*next free one is {chunk}"):
            conn.call("BeginSave", pb.BeginSaveRequest(session_id=sid, step=2, manifest_json=_manifest(
                "pos", 2, good), data_bytes=80, stream_base=0))
        second = conn.call("BeginSave", pb.BeginSaveRequest(session_id=sid, step=2, manifest_json=_manifest(
            "pos", 2, good), data_bytes=80, stream_base=3 * chunk))  # later is fine: a gap is just unused
        assert second.stream_base == 3 * chunk
        [session] = conn.status().sessions
        assert session.saves_in_flight == 2  # the refusals took nothing
        for r in (first, second):
            conn.call("AbortSave", pb.AbortSaveRequest(save_id=r.save_id, reason="test"))
        conn.call("CloseSession", pb.CloseSessionRequest(session_id=sid))
    assert temporaries(daemon.local) == []
    assert_serves(daemon, "pos")


def _limits_manifest(**fields: Any) -> bytes:
    base: dict[str, Any] = {"format": layout.FORMAT, "job": "lim", "step": 1, "rank": 0, "world_size": 1,
                            "data_start": 64, "tensors": [_tensor("t", 64, 16)], "tree": {"T": 0}}
    return layout.encode_manifest({**base, **fields})


def _lists(depth: int) -> Any:
    node: Any = {"T": 0}
    for _ in range(depth):
        node = {"l": [node]}
    return node


def _f32(shape: list[Any], nbytes: int, name: str = "w", offset: int = 64) -> dict[str, Any]:
    return {"name": name, "dtype": "float32", "shape": shape, "offset": offset, "nbytes": nbytes}


MAX_JSON_DEPTH = manifest_check.MAX_MANIFEST_DEPTH
LIMITS = [
    # label, manifest_json, data_bytes, what the refusal must name (the field or key path, and the limit)
    ("json-depth", b"[" * 200_000 + b"]" * 200_000, 80, f"nested 200000 levels deep.*limit of {MAX_JSON_DEPTH}"),
    ("json-depth-in-a-string-is-fine", _limits_manifest(note="[" * 10_000), 80, None),
    ("tree-depth", _limits_manifest(tree=_lists(layout.MAX_TREE_DEPTH + 1)), 80,
     rf"tree state(\[0\])+ is nested more than {layout.MAX_TREE_DEPTH} containers"),
    ("tree-depth-at-the-limit", _limits_manifest(tree=_lists(layout.MAX_TREE_DEPTH)), 80, None),
    ("data-bytes-2^64-1", _limits_manifest(), 2**64 - 1,
     rf"data_bytes = {2**64 - 1} is out of range: an int in \[0, {manifest_check.MAX_PART_BYTES}\]"),
    ("data-bytes-past-the-part-limit", _limits_manifest(), manifest_check.MAX_PART_BYTES + 1, "data_bytes = .*out of range"),
    ("tensor-count", _limits_manifest(tensors=[{}] * (manifest_check.MAX_TENSORS + 1)), 80,
     f"has {manifest_check.MAX_TENSORS + 1} tensors, more than the limit of {manifest_check.MAX_TENSORS}"),
    ("dims", _limits_manifest(tensors=[_f32([1] * 65, 4)]), 80, r"tensors\[0\] \('w'\)\.shape = .*at most 64"),
    ("dim-2^64", _limits_manifest(tensors=[_f32([2**64], 16)]), 80,
     rf"tensors\[0\] \('w'\)\.shape\[0\] = {2**64} is out of range"),
    ("dim-float", _limits_manifest(tensors=[_f32([4.0], 16)]), 80, r"\.shape\[0\] = 4\.0 is out of range"),
    ("shape-beyond-nbytes", _limits_manifest(tensors=[_f32([1 << 30, 1 << 30], 16)]), 80,
     r"tensors\[0\] \('w'\): shape \[1073741824, 1073741824\] of float32 does not fit nbytes 16"),
    ("offset-2^63", _limits_manifest(tensors=[_f32([4], 16, offset=2**63)]), 80,
     rf"\('w'\)\.offset = {2**63} is out of range: an int in \[0, 80\]"),
    ("data-start-negative", _limits_manifest(data_start=-64), 80, r"data_start = -64 is out of range"),
    ("step-as-bool", _limits_manifest(step=True), 80, "step=True does not match"),
    ("tensor-ref-out-of-range", _limits_manifest(tree={"d": [[{"s": "w"}, {"T": 1}]]}), 80,
     r"tree state\['w'\] \(a tensor reference\) = 1 is out of range: an int in \[0, 0\]"),
    ("unknown-node", _limits_manifest(tree={"d": [[{"s": "cfg"}, {"l": [{"pickle": "x"}]}]]}), 80,
     r"tree state\['cfg'\]\[0\] = .*pickle.* is not a valid tree node"),
    ("plain-value-size", _limits_manifest(tree={"d": [[{"s": "w"}, {"T": 0}], [{"s": "blob"}, {
        "s": "x" * (layout.MAX_PLAIN_VALUE_BYTES + 1)}]]}), 80,
     rf"tree state\['blob'\] is a str/bytes value .*limit of {layout.MAX_PLAIN_VALUE_BYTES}"),
    ("bytes-value-over-the-limit", _limits_manifest(tree={"d": [[{"s": "w"}, {"T": 0}], [{"s": "blob"}, {
        "y": base64.b64encode(b"\0" * (layout.MAX_PLAIN_VALUE_BYTES + 1)).decode()}]]}), 80,
     rf"tree state\['blob'\] is a str/bytes value of {layout.MAX_PLAIN_VALUE_BYTES + 1} bytes, over the limit of "
     f"{layout.MAX_PLAIN_VALUE_BYTES}"),
    ("bytes-value-at-the-limit", _limits_manifest(tree={"d": [[{"s": "w"}, {"T": 0}], [{"s": "blob"}, {
        "y": base64.b64encode(b"\0" * layout.MAX_PLAIN_VALUE_BYTES).decode()}]]}), 80, None),
]


@pytest.fixture(scope="module")
def limits_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    """One daemon for every case below (each leaves it as it found it), with its temporaries' directory made.
    It keeps every step: retention deleting one (a rename into the temporaries, then a removal) would touch the
    directory whose modification time says a refused request created nothing there."""
    d = DaemonProc(tmp_path_factory.mktemp("limits") / "node", **{"local.keep_last": 1000}).start()
    assert_serves(d, "lim")
    yield d
    d.stop()


@pytest.mark.parametrize("label,raw,data_bytes,pattern", LIMITS, ids=[c[0] for c in LIMITS])
def test_begin_save_bounds_every_size_naming_the_field_and_the_limit_before_creating_a_file(
        limits_daemon, label, raw, data_bytes, pattern):
    daemon = limits_daemon
    [tmp_root] = (daemon.local / layout.TMP_DIR).iterdir()  # where this daemon makes its temporaries
    with daemon.connection() as conn:
        sid = conn.call("OpenSession", pb.OpenSessionRequest(job="lim", rank=0, world_size=1, pid=os.getpid()))\
            .session_id
        conn.call("EnsureArena", pb.EnsureArenaRequest(session_id=sid, want_bytes=1 << 20))
        before = tmp_root.stat().st_mtime_ns
        request = pb.BeginSaveRequest(session_id=sid, step=1, manifest_json=raw, data_bytes=data_bytes)
        try:
            if pattern is None:  # inside the limits: accepted, then aborted
                save_id = conn.call("BeginSave", request).save_id
                assert tmp_root.stat().st_mtime_ns != before  # this check does see a temporary being made
                conn.call("AbortSave", pb.AbortSaveRequest(save_id=save_id, reason="test"))
            else:
                with pytest.raises(InvalidRequest, match="INVALID_ARGUMENT") as info:
                    conn.call("BeginSave", request)
                assert info.match(pattern), str(info.value)[:500]
                # Refused before any file was created: the temporaries' directory was never touched.
                assert tmp_root.stat().st_mtime_ns == before
            [session] = conn.status().sessions
            assert session.saves_in_flight == 0
        finally:
            conn.call("CloseSession", pb.CloseSessionRequest(session_id=sid))
    assert temporaries(daemon.local) == []
    assert_serves(daemon, "lim")
