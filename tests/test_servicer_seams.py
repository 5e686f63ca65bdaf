"""The servicer's seams, against a real daemon: session errors keep their code, waits wake on the event
(not on a poll), and the servicer reaches the domain only through Node's methods."""

from __future__ import annotations

import ast
import inspect
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from ckptstage.client import errors
from ckptstage.client.rpc import Connection
from ckptstage.daemon.serve import servicer
from ckptstage.daemon.node.node import Node
from ckptstage.protos.v1 import ckptstage_pb2 as pb
from support import begin_raw_save

JOB = "seamjob"


def attach_code(conn: Connection, session_id: str) -> grpc.StatusCode:
    stream = conn.stub.Attach(pb.AttachRequest(session_id=session_id), timeout=10)
    with pytest.raises(grpc.RpcError) as failed:
        next(stream)
    return failed.value.code()


def test_attach_to_a_session_that_is_gone_is_session_lost_not_a_missing_checkpoint(daemon: Any) -> None:
    with daemon.connection() as conn:
        sid = conn.call("OpenSession", pb.OpenSessionRequest(job=JOB, rank=0, world_size=1)).session_id
        conn.call("CloseSession", pb.CloseSessionRequest(session_id=sid))
        for gone in (sid, "no-such-session", ""):
            code = attach_code(conn, gone)
            assert code == grpc.StatusCode.FAILED_PRECONDITION, (gone, code)
        # What a client makes of it: its session is lost (it opens a new one), no checkpoint is missing.
        stream = conn.stub.Attach(pb.AttachRequest(session_id=sid), timeout=10)
        with pytest.raises(grpc.RpcError) as failed:
            next(stream)
        assert isinstance(errors.from_rpc_error(failed.value, str(daemon.socket)), errors.SessionLost)


def begin_unfinished_save(conn: Connection, step: int) -> str:
    """A save begun and never finished: it stays in flight until it is aborted."""
    return begin_raw_save(conn, JOB, step)[1]


def test_wait_save_returns_as_soon_as_the_save_fails(daemon: Any) -> None:
    # A failure is an event too: the wait ends with it, not at the next tick of a poll (it was 0.5 s).
    with daemon.connection() as conn:
        for round_ in range(3):
            save_id = begin_unfinished_save(conn, 10 + round_)
            outcome: dict[str, Any] = {}

            def wait() -> None:
                started = time.monotonic()
                try:
                    conn.call("WaitSave", pb.WaitSaveRequest(save_id=save_id, tier=pb.LOCAL, timeout_s=20),
                              timeout=30)
                except errors.SaveFailed as e:
                    outcome["error"] = e
                outcome["took"] = time.monotonic() - started

            waiter = threading.Thread(target=wait)
            waiter.start()
            time.sleep(0.15)  # the WaitSave is blocked in the daemon by now
            conn.call("AbortSave", pb.AbortSaveRequest(save_id=save_id, reason="test"))
            waiter.join(30)
            assert "aborted by the client: test" in str(outcome.get("error"))
            assert outcome["took"] < 0.45, f"WaitSave took {outcome['took']:.2f}s to see the abort"


def test_wait_save_times_out_when_nothing_happens(daemon: Any) -> None:
    with daemon.connection() as conn:
        save_id = begin_unfinished_save(conn, 20)
        started = time.monotonic()
        done = conn.call("WaitSave", pb.WaitSaveRequest(save_id=save_id, tier=pb.LOCAL, timeout_s=0.3)).done
        took = time.monotonic() - started
        assert not done and 0.25 <= took < 5
        conn.call("AbortSave", pb.AbortSaveRequest(save_id=save_id, reason="test"))


def test_the_servicer_calls_only_node_methods() -> None:
    """Each RPC calls one domain method: the servicer never reads a Node attribute (its catalogue, its
    drainer, its config) to do the node's work itself."""
    tree = ast.parse(Path(inspect.getfile(servicer)).read_text())
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "node" and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"}
    assert used, "the servicer calls the node through self.node"
    not_methods = sorted(a for a in used if not inspect.isfunction(getattr(Node, a, None)))
    assert not not_methods, f"the servicer reaches into Node attributes {not_methods}"
